"""What the periodic sweeps find, without a queue: the engine side of `scheduler/`.

A record of what was indexed that never checks the vector store drifts silently (seen in
LangChain #39937). The reconcile sweep looks at both sides: it mends what needs no provider at
once (vec rows missing or orphaned) and returns the items that need a run (content changed,
pending or partial, chunks without vectors, chunk rows or a whole-item vector deleted or added
by hand, vectors of another model or dimension, skipped while no provider was configured, or
chunked structurally because the chunk model failed them).
Rows that deleted items left behind (worker.store.removal) are removed first. The retry sweep
returns failed items whose backoff has passed, until their attempts run out.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TypeVar

import apsw

from worker.chunking import FELL_BACK
from worker.log import get_logger
from worker.store.db import Database
from worker.store.fts import SWEEP_ROWS, check_due, sync_fts
from worker.store.items import NOW
from worker.store.jobs import LOST_RETRY, batch_outcome
from worker.store.removal import remove_leftovers
from worker.store.repair import RepairReport, repair_vectors
from worker.store.schema import refused_by_host, restore_dropped
from worker.store.text import integer_or_null
from worker.store.vec import refuse_stale, set_meta, sound

log = get_logger("kidx.reconcile")
T = TypeVar("T")

# Items a sweep must not send: a task for them is queued or running, or waits for its retry's
# countdown (Celery's retry of a task: the row of the attempt that failed says `retry`, the
# item `failed`, until a later run of the item starts; a countdown is at most the visibility
# timeout less the time limit, tasks.run.longest_countdown). Not lost: younger than the
# visibility timeout, after which Redis would have redelivered it anyway; a task the broker no
# longer holds at all is marked failed first, `mark_lost`. A send the broker refused leaves
# no `queued` row (tasks.producer), so its item is not taken for busy. A row without an
# integer item id (a task whose arguments were none: NULL) names no item: a NULL in `NOT IN`
# (the retry sweep's) made every item look busy, and TEXT that is not UTF-8 cannot be read.
# An age is taken whole (`abs`): a time in the future (written before the clock was set back,
# or a host's year 9999) was younger than any horizon, its item busy until then; one more
# than the horizon ahead is no run under way. (A time SQLite cannot read: NULL, not busy.)
_AGE = "abs(julianday('now') - julianday(coalesce(j.started_at, j.queued_at))) * 86400"
_ITEM = "typeof(j.item_id) = 'integer'"
BUSY_JOBS = f"""
SELECT item_id FROM index_jobs j WHERE state IN ('queued', 'started') AND {_AGE} < :horizon
 AND {_ITEM}
UNION SELECT item_id FROM index_jobs j WHERE state = 'retry' AND {_AGE} < :horizon AND {_ITEM}
 AND NOT EXISTS (SELECT 1 FROM index_jobs k WHERE k.item_id = j.item_id
  AND (coalesce(k.started_at, k.queued_at) > coalesce(j.started_at, j.queued_at)
   OR (k.task_id = j.task_id AND k.attempt > j.attempt)))
"""
# Items marked `indexing`: a run holds them, or held them and died (a killed process, inline
# or a worker's). The item's lock tells which, when the caller can look (`locked`); without
# it, a mark younger than the horizon counts as a run under way.
INDEXING = """
SELECT item_id, abs(julianday('now') - julianday(updated_at)) * 86400 < :horizon
  FROM item_index_state WHERE status = 'indexing'
"""
BUSY = f"""{BUSY_JOBS}
UNION SELECT item_id FROM item_index_state WHERE status = 'indexing'
 AND abs(julianday('now') - julianday(updated_at)) * 86400 < :horizon
