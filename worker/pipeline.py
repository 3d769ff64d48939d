"""The steps of indexing an item: chunk -> embed -> write, with reuse, repair and failure counting.

The rules:

* No provider: the item is `skipped`, nothing else is written.
* Reuse: a chunk whose embedding input (title, heading path, summary, content) and model are
  unchanged keeps its vector wherever it moved; only new or changed chunks are embedded.
* Embedding happens outside any transaction; the write is one short transaction: chunks,
  relational vectors, vec rows (DELETE + INSERT), the whole-item vector for single-chunk content
  (removed when the content grows), repair of the mirror, the index state.
* A failing vector is logged and counted, for its item alone (items sharing requests never count
  each other's); three in a row abort the item with its previous index intact. An isolated
  failure leaves that chunk without a vector and the item `partial` (an edit's new chunk too:
  the rest keeps its vectors); only an item that would have no vector at all fails instead.
* Cancellation rolls back, leaves the previous index, marks the item `cancelled`, propagates.
* Fenced: a run writes nothing of an item (chunks, state, a failure) once another run has
  started on it since this run read it (`Claim`): a run whose lock expired while its process
  was stopped must not put its older text over the newer index. Its result is `coalesced`
  (a failure stays its own outcome, not the item's state). Taken between its read and its
  `indexing` mark, the item is read again instead (`worker.bulk`): which of the two runs read
  the newer text is not known then.

Every kind of item goes the same way, through its kind's indexer (`worker.indexers`): plan
(chunk, match vectors made before), embed what is missing, write. These are the steps;
`worker.bulk` runs them, for one item (`index_item`) as for many (`index_items`). How a run goes
(the chunk model, the reader, cancellation...) is one `IndexOptions`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Any

import apsw

from worker.chunking import FELL_BACK, text_hash
from worker.embedding import Plan, check
from worker.errors import (
    Cancelled,
    IndexAborted,
    ItemNotFound,
    KidxError,
    PermanentProviderError,
    SourceUnavailable,
    StaleConfig,
    StoreError,
)
from worker.indexers import IndexOptions, Kind, Planned, kind_of
from worker.log import KI_EMBED, get_logger
from worker.providers.base import EmbeddingModel
from worker.store.db import Database
from worker.store.fts import DAMAGED
from worker.store.items import (
    CREATE_STATE,
    NOW,
    Claim,
    Item,
    Status,
    get_item,
    origin_unchanged,
    read_claim,
    set_state,
)
from worker.store.removal import remove_other_kind
from worker.store.schema import refused_by_host

log = get_logger("kidx.pipeline")

NO_PROVIDER = "no embedding provider configured (KIDX_EMBEDDING__PROVIDER=none)"
# A run's outcome for an item another run has taken (`Claim.taken`): nothing written.
COALESCED = "coalesced"


@dataclass
class IndexResult:
    """What one run did: the task's JSON result."""

    item_id: int
    status: str
    chunk_method: str | None = None
    chunks: int = 0
    reused: int = 0
    embedded: int = 0
    failed: int = 0
    dimensions: int | None = None
    model: str | None = None
    duration_ms: int = 0
    repaired: int = 0
    error: str | None = None
    fallback: str | None = None  # why LLM chunking was not used, when it was wanted

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class Work:
    """One item between its steps: read and chunked, its vectors planned, not yet written."""

    item: Item
    kind: Kind
    text: str  # what was read (files, URLs, code: it is stored with the index); "" for notes
    content_hash: str
    planned: Planned
    started: float
    log: Any
    # The state as read before the text, then (`marked`) as this run's `indexing` mark left it
    # (index_items marks in its next write, `claim_items`): what the run may write over.
    claim: Claim
    marked: bool = False

    @property
    def plan(self) -> Plan:
        return self.planned.plan

    def elapsed(self) -> int:
        return int((time.monotonic() - self.started) * 1000)


