"""The two indexing tasks, thin: check the arguments, record the run, hand it to `tasks.run`.

    GenerateEmbedding(item_id, reason=None)                notes
    GenerateKnowledgeItemEmbedding(item_id, reason=None)   files, URLs, code

Outcomes: SUCCESS with the run's JSON result (status `indexed`, `partial`, `skipped` or
`coalesced`); RETRY for a provider that may recover, with exponential backoff and jitter;
FAILURE with a one-line message naming the cause and the duration (Flower shows no runtime for
failed tasks); REVOKED when cancelled, never FAILURE.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import structlog
from celery import Task, current_app, shared_task
from celery.signals import worker_init, worker_process_init, worker_process_shutdown

from tasks import KNOWLEDGE_ITEM, NOTE
from tasks import cancel as cancellation
from tasks.base import KidxTask
from tasks.group import kept_batch
from tasks.run import (
    BUSY,
    Arguments,
    IndexFailed,
    Run,
    backoff,
    bad_arguments,
    bare_result,
    bind_arguments,
    retry_busy,
    retry_task,
    sane_attempt,
    stored_reason,
)
from tasks.runtime import close_runtime, runtime
from worker.errors import IndexAborted
from worker.log import KI_EMBED, get_logger
from worker.settings import deadline_problem
from worker.store.items import valid_item_id
from worker.store.jobs import JobState, record_start

log = get_logger("kidx.tasks")


@shared_task(base=KidxTask, name=NOTE, bind=True, throws=(IndexFailed,))
def generate_embedding(self: Task, /, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Index a note: (item_id, reason=None, batch_id=None, structure_only=False)."""
    return start(self, bind_arguments("item_id", args, kwargs), frozenset({"note"}))


@shared_task(base=KidxTask, name=KNOWLEDGE_ITEM, bind=True, throws=(IndexFailed,))
def generate_knowledge_item_embedding(self: Task, /, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Index a file, URL or code item: (item_id, reason=None, batch_id=None,
    structure_only=False)."""
    kinds = frozenset({"file", "url", "code"})
    return start(self, bind_arguments("item_id", args, kwargs), kinds)


class SingleRun(Run):
    """One item: its job row is the task's own (task id, attempt); a provider that may recover
    is tried again by Celery's retry; its result is the item's."""

    def __init__(self, *args: Any, kinds: frozenset[str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.kinds = kinds
        self.retry: tuple[str, float] | None = None

    def job(self, item_id: int) -> tuple[str, int]:
        return self.task_id, self.attempt

    def retry_later(self, item_id: int, error: IndexAborted, message: str) -> None:
        if self.attempt >= self.settings.tasks.max_retries:
            self._failed(item_id, message, "provider_transient")
            return
        self.end(item_id, JobState.RETRY, "retry", message, why="provider_transient")
        self.retry = (message, backoff(self.rt, self.attempt, error.retry_after))
        self.results[item_id] = bare_result(item_id, "retry", message)

    def result(self) -> dict[str, Any]:
        if self.retry is not None:
            message, countdown = self.retry
            retry_task(self.task, message, countdown, self.settings.tasks.max_retries)
        item_id = self.ids[0]
        return {**self.results[item_id], "duration_ms": self.took()}

    def failure(self) -> str:
        return next(iter(self.failures.values()), "the run failed")


def start(task: Task, given: Arguments, kinds: frozenset[str]) -> dict[str, Any]:
    started = time.monotonic()
    item_id, reason, batch_id, structure_only = given[:4]
    task_id = str(task.request.id)
    valid = valid_item_id(item_id)
    structlog.contextvars.bind_contextvars(
        task_id=task_id, item_id=item_id if valid else f"{item_id!r:.60}"
    )
    cancellation.reset()
    try:
        rt = runtime(task.app)
        attempt = sane_attempt(task)
        problem = bad_arguments(rt, item_id, reason, batch_id, structure_only, *given[4:])
        if problem is not None:  # recorded without what cannot be stored (a batch that is not one)
            batch_id, reason = kept_batch(rt, batch_id), stored_reason(reason)
        try:
            record_start(
                rt.db,
                task_id,
                attempt,
                task.name,
                item_id if valid else None,
                batch_id,
                stored_reason(reason),
            )
        except BUSY as e:  # locked past the busy timeout: nothing recorded, tried again later
            retry_busy(task, rt, e)
        run = SingleRun(
            task,
            rt,
            [item_id] if valid else [],
            reason=reason,
            batch_id=batch_id,
            structure_only=structure_only,
            started=started,
            kinds=kinds,
        )
        if problem is not None:
            log.error(f"{KI_EMBED} refused", reason=problem)
            message = run.line(item_id, problem)
            # ended as any refusal is, counted in its batch (which would wait for it for good)
            run.end(item_id if valid else 0, JobState.FAILED, "refused", message, why="bad_input")
            raise IndexFailed(message)
        return run.execute()
    finally:
        structlog.contextvars.unbind_contextvars("task_id", "item_id")


@worker_init.connect
def _said_at_start(sender: Any = None, **_: Any) -> None:
    """What the settings allow but a worker should not run with unsaid (`kidx doctor` says it
    too): once, in the main process's log."""
    settings = getattr(getattr(sender, "app", None), "kidx_settings", None)
    if settings is not None and (problem := deadline_problem(settings)) is not None:
        log.warning(problem)


@worker_process_init.connect
def _open(**_: Any) -> None:
    """Build the process's runtime before the first task, not in it. Not with the local model:
    loading it takes longer than Celery waits for a new process to report."""
    # A run's embedding thread waits on the GIL for its answer while the main thread chunks
    # and writes: switch within 1 ms rather than Python's 5 (bench/throughput.py).
    sys.setswitchinterval(0.001)
    settings = getattr(current_app, "kidx_settings", None)
    if settings is None or settings.embedding.provider == "local":
        return
    try:
        runtime(current_app)
    except Exception as e:  # the first task meets it again and fails with the reason
        log.warning("could not prepare the worker process", reason=f"{type(e).__name__}: {e}")


@worker_process_shutdown.connect
def _close(**_: Any) -> None:
    close_runtime(current_app)
