"""The bulk-run task: a batch's items in groups, one task a group, their texts sharing embedding
requests (one task an item sends one item's dozen texts a request, a fifth of a batch of 64).

    kidx.index_group(item_ids, reason=None, batch_id=None, structure_only=False)

Each item keeps what a single run gives it: its lock (a busy item is `coalesced`, with a
re-run request), its own write transaction, its own `index_jobs` row (job id
`<task id>:<item id>`), its own count in the batch. An item that may succeed later (the
provider failed) is sent again alone, with a delay, in the same batch; one that failed for good
ends the group FAILURE, with a line for each such item and how long the group took.
Cancellation (`kidx cancel` with the group's id, or an item's job id) revokes the whole group:
what was written stays, the rest keeps its previous index.
"""

from __future__ import annotations

import time
from typing import Any

import apsw
import structlog
from celery import Task
from celery.exceptions import Ignore, SoftTimeLimitExceeded

from tasks import GROUP, metrics
from tasks import cancel as cancellation
from tasks.cancel import TERMINATED, CancelToken, running
from tasks.index import IndexFailed, backoff, bad_arguments, changed, one_line, valid_id
from tasks.lock import LockSet
from tasks.producer import enqueue, send_group
from tasks.runtime import Runtime, get_runtime
from worker.app import app, settings
from worker.bulk import index_items
from worker.errors import Cancelled, IndexAborted, KidxError
from worker.log import KI_EMBED, get_logger
from worker.pipeline import IndexResult
from worker.store.items import Status, set_state
from worker.store.jobs import (
    BatchState,
    JobState,
    batch_outcome,
    get_batch,
    group_job_id,
    record_end,
    record_starts,
)

log = get_logger("kidx.tasks")


@app.task(name=GROUP, bind=True)
def index_group(
    self: Task,
    item_ids: list[int],
    reason: str | None = None,
    batch_id: int | None = None,
    structure_only: bool = False,
) -> dict[str, Any]:
    """Index a bulk run's items together."""
    started = time.monotonic()
    task_id = str(self.request.id)
    structlog.contextvars.bind_contextvars(task_id=task_id)
    cancellation.reset()
    try:
        if not isinstance(item_ids, list) or not item_ids or not all(map(valid_id, item_ids)):
            shown = repr(item_ids)[:80]
            raise IndexFailed(f"the item ids must be a list of positive integers, not {shown}")
        rt = get_runtime(settings)
        problem = bad_arguments(rt, item_ids[0], reason, batch_id, structure_only)
        if problem is not None:  # its job rows say so, without what cannot be stored
            group = _Group(
                self, rt, item_ids, reason if isinstance(reason, str) else None, None, started
            )
            for item_id in group.ids:
                group._failed(item_id, one_line(item_id, problem, group.took()), "bad_input")
            raise IndexFailed(group._failure_line())
        return _Group(self, rt, item_ids, reason, batch_id, started).run(structure_only)
    finally:
        structlog.contextvars.unbind_contextvars("task_id")