@contextmanager
def recorded_outcome(
    db: Database,
    item_id: int,
    task_id: str | None,
    started: float,
    ilog: Any,
    claim: Claim | None = None,
) -> Iterator[None]:
    """An item's failure, recorded and logged as its outcome: the state, then the exception.
    The database refusing a write becomes a KidxError too (`store_failure`); recording the
    failure is then attempted, never allowed to hide the cause. `claim`: the state is left
    alone if another run has taken the item since (`record_failure`)."""

    def elapsed() -> int:
        return int((time.monotonic() - started) * 1000)

    def failed(reason: str) -> None:
        recorded = _quietly(
            ilog, record_failure, db, item_id, reason, task_id, elapsed(), claim=claim
        )
        if recorded is False:
            ilog.info(f"{KI_EMBED} {TAKEN_LOG}; its state is not this run's", outcome=reason)

    try:
        yield
    except Cancelled:
        if _quietly(ilog, record_cancelled, db, item_id, task_id, elapsed(), claim=claim) is False:
            ilog.info(f"{KI_EMBED} {TAKEN_LOG}; its state is not this run's", outcome="cancelled")
        ilog.info(f"{KI_EMBED} cancelled; the previous index is intact", duration_ms=elapsed())
        raise
    except StaleConfig as e:
        # Switched to another model while it ran (`config_conflict`): not the item's failure
        # (no attempt spent, no retry backoff); `pending`, for a process of the index's model.
        pending = _quietly(
            ilog,
            _record_unwritten,
            db,
            item_id,
            claim,
            status=Status.PENDING,
            last_error=str(e),
            last_task_id=task_id,
            duration_ms=elapsed(),
        )
        if pending is False:
            ilog.info(f"{KI_EMBED} {TAKEN_LOG}; its state is not this run's", outcome="pending")
        ilog.error(f"{KI_EMBED} refused; the previous index is intact", reason=str(e))
        raise
    except ItemNotFound as e:  # deleted while it ran: nothing of it is written or recorded
        ilog.info(f"{KI_EMBED} the item was deleted; nothing written", reason=str(e))
        raise
    except apsw.Error as e:
        failure = store_failure(e, db)
        failed(str(failure))
        ilog.error(
            f"{KI_EMBED} the write failed; the previous index is intact",
            reason=str(failure),
            duration_ms=elapsed(),
        )
        raise failure from None
    except IndexAborted as e:
        failed(f"aborted: {e}")
        ilog.error(
            f"{KI_EMBED} aborted; the previous index is intact",
            reason=str(e),
            duration_ms=elapsed(),
        )
        raise
    except PermanentProviderError as e:
        failed(str(e))
        ilog.error(f"{KI_EMBED} failed", reason=str(e), duration_ms=elapsed())
        raise IndexAborted(str(e)) from e
    except KidxError as e:  # bad input: a refused file or URL, nothing to index
        failed(str(e))
        ilog.error(f"{KI_EMBED} failed", reason=str(e), duration_ms=elapsed())
        raise
    except Exception as e:
        failed(f"{type(e).__name__}: {e}")
        raise


def store_failure(e: apsw.Error, db: Database | None = None) -> KidxError:
    """What a write the database refused means for the run: a full disk or an I/O error may
    pass (IndexAborted, transient: the task retries, a batch counts it towards its abort);
    anything else is a StoreError (naming a host's triggers and indexes on kidx's tables, if
    `db` has any: one of them may be what refused it)."""
    cause = f"{type(e).__name__}: {e}"
    if isinstance(e, apsw.FullError | apsw.IOError | apsw.BusyError | apsw.ReadOnlyError):
        return IndexAborted(f"the database could not be written ({cause})", transient=True)
    # SQLite's words when a host damaged a keyword table (FTS5's shadow tables): derived data
    damaged = isinstance(e, apsw.CorruptError) or any(
        w in str(e) for w in ("fts5", "_fts", "vtable constructor failed")
    )
    if damaged:
        return StoreError(
            f"the database refused the write ({cause}): {DAMAGED} is "
            "rebuilt by the reconcile sweep and the item sent again; `kidx doctor` says more"
        )
    if db is not None and (theirs := refused_by_host(db, e)) is not None:
        return theirs
    return StoreError(f"the database refused the write ({cause})")


def refuses_every_write(e: KidxError) -> bool:
    """Whether an item's write failed for the database's reason, which the next write would
    meet too (`store_failure`'s IndexAborted, the only transient one a write raises), rather
    than the item's own: its vec rows failing N in a row (`worker.indexers.prose`) abort the
    item alone."""
    return isinstance(e, IndexAborted) and e.transient