"""

# Items that the reconcile sweep leaves to their backoff: `failed` ones are the retry sweep's
# (with its backoff and its cap on attempts; sending them from here too bypassed both), and a
# `partial` one waits as a failed one would before it is sent again for its missing vectors
# (each partial outcome is an attempt). A content change or a model switch is not a retry:
# `changed` and `other_model` send a partial item all the same (a host's edit of a failed note
# makes it `pending`, schema migration 12; the retry sweep sends a failed one after a switch).
RESTING_STATUSES = ("failed", "partial")
ALWAYS_SENT = ("changed", "other_model")

FINDINGS = {
    "changed": """SELECT i.id FROM knowledge_items i JOIN item_index_state s ON s.item_id = i.id
        WHERE s.status IN ('indexed', 'partial', 'cancelled') AND i.kind = 'note'
        AND (i.content_hash IS NULL OR s.indexed_hash IS NULL
             OR i.content_hash != s.indexed_hash)""",
    "pending": """SELECT i.id FROM knowledge_items i LEFT JOIN item_index_state s
        ON s.item_id = i.id WHERE coalesce(s.status, 'pending') IN ('pending', 'partial')""",
    # A cancelled run took the place of the `pending` an edit or a rename left (any kind: a
    # file's text or a title is in no hash), or its item was never indexed: the item has
    # changed since its index was written (schema migrations 3 and 10 move `updated_at`).
    "cancelled_stale": """SELECT i.id FROM knowledge_items i JOIN item_index_state s
        ON s.item_id = i.id WHERE s.status = 'cancelled'
        AND (s.indexed_at IS NULL OR i.updated_at > s.indexed_at)""",
    # (a vector a host wrote that kidx cannot read counts as none: `sound`)
    # (an item id a host wrote as text or a blob: a leftover whose removal a host's trigger
    # refused, kept; read, it failed every sweep from then on)
    "without_vectors": f"""SELECT DISTINCT c.item_id FROM note_chunks c
        LEFT JOIN note_chunk_embeddings e ON e.chunk_id = c.id
        WHERE (e.chunk_id IS NULL OR NOT ({sound("e")})) AND typeof(c.item_id) = 'integer'
        UNION SELECT DISTINCT c.item_id FROM code_chunks c
        LEFT JOIN code_chunk_embeddings e ON e.chunk_id = c.id
        WHERE (e.chunk_id IS NULL OR NOT ({sound("e")})) AND typeof(c.item_id) = 'integer'""",
    "other_model": """SELECT DISTINCT c.item_id FROM note_chunks c JOIN note_chunk_embeddings e
        ON e.chunk_id = c.id WHERE (e.model != :model OR e.dimensions != :dims)
        AND typeof(c.item_id) = 'integer'
        UNION SELECT DISTINCT c.item_id FROM code_chunks c JOIN code_chunk_embeddings e
        ON e.chunk_id = c.id WHERE (e.model != :model OR e.dimensions != :dims)
        AND typeof(c.item_id) = 'integer'""",
    # An indexed item whose chunk rows are not the ones its run wrote: a host's plain DELETE
    # of some (or all) of them, or rows added under its id. Their vec rows go as orphans, and
    # nothing else would ever bring the chunks back: the item looked indexed and was not found.
    "chunks_lost": """SELECT s.item_id FROM item_index_state s
        LEFT JOIN (SELECT item_id, count(*) AS n FROM note_chunks GROUP BY item_id) c
        ON c.item_id = s.item_id
        LEFT JOIN (SELECT item_id, count(*) AS n FROM code_chunks GROUP BY item_id) k
        ON k.item_id = s.item_id
        WHERE s.status = 'indexed' AND typeof(s.item_id) = 'integer'
        AND s.chunk_count IS NOT coalesce(c.n, 0) + coalesce(k.n, 0)""",
    # An indexed item of one chunk without its whole-item vector (a host deleted the row: its
    # vec row went as an orphan, and the note was never recalled whole again), or one of
    # another count of chunks with such a row. The run writes it from the chunk's vector.
    "whole_vector": """SELECT s.item_id FROM item_index_state s
        WHERE s.status = 'indexed' AND typeof(s.item_id) = 'integer'
        AND ((SELECT count(*) FROM (SELECT 1 FROM note_chunks c WHERE c.item_id = s.item_id
              LIMIT 2)) = 1)
        != EXISTS (SELECT 1 FROM note_embeddings e WHERE e.item_id = s.item_id)""",
}
# An item's attempts as the sweeps read them: NULL for what a host wrote that is no integer (its
# item rests); read as it is, text that is not UTF-8 raised in apsw and ended every sweep.
ATTEMPTS = integer_or_null("attempts")
# Items indexed by structure because the chunk model failed them (their run's note in
# `last_error`): the chunk model is asked again, each fallback it was asked for an attempt on
# the retry backoff (`Backoff`), oldest first. A fallback degrades an item for good otherwise:
# an outage of the chunk model left every item indexed meanwhile without LLM chunks.
FELL_BACK_ITEMS = """
SELECT item_id, {ATTEMPTS}, (julianday('now') - julianday(updated_at)) * 86400
  FROM item_index_state WHERE status = 'indexed' AND chunk_method = 'structure'
  AND instr(last_error, :note) > 0 AND typeof(item_id) = 'integer'
  ORDER BY updated_at, item_id
