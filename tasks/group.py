"""The bulk-run task: a batch's items in groups, one task a group, their texts sharing embedding
requests (one task an item sends one item's dozen texts a request, a fifth of a batch of 64).

    kidx.index_group(item_ids, reason=None, batch_id=None, structure_only=False)

A thin entry onto `tasks.run`: each item keeps what a single run gives it (its lock, its own
write, its own count in the batch) and has its own `index_jobs` row, `<task id>:<item id>`. An
item that may succeed later (the provider failed) is sent again alone, with a delay, in the same
batch; one that failed for good ends the group FAILURE, with a line for each such item and how
long the group took. Arguments it refuses end it FAILURE the same way, with its rows (one for
the task, without an item, when its ids are no list of ids), counted in the batch it names.
Cancellation (`kidx cancel` with the group's id, or an item's job id) revokes the whole group:
what was written stays, the rest keeps its previous index.
"""

from __future__ import annotations

import time
from typing import Any

import apsw
import structlog
from celery import Task, shared_task

from tasks import GROUP
from tasks import cancel as cancellation
from tasks.base import KidxTask
from tasks.producer import enqueue
from tasks.run import (
    BUSY,
    IndexFailed,
    Run,
    backoff,
    bad_arguments,
    bare_result,
    bind_arguments,
    retry_busy,
    stored_reason,
    valid_batch,
)
from tasks.runtime import Runtime, runtime
from worker.errors import IndexAborted, KidxError
from worker.log import KI_EMBED, get_logger
from worker.settings import GROUP_SIZE_MAX
from worker.store.items import valid_item_id
from worker.store.jobs import (
    JobState,
    batch_outcome,
    get_batch,
    group_job_id,
    record_end,
    record_starts,
)

log = get_logger("kidx.tasks")


@shared_task(base=KidxTask, name=GROUP, bind=True, throws=(IndexFailed,))
def index_group(self: Task, /, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Index a bulk run's items together: (item_ids, reason=None, batch_id=None,
    structure_only=False)."""
    given = bind_arguments("item_ids", args, kwargs)
    item_ids, reason, batch_id, structure_only = given[:4]
    started = time.monotonic()
    task_id = str(self.request.id)
    structlog.contextvars.bind_contextvars(task_id=task_id)
    cancellation.reset()
    try:
        rt = runtime(self.app)
        # A host's list of a million ids wrote a million job rows in one transaction (9 s of
        # every writer waiting) before anything looked at its length.
        many = isinstance(item_ids, list) and len(item_ids) > GROUP_SIZE_MAX
        listed = (
            isinstance(item_ids, list)
            and not many
            and bool(item_ids)
            and all(map(valid_item_id, item_ids))
        )
        if listed:
            problem = bad_arguments(rt, item_ids[0], reason, batch_id, structure_only, *given[4:])
        elif many:
            problem = f"a group takes at most {GROUP_SIZE_MAX} items, not {len(item_ids)}"
        else:
            shown = repr(item_ids)[:80]
            problem = f"the item ids must be a list of 64-bit integers, not {shown}"
        if problem is not None:  # its job rows say so, without what cannot be stored
            batch_id, reason = kept_batch(rt, batch_id), stored_reason(reason)
        run = GroupRun(
            self,
            rt,
            item_ids if listed else [],
            reason=reason,
            batch_id=batch_id,
            structure_only=structure_only,
            started=started,
        )
        # ids that are no list of ids: one row for the task, without an item
        jobs = [(run.job(i)[0], i) for i in run.ids] if listed else [(task_id, None)]
        try:
            record_starts(rt.db, jobs, GROUP, batch_id, stored_reason(reason))
        except BUSY as e:  # locked past the busy timeout: nothing recorded, tried again later
            retry_busy(self, rt, e)
        if problem is not None:
            log.error(f"{KI_EMBED} refused", reason=problem)
            if not listed:
                raise IndexFailed(run.refuse_all(problem))
            for item_id in run.ids:
                run._failed(item_id, run.line(item_id, problem), "bad_input")
            raise IndexFailed(run.failure())
        return run.execute()
    finally:
        structlog.contextvars.unbind_contextvars("task_id")


def kept_batch(rt: Runtime, batch_id: object) -> int | None:
    """The batch of a refused task, when it names one (a refusal is counted in its batch, or
    that batch would wait for it for good); None for what is no batch."""
    if valid_batch(batch_id) and get_batch(rt.db, batch_id) is not None:  # type: ignore[arg-type]
        return batch_id  # type: ignore[return-value]
    return None


class GroupRun(Run):
    """Several items: a job row each, a provider that may recover tried again as a task of the
    item's own, the items not started past the deadline sent on; its result counts them."""

    sends_on = True

    def job(self, item_id: int) -> tuple[str, int]:
        return group_job_id(self.task_id, item_id), 0

    def retry_later(self, item_id: int, error: IndexAborted, message: str) -> None:
        """The item's own task, sent once the write transaction that reported the item (when
        one did) commits: a message sent inside it would hold every writer's lock for a broker
        round trip, and would go even if the transaction then rolled back (the item is then
        reported again, with the cause)."""
        if not self.settings.tasks.max_retries:
            self._failed(item_id, message, "provider_transient")
            return
        self.rt.db.on_commit(lambda: self._send_retry(item_id, error, message))

    def _send_retry(self, item_id: int, error: IndexAborted, message: str) -> None:
        if self.locks is not None:  # or the retry, due in seconds, would find it locked
            self.locks.release_one(item_id)
        try:
            retry = enqueue(
                self.rt.db,
                item_id,
                app=self.task.app,
                reason="retry",
                batch_id=self.batch_id,
                countdown=backoff(self.rt, 0, error.retry_after),
            )
        except (apsw.Error, KidxError) as e:  # no retry to be had: it failed
            self._failed(
                item_id, self.line(item_id, f"{error}; not sent again: {e}"), "provider_transient"
            )
            return
        self.end(item_id, JobState.RETRY, "retry", message, why="provider_transient")
        self.results[item_id] = bare_result(item_id, "retry", message, next=retry)

    def result(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for r in self.results.values():
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        return {
            "items": len(self.ids),
            **counts,
            "duration_ms": self.took(),
            "results": list(self.results.values()),
        }

    def refuse_all(self, problem: str) -> str:
        """The task's one row (no item in it) ends failed, counted in its batch as one
        refusal; its one line."""
        message = f"{' '.join(self.rt.redact.scrub(problem).split())} "
        message += f"(after {self.took() / 1000:.1f} s)"
        with self.rt.db.atomic():
            record_end(self.rt.db, self.task_id, 0, JobState.FAILED, self.took(), message)
            if self.batch_id is not None:
                batch_outcome(
                    self.rt.db,
                    self.batch_id,
                    "refused",
                    message,
                    abort_after=self.settings.tasks.batch_abort_after,
                    job=(self.task_id, 0),
                )
        return message

    def failure(self) -> str:
        failed = list(self.failures.values())
        shown = "; ".join(failed[:3]) + (" ..." if len(failed) > 3 else "")
        others = len(self.ids) - len(failed)
        return (
            f"group of {len(self.ids)} items: {len(failed)} failed ({shown}), "
            f"{others} did not fail (after {self.took() / 1000:.1f} s)"
        )