def _quietly(ilog: Any, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Record an outcome if the database lets us (a full disk may not): the cause of the
    failure is what must reach the caller. What `fn` returned (None when it raised)."""
    try:
        return fn(*args, **kwargs)
    except (apsw.Error, StoreError) as e:
        ilog.error(f"{KI_EMBED} could not record the outcome", reason=f"{type(e).__name__}: {e}")
        return None


def prepare_item(
    db: Database,
    item: Item,
    embedder: EmbeddingModel | None,
    options: IndexOptions,
    started: float,
    ilog: Any,
    *,
    claim: Claim,
) -> Work | IndexResult:
    """Read the item, chunk it and plan its vectors (what is reused), through its kind's
    indexer; no provider call but the chunk model's. With no embedding provider the item is
    skipped: the result says so. `claim`: its state, read before this reads its text
    (`read_claim`); the caller marks the item `indexing` in its next write transaction, if
    the state is still that (`claim_items`)."""
    item_id, task_id = item.id, options.task_id
    kind = kind_of(item)
    # A note's text is loaded here, so that this frame holds the only reference and can let a
    # big note's text go once it is chunked (callers have the item without its content; other
    # kinds are read from their source).
    if kind.text_in_row:
        item = get_item(db, item_id)
    if embedder is None:
        duration = int((time.monotonic() - started) * 1000)
        # not over the state of a run that has taken the item since it was read (a process
        # with a provider): its `indexing` mark went, and that run ended coalesced
        recorded = _record_unwritten(
            db,
            item_id,
            claim,
            status=Status.SKIPPED,
            last_error=NO_PROVIDER,
            last_task_id=task_id,
            duration_ms=duration,
        )
        if not recorded:
            ilog.info(f"{KI_EMBED} {TAKEN_LOG}; its state is not this run's", outcome="skipped")
        ilog.info(f"{KI_EMBED} skipped", reason=NO_PROVIDER)
        return IndexResult(item_id, str(Status.SKIPPED), error=NO_PROVIDER, duration_ms=duration)
    check(options.cancel)
    try:
        text = options.reader.text(item, cancel=options.cancel)
    except SourceUnavailable as e:  # a URL that may answer later: the task retries
        raise IndexAborted(str(e), transient=True) from e
    content_hash = text_hash(text)
    planned = kind.indexer.plan(db, item, text, embedder.model_id, options, ilog)
    if kind.text_in_row:  # the chunks hold what is needed: let a big text go
        item, text = replace(item, content=""), ""
    return Work(item, kind, text, content_hash, planned, started, ilog, claim)


def write_item(
    db: Database, w: Work, model: str, options: IndexOptions, *, orphans: bool = True
) -> IndexResult:
    """Write the item's chunks, vectors and state in one transaction (the only one); nothing,
    and a `coalesced` result, if another run has taken the item since this run's claim.
    `orphans=False`: the caller looks for orphan vec rows (once for many items)."""
    dims = db.dimensions
    item, plan = w.item, w.plan
    with db.atomic():
        now = read_claim(db, item.id)
        if now is None:
            raise ItemNotFound(item.id)  # deleted while it was read and embedded
        if w.claim.taken(now):
            return taken_result(w, now)
        remove_other_kind(db, [item.id], code=item.kind == "code")
        with db.writing_index():
            repaired, vec_failed = w.kind.indexer.write(
                db, item, w.planned, model, options, w.log, orphans=orphans
            )
        failed = len(plan.failed) + vec_failed
        _record(db, w, failed, model, dims, options.task_id)
    return _result(w, model, dims, failed, repaired)


def new_and_whole(w: Work) -> bool:
    """Whether an item may go through `write_new_items`: every chunk has a new vector."""
    plan = w.plan
    return bool(plan.chunks) and not plan.reuse and len(plan.vectors) == len(plan.chunks)


def write_new_items(
    db: Database, works: list[Work], model: str, options: IndexOptions
) -> list[tuple[Work, IndexResult]]:
    """Items indexed for the first time (`new_and_whole`), each kind's together through its
    indexer's `write_new`, with their states, in one savepoint: what `write_item` writes for
    each, in a few statements for all. The items written, with their results, and those
    another run has taken since this run's claim, with a `coalesced` result (nothing written:
    `write_item`'s fence, an indexed read each); the others are for `write_item`. Raises what
    the database raised (the savepoint rolled back)."""
    dims = db.dimensions
    kinds: dict[int, list[Work]] = {}
    written: list[tuple[Work, IndexResult]] = []
    taken: list[tuple[Work, IndexResult]] = []
    with db.atomic():
        free = []
        for w in works:
            now = read_claim(db, w.item.id)
            if now is not None and w.claim.taken(now):
                taken.append((w, taken_result(w, now)))
            else:  # (a deleted item: `write_new` leaves it out, `write_item` says so)
                free.append(w)
        works = free
        for w in works:
            kinds.setdefault(id(w.kind.indexer), []).append(w)
        for code in (True, False):
            remove_other_kind(
                db, [w.item.id for w in works if (w.item.kind == "code") == code], code=code
            )
        for group in kinds.values():
            with db.writing_index():
                ids = set(
                    group[0].kind.indexer.write_new(db, [(w.item, w.planned) for w in group], model)
                )
            written += [(w, _result(w, model, dims, 0, 0)) for w in group if w.item.id in ids]
        _record_all(db, [(w, 0) for w, _ in written], model, dims, options.task_id)
    return written + taken


def _result(w: Work, model: str, dims: int, failed: int, repaired: int) -> IndexResult:
    plan = w.plan
    return IndexResult(
        item_id=w.item.id,
        status=str(Status.PARTIAL if failed else Status.INDEXED),
        chunk_method=str(w.planned.method),
        chunks=w.planned.chunk_count,
        reused=len(plan.reuse),
        embedded=len(plan.vectors) - len(plan.reuse),
        failed=failed,
        dimensions=dims,
        model=model,
        duration_ms=w.elapsed(),
        repaired=repaired,
        error=plan.first_failure() if failed else None,
        fallback=w.planned.fallback,
    )


TAKEN_LOG = "another run has started on the item since this run read it"


def taken_result(w: Work, now: Claim) -> IndexResult:
    """A run's result for an item another run has taken (`Claim.taken`): nothing written, the
    index stands as that run leaves it; `now`, the state that says so, is named."""
    reason = f"{TAKEN_LOG} (state now {now.status}, task {now.task_id}): nothing written"
    return IndexResult(w.item.id, COALESCED, duration_ms=w.elapsed(), error=reason)


def log_written(w: Work, result: IndexResult) -> None:
    """After the commit: an item written (`log_indexed`), or not, for another run had it."""
    if result.status == COALESCED:
        w.log.info(
            f"{KI_EMBED} coalesced: not written", reason=result.error, duration_ms=w.elapsed()
        )
    else:
        log_indexed(w, result)


def log_indexed(w: Work, result: IndexResult) -> None:
    """After the commit: a log line written while a write transaction is open holds the
    database's write lock for every other worker process (measured: 9% of a bulk run)."""
    w.log.info(
        f"{KI_EMBED} indexed", **{k: v for k, v in result.as_dict().items() if v is not None}
    )


def _record(db: Database, w: Work, failed: int, model: str, dims: int, task_id: str | None) -> None:
    _record_all(db, [(w, failed)], model, dims, task_id)


_SAME_ORIGIN = origin_unchanged("?10", "?11", "?12", "?13")


def _record_all(
    db: Database, works: list[tuple[Work, int]], model: str, dims: int, task_id: str | None
) -> None:
    """Each item's index state (and, for what is read from a source, the text just read), in
    the write's transaction, a statement for all of them each way; `works`: (item, vectors
    that failed)."""
    states, hashes, texts = [], [], []
    for w, failed in works:
        plan, planned = w.plan, w.planned
        notes = []
        if failed:
            first = plan.first_failure() or "vec write failed"
            notes.append(f"{failed} of {planned.chunk_count} chunks have no vector: {first}")
        if planned.fallback:
            notes.append(f"{FELL_BACK}{planned.fallback}")
        if w.kind.text_in_row:
            hashes.append((w.content_hash, w.item.id))
        else:  # the text last extracted, so a host can read it
            texts.append((w.text, w.content_hash, w.item.id, w.content_hash))
        status = Status.PARTIAL if failed else Status.INDEXED
        # an attempt more: a partial index, or a fallback the chunk model was asked for (the
        # reconcile sweep asks it again, on the retry backoff); one it was not asked for keeps
        # the count; a run that fell short of neither starts it again. (A fallback counts on
        # from a fallback only: the failed runs before it were the embedder's, not the model's.)
        if failed or (planned.fallback and planned.asked):
            more: int | None = 1
        else:
            more = 0 if planned.fallback else None
        states.append(
            (
                str(status),
                w.content_hash,
                str(planned.method),
                planned.chunk_count,
                model,
                dims,
                "; ".join(notes) or None,
                task_id,
                w.elapsed(),
                w.item.id,
                *w.item.origin,
                more,
                FELL_BACK,
                planned.target,
            )
        )
    with db.atomic():
        # A note's missing or wrong hash is filled only while the row holds the text that was
        # indexed: one edited during the run keeps the hash that says so (NULL, from the
        # trigger, or the editor's), for the re-run check and the sweep.
        db.executemany(
            "UPDATE knowledge_items SET content_hash = ?1 WHERE id = ?2 AND "
            "(content_hash IS NULL OR content_hash != ?1) "
            "AND kidx_sha256(CAST(content AS BLOB)) = ?1",
            hashes,
        )
        db.executemany(
            f"UPDATE knowledge_items SET content = ?, content_hash = ?, updated_at = {NOW} "
            "WHERE id = ? AND (content_hash IS NULL OR content_hash != ?)",
            texts,
        )
        db.executemany(CREATE_STATE, [(state[9],) for state in states])
        # Renamed, moved or made another kind during the run (what the embedder was given
        # includes the title): `pending`, for the sweep, not `indexed`.
        db.executemany(
            f"UPDATE item_index_state SET status = CASE WHEN {_SAME_ORIGIN} THEN ?1 "
            "ELSE 'pending' END, indexed_hash = ?2, chunk_method = ?3, "
            "chunk_count = ?4, model = ?5, dimensions = ?6, last_error = ?7, last_task_id = ?8, "
            # a partial index, or a fallback, is an attempt that fell short: the sweep sends
            # it again with the retry sweep's backoff (worker.reconcile), not on every sweep
            "attempts = CASE WHEN ?14 IS NULL THEN 0 "
            "WHEN ?1 = 'partial' OR instr(last_error, ?15) > 0 THEN attempts + ?14 ELSE ?14 END, "
            f"duration_ms = ?9, updated_at = {NOW}, indexed_at = {NOW}, "
            "claim = random(), chunk_target = ?16 "
            "WHERE item_id = ?10",
            states,
        )


def _taken(db: Database, item_id: int, claim: Claim | None) -> bool:
    """Whether another run has taken the item since `claim` (None: not fenced). A deleted
    item is not taken: `set_state` writes nothing for it."""
    if claim is None:
        return False
    now = read_claim(db, item_id)
    return now is not None and claim.taken(now)


def record_failure(
    db: Database,
    item_id: int,
    reason: str,
    task_id: str | None,
    duration: int,
    *,
    claim: Claim | None = None,
) -> bool:
    """The item's state says the run failed (an attempt more), unless another run has taken
    the item since `claim`: that run's state stands. Whether it was recorded."""
    return _record_unwritten(
        db,
        item_id,
        claim,
        attempt=True,
        status=Status.FAILED,
        last_error=reason,
        last_task_id=task_id,
        duration_ms=duration,
    )


def record_cancelled(
    db: Database, item_id: int, task_id: str | None, duration: int, *, claim: Claim | None = None
) -> bool:
    """The item's state says the run was cancelled, as `record_failure` says it failed."""
    return _record_unwritten(
        db, item_id, claim, status=Status.CANCELLED, last_task_id=task_id, duration_ms=duration
    )


def _record_unwritten(
    db: Database, item_id: int, claim: Claim | None, *, attempt: bool = False, **state: Any
) -> bool:
    with db.atomic():
        if _taken(db, item_id, claim):
            return False
        set_state(db, item_id, **state)
        if attempt:
            db.execute(
                "UPDATE item_index_state SET attempts = attempts + 1 WHERE item_id = ?", (item_id,)
            )
    return True
