"""The two indexing tasks, thin: take the lock, call the engine, record, report.

    GenerateEmbedding(item_id, reason=None)                notes
    GenerateKnowledgeItemEmbedding(item_id, reason=None)   files, URLs, code

Outcomes: SUCCESS with the run's JSON result (status `indexed`, `partial`, `skipped` or
`coalesced`); RETRY for a provider that may recover, with exponential backoff and jitter;
FAILURE with a one-line message naming the cause and the duration (Flower shows no runtime for
failed tasks); REVOKED when cancelled, never FAILURE.
"""

from __future__ import annotations

import random
import sys
import time
from typing import Any

import apsw
import structlog
from celery import Task
from celery.exceptions import Ignore, SoftTimeLimitExceeded
from celery.signals import worker_process_init, worker_process_shutdown

from tasks import KNOWLEDGE_ITEM, NOTE, metrics
from tasks import cancel as cancellation
from tasks.cancel import TERMINATED, CancelToken, running
from tasks.lock import ItemLock
from tasks.producer import enqueue
from tasks.runtime import Runtime, close_runtime, get_runtime
from worker.app import app, settings
from worker.chunking import text_hash
from worker.errors import Cancelled, IndexAborted, InvalidInput, KidxError, WrongTaskKind
from worker.log import KI_EMBED, Redact, get_logger
from worker.pipeline import index_item
from worker.store.items import Status, get_item, get_state, set_state
from worker.store.jobs import (
    BatchState,
    JobState,
    batch_outcome,
    get_batch,
    record_end,
    record_start,
)

log = get_logger("kidx.tasks")

KINDS = {NOTE: frozenset({"note"}), KNOWLEDGE_ITEM: frozenset({"file", "url", "code"})}
_REDACT = Redact(settings.secrets())  # the provider masks its key; this catches any other way in


class IndexFailed(Exception):
    """A run failed for good; the message names the cause and how long the run took."""


@app.task(name=NOTE, bind=True)
def generate_embedding(
    self: Task,
    item_id: int,
    reason: str | None = None,
    batch_id: int | None = None,
    structure_only: bool = False,
) -> dict[str, Any]:
    """Index a note."""
    return _run(self, item_id, reason, batch_id, structure_only)


@app.task(name=KNOWLEDGE_ITEM, bind=True)
def generate_knowledge_item_embedding(
    self: Task,
    item_id: int,
    reason: str | None = None,
    batch_id: int | None = None,
    structure_only: bool = False,
) -> dict[str, Any]:
    """Index a file, URL or code item."""
    return _run(self, item_id, reason, batch_id, structure_only)


