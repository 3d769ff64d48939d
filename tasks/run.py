"""One task run: a set of items indexed under their locks, each outcome recorded as it comes.
The one path behind the three tasks; a single item's run is a group of one.

What happens here, once, whatever the task: a revoke seen before the start; an aborted batch
(its items skipped and left `failed`, for `kidx retry --failed`); the items' locks (a busy item
ends `coalesced` and its holder runs it once more); the engine's run (`worker.bulk`), each
item's outcome recorded when it is known (its job row and its count in the batch, in one
transaction); an item asked for again while it ran, indexed once more under its lock if it
changed (asked again after that: sent again); a provider that may recover (the item sent again
later, as `retry_later` says); a revoke, a terminate and the soft time limit, for every item not
yet written. A task says only what differs: the id of an item's job row, how a retry is sent,
the shape of its result (`SingleRun`, `GroupRun`).
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, NamedTuple, NoReturn

import apsw
from celery import Task
from celery.exceptions import Ignore, SoftTimeLimitExceeded

from tasks import TASK_FOR_KIND, attempt_of, metrics
from tasks.cancel import TERMINATED, CancelToken, running
from tasks.lock import REQUEST_KEPT, LockSet
from tasks.producer import enqueue, send_group
from tasks.runtime import Runtime
from tasks.streak import SharedStreak, streak_key
from worker.bulk import LOCKED_OUT_MS, index_items
from worker.chunking import text_hash
from worker.errors import Cancelled, IndexAborted, KidxError, WrongTaskKind
from worker.indexers import IndexOptions, kind_of
from worker.log import KI_EMBED, get_logger
from worker.pipeline import IndexResult
from worker.settings import TaskSettings
from worker.store.items import Status, get_item, mark_not_run, name_failure, valid_item_id
from worker.store.jobs import (
    BatchState,
    JobState,
    abort_batch,
    batch_outcome,
    get_batch,
    record_end,
)

log = get_logger("kidx.tasks")

# The database locked past its busy timeout: a transient refusal, waited for again.
BUSY = (apsw.BusyError, apsw.LockedError)
# How many times an item's end is tried when the database is locked (each waits the timeout).
BUSY_TRIES = 3


def bare_result(item_id: int, status: str, error: str | None = None, **more: Any) -> dict[str, Any]:
    """An item's result that no run wrote (coalesced, skipped, retried, failed, sent on): the
    fields of every result (`IndexResult`), so that a host reading `chunks` or `model` of any
    result finds them, empty."""
    return {**IndexResult(item_id, status, error=error).as_dict(), **more}


class IndexFailed(Exception):
    """A run failed for good; the message names the cause and how long the run took."""


class Run:
    """A run of `task` over `item_ids` (their job rows already recorded as started)."""

    #: the item kinds this task handles (None: any)
    kinds: frozenset[str] | None = None
    #: whether items not started past the deadline go on in a group of their own
    sends_on: bool = False

    def __init__(
        self,
        task: Task,
        rt: Runtime,
        item_ids: list[int],
        *,
        reason: str | None,
        batch_id: int | None,
        structure_only: bool,
        started: float,
    ) -> None:
        self.task, self.rt, self.settings = task, rt, rt.settings
        self.task_id = str(task.request.id)
        self.attempt = sane_attempt(task)
        self.ids = list(dict.fromkeys(item_ids))  # an item once, whatever was sent
        self.reason, self.batch_id, self.structure_only = reason, batch_id, structure_only
        self.started = started
        # its start as the database writes times (NOW): what this run marked since is its own
        self.since = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"
        self.token = CancelToken(rt.redis, self.task_id)
        self.options = IndexOptions(
            chat=rt.chat,
            reader=rt.reader,
            chunk_window=self.settings.chunk.window,
            chunk_deadline=self.settings.chunk.deadline,
            chunk_target=self.settings.chunk.target,
            structure_only=structure_only,
            cancel=self.token,
            task_id=self.task_id,
            context_chars=self.settings.embedding.context_chars,
            streak=None
            if batch_id is None
            else SharedStreak(rt.redis, streak_key(rt.db.instance(), batch_id)),
        )
        self.locks: LockSet | None = None
        # re-runs other tasks asked of this run (item -> the task that asked) and not served
        # yet: `owed`, taken while the locks are held; `unserved`, every one left at the end
        self.owed: dict[int, str] = {}
        self.unserved: dict[int, str] = {}
        self.abort_reason: str | None = None
        self.ended: dict[int, str] = {}  # item -> its job state
        self.results: dict[int, dict[str, Any]] = {}  # item -> its result, in order
        self.failures: dict[int, str] = {}  # item -> its one-line failure
        self.locked_out = False  # an end the database stayed locked for: the rest wait less
        self.rerun: set[int] = set()  # items in the once-more pass (already ended, counted)

    # -- what a task says ---------------------------------------------------------------------

    def job(self, item_id: int) -> tuple[str, int]:
        """The item's job row: (task id, attempt)."""
        raise NotImplementedError

    def retry_later(self, item_id: int, error: IndexAborted, message: str) -> None:
        """Send the item again later (a provider that may recover), or fail it."""
        raise NotImplementedError

    def result(self) -> dict[str, Any]:
        """The task's result, once every item has ended."""
        raise NotImplementedError

    # -- the run ----------------------------------------------------------------------------

    def took(self) -> int:
        return int((time.monotonic() - self.started) * 1000)

    def line(self, item_id: int, cause: str) -> str:
        """One line naming the item, the cause (no secret in it) and how long the run took."""
        cause = " ".join(self.rt.redact.scrub(cause).split())
        return f"item {str(item_id)[:60]}: {cause} (after {self.took() / 1000:.1f} s)"

    def execute(self) -> dict[str, Any]:
        """Run the items; the task's result, or IndexFailed naming each item that failed.

        SIGTERM (`kidx cancel --terminate`) is a cancellation from the first step to the last
        record: a terminate that came after the run saw the revoke in Redis, while it recorded
        the revoke, ended the process before the job rows were written. The result is
        scrubbed of every configured secret: it goes to the result backend and the Tasks page,
        and an item's error is what a provider said (the HTTP client masks its own key; a
        provider of a host's own may not)."""
        with running():
            return self.rt.redact.scrub(self._execute())

    def _execute(self) -> dict[str, Any]:
        try:
            if self.token():
                raise Cancelled("revoked before it started")
            if self._batch_aborted():
                for item_id in self.ids:
                    self._skip(item_id)
                log.info(
                    f"{KI_EMBED} skipped: its batch was aborted",
                    batch_id=self.batch_id,
                    items=len(self.ids),
                )
                return self.result()
            self._check_kinds()
            asked = self._under_locks([i for i in self.ids if i not in self.ended])
            self._send_on([i for i in self.ids if i not in self.ended])
            for item_id in asked:  # asked for again after its re-run: a run of its own
                if changed(self.rt, item_id):
                    follow = enqueue(self.rt.db, item_id, app=self.task.app, reason="changed")
                    log.info(
                        f"{KI_EMBED} changed again during the run: sent again",
                        item_id=item_id,
                        next=follow,
                    )
                # served only now: a time limit during the send leaves it to `_send_unserved`
                self.unserved.pop(item_id, None)
        except (Cancelled, SoftTimeLimitExceeded) as e:
            self._send_unserved()
            if isinstance(e, SoftTimeLimitExceeded) and not TERMINATED.is_set():
                limit = f"ran over the soft time limit of {self.settings.tasks.soft_time_limit} s"
                if not self._open() and not self.failures:  # (every item had ended well)
                    log.warning(f"{KI_EMBED} {limit} once every item had ended")
                    return self.result()
                log.error(f"{KI_EMBED} failed", items=self._open(), reason=limit)
                with contextlib.suppress(apsw.Error, KidxError):
                    name_failure(self.rt.db, self._open(), self.task_id, limit)
                for item_id in self._open():
                    line = self.line(item_id, limit)
                    self._failed(item_id, line, "time_limit")
                    # its state too, as below: an item the run never read kept `indexed`
                    # over its old text, and no sweep read a file's or URL's new text
                    self._not_run(item_id, line, attempt=True, since=self.since)
                raise IndexFailed(self.failure()) from None
            self._revoked()
        except Exception as e:  # a bug, Redis or the database refusing: each open item names it
            self._send_unserved()
            for item_id in self._open():
                line = self.line(item_id, f"{type(e).__name__}: {e}")
                self._failed(item_id, line, "error")
                # its state too, an attempt counted, for the retry sweep to send it again: an
                # item the run never got to (Redis refused its lock) kept `indexed` over its old
                # text, and a file's or a URL's new text was never read (no sweep sees it)
                self._not_run(item_id, line, attempt=True, since=self.since)
            log.exception(f"{KI_EMBED} the run failed", reason=f"{type(e).__name__}: {e}")
            if self.failures:
                raise IndexFailed(self.failure()) from None
            # Every item had ended well (the error came after: a lock's release, a follow-up
            # send): their outcomes stand, and so does the task's.
        if self.failures:
            raise IndexFailed(self.failure())
        return self.result()

    def _under_locks(self, ids: list[int]) -> dict[int, str]:
        """Index the items under their locks; those asked for again after their re-run (item ->
        the task that asked). However the run ends, the requests it did not serve are kept
        (`unserved`): a task that ended `coalesced` trusted this run with its item."""
        t = self.settings.tasks
        locks = self.locks = LockSet(
            self.rt.redis,
            self.rt.db.instance(),
            ids,
            self.task_id,
            t.lock_ttl,
            # (a request outlives the longest run: the limits may be set to weeks)
            keep=max(REQUEST_KEPT, t.time_limit + t.lock_ttl),
        )
        held, busy = locks.acquire()
        asked: dict[int, str] = {}
        failed_asked: dict[int, str] = {}
        try:
            for item_id, problem in locks.refused.items():  # another program's value at a key
                self._conflict(item_id, problem)
            for item_id in busy:
                log.info(
                    f"{KI_EMBED} coalesced: the item is being indexed by another run",
                    item_id=item_id,
                )
                self.end(item_id, JobState.COALESCED, "ok")
                self.results[item_id] = bare_result(item_id, "coalesced")
            with self.rt.scope.running(self.token):
                self._index(held)
                taken = locks.take_reruns()
                again = [i for i in taken if self._indexed(i) and changed(self.rt, i)]
                self.owed = {i: taken[i] for i in again}
                # Asked for while this run failed it: the asker ended `coalesced`, trusting
                # this run, and its request was dropped (a host's fix of a note the provider
                # refused, left failed). Or while another run had the item (this one's lock
                # had expired: its write ended `coalesced`), whose request this run took.
                # Sent again as a run of its own if changed, below.
                failed_asked = {
                    i: t
                    for i, t in taken.items()
                    if self.ended.get(i) in (JobState.FAILED, JobState.COALESCED)
                }
                if again:  # edited while it ran, and asked for: once more, under the lock
                    log.info(
                        f"{KI_EMBED} changed while it was indexed: once more", items=len(again)
                    )
                    self.rerun = set(again)
                    self._index(again)
        finally:
            try:
                # (`owed`: what the once-more pass did not start, past the run's deadline)
                asked = {**self.owed, **failed_asked, **locks.release()}
            finally:
                self.unserved = {**self.owed, **failed_asked, **asked}
        return asked

    def _send_unserved(self) -> None:
        """The run ends early (cancelled, failed): send again, each as a run of its own, the
        items other tasks asked it to run once more, which it now will not. A request of this
        task's own (a second delivery of it) goes with this run: a cancel of it covers both."""
        unserved, self.unserved, self.owed = self.unserved, {}, {}
        for item_id, asker in unserved.items():
            if asker == self.task_id:
                continue
            try:
                if not changed(self.rt, item_id):
                    continue
                follow = enqueue(self.rt.db, item_id, app=self.task.app, reason="changed")
            except (apsw.Error, KidxError) as e:
                log.error(
                    "could not send again an item another task asked to run once more",
                    item_id=item_id,
                    asked_by=asker,
                    reason=f"{type(e).__name__}: {e}",
                )
                continue
            log.info(
                f"{KI_EMBED} asked for by another task while the run went on: sent again",
                item_id=item_id,
                asked_by=asker,
                next=follow,
            )

    def _index(self, ids: list[int]) -> None:
        deadline = self.started + self.settings.tasks.soft_time_limit / 2
        index_items(
            self.rt.db,
            ids,
            embedder=self.rt.embedder,
            options=self.options,
            on_done=self._done,
            deadline=deadline if self.sends_on else None,
        )

    def _indexed(self, item_id: int) -> bool:
        return self.ended.get(item_id) == JobState.SUCCESS

    # -- an item's end ----------------------------------------------------------------------

    def end(
        self,
        item_id: int,
        state: JobState,
        outcome: str | None,
        error: str | None = None,
        why: str | None = None,
    ) -> None:
        """An item's run ends: its job row and its count in the batch, in one transaction
        (the write's own transaction, when the item was just written: if that does not commit,
        the item ends again, failed). A database locked past the busy timeout (a host's long
        transaction) is waited for again, `BUSY_TRIES` times in all: a row left `started`
        would be ended failed by the overrun sweep, and its item counted twice. A database
        that refuses (a full disk), or stays locked, is logged: the task's result still says
        what happened. Once it stayed locked, the run's other ends are tried once, for
        `LOCKED_OUT_MS` (`locked_out`), until one is recorded: a cancelled group of 128 waited
        the whole timeout four times for each item, hours at the default."""
        tries = 1 if self.locked_out else BUSY_TRIES
        for tried in range(1, tries + 1):
            try:
                with self._patience(), self.rt.db.atomic():
                    record_end(self.rt.db, *self.job(item_id), state, self.took(), error)
                    if self.batch_id is not None and outcome is not None:
                        batch_outcome(
                            self.rt.db,
                            self.batch_id,
                            outcome,
                            error,
                            abort_after=self.settings.tasks.batch_abort_after,
                            job=self.job(item_id),
                        )
                if not self.rt.db.conn.in_transaction:
                    self.locked_out = False  # (recorded: the lock has gone)
                break
            except (apsw.Error, KidxError) as e:
                reason = f"{type(e).__name__}: {e}"
                # (inside the caller's transaction, its own outcome decides: not tried again)
                again = isinstance(e, BUSY) and tried < tries
                if not again or self.rt.db.conn.in_transaction:
                    if isinstance(e, BUSY) and not self.rt.db.conn.in_transaction:
                        self.locked_out = True
                    log.error(
                        "could not record an item's end",
                        item_id=item_id,
                        reason=reason,
                        tries=tried,
                    )
                    break
                log.warning(
                    "could not record an item's end yet (the database is locked): trying again",
                    item_id=item_id,
                    reason=reason,
                )
        metrics.run(self.task.name, str(state), why)
        self.ended[item_id] = str(state)

    @contextlib.contextmanager
    def _patience(self) -> Iterator[None]:
        """Once an end stayed locked out (`locked_out`), the next ones wait `LOCKED_OUT_MS`,
        not the whole busy timeout again (as `index_items` does, for the same reason); only
        for their own write: the connection is the process's, and its runs' writes wait as
        configured."""
        if not self.locked_out:
            yield
            return
        patience = self.rt.db.busy_timeout_ms
        self.rt.db.busy_timeout_ms = min(patience, LOCKED_OUT_MS)
        try:
            yield
        finally:
            self.rt.db.busy_timeout_ms = patience

    def _done(self, item_id: int, outcome: IndexResult | KidxError) -> None:
        """An item's outcome, recorded at once (progress shows while the run goes on)."""
        self.failures.pop(item_id, None)  # an item reported again (its write did not commit)
        self.owed.pop(item_id, None)  # its re-run has an outcome: the request is served
        if isinstance(outcome, IndexResult):
            result = outcome.as_dict()
            if outcome.status == "skipped":  # no provider configured: nothing was written
                self.end(item_id, JobState.SKIPPED, "skipped", outcome.error)
            elif outcome.status == "coalesced":  # another run took the item: its index stands
                self.end(item_id, JobState.COALESCED, "ok", outcome.error)
            else:
                self.end(item_id, JobState.SUCCESS, "ok")
                metrics.record_chunks(result)
            self.results[item_id] = result
            return
        if isinstance(outcome, IndexAborted) and outcome.transient and item_id in self.rerun:
            self._send_changed(item_id, outcome)
            return
        if isinstance(outcome, IndexAborted) and outcome.provider_down and self.batch_id:
            # The batch's requests failed N times in a row, in this run or others: it stops.
            # The item whose outcome stopped it failed (with the cause); the rest are skipped.
            with contextlib.suppress(apsw.Error, KidxError):
                if abort_batch(self.rt.db, self.batch_id, f"aborted after {outcome}"):
                    self._failed(item_id, self.line(item_id, str(outcome)), "provider_transient")
                    return
        if self._batch_aborted():  # by this run's failures or another's: no retry
            self._skip(item_id)
            return
        message = self.line(item_id, str(outcome))
        if isinstance(outcome, IndexAborted) and outcome.transient:
            self.retry_later(item_id, outcome, message)
            return
        why = "provider_permanent" if isinstance(outcome, IndexAborted) else "bad_input"
        self._failed(item_id, message, why)

    def _send_changed(self, item_id: int, error: IndexAborted) -> None:
        """The once-more pass of an item this run indexed met a provider that may recover: the
        first pass's index and its count in the batch stand, and the edit goes later as a run
        of its own, outside the batch (a retry in it counted the item twice, and the batch
        ended `done` before its other items ran)."""

        def send() -> None:
            try:
                follow = enqueue(
                    self.rt.db,
                    item_id,
                    app=self.task.app,
                    reason="changed",
                    countdown=backoff(self.rt, 0, error.retry_after),
                )
            except (apsw.Error, KidxError) as e:  # the retry sweep takes it (its state failed)
                log.error(
                    f"{KI_EMBED} could not send again an item changed during the run",
                    item_id=item_id,
                    reason=f"{type(e).__name__}: {e}",
                )
                return
            log.warning(
                f"{KI_EMBED} changed during the run, not indexed again yet: sent again later",
                item_id=item_id,
                reason=str(error),
                next=follow,
            )

        self.rt.db.on_commit(send)

    def _failed(self, item_id: int, message: str, why: str) -> None:
        # bad input, a key another program holds: the item's own problem, no batch abort
        outcome = "refused" if why in ("bad_input", "key_conflict") else "failed"
        self.end(item_id, JobState.FAILED, outcome, message, why=why)
        self.failures[item_id] = message
        self.results[item_id] = bare_result(item_id, "failed", message)

    def _conflict(self, item_id: int, problem: str) -> None:
        """The item's lock or re-run request key holds another program's value (KeyConflict):
        failed with that line, its state too (`kidx status` says what to do), an attempt
        counted (the retry sweep sent it again at its first backoff for good, a batch and a
        task every time), and not counted against its batch: another item's run is not the
        worse for it."""
        log.error(f"{KI_EMBED} failed", item_id=item_id, reason=problem)
        self._failed(item_id, self.line(item_id, problem), "key_conflict")
        self._not_run(item_id, problem, attempt=True)

    def _skip(self, item_id: int) -> None:
        """Not run for an aborted batch (`mark_not_run`)."""
        self.end(item_id, JobState.SKIPPED, "skipped", self.abort_reason)
        self._not_run(item_id, f"not run: batch {self.batch_id} was aborted ({self.abort_reason})")
        self.results[item_id] = bare_result(item_id, "skipped", self.abort_reason)

    def _not_run(self, item_id: int, error: str, **how: Any) -> None:
        """The item's state for a run that did not index it (`mark_not_run`), if the database
        takes it: the job row says what happened either way."""
        try:
            with self._patience():
                mark_not_run(self.rt.db, item_id, self.task_id, self.job(item_id)[0], error, **how)
        except BUSY:
            if not self.rt.db.conn.in_transaction:
                self.locked_out = True
        except (apsw.Error, KidxError):
            pass

    def _check_kinds(self) -> None:
        if self.kinds is None:
            return
        for item_id in self.ids:
            try:
                kind = get_item(self.rt.db, item_id, content=False).kind
            except KidxError:
                continue  # no such item: the run says so
            if kind not in self.kinds:
                other = TASK_FOR_KIND.get(kind, "?")
                wrong = WrongTaskKind(
                    f"item {item_id} is a {kind}: send {other}, not {self.task.name}"
                )
                log.error(f"{KI_EMBED} failed", item_id=item_id, reason=str(wrong))
                self._failed(item_id, self.line(item_id, str(wrong)), "bad_input")

    def _send_on(self, item_ids: list[int]) -> None:
        """Items not started before the run's deadline (half the soft time limit) go on in a
        group of their own, in the same batch: a big group never meets the time limit."""
        if not item_ids:
            return
        follow = send_group(
            self.rt.db,
            self.task.app,
            item_ids,
            self.batch_id,
            stored_reason(self.reason) or "group",  # as the job rows keep it
            structure_only=self.structure_only,
        )
        note = f"not started within half the time limit: sent on in group {follow}"
        for item_id in item_ids:
            self.end(item_id, JobState.RETRY, None, note)
            self.results[item_id] = bare_result(item_id, "sent on", next=follow)
        log.info(
            f"{KI_EMBED} group past its deadline: the rest sent on",
            items=len(item_ids),
            next=follow,
        )

    def _revoked(self) -> None:
        """Cancelled: what was written stays, the rest keeps its previous index; REVOKED."""
        for item_id in self._open():
            self.end(item_id, JobState.REVOKED, "skipped", "cancelled")
            # as an aborted batch's: not over another run's index, or its run under way (a
            # revoke seen before the start holds no lock)
            self._not_run(item_id, "cancelled", status=Status.CANCELLED)
        self.task.backend.mark_as_revoked(self.task_id, "cancelled", request=self.task.request)
        self.task.send_event(
            "task-revoked", terminated=TERMINATED.is_set(), signum=None, expired=False
        )
        log.info(
            f"{KI_EMBED} task revoked; what was not written keeps its previous index",
            duration_ms=self.took(),
        )
        raise Ignore()

    def _open(self) -> list[int]:
        return [i for i in self.ids if i not in self.ended]

    def _batch_aborted(self) -> bool:
        if self.batch_id is None:
            return False
        batch = get_batch(self.rt.db, self.batch_id)
        self.abort_reason = batch["abort_reason"] if batch else None
        return bool(batch and batch["state"] == BatchState.ABORTED)

    def failure(self) -> str:
        """The task's failure: one line for each item that failed."""
        raise NotImplementedError