""".replace("{ATTEMPTS}", ATTEMPTS)
# Items of any kind a run skipped because no provider was configured (a file's or URL's text is
# read only by its run, so no hash says whether it changed): sent once a provider is. Without
# one, a run would only skip them again: they are not sent, whatever else found them.
SKIPPED = "SELECT item_id FROM item_index_state WHERE status = 'skipped'"


@dataclass
class Drift:
    """One reconcile sweep's findings."""

    found: dict[str, list[int]] = field(default_factory=dict)
    repaired: dict[str, dict[str, int]] = field(default_factory=dict)
    busy: int = 0
    to_index: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


LOST = "lost: the broker no longer holds this task (a Redis restart?); the sweep sends it again"


@dataclass(frozen=True)
class Backoff:
    """How long a failed (or partial) item waits before it is sent again: `backoff` x
    2^(attempts-1), at most `backoff_max`; none is sent after `max_attempts`."""

    max_attempts: int
    backoff: float
    backoff_max: float

    def due(self, attempts: int | None, waited: float | None) -> bool:
        if (attempts or 0) >= self.max_attempts:
            return False
        # An `updated_at` that is no time SQLite reads (a host's 'soon', a Unix epoch: None
        # here), or later than any backoff ahead (a clock set back, a host's year 9999), says
        # nothing of the wait: it has passed. Such an item rested failed for good; its run
        # writes a real time, so it is sent once, then waits as any.
        if waited is None or waited < -self.backoff_max:
            return True
        return waited >= min(self.backoff_max, self.backoff * 2 ** max(0, (attempts or 1) - 1))


def queued_jobs(db: Database, *, older_than: float) -> list[str]:
    """Job ids recorded as queued (first attempt, not started) for at least `older_than`
    seconds: those the caller may look for in the broker (`mark_lost`). UTF-8 text ids only:
    a host's BLOB, or TEXT that is not UTF-8 (apsw cannot read it), is no Celery task's (its
    item is busy until the horizon, as any queued one's). A `queued_at` far in the future or
    not a time (a clock set back, a host's) is looked for too: the broker tells."""
    ids = []
    for (raw,) in db.all(
        "SELECT CAST(task_id AS BLOB) FROM index_jobs WHERE state = 'queued' AND attempt = 0 "
        "AND typeof(task_id) = 'text' "
        "AND coalesce(abs(julianday('now') - julianday(queued_at)) * 86400 >= ?, 1)",
        (older_than,),
    ):
        try:
            ids.append(raw.decode("utf-8"))
        except UnicodeDecodeError:
            continue
    return ids


