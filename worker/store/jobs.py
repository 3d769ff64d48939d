"""Durable records of task runs (`index_jobs`) and batches (`index_batches`).

Flower keeps what it saw; these rows keep what happened, for `kidx jobs` and the sweeps. A batch
aborts after N consecutive failed runs (a provider that is down fails every item: there is no
point in sending the rest); its remaining tasks then end as skipped with the batch's reason.
"""

from __future__ import annotations

import enum
from typing import Any

from worker.store.db import Database
from worker.store.items import NOW, Status, mark_not_run
from worker.store.schema import named_refusals
from worker.store.text import integer_or_null, readable, shown_row


class JobState(enum.StrEnum):
    """What became of one run of a task."""

    QUEUED = "queued"  # sent, not started
    STARTED = "started"
    SUCCESS = "success"
    FAILED = "failed"  # final: no retry left, or a permanent error
    RETRY = "retry"  # failed, and sent again with a delay
    REVOKED = "revoked"  # cancelled: not a failure
    COALESCED = "coalesced"  # the item was being indexed; that run will cover this one
    SKIPPED = "skipped"  # nothing to do, or its batch was aborted


class BatchState(enum.StrEnum):
    """Where a batch is: running until every item is counted, or aborted after N failures."""

    RUNNING = "running"
    DONE = "done"
    ABORTED = "aborted"


JOB_COLUMNS = (
    "task_id",
    "attempt",
    "task_name",
    "item_id",
    "batch_id",
    "state",
    "reason",
    "started_at",
    "finished_at",
    "duration_ms",
    "error",
)


def record_queued(
    db: Database,
    task_id: str,
    task_name: str,
    item_id: int,
    batch_id: int | None,
    reason: str | None,
) -> None:
    record_queued_many(db, [(task_id, item_id)], task_name, batch_id, reason)


def record_queued_many(
    db: Database,
    runs: list[tuple[str, int]],
    task_name: str,
    batch_id: int | None,
    reason: str | None,
) -> None:
    with named_refusals(db), db.atomic():
        db.executemany(
            "INSERT INTO index_jobs(task_id, attempt, task_name, item_id, batch_id, state, "
            f"reason, queued_at) VALUES (?, 0, ?, ?, ?, 'queued', ?, {NOW}) "
            "ON CONFLICT(task_id, attempt) DO NOTHING",
            [(task_id, task_name, item_id, batch_id, reason) for task_id, item_id in runs],
        )


def forget_queued(db: Database, task_ids: list[str]) -> None:
    """Runs recorded as queued whose task never reached the broker: no trace of them, so that
    no sweep takes their items for busy."""
    with db.atomic():
        db.executemany(
            "DELETE FROM index_jobs WHERE task_id = ? AND attempt = 0 AND state = 'queued'",
            [(t,) for t in task_ids],
        )


NOT_STARTED = "not started (the database was locked): run again as attempt"


def record_start(
    db: Database,
    task_id: str,
    attempt: int,
    task_name: str,
    item_id: int | None,
    batch_id: int | None,
    reason: str | None,
) -> None:
    """A run starts (again, after a redelivery: the row is reset)."""
    record_starts(db, [(task_id, item_id)], task_name, batch_id, reason, attempt=attempt)


# A row met again is the same run redelivered (or the row its send wrote) only when it names
# the same task, item and batch: a host that gives a task id twice (its own ids, or none,
# which a run reads as "None") starts another run under the old row, which kept the old item
# and batch, and `counted` from the old run: the new run was never counted in its batch.
_SAME_RUN = (
    "index_jobs.task_name IS excluded.task_name AND index_jobs.item_id IS excluded.item_id "
    "AND index_jobs.batch_id IS excluded.batch_id"
)


# What a sweep wrote on an attempt whose retry it took for lost (`worker.reconcile`), having
# counted the item skipped in its batch: a later attempt that runs after all is not counted.
LOST_RETRY = (
    "its retry did not run within the visibility timeout (lost with the broker, or never "
    "sent): counted skipped in its batch; the retry sweep sends the item again"
)
_LOST_BEFORE = (
    "(SELECT count(*) > 0 FROM index_jobs p WHERE p.task_id = ? AND p.attempt < ? AND p.error = ?)"
)


