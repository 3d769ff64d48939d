"""A run of items (one or many): each read, chunked, embedded and written as the steps of
worker/pipeline.py say, with the texts of several items in shared embedding requests, one
request in flight while the next items are read and chunked and the finished ones written, and
the written items sharing a write transaction (a savepoint each). `index_item` is a run of one.

Each item is fenced (`worker.store.items.Claim`): its state is read before its text, its
`indexing` mark is made only while that state is unchanged, and its write (or its failure)
only while the mark is still this run's. A run whose lock expired while its process was
stopped never writes its older text over the index another run made meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import apsw

from worker.embedding import EmbedQueue, Plan, PlanFailures, Requests, abort_of, check
from worker.errors import (
    Cancelled,
    IndexAborted,
    ItemNotFound,
    KidxError,
    PermanentProviderError,
    StaleConfig,
    StoreError,
    TransientProviderError,
)
from worker.indexers import IndexOptions
from worker.log import KI_EMBED, get_logger
from worker.pipeline import (
    COALESCED,
    TAKEN_LOG,
    IndexResult,
    Work,
    log_written,
    new_and_whole,
    prepare_item,
    record_cancelled,
    record_failure,
    recorded_outcome,
    refuses_every_write,
    store_failure,
    write_item,
    write_new_items,
)
from worker.providers.base import EmbeddingModel
from worker.store.db import Database
from worker.store.items import Claim, claim_items, get_item, read_claim
from worker.store.repair import repair_orphans
from worker.store.vec import config_conflict

log = get_logger("kidx.pipeline")

# How many times a run reads an item that other runs keep taking between its read and its
# mark before it leaves the item to them (`coalesced`).
MAX_READS = 3


def index_item(
    db: Database,
    item_id: int,
    *,
    embedder: EmbeddingModel | None,
    options: IndexOptions | None = None,
) -> IndexResult:
    """Index one item: a run of one. Raises what the run met (IndexAborted, KidxError),
    Cancelled included."""
    outcome = index_items(db, [item_id], embedder=embedder, options=options)[item_id]
    if isinstance(outcome, KidxError):
        raise outcome
    return outcome


# How long the rest of a run waits for the write lock once another's lock outlasted the busy
# timeout: a moment, for a lock that has just been let go.
LOCKED_OUT_MS = 100


def index_items(
    db: Database,
    item_ids: list[int],
    *,
    embedder: EmbeddingModel | None,
    options: IndexOptions | None = None,
    on_done: Callable[[int, IndexResult | KidxError], None] | None = None,
    deadline: float | None = None,
) -> dict[int, IndexResult | KidxError]:
    """Index several items as index_item() does each, with their texts embedded in shared
    batches: a request carries up to the batch size whatever the items' sizes (bulk runs),
    and goes while the next items are chunked and the finished ones written (EmbedQueue).

    Each item is written as soon as its vectors are back, in a savepoint of its own (the items
    ready together share one write transaction; one that fails rolls back alone), and has its
    own outcome, passed to `on_done` when known (inside that transaction: the caller's records
    commit with the item): a result, or the KidxError index_item() would have raised. An
    item's vectors failing N times in a row abort that item alone (as a run of one would),
    whoever shared its requests; so do its vec rows failing N times in a row as it is
    written. The provider's requests failing N times in a row (or a refusal outright), N
    items getting not one vector before any text was embedded (it refuses every text), the
    database refusing a write, or N items in a row aborted by their vec rows end the run:
    items with every vector are written, the others, and those not yet read, get that
    IndexAborted. Past `deadline` (time.monotonic()) no further item is started: those have
    no outcome, for the caller to send again. Anything else (Cancelled, a time limit, a bug)
    propagates, after each item read and not written is marked cancelled or failed.

    An item another run has taken since this run read it is not written, nor its failure
    recorded: its result is `coalesced` (the other run's index stands). One taken between its
    read and its `indexing` mark is read again (which run read the newer text is not known
    then), in a pass of its own after the others, `MAX_READS` times at most."""
    options = options or IndexOptions()
    out: dict[int, IndexResult | KidxError] = {}
    if embedder is not None and (stale := config_conflict(db)) is not None:
        # A process of the model the index was switched away from: it would write its
        # vectors over the new model's. Nothing is read, embedded or recorded: each item
        # keeps its state, for a process of the index's model (`claim_config`).
        log.error(f"{KI_EMBED} refused: {stale}", items=len(item_ids))
        for item_id in item_ids:
            out[item_id] = StaleConfig(stale)
            if on_done is not None:
                on_done(item_id, out[item_id])
        return out
    ids = item_ids
    for reads in range(1, MAX_READS + 1):
        again = _index_pass(
            db, ids, embedder, options, out, on_done, deadline, last=reads == MAX_READS
        )
        if not again:
            break
        ids, deadline = again, None  # (started already: read again whatever the time)
    return out


def _index_pass(
    db: Database,
    item_ids: list[int],
    embedder: EmbeddingModel | None,
    options: IndexOptions,
    out: dict[int, IndexResult | KidxError],
    on_done: Callable[[int, IndexResult | KidxError], None] | None,
    deadline: float | None,
    *,
    last: bool,
) -> list[int]:
    """`index_items`' run over `item_ids`, their outcomes into `out`: the items to read
    again, taken by another run between their read and their mark (`last`: none, they end
    `coalesced`)."""
    task_id, cancel = options.task_id, options.cancel
    # A run of one looks for orphan vec rows in its item's write (its result counts them);
    # a run of many, once at the end rather than once an item.
    alone = len(item_ids) == 1
    works: list[Work] = []  # read and chunked, not yet written
    again: list[Work] = []  # taken between their read and their mark
    written: list[int] = []
    limit = options.max_consecutive_failures
    unembedded = 0  # items in a row that asked for vectors and got not one
    patience = db.busy_timeout_ms  # (shortened once the database stayed locked: LOCKED_OUT_MS)
    refusing: IndexAborted | None = None  # set when the provider takes no text at all
    unmirrored = 0  # items in a row whose write was aborted by its vec rows failing

    def count_write(e: KidxError | None) -> KidxError | None:
        """An item's write, written (None) or failed: what stops the run, if anything. The
        database refusing the write (a full disk, read-only: `refuses_every_write`), or
        rolling the transaction back, stops it: the next write would fail alike. An item
        whose vec rows failed N in a row fails alone, as one whose vectors the provider
        refused does (`PlanFailures`): the vec table refused that item's rows (a host's stray
        row under a key it was given), not every row. N such items in a row, though, stop
        the run: the vec table takes no row at all."""
        nonlocal unmirrored
        if e is None:
            unmirrored = 0
            return None
        if refuses_every_write(e) or db.conn.get_autocommit() or isinstance(e, StaleConfig):
            return e  # (StaleConfig: another model's index refuses every item alike)
        if not isinstance(e, IndexAborted):
            return None  # the item's own (a constraint its rows broke: a StoreError)
        unmirrored += 1
        if unmirrored < limit:
            return None
        return IndexAborted(f"the vec writes of {unmirrored} items in a row failed, last: {e}")

    def count_vectors(plan: Plan) -> None:
        """A provider that refuses each text alone (a 400 for every input, NaN for every
        vector) is not down as the request count sees it: once N items in a row got not one
        vector, nor any other text of the requests that carried theirs, it stops (else every
        item costs a request a text and fails alike; counting only a run that had embedded
        nothing yet, a provider that turned after its first answer cost every item of the
        run that). An item refused among others that are embedded never stops it: its
        vectors, and its abort, are its own."""
        nonlocal unembedded, refusing
        if not plan.failed or len(plan.vectors) > len(plan.reuse):
            return
        if plan.beside_embedded:  # the provider embedded others' texts beside its own
            unembedded = 0
            return
        unembedded += 1
        if unembedded >= limit and refusing is None:
            refusing = IndexAborted(
                f"the provider embedded no text of {unembedded} items, last: {plan.last_error}",
                transient=isinstance(plan.last_error, TransientProviderError),
                retry_after=getattr(plan.last_error, "retry_after", None),
            )

    def done(item_id: int, outcome: IndexResult | KidxError) -> None:
        out[item_id] = outcome
        if on_done is not None:
            on_done(item_id, outcome)

    def write_ready() -> KidxError | None:
        """Write every item whose vectors are back, in one write transaction (an item a
        savepoint: one that fails rolls back alone), with the `indexing` marks of the items
        read since the last one. When the transaction does not commit (a full disk, SQLite
        rolling it back), every item of it fails with the cause, reported again after the
        rollback; the cause is returned, for the run to stop: the next writes would fail too.
        So is an item's write the database refused as it would any (`count_write`)."""
        ready = [w for w in works if w.plan.waiting == 0]
        fresh = [w for w in works if not w.marked]
        if not ready and not fresh:  # (always so without a provider: every item skipped)
            return None
        assert embedder is not None
        for w in ready:
            count_vectors(w.plan)
        indexed: list[tuple[Work, IndexResult]] = []  # written, or coalesced
        halt: KidxError | None = None
        read: dict[int, Claim] = {id(w): w.claim for w in fresh}  # again if no commit
        try:
            with db.committing():
                if fresh:
                    held = claim_items(db, [(w.item.id, w.claim) for w in fresh], task_id)
                    for w in fresh:
                        if w.item.id in held:
                            w.claim, w.marked = held[w.item.id], True
                        else:  # taken since it was read: read again, after the others
                            works.remove(w)
                            again.append(w)
                    ready = [w for w in ready if w.marked]
                try:
                    together = _new_items(ready)
                except apsw.Error as e:  # the transaction went with it: the cause is reported
                    halt = store_failure(e, db)
                    raise
                for w, result in together:
                    works.remove(w)
                    indexed.append((w, result))
                    done(w.item.id, result)
                    if result.status != COALESCED:
                        count_write(None)
                written_together = {id(w) for w, _ in together}
                for w in ready:
                    if id(w) in written_together:
                        continue
                    works.remove(w)
                    writing = False
                    try:
                        with recorded_outcome(db, w.item.id, task_id, w.started, w.log, w.claim):
                            if (aborted := abort_of(w.plan)) is not None:
                                raise aborted  # its own: N failed in a row, or not one
                            check(cancel)
                            writing = True
                            # (orphans: looked for once the run's writes are done, outside
                            # their transactions: `repair_orphans` counts whole tables)
                            result = write_item(db, w, embedder.model_id, options, orphans=False)
                    except KidxError as e:
                        if writing:
                            halt = halt or count_write(e)
                        done(w.item.id, e)
                    else:
                        indexed.append((w, result))
                        done(w.item.id, result)
                        if result.status != COALESCED:
                            count_write(None)
        except (apsw.Error, StoreError) as e:
            if isinstance(e, apsw.BusyError | apsw.LockedError):
                # Another's lock outlasted the busy timeout: what is left of the run is
                # recorded if the lock is free, not after the whole timeout again for each
                # item (a host's long transaction held a group of 128 for an hour, past the
                # soft time limit). The caller's timeout comes back at the run's end.
                db.busy_timeout_ms = min(db.busy_timeout_ms, LOCKED_OUT_MS)
            for w in fresh:  # their marks went with the transaction
                w.claim, w.marked = read[id(w)], False
            # The cause, when an item met it first (a full disk), rather than its echo ("the
            # transaction was rolled back").
            halt = halt or (store_failure(e, db) if isinstance(e, apsw.Error) else e)
            log.error(
                f"{KI_EMBED} a write transaction did not commit: its items keep their "
                "previous index",
                task_id=task_id,
                items=len(ready),
                reason=str(halt),
            )
            for w in ready:
                if w in works:
                    works.remove(w)
                try:  # its state and the caller's records, again: they were rolled back
                    with recorded_outcome(db, w.item.id, task_id, w.started, w.log, w.claim):
                        raise halt
                except KidxError as e:
                    done(w.item.id, e)
            return halt
        for w, result in indexed:
            if result.status != COALESCED:
                written.append(w.item.id)
            log_written(w, result)
        return halt

    def _new_items(ready: list[Work]) -> list[tuple[Work, IndexResult]]:
        """The ready items indexed for the first time, written together when they can be
        (`write_new_items`); on any error the savepoint is rolled back and every item goes
        through `write_item` on its own (which records its outcome). A run of one writes its
        item alone: its write also looks for orphans."""
        new = [w for w in ready if new_and_whole(w)]
        if alone or not new or (cancel is not None and cancel()):
            return []
        assert embedder is not None
        try:
            return write_new_items(db, new, embedder.model_id, options)
        except (apsw.Error, StoreError) as e:
            if db.conn.get_autocommit():
                raise  # SQLite rolled the whole transaction back (a full disk): the caller's
            log.info(
                f"{KI_EMBED} writing new items together failed; one by one now",
                task_id=task_id,
                reason=f"{type(e).__name__}: {e}",
            )
            return []

    queue = None
    if embedder is not None:
        failures = PlanFailures(limit, log.bind(task_id=task_id))
        queue = EmbedQueue(embedder, cancel, failures, Requests(limit, options.streak))
    stop: KidxError | None = None
    halted = False  # stopped by the database refusing writes, not by the provider

    def advance() -> None:
        """Send the next batch, and write what is ready; `stop` says when the run must."""
        nonlocal stop, halted
        assert queue is not None
        queue.send()
        if (halt := write_ready()) is not None:
            stop, halted = halt, True
        elif refusing is not None:
            stop = refusing

    try:
        for position, item_id in enumerate(item_ids):
            if deadline is not None and position and time.monotonic() > deadline:
                break
            started = time.monotonic()
            ilog = log.bind(item_id=item_id, task_id=task_id)
            try:
                item = get_item(db, item_id, content=False)
                # before its text: a run that takes the item after this reads its text later
                claim = read_claim(db, item_id)
                if claim is None:
                    raise ItemNotFound(item_id)
                with recorded_outcome(db, item_id, task_id, started, ilog, claim):
                    if stop is not None:  # the provider or the database is down: stop reading
                        raise stop
                    w = prepare_item(db, item, embedder, options, started, ilog, claim=claim)
            except KidxError as e:
                done(item_id, e)
                continue
            if isinstance(w, IndexResult):
                done(item_id, w)
                continue
            assert queue is not None
            works.append(w)
            queue.add(w.plan)
            try:
                while stop is None and queue.full():  # what was read meanwhile is written
                    advance()
            except (IndexAborted, PermanentProviderError) as e:
                stop = e
        if queue is not None and stop is None:
            try:
                while stop is None and queue.todo:
                    advance()
                if stop is None:
                    queue.wait()
            except (IndexAborted, PermanentProviderError) as e:
                stop = e
        if stop is None:
            write_ready()
        else:  # what has every vector is written (unless the database refused writes); the
            # rest keeps its previous index, with its own abort if it has one
            for w in [w for w in works if halted or w.plan.waiting or w.plan.failed]:
                works.remove(w)
                try:
                    with recorded_outcome(db, w.item.id, task_id, w.started, w.log, w.claim):
                        raise w.plan.aborted or stop
                except KidxError as e:
                    done(w.item.id, e)
            if not halted:
                write_ready()
    except BaseException as e:
        for w in works:
            if w.item.id not in out:
                # Recorded if the database lets us (a full disk may not): the cause is raised.
                try:
                    # Ctrl-C on an inline run is the user cancelling it, as a revoke is
                    # (not over the state of a run that has taken the item since)
                    if isinstance(e, Cancelled | KeyboardInterrupt):
                        record_cancelled(db, w.item.id, task_id, w.elapsed(), claim=w.claim)
                    else:
                        record_failure(
                            db,
                            w.item.id,
                            f"{type(e).__name__}: {e}",
                            task_id,
                            w.elapsed(),
                            claim=w.claim,
                        )
                except (apsw.BusyError, apsw.LockedError):  # the rest: not the whole wait each
                    db.busy_timeout_ms = min(db.busy_timeout_ms, LOCKED_OUT_MS)
                except (apsw.Error, StoreError):
                    pass
        raise
    finally:
        db.busy_timeout_ms = patience
        if queue is not None:
            queue.close()
    if written:  # the orphan check of each item's write, once for all
        repaired = repair_orphans(db, db.dimensions)
        if alone and isinstance(only := out.get(item_ids[0]), IndexResult):
            only.repaired += repaired.total  # (a run of one says what it mended)
        if repaired.total:
            log.info(
                f"{KI_EMBED} repaired the mirror",
                task_id=task_id,
                orphans_deleted=repaired.orphans_deleted,
            )
    return _taken_since_read([w for w in again if w.item.id not in out], stop, last, done)


def _taken_since_read(
    works: list[Work],
    stop: KidxError | None,
    last: bool,
    done: Callable[[int, IndexResult | KidxError], None],
) -> list[int]:
    """Items another run took between this run's read and its mark: read again (the ids),
    unless the run stopped (the provider or the database is down: the cause is their outcome,
    their state left to that run, for the caller to send them again) or they were read
    `MAX_READS` times (`coalesced`: other runs keep taking them)."""
    if stop is None and not last:
        return [w.item.id for w in works]
    for w in works:
        if stop is not None:
            w.log.info(f"{KI_EMBED} taken by another run since it was read", outcome=str(stop))
            stopped = stop
            if isinstance(stop, PermanentProviderError):  # as `recorded_outcome` says it
                stopped = IndexAborted(str(stop))
            done(w.item.id, stopped)
        else:
            reason = f"{TAKEN_LOG}, each of the {MAX_READS} times it read it: nothing written"
            w.log.info(f"{KI_EMBED} coalesced: not written", reason=reason)
            done(
                w.item.id, IndexResult(w.item.id, COALESCED, duration_ms=w.elapsed(), error=reason)
            )
    return []