def mark_lost(db: Database, job_ids: list[str]) -> None:
    """Jobs whose task the broker no longer holds: failed, so that their items are not taken
    for busy and the sweep sends them again (a run that starts after all resets its row). The
    item is marked `pending` (unless a run holds it, it was cancelled, or no provider can run
    it): nothing else would tell the sweep that a file's or a URL's source changed, or that
    an admin asked for a run.

    A lost job of a batch counts in it as skipped, in the same transaction: it never ran, and
    its item goes again in the sweep's own batch, so its batch would otherwise wait for it for
    good. A broker's loss says nothing of the provider: it does not count towards aborting the
    batch. Its row is then `counted`, so a run that starts after all is not counted twice."""
    with db.atomic():
        for job_id in job_ids:
            rows = db.all(
                f"UPDATE index_jobs SET state = 'failed', finished_at = {NOW}, error = ? "
                "WHERE task_id = ? AND attempt = 0 AND state = 'queued' "
                f"RETURNING {integer_or_null('batch_id')}, {integer_or_null('item_id')}",
                (LOST, job_id),
            )
            db.executemany(
                f"UPDATE item_index_state SET status = 'pending', updated_at = {NOW} "
                "WHERE item_id = ? AND status IN ('indexed', 'partial', 'failed')",
                [(item_id,) for _, item_id in rows],
            )
            for batch_id, _ in rows:
                if batch_id is not None:
                    # (abort_after: a skip never aborts a batch)
                    batch_outcome(db, batch_id, "skipped", LOST, abort_after=0, job=(job_id, 0))


def close_lost_retries(db: Database, horizon: float) -> int:
    """A batch's item whose last attempt ended `retry` that long ago (`horizon`: the broker's
    visibility timeout, by which a retry on its way has run) with no later attempt: its retry
    was lost (its send failed, or Redis lost it during its countdown), and its batch waited
    for it for good (`kidx reindex --wait` with it). The row ends failed (`LOST_RETRY`), the
    item counts skipped in its batch, and the retry sweep sends it again; a later attempt
    that runs after all is not counted twice (`record_starts`). How many."""
    age = "coalesce(abs(julianday('now') - julianday(finished_at)) * 86400 >= :horizon, 1)"
    # A later row of the item in the batch is the run its retry became: a Celery retry's next
    # attempt, or the task of its own a group sends for it (written as it is sent), whose loss
    # `mark_lost` sees. `counted`: a redelivery of this attempt that starts after all is not
    # counted a second time (`record_starts` keeps a row's mark for the same run).
    with db.atomic():
        rows = db.all(
            "UPDATE index_jobs SET state = 'failed', error = :lost, counted = 1 "
            f"WHERE state = 'retry' AND {age} AND typeof(batch_id) = 'integer' "
            "AND EXISTS (SELECT 1 FROM index_batches b WHERE b.id = index_jobs.batch_id "
            "AND b.state = 'running') "
            "AND NOT EXISTS (SELECT 1 FROM index_jobs k WHERE k.item_id IS index_jobs.item_id "
            "AND k.batch_id = index_jobs.batch_id AND k.rowid > index_jobs.rowid) "
            "RETURNING batch_id",
            {"horizon": horizon, "lost": LOST_RETRY},
        )
        for (batch_id,) in rows:  # (abort_after: a skip never aborts a batch)
            batch_outcome(db, batch_id, "skipped", LOST_RETRY, abort_after=0)
    return len(rows)


OVERRUN = "ran past the hard time limit: killed, or its worker died (a redelivery may still run it)"
SUPERSEDED = "its end was not recorded (the database was locked); a later attempt ran"