def record_starts(
    db: Database,
    runs: list[tuple[str, int | None]],
    task_name: str,
    batch_id: int | None,
    reason: str | None,
    *,
    attempt: int = 0,
) -> None:
    """Runs start (a group's: one row for each (job id, item id)), in one transaction; a row
    met again after a redelivery is reset (and takes this run's task, item and batch: a task
    id given twice); an earlier attempt that never started ends
    (`_close_unstarted`)."""
    with named_refusals(db), db.atomic():
        _close_unstarted(db, [job_id for job_id, _ in runs], attempt)
        db.executemany(
            "INSERT INTO index_jobs(task_id, attempt, task_name, item_id, batch_id, state, "
            "reason, started_at, counted) "
            f"VALUES (?, ?, ?, ?, ?, 'started', ?, {NOW}, {_LOST_BEFORE}) "
            "ON CONFLICT(task_id, attempt) DO UPDATE SET state = 'started', "
            "started_at = excluded.started_at, finished_at = NULL, duration_ms = NULL, "
            f"error = NULL, counted = CASE WHEN {_SAME_RUN} "
            "THEN max(counted, excluded.counted) ELSE excluded.counted END, "
            "task_name = excluded.task_name, item_id = excluded.item_id, "
            "batch_id = excluded.batch_id, reason = excluded.reason",
            [
                (job_id, attempt, task_name, item_id, batch_id, reason, job_id, attempt, LOST_RETRY)
                for job_id, item_id in runs
            ],
        )


def _close_unstarted(db: Database, job_ids: list[str], attempt: int) -> None:
    """Attempts before `attempt` still `queued` never started (the database was locked when
    they were to: `tasks.run.retry_busy`): they end `retry`, not counted, so that no sweep
    takes them for lost."""
    if attempt > 0:
        db.executemany(
            f"UPDATE index_jobs SET state = 'retry', finished_at = {NOW}, "
            "error = coalesce(error, ?) WHERE task_id = ? AND attempt < ? AND state = 'queued'",
            [(f"{NOT_STARTED} {attempt}", job_id, attempt) for job_id in job_ids],
        )


def end_discarded(
    db: Database, task_id: str, attempt: int, error: str, status: Status = Status.CANCELLED
) -> int:
    """A task Celery discarded before it ran (revoked while queued or reserved, or expired):
    no kidx code ran for it, so what its run would have recorded is recorded here, as a run
    that sees its revoke before it starts does. Its rows still `queued` (a group's too,
    `<task id>:<item id>`) end `revoked`, each counted skipped in its batch (never run: no
    step towards aborting it), and their items are marked as items a run did not run are
    (`mark_not_run`: `status`, unless another run has indexed them since or is indexing them
    now). A retry discarded while it waited for its countdown has no row yet: it gets one,
    from its previous attempt's. `attempt`: the task's retries (a group's rows: 0). How many
    rows ended."""
    with db.atomic():
        if attempt > 0:
            db.execute(
                "INSERT INTO index_jobs(task_id, attempt, task_name, item_id, batch_id, state, "
                f"reason, queued_at) SELECT task_id, ?, task_name, item_id, batch_id, 'queued', "
                f"reason, {NOW} FROM index_jobs WHERE task_id = ? AND attempt = ? "
                "ON CONFLICT(task_id, attempt) DO NOTHING",
                (attempt, task_id, attempt - 1),
            )
            _close_unstarted(db, [task_id], attempt)
        # the task's own row, or its group's rows: `<task id>:` sorts before `<task id>;`
        rows = db.all(
            f"UPDATE index_jobs SET state = 'revoked', finished_at = {NOW}, error = ? "
            "WHERE attempt = ? AND state = 'queued' "
            "AND (task_id = ? OR (task_id > ? AND task_id < ?)) "
            "RETURNING CAST(task_id AS BLOB), "  # a host's bytes, which apsw cannot read as text
            f"{integer_or_null('item_id')}, {integer_or_null('batch_id')}",
            (error, attempt, task_id, f"{task_id}:", f"{task_id};"),
        )
        for raw, item_id, batch_id in rows:
            try:
                job_id = raw.decode("utf-8")
            except (AttributeError, UnicodeDecodeError):
                continue  # no row of kidx's: ended, nothing to count it by
            if batch_id is not None:
                batch_outcome(db, batch_id, "skipped", error, abort_after=0, job=(job_id, attempt))
            if item_id is not None:
                mark_not_run(db, item_id, task_id, job_id, error, status=status)
    return len(rows)


def group_job_id(task_id: str, item_id: int) -> str:
    """An item's record in a group run: the group's task id, then the item (`kidx cancel`
    takes either and revokes the group)."""
    return f"{task_id}:{item_id}"


def record_end(
    db: Database,
    task_id: str,
    attempt: int,
    state: JobState,
    duration_ms: int,
    error: str | None = None,
) -> None:
    with named_refusals(db), db.atomic():
        db.execute(
            f"UPDATE index_jobs SET state = ?, finished_at = {NOW}, duration_ms = ?, error = ? "
            "WHERE task_id = ? AND attempt = ?",
            (str(state), duration_ms, error, task_id, attempt),
        )