def valid_batch(batch_id: object) -> bool:
    """A batch id: kidx's own, from 1 up."""
    return type(batch_id) is int and 0 < batch_id < 2**63


def not_utf8(text: str) -> int | None:
    """Where a string stops being UTF-8 (a lone surrogate: JSON's "\\ud800" decodes to one,
    and SQLite cannot store it), or None. A task argument that is stored is refused then, as
    text that must be UTF-8 is refused where it is read (worker.store.text)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def stored_reason(reason: object) -> str | None:
    """A task's reason as its job row keeps it (refused arguments are recorded too): at most
    200 characters of a string SQLite can store, or None."""
    if not isinstance(reason, str) or not_utf8(reason) is not None:
        return None
    return reason[:200] or None


class Arguments(NamedTuple):
    """A task's arguments as a message gave them, positional or by name (`bind_arguments`)."""

    first: Any  # the item id, or a group's list of them
    reason: Any
    batch_id: Any
    structure_only: Any
    extra: tuple[Any, ...]  # positional ones past the fourth
    unknown: dict[str, Any]  # names the task does not take
    twice: list[str]  # names given both by position and by name


def bind_arguments(first: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Arguments:
    """Bind a message's arguments as Python would, without its TypeError: the tasks take
    `self, /, *args, **kwargs` (a `self` by name lands in kwargs), so that an argument given
    twice, or one named `self`, is refused by `bad_arguments` with a job row, not by Python
    before any kidx code ran."""
    names = (first, "reason", "batch_id", "structure_only")
    given = dict(zip(names, args, strict=False))
    twice = [name for name in kwargs if name in given]
    given.update((k, v) for k, v in kwargs.items() if k in names and k not in given)
    return Arguments(
        given.get(first),
        given.get("reason"),
        given.get("batch_id"),
        given.get("structure_only", False),
        tuple(args[len(names) :]),
        {k: v for k, v in kwargs.items() if k not in names},
        twice,
    )


def bad_arguments(
    rt: Runtime,
    item_id: object,
    reason: object,
    batch_id: object,
    structure_only: object,
    extra: tuple[Any, ...] = (),
    unknown: dict[str, Any] | None = None,
    twice: list[str] | None = None,
) -> str | None:
    """What is wrong with a task's arguments (a host may send anything a JSON message
    holds), in one line; None when they are fine. Arguments the task does not take are
    refused here, not by Python's TypeError, so that the run still gets its job row."""
    if not valid_item_id(item_id):  # a JSON message may carry "abc", 1.5, true or 2**70
        return f"the item id must be a 64-bit integer, not {item_id!r:.60}"
    if extra:
        return f"the task takes at most 4 arguments, not {4 + len(extra)}"
    if twice:
        names = ", ".join(repr(name) for name in sorted(twice))
        return f"task argument {names:.120} given both by position and by name"
    if unknown:
        names = ", ".join(repr(name) for name in sorted(unknown))
        return f"unknown task argument {names:.120}"
    if reason is not None and not isinstance(reason, str):
        return f"reason must be a string, not {reason!r:.60}"
    if isinstance(reason, str) and (at := not_utf8(reason)) is not None:
        return f"reason must be UTF-8 text, not a string with a lone surrogate at character {at}"
    if not isinstance(structure_only, bool):
        return f"structure_only must be true or false, not {structure_only!r:.60}"
    if batch_id is not None:
        if not valid_batch(batch_id):
            return f"the batch id must be a positive integer, not {batch_id!r:.60}"
        if get_batch(rt.db, batch_id) is None:  # type: ignore[arg-type]
            return f"no batch with id {batch_id}"
    return None


def longest_countdown(t: TaskSettings) -> float:
    """The longest retry countdown the broker holds without running the task twice: a Redis
    broker hands a task out again when it is not acknowledged within the visibility timeout,
    and a task waiting for its countdown is delivered (unacknowledged) from the start, so its
    wait and its run (up to the hard time limit) must both fit in the timeout."""
    return float(t.visibility_timeout - t.time_limit)


def backoff(rt: Runtime, attempt: int, retry_after: float | None) -> float:
    """Seconds before a retry: exponential with jitter, not before the server's Retry-After,
    and never past `longest_countdown` (a server asking for a day, or for 1e12 s, which no
    countdown can hold, is retried then; asked again, it is retried again, until the task's
    retries run out and the retry sweep takes the item). A wait that is no number (NaN) or
    negative counts as none."""
    t = rt.settings.tasks
    exponent = min(max(attempt, 0), 64)  # a float, not an overflow, whatever the retries
    delay = min(t.retry_backoff_max, t.retry_backoff * 2.0**exponent) * random.uniform(0.5, 1.5)
    asked = 0.0 if retry_after is None or math.isnan(retry_after) else retry_after
    return min(longest_countdown(t), max(delay, asked, 0.0))


def sane_attempt(task: Task) -> int:
    """The run's attempt (`attempt_of`), written back into its request: Celery's retry counts
    on from there."""
    attempt = attempt_of(task.request.retries)
    task.request.retries = attempt
    return attempt


def retry_busy(task: Task, rt: Runtime, error: Exception) -> NoReturn:
    """The database stayed locked past the busy timeout as the run was to be recorded (a
    host's long transaction, a rebuild): nothing was written, so the task goes again later,
    as Celery's retry (with the backoff, up to `max_retries`), rather than fail unrecorded
    with its job row left `queued` and its batch waiting."""
    attempt = sane_attempt(task)
    message = f"the database was locked when the run started ({type(error).__name__}: {error})"
    if attempt >= rt.settings.tasks.max_retries:
        log.error(f"{KI_EMBED} failed", reason=message, retries=attempt)
        raise IndexFailed(f"{message}; no retries left") from None
    countdown = backoff(rt, attempt, None)
    log.warning(f"{KI_EMBED} not started: tried again later", reason=message, countdown=countdown)
    retry_task(task, message, countdown, rt.settings.tasks.max_retries)


def retry_task(task: Task, message: str, countdown: float, max_retries: int) -> NoReturn:
    """Celery's retry of `task`, failing with `message` until then. What the task is about
    (`kwargsrepr`: kind and title) goes with it, or Flower would show the retry's bare kwargs
    from then on."""
    request = task.request
    shown = {
        k: v for k in ("argsrepr", "kwargsrepr") if (v := getattr(request, k, None)) is not None
    }
    raise task.retry(
        exc=IndexFailed(message), countdown=countdown, max_retries=max_retries, **shown
    )


def changed(rt: Runtime, item_id: int) -> bool:
    """Whether the item's text differs from what its index was built from. A file's, URL's or
    code's text is read from its source, by a run only: asked for again, it is run again."""
    try:
        item = get_item(rt.db, item_id, content=False)
        if not kind_of(item).text_in_row:
            return True
        if item.content_hash is None:  # the content was written without its hash
            item = get_item(rt.db, item_id)
    except KidxError:  # gone, or of no kind kidx knows
        return False
    # (as bytes: a host's text that is not UTF-8 raised in apsw; a hash is ASCII hex)
    state = "SELECT CAST(indexed_hash AS BLOB) FROM item_index_state WHERE item_id = ?"
    current = item.content_hash or text_hash(item.content)
    return rt.db.scalar(state, (item_id,)) != current.encode("utf-8", "surrogatepass")