def mark_overrun(db: Database, run_limit: float) -> int:
    """Runs recorded as started longer ago than any run can last (`run_limit`: the hard time
    limit and the item lock's TTL): Celery kills a run at the hard limit without a word to
    kidx, and a worker may die. Their rows end failed, counted in their batch (as a refusal:
    the item's own, no step towards aborting), and their items, if that run still marks them
    `indexing`, end failed (an attempt more): the retry sweep then takes them with its backoff,
    where they were taken for busy until the visibility timeout, then sent again on every
    sweep. A redelivery that starts after all resets its row. How many rows.

    A row a later attempt of the same task has superseded is not an overrun: that attempt
    ran because this one asked for a retry, whose end the database (locked past its busy
    timeout) did not take. It ends `retry`, as it did, and is not counted again."""
    # (a start further in the future than the limit, a clock set back or a host's year 9999,
    # or one that is no time: no run under way, or the row stayed `started` for good)
    age = "coalesce(abs(julianday('now') - julianday(started_at)) * 86400 >= :limit, 1)"
    later = (
        "EXISTS (SELECT 1 FROM index_jobs k WHERE k.task_id = index_jobs.task_id "
        "AND k.attempt > index_jobs.attempt)"
    )
    with db.atomic():
        db.execute(
            f"UPDATE index_jobs SET state = 'retry', finished_at = {NOW}, "
            "error = coalesce(error, :superseded) "
            f"WHERE state = 'started' AND {age} AND {later}",
            {"superseded": SUPERSEDED, "limit": run_limit},
        )
        rows = db.all(
            f"UPDATE index_jobs SET state = 'failed', finished_at = {NOW}, error = :error "
            f"WHERE state = 'started' AND {age} "
            f"RETURNING CAST(task_id AS BLOB), {integer_or_null('attempt')}, "
            f"{integer_or_null('item_id')}, {integer_or_null('batch_id')}",
            {"error": OVERRUN, "limit": run_limit},
        )
        for raw, attempt, item_id, batch_id in rows:
            run = raw.split(b":", 1)[0]  # a group's item row: `<task id>:<item id>`
            db.execute(
                f"UPDATE item_index_state SET status = 'failed', last_error = ?, "
                f"attempts = attempts + 1, updated_at = {NOW} WHERE item_id = ? "
                "AND status = 'indexing' AND CAST(last_task_id AS BLOB) = ?",
                (OVERRUN, item_id, run),
            )
            job_id = raw.decode("utf-8", "replace")
            if batch_id is not None and attempt is not None and job_id.encode() == raw:
                # (a host's bytes in the row's key: no row to count it by, so not counted)
                batch_outcome(
                    db, batch_id, "refused", OVERRUN, abort_after=0, job=(job_id, attempt)
                )
    return len(rows)