def list_jobs(
    db: Database, *, failed: bool = False, batch_id: int | None = None, limit: int = 500
) -> list[dict[str, Any]]:
    where, params = [], []
    if failed:
        where.append("j.state = 'failed'")
    if batch_id is not None:
        where.append("j.batch_id = ?")
        params.append(batch_id)
    clause = ("WHERE " + " AND ".join(where)) if where else ""
    # The table's columns named with `j.`: a bare name in ORDER BY is the result's column
    # of that name, which `readable` made a BLOB (sorted after every text, '9999' included).
    rows = db.dicts(
        f"SELECT {', '.join(readable('j.' + c) for c in JOB_COLUMNS)} FROM index_jobs j "
        f"{clause} ORDER BY coalesce(j.started_at, '9999') DESC, j.rowid DESC LIMIT ?",
        (*params, limit),
    )
    return [shown_row(r) for r in rows]  # what a host wrote is shown, never raised


# -- batches ---------------------------------------------------------------------------------

BATCH_COLUMNS = (
    "id",
    "kind",
    "state",
    "total",
    "ok",
    "failed",
    "skipped",
    "consecutive_failures",
    "abort_reason",
    "created_at",
    "finished_at",
)


BATCH_KINDS = ("reindex", "reconcile", "retry")  # index_batches.kind (its CHECK)


def create_batch(db: Database, kind: str, total: int) -> int:
    with db.atomic():
        return int(
            db.scalar(
                "INSERT INTO index_batches(kind, total) VALUES (?, ?) RETURNING id", (kind, total)
            )
        )


def abort_batch(db: Database, batch_id: int, reason: str) -> bool:
    """End a running batch as aborted: its tasks still to run end skipped with the reason.
    Whether this call ended it (False: it was not running)."""
    with db.atomic():
        db.execute(
            f"UPDATE index_batches SET state = 'aborted', abort_reason = ?, finished_at = {NOW} "
            "WHERE id = ? AND state = 'running'",
            (reason, batch_id),
        )
        return db.conn.changes() > 0


def get_batch(db: Database, batch_id: int) -> dict[str, Any] | None:
    rows = db.dicts(
        f"SELECT {', '.join(map(readable, BATCH_COLUMNS))} FROM index_batches WHERE id = ?",
        (batch_id,),
    )
    return shown_row(rows[0]) if rows else None  # what a host wrote is shown, never raised


def batch_outcome(
    db: Database,
    batch_id: int,
    outcome: str,
    reason: str | None,
    *,
    abort_after: int,
    job: tuple[str, int] | None = None,
) -> dict[str, Any] | None:
    """Count one run of a batch's task: `ok`, `failed` (final), `retry` (a failed attempt
    that will run again), `refused` (final, for its input: a missing file, a deleted item),
    `skipped`. The Nth failure in a row aborts the batch; a refusal neither counts towards
    that nor breaks the run of failures. `job` (task
    id, attempt): the run's row, counted once whatever redeliveries run it again; a `retry`
    does not mark it: it is no end, and a redelivery of that attempt (its worker died before
    the retry was sent) must still count its own (the batch waited for it for good)."""
    with db.atomic():
        if job is not None and outcome != "retry":
            db.execute(
                "UPDATE index_jobs SET counted = 1 WHERE task_id = ? AND attempt = ? "
                "AND counted = 0",
                job,
            )
            if db.conn.changes() == 0:
                return get_batch(db, batch_id)
        if outcome == "ok":
            db.execute(
                "UPDATE index_batches SET ok = ok + 1, consecutive_failures = 0 WHERE id = ?",
                (batch_id,),
            )
        elif outcome in ("failed", "retry"):
            final = 1 if outcome == "failed" else 0
            db.execute(
                "UPDATE index_batches SET failed = failed + ?, "
                "consecutive_failures = consecutive_failures + 1 WHERE id = ?",
                (final, batch_id),
            )
            db.execute(
                "UPDATE index_batches SET state = 'aborted', abort_reason = ?, "
                f"finished_at = {NOW} WHERE id = ? AND state = 'running' "
                "AND consecutive_failures >= ?",
                (
                    f"aborted after {abort_after} consecutive failures; last: {reason}",
                    batch_id,
                    abort_after,
                ),
            )
        elif outcome == "refused":  # bad input says nothing of the provider: no abort
            db.execute("UPDATE index_batches SET failed = failed + 1 WHERE id = ?", (batch_id,))
        elif outcome == "skipped":
            db.execute("UPDATE index_batches SET skipped = skipped + 1 WHERE id = ?", (batch_id,))
        db.execute(
            f"UPDATE index_batches SET state = 'done', finished_at = {NOW} "
            "WHERE id = ? AND state = 'running' AND ok + failed + skipped >= total",
            (batch_id,),
        )
        return get_batch(db, batch_id)