def _run(
    task: Task, item_id: int, reason: str | None, batch_id: int | None, structure_only: bool
) -> dict[str, Any]:
    started = time.monotonic()
    req = task.request
    task_id, attempt = str(req.id), int(req.retries or 0)
    valid = valid_id(item_id)
    structlog.contextvars.bind_contextvars(
        task_id=task_id, item_id=item_id if valid else f"{item_id!r:.60}"
    )
    cancellation.reset()
    rt = get_runtime(settings)
    problem = bad_arguments(rt, item_id, reason, batch_id, structure_only)
    if problem is not None:  # recorded without what cannot be stored (a batch that is not one)
        batch_id = None
        reason = reason if isinstance(reason, str) else None

    def took() -> int:
        return int((time.monotonic() - started) * 1000)

    def end(
        state: JobState, outcome: str | None, error: str | None = None, why: str | None = None
    ) -> None:
        try:
            with rt.db.atomic():  # the run's row and its count in the batch, together
                record_end(rt.db, task_id, attempt, state, took(), error)
                if batch_id is not None and outcome is not None:
                    batch_outcome(
                        rt.db,
                        batch_id,
                        outcome,
                        error,
                        job=(task_id, attempt),
                        abort_after=settings.tasks.batch_abort_after,
                    )
        except (apsw.Error, KidxError) as e:  # a full disk: the task's result still says it
            log.error("could not record the run's end", reason=f"{type(e).__name__}: {e}")
        metrics.run(task.name, str(state), why)

    try:
        record_start(
            rt.db,
            task_id,
            attempt,
            task.name,
            item_id if valid else None,
            batch_id,
            reason[:200] if reason else None,
        )
        if problem is not None:
            raise InvalidInput(problem)
        token = CancelToken(rt.redis, task_id)
        if token():
            raise Cancelled("revoked before it started")
        if batch_id is not None:
            batch = get_batch(rt.db, batch_id)
            if batch and batch["state"] == BatchState.ABORTED:
                end(JobState.SKIPPED, "skipped", batch["abort_reason"])
                # Its index is not what was asked for: `kidx retry --failed` picks it up.
                set_state(
                    rt.db,
                    item_id,
                    status=Status.FAILED,
                    last_task_id=task_id,
                    last_error=f"not run: batch {batch_id} was aborted ({batch['abort_reason']})",
                )
                log.info(
                    f"{KI_EMBED} skipped: its batch was aborted",
                    batch_id=batch_id,
                    reason=batch["abort_reason"],
                )
                return {
                    "item_id": item_id,
                    "status": "skipped",
                    "error": batch["abort_reason"],
                    "duration_ms": took(),
                }
        item = get_item(rt.db, item_id, content=False)
        if item.kind not in KINDS[task.name]:
            other = NOTE if item.kind == "note" else KNOWLEDGE_ITEM
            raise WrongTaskKind(f"item {item_id} is a {item.kind}: send {other}, not {task.name}")
        result = _locked_runs(rt, item_id, task, token, structure_only)
        if result["status"] == "skipped":  # no provider configured: nothing was written
            end(JobState.SKIPPED, "skipped", result.get("error"))
        else:
            end(JobState.COALESCED if result["status"] == "coalesced" else JobState.SUCCESS, "ok")
            metrics.record_chunks(result)
        result["duration_ms"] = took()
        return result
    except (Cancelled, SoftTimeLimitExceeded) as e:
        if isinstance(e, SoftTimeLimitExceeded) and not TERMINATED.is_set():
            message = one_line(
                item_id,
                f"ran over the soft time limit of {settings.tasks.soft_time_limit} s",
                took(),
            )
            end(JobState.FAILED, "failed", message, why="time_limit")
            raise IndexFailed(message) from None
        end(JobState.REVOKED, "skipped", "cancelled")  # the durable record first
        task.backend.mark_as_revoked(task_id, "cancelled", request=req)
        task.send_event("task-revoked", terminated=TERMINATED.is_set(), signum=None, expired=False)
        log.info(f"{KI_EMBED} task revoked; the previous index is intact", duration_ms=took())
        raise Ignore() from None
    except IndexAborted as e:
        message = one_line(item_id, str(e), took())
        why = "provider_transient" if e.transient else "provider_permanent"
        if e.transient and attempt < settings.tasks.max_retries:
            end(JobState.RETRY, "retry", message, why=why)
            raise task.retry(
                exc=IndexFailed(message),
                countdown=backoff(attempt, e.retry_after),
                max_retries=settings.tasks.max_retries,
            ) from None
        end(JobState.FAILED, "failed", message, why=why)
        raise IndexFailed(message) from None
    except KidxError as e:  # unknown item, wrong kind, bad input: retrying cannot help
        message = one_line(item_id, str(e), took())
        end(JobState.FAILED, "refused", message, why="bad_input")
        raise IndexFailed(message) from None
    except Exception as e:  # a bug, or the database refusing: one line, and a job row that says
        message = one_line(item_id, f"{type(e).__name__}: {e}", took())
        end(JobState.FAILED, "failed", message, why="error")
        log.exception(f"{KI_EMBED} failed", reason=message)
        raise IndexFailed(message) from None
    finally:
        structlog.contextvars.unbind_contextvars("task_id", "item_id")