def reconcile(
    db: Database,
    *,
    model: str,
    max_items: int,
    horizon: float = 3600.0,
    locked: Callable[[list[int]], set[int]] | None = None,
    provider: bool = True,
    backoff: Backoff | None = None,
    rechunk: int = 0,
) -> Drift:
    """Mend the mirror and list the items that need a run (at most `max_items`). `locked`:
    which of these items a run holds the lock of now; an item marked `indexing` whose lock
    is not held was left by a run that died, and is sent again (`interrupted`). `provider`:
    whether an embedding provider is configured; `skipped` items are sent only then.
    `backoff`: the retry sweep's, which `failed` and `partial` items keep (RESTING_STATUSES;
    None: they are never sent for what a retry would mend). `rechunk`: how many items that
    fell back to structure may be sent for the chunk model (`FELL_BACK_ITEMS`, on that
    backoff): 0 without one, 1 (a probe) while it is taken for down. Items never tried again
    go first: the cut at `max_items` must not hand every sweep to the same retries."""
    dims = db.dimensions
    # A process of the model the index was switched away from: its repair would rebuild the
    # vec tables back to its dimension, and its findings send the new model's items to be
    # embedded again by the old one (`config_conflict`). It mends and sends nothing.
    refuse_stale(db)
    drift = Drift()
    # A worker's connection lives as long as its process: what a host dropped or made again
    # since (a table, a trigger) is made again here, not only by the next process's connect.
    # (Outside a transaction only: there foreign keys could not be turned off for its DROPs.)
    if db.conn.get_autocommit() and (restored := restore_dropped(db)):
        log.warning(
            "kidx's tables, indexes or triggers dropped or altered outside kidx were made "
            "again: this sweep refills them",
            restored=restored,
        )
    # first: their vec rows are then orphans, deleted next
    removed = _mended(db, "remove leftovers", lambda: remove_leftovers(db), {})
    report = _mended(db, "repair the vectors", lambda: repair_vectors(db, dims), RepairReport())
    drift.repaired = {
        "leftovers_removed": removed,
        "keyword_rows": _mended(
            db,
            "mend the keyword index",
            lambda: sync_fts(db, verify=True, check=check_due(db), most=SWEEP_ROWS),
            {},
        ),
        "restored": report.restored,
        "orphans_deleted": report.orphans_deleted,
        "replaced": report.replaced,
        "tables_rebuilt": report.tables_rebuilt,
    }
    params = {"model": model, "dims": dims, "horizon": horizon}
    busy = {r[0] for r in db.all(BUSY_JOBS, params)}
    marked = {item_id: bool(young) for item_id, young in db.all(INDEXING, params)}
    held = locked(sorted(marked)) if locked is not None and marked else set()
    running = held if locked is not None else {i for i, young in marked.items() if young}
    busy |= running
    skipped = {r[0] for r in db.all(SKIPPED)}
    resting, retried, failed = _resting(db, backoff)
    wanted: set[int] = set()
    for name, sql in FINDINGS.items():
        ids = {r[0] for r in db.all(sql, params)} - (set() if provider else skipped)
        drift.found[name] = sorted(ids - failed if name in ALWAYS_SENT else ids - resting)
        wanted.update(drift.found[name])
    drift.found["skipped"] = sorted(skipped) if provider else []
    wanted.update(drift.found["skipped"])
    drift.found["interrupted"] = sorted(set(marked) - running - busy)
    wanted.update(drift.found["interrupted"])
    fell_back = _fell_back(db, backoff, busy, rechunk if provider else 0)
    drift.found["fell_back"] = sorted(fell_back)
    retried |= fell_back - wanted  # (found for another reason too: not a retry)
    wanted.update(fell_back)
    if wanted:  # (a leftover a refused repair kept names an item that is gone: not sent)
        live = "SELECT value FROM json_each(?) WHERE value IN (SELECT id FROM knowledge_items)"
        wanted = {r[0] for r in db.all(live, (json.dumps(sorted(wanted)),))}
    drift.busy = len(wanted & busy)
    drift.to_index = sorted(wanted - busy, key=lambda i: (i in retried, i))[:max_items]
    return drift


def _mended(db: Database, what: str, mend: Callable[[], T], nothing: T) -> T:
    """One of the sweep's repairs (each in a transaction of its own). One that a host's
    trigger or index on kidx's tables refuses (a `RAISE` on deleting note_chunks) failed every
    sweep with SQLite's words, and no item was sent again: it is logged naming them, its rows
    are left as they are, and the sweep goes on."""
    try:
        return mend()
    except apsw.Error as e:
        if (theirs := refused_by_host(db, e)) is None:
            raise
        log.error(f"the reconcile sweep could not {what}", reason=str(theirs))
        return nothing


def _fell_back(db: Database, backoff: Backoff | None, busy: set[int], most: int) -> set[int]:
    """The first `most` items that fell back to structure whose backoff has passed, and that no
    run holds (a probe of one must not go to an item that is not sent)."""
    if backoff is None or most <= 0:
        return set()
    due = (
        item_id
        for item_id, attempts, waited in db.all(FELL_BACK_ITEMS, {"note": FELL_BACK})
        if item_id not in busy
        and type(attempts) is int  # (a host's bytes: resting, as a failed item's)
        and (waited is None or isinstance(waited, float))
        and backoff.due(attempts, waited)
    )
    return set(itertools.islice(due, most))