class _Group:
    """One run of a group: its items' records, as each item's outcome becomes known."""

    def __init__(
        self,
        task: Task,
        rt: Runtime,
        item_ids: list[int],
        reason: str | None,
        batch_id: int | None,
        started: float,
    ) -> None:
        self.task, self.rt, self.batch_id, self.started = task, rt, batch_id, started
        self.reason = reason
        self.abort_reason: str | None = None
        self.locks: LockSet | None = None
        self.task_id = str(task.request.id)
        self.ids = list(dict.fromkeys(item_ids))  # an item once, whatever was sent
        self.ended: dict[int, str] = {}  # item -> its job state
        self.failures: list[str] = []
        self.results: list[dict[str, Any]] = []
        record_starts(
            rt.db, [(group_job_id(self.task_id, i), i) for i in self.ids], GROUP, batch_id, reason
        )

    def took(self) -> int:
        return int((time.monotonic() - self.started) * 1000)

    def end(
        self,
        item_id: int,
        state: JobState,
        outcome: str | None,
        error: str | None = None,
        why: str | None = None,
    ) -> None:
        """An item's run ends: its job row and its count in the batch, in one transaction
        (the group's write transaction, when the item was just written: if that does not
        commit, the item ends again, failed). A database that refuses (a full disk) is logged:
        the task's result still says what happened."""
        try:
            with self.rt.db.atomic():
                record_end(
                    self.rt.db, group_job_id(self.task_id, item_id), 0, state, self.took(), error
                )
                if self.batch_id is not None and outcome is not None:
                    batch_outcome(
                        self.rt.db,
                        self.batch_id,
                        outcome,
                        error,
                        abort_after=settings.tasks.batch_abort_after,
                        job=(group_job_id(self.task_id, item_id), 0),
                    )
        except (apsw.Error, KidxError) as e:
            log.error(
                "could not record an item's end", item_id=item_id, reason=f"{type(e).__name__}: {e}"
            )
        metrics.run(GROUP, str(state), why)
        self.ended[item_id] = str(state)

    def run(self, structure_only: bool) -> dict[str, Any]:
        rt = self.rt
        token = CancelToken(rt.redis, self.task_id)
        try:
            if token():
                raise Cancelled("revoked before it started")
            if self._batch_aborted():
                return self._summary()
            locks = self.locks = LockSet(rt.redis, self.ids, self.task_id, settings.tasks.lock_ttl)
            held, busy = locks.acquire()
            try:
                for item_id in busy:
                    log.info(
                        f"{KI_EMBED} coalesced: the item is being indexed by another run",
                        item_id=item_id,
                    )
                    self.end(item_id, JobState.COALESCED, "ok")
                    self.results.append({"item_id": item_id, "status": "coalesced"})
                for client in (rt.embedder, rt.chat):
                    if client is not None:
                        client.sleep = token.sleep  # a provider's backoff ends on cancellation
                with running():
                    index_items(
                        rt.db,
                        held,
                        embedder=rt.embedder,
                        chat=rt.chat,
                        reader=rt.reader,
                        chunk_window=settings.chunk.window,
                        structure_only=structure_only,
                        cancel=token,
                        task_id=self.task_id,
                        on_done=self._done,
                        deadline=self.started + settings.tasks.soft_time_limit / 2,
                        context_chars=settings.embedding.context_chars,
                    )
            finally:
                asked = locks.release()
            self._send_on(self._open(), structure_only)
            for item_id in asked:  # asked for while the group ran: each alone, once more
                if changed(rt, item_id):
                    enqueue(rt.db, item_id, app=self.task.app, reason="changed")
        except (Cancelled, SoftTimeLimitExceeded) as e:
            if isinstance(e, SoftTimeLimitExceeded) and not TERMINATED.is_set():
                limit = f"ran over the soft time limit of {settings.tasks.soft_time_limit} s"
                for item_id in self._open():
                    self._failed(item_id, one_line(item_id, limit, self.took()), "time_limit")
                raise IndexFailed(self._failure_line()) from None
            for item_id in self._open():
                self.end(item_id, JobState.REVOKED, "skipped", "cancelled")
                set_state(rt.db, item_id, status=Status.CANCELLED, last_task_id=self.task_id)
            self.task.backend.mark_as_revoked(self.task_id, "cancelled", request=self.task.request)
            self.task.send_event(
                "task-revoked", terminated=TERMINATED.is_set(), signum=None, expired=False
            )
            log.info(
                f"{KI_EMBED} group revoked; what was not written keeps its previous index",
                duration_ms=self.took(),
            )
            raise Ignore() from None
        except Exception as e:  # a bug or a store failure: every open item names it
            for item_id in self._open():
                self._failed(
                    item_id, one_line(item_id, f"{type(e).__name__}: {e}", self.took()), "bad_input"
                )
            raise IndexFailed(self._failure_line()) from None
        if self.failures:
            raise IndexFailed(self._failure_line())
        return self._summary()

    def _done(self, item_id: int, outcome: IndexResult | KidxError) -> None:
        """An item's outcome, recorded at once (progress shows while the group runs)."""
        if isinstance(outcome, IndexResult):
            result = outcome.as_dict()
            if outcome.status == "skipped":
                self.end(item_id, JobState.SKIPPED, "skipped", outcome.error)
            else:
                self.end(item_id, JobState.SUCCESS, "ok")
                metrics.record_chunks(result)
            self._result(result)
            return
        if item_id in self.ended:  # reported as written, then its transaction did not commit
            self.failures = [f for f in self.failures if not f.startswith(f"item {item_id}:")]
        if self._batch_aborted_now():  # by this group's failures or another's: no retry
            self._skip(item_id)
            return
        message = one_line(item_id, str(outcome), self.took())
        if isinstance(outcome, IndexAborted) and outcome.transient and settings.tasks.max_retries:
            why = "provider_transient"
            if self.locks is not None:  # or the retry, due in seconds, would find it locked
                self.locks.release_one(item_id)
            try:
                retry = enqueue(
                    self.rt.db,
                    item_id,
                    app=self.task.app,
                    reason="retry",
                    batch_id=self.batch_id,
                    countdown=backoff(0, outcome.retry_after),
                )
            except (apsw.Error, KidxError) as e:  # no retry to be had: it failed
                message = one_line(item_id, f"{outcome}; not sent again: {e}", self.took())
                self._failed(item_id, message, why)
                return
            self.end(item_id, JobState.RETRY, "retry", message, why=why)
            self._result({"item_id": item_id, "status": "retry", "error": message, "next": retry})
            return
        why = "provider_permanent" if isinstance(outcome, IndexAborted) else "bad_input"
        self._failed(item_id, message, why)

    def _send_on(self, item_ids: list[int], structure_only: bool) -> None:
        """Items not started before the group's deadline (half its soft time limit) go on in a
        group of their own, in the same batch: a big group never meets the time limit."""
        if not item_ids:
            return
        follow = send_group(
            self.rt.db,
            self.task.app,
            item_ids,
            self.batch_id,
            self.reason or "group",
            structure_only=structure_only,
        )
        note = f"not started within half the time limit: sent on in group {follow}"
        for item_id in item_ids:
            self.end(item_id, JobState.RETRY, None, note)
            self.results.append({"item_id": item_id, "status": "sent on", "next": follow})
        log.info(
            f"{KI_EMBED} group past its deadline: the rest sent on",
            items=len(item_ids),
            next=follow,
        )

    def _failed(self, item_id: int, message: str, why: str) -> None:
        outcome = "refused" if why == "bad_input" else "failed"  # bad input: no batch abort
        self.end(item_id, JobState.FAILED, outcome, message, why=why)
        self.failures.append(message)
        self._result({"item_id": item_id, "status": "failed", "error": message})

    def _result(self, result: dict[str, Any]) -> None:
        """An item's result; one reported again (its write did not commit) replaces it."""
        self.results = [r for r in self.results if r["item_id"] != result["item_id"]]
        self.results.append(result)

    def _open(self) -> list[int]:
        return [i for i in self.ids if i not in self.ended]

    def _batch_aborted(self) -> bool:
        """A group of an aborted batch does not run: its items end skipped, as a single run's
        would."""
        if not self._batch_aborted_now():
            return False
        for item_id in self.ids:
            self._skip(item_id)
        log.info(
            f"{KI_EMBED} skipped: its batch was aborted",
            batch_id=self.batch_id,
            items=len(self.ids),
        )
        return True

    def _batch_aborted_now(self) -> bool:
        if self.batch_id is None:
            return False
        batch = get_batch(self.rt.db, self.batch_id)
        self.abort_reason = batch["abort_reason"] if batch else None
        return bool(batch and batch["state"] == BatchState.ABORTED)

    def _skip(self, item_id: int) -> None:
        """Not run for an aborted batch: `failed`, so that `kidx retry --failed` picks it up."""
        self.end(item_id, JobState.SKIPPED, "skipped", self.abort_reason)
        set_state(
            self.rt.db,
            item_id,
            status=Status.FAILED,
            last_task_id=self.task_id,
            last_error=f"not run: batch {self.batch_id} was aborted ({self.abort_reason})",
        )
        self.results.append({"item_id": item_id, "status": "skipped"})

    def _summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for r in self.results:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        return {
            "items": len(self.ids),
            **counts,
            "duration_ms": self.took(),
            "results": self.results,
        }

    def _failure_line(self) -> str:
        shown = "; ".join(self.failures[:3]) + (" ..." if len(self.failures) > 3 else "")
        others = len(self.ids) - len(self.failures)
        return (
            f"group of {len(self.ids)} items: {len(self.failures)} failed ({shown}), "
            f"{others} did not fail (after {self.took() / 1000:.1f} s)"
        )