def bad_arguments(
    rt: Runtime, item_id: object, reason: object, batch_id: object, structure_only: object
) -> str | None:
    """What is wrong with a task's arguments (a host may send anything a JSON message
    holds), in one line; None when they are fine."""
    if not valid_id(item_id):
        return f"the item id must be a positive integer, not {item_id!r:.60}"
    if reason is not None and not isinstance(reason, str):
        return f"reason must be a string, not {reason!r:.60}"
    if not isinstance(structure_only, bool):
        return f"structure_only must be true or false, not {structure_only!r:.60}"
    if batch_id is not None:
        if not valid_id(batch_id):
            return f"the batch id must be a positive integer, not {batch_id!r:.60}"
        if get_batch(rt.db, batch_id) is None:  # type: ignore[arg-type]
            return f"no batch with id {batch_id}"
    return None


def _locked_runs(
    rt: Runtime, item_id: int, task: Task, token: CancelToken, structure_only: bool
) -> dict[str, Any]:
    """The pipeline under the item's lock: once, and once more if the item changed while it ran
    and someone asked (a burst of enqueues costs at most two runs)."""
    lock = ItemLock(rt.redis, item_id, str(task.request.id), settings.tasks.lock_ttl)
    lock.request_rerun()  # before trying the lock: a holder finishing now will see it
    if not lock.acquire():
        log.info(f"{KI_EMBED} coalesced: the item is being indexed by another run")
        return {"item_id": item_id, "status": "coalesced"}
    try:
        lock.take_rerun()  # this run covers every request made until now
        for client in (rt.embedder, rt.chat):
            if client is not None:
                client.sleep = token.sleep  # a provider's backoff ends on cancellation

        def run() -> Any:
            return index_item(
                rt.db,
                item_id,
                embedder=rt.embedder,
                chat=rt.chat,
                reader=rt.reader,
                chunk_window=settings.chunk.window,
                structure_only=structure_only,
                cancel=token,
                task_id=str(task.request.id),
                context_chars=settings.embedding.context_chars,
            )

        with running():
            result = run()
            if lock.take_rerun() and changed(rt, item_id):
                log.info(f"{KI_EMBED} the item changed while it was indexed: once more")
                result = run()
    finally:
        lock.release()
    if lock.take_rerun() and changed(rt, item_id):
        follow = enqueue(rt.db, item_id, app=task.app, reason="changed")
        log.info(f"{KI_EMBED} changed again during the re-run: sent again", next=follow)
    return result.as_dict()


@worker_process_init.connect
def _open(**_: Any) -> None:
    """Open the database and the provider's client before the first task, not in it. Not the
    local model: loading it takes longer than Celery waits for a new process to report."""
    # A group's embedding thread waits on the GIL for its answer while the main thread chunks
    # and writes: switch within 1 ms rather than Python's 5 (bench/throughput.py, provider-bound).
    sys.setswitchinterval(0.001)
    if settings.embedding.provider == "local":
        return
    try:
        get_runtime(settings)
    except Exception as e:  # the first task meets it again and fails with the reason
        log.warning("could not prepare the worker process", reason=f"{type(e).__name__}: {e}")


@worker_process_shutdown.connect
def _close(**_: Any) -> None:
    close_runtime()


def changed(rt: Runtime, item_id: int) -> bool:
    """Whether the item's text differs from what its index was built from."""
    item = get_item(rt.db, item_id, content=False)
    if item.content_hash is None:  # the content was written without its hash
        item = get_item(rt.db, item_id)
    content_hash = item.content_hash or text_hash(item.content)
    return get_state(rt.db, item_id).get("indexed_hash") != content_hash


def backoff(attempt: int, retry_after: float | None) -> float:
    t = settings.tasks
    delay = min(t.retry_backoff_max, t.retry_backoff * 2**attempt) * random.uniform(0.5, 1.5)
    return max(delay, retry_after or 0.0)


def valid_id(item_id: object) -> bool:
    """An id SQLite can hold: a JSON message may carry "abc", 1.5, true or 2**70 (a 64-bit
    overflow that would otherwise fail before the run is recorded)."""
    return type(item_id) is int and 0 < item_id < 2**63


def one_line(item_id: object, cause: str, duration_ms: int) -> str:
    cause = " ".join(_REDACT.scrub(cause).split())  # stored and shown: never a secret
    return f"item {str(item_id)[:60]}: {cause} (after {duration_ms / 1000:.1f} s)"