def _resting(db: Database, backoff: Backoff | None) -> tuple[set[int], set[int], set[int]]:
    """(items the sweep leaves to their backoff, partial items whose backoff has passed, the
    failed items: never sent from here, a model switch included, or a document that fails
    under the new model would be sent by every sweep)."""
    resting, retried, failed = set(), set(), set()
    rows = db.all(
        f"SELECT item_id, status, {ATTEMPTS}, (julianday('now') - julianday(updated_at)) * 86400 "
        f"FROM item_index_state WHERE status IN {RESTING_STATUSES}"
    )
    for item_id, status, attempts, waited in rows:
        sound = type(attempts) is int  # a host's bytes: resting
        if status == "partial" and backoff is not None and sound and backoff.due(attempts, waited):
            retried.add(item_id)
        else:
            resting.add(item_id)
        if status == "failed":
            failed.add(item_id)
    return resting, retried, failed


def due_retries(
    db: Database, *, max_attempts: int, backoff: float, backoff_max: float, horizon: float = 3600.0
) -> list[int]:
    """Failed items whose wait (backoff × 2^(attempts-1), capped) has passed, and that have
    attempts left; after the last attempt an item stays failed until an admin retries it."""
    policy = Backoff(max_attempts, backoff, backoff_max)
    rows = _failed_rows(db, max_attempts, horizon)
    # (a wait that is not a number, of an `updated_at` that is not a time: `Backoff.due`)
    return [
        item_id
        for item_id, attempts, waited in rows
        if (waited is None or isinstance(waited, float)) and policy.due(attempts, waited)
    ]


def _failed_rows(db: Database, max_attempts: int, horizon: float) -> list[tuple[int, int, float]]:
    return db.all(
        "SELECT s.item_id, s.attempts, (julianday('now') - julianday(s.updated_at)) * 86400 "
        "FROM item_index_state s WHERE s.status = 'failed' AND s.attempts < :max "
        f"AND s.item_id NOT IN ({BUSY}) ORDER BY s.item_id",
        {"max": max_attempts, "horizon": horizon},
    )


# The findings of rows a host deleted or added under an indexed item (`kidx doctor`).
BY_HAND = ("chunks_lost", "whole_vector")


def changed_by_hand(db: Database) -> dict[str, list[int]]:
    """Indexed items whose chunks or whole-item vector are not what their run wrote."""
    return {name: sorted(r[0] for r in db.all(FINDINGS[name])) for name in BY_HAND}


def record_sweep(db: Database, kind: str, summary: dict[str, object]) -> None:
    """Remember the last sweep of each kind (for `kidx status` and `kidx doctor`)."""
    with db.atomic():
        at = db.scalar(f"SELECT {NOW}")
        set_meta(db, f"last_{kind}", json.dumps({"at": at, **summary}))


def last_sweeps(db: Database) -> dict[str, dict[str, object]]:
    """The records of `record_sweep`; a row under such a key that is not one (a host's: not
    UTF-8, not JSON, or not an object) is left out, never a crash of `kidx status` or `kidx
    doctor`."""
    found = {}
    for key, value in db.all(
        "SELECT CAST(key AS BLOB), CAST(value AS BLOB) FROM index_meta "
        "WHERE substr(key, 1, 5) = 'last_'"  # (LIKE 'last_%': `_` is any character)
    ):
        try:
            kind, record = key[len("last_") :].decode("utf-8"), json.loads(value)
        except (ValueError, RecursionError):  # not UTF-8, not JSON, too long a number, too deep
            continue
        # nested past what kidx writes: json read it, but what shows it walks it recursively
        # (a host's 500 levels: `kidx status --json` a RecursionError)
        if isinstance(record, dict) and _nesting(record) <= SWEEP_NESTING:
            found[kind] = record
    return found


SWEEP_NESTING = 8  # levels a sweep's record may have (kidx's own have 3)


def _nesting(value: object) -> int:
    """How deep `value` nests (a scalar: 0), found without recursion."""
    deepest, todo = 0, [(value, 0)]
    while todo:
        item, depth = todo.pop()
        deepest = max(deepest, depth)
        if depth > SWEEP_NESTING:
            break
        if isinstance(item, dict):
            todo.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            todo.extend((v, depth + 1) for v in item)
    return deepest
