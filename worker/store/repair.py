"""Mend the mirror from the truth, with no provider call: vec rows missing for relational vectors
are re-inserted (an interrupted run, vectors written while sqlite-vec was off), and vec rows
without a relational vector of the index's dimension (orphans) are deleted. A database marked
`vec_behind` (worker.store.vec) has its vec tables rebuilt by the full repair: a stale vector
under a live key is found by no comparison of keys. So has a vec table that a host dropped, made
in another shape, or whose shadow tables it damaged (sqlite-vec then fails, or finds nothing)."""

from __future__ import annotations

import json
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import apsw

from worker.log import KI_EMBED, get_logger
from worker.store.db import Database, meta_cursor
from worker.store.vec import (
    VEC_TABLES,
    VecTable,
    claimed,
    rebuild_vec_table,
    set_meta,
    sound,
    sync_vec_tables,
    vec_behind,
    vec_ready,
    vec_table_damage,
    vec_table_dimensions,
)

# Relational vectors of one item, per vec table that holds item vectors.
_ITEM_VECTORS = {
    "vec_note_embeddings": "SELECT item_id, vector FROM note_embeddings "
    f"WHERE item_id = :item AND dimensions = :d AND {sound()}",
    "vec_chunk_embeddings": "SELECT e.chunk_id, e.vector FROM note_chunks c "
    "JOIN note_chunk_embeddings e ON e.chunk_id = c.id "
    f"WHERE c.item_id = :item AND e.dimensions = :d AND {sound('e')}",
    "vec_work_code_chunks": "SELECT e.chunk_id, e.vector FROM code_chunks c "
    "JOIN code_chunk_embeddings e ON e.chunk_id = c.id "
    f"WHERE c.item_id = :item AND e.dimensions = :d AND {sound('e')}",
}
_ITEM_VECTORS["vec_note_bits"] = _ITEM_VECTORS["vec_note_embeddings"]
_ITEM_VECTORS["vec_chunk_bits"] = _ITEM_VECTORS["vec_chunk_embeddings"]
# The tables an item run checks for orphans (cheaply, by counting first).
_ITEM_RUN_ORPHAN_TABLES = (
    "vec_note_embeddings",
    "vec_chunk_embeddings",
    "vec_note_bits",
    "vec_chunk_bits",
)
_CHUNK_TABLES = ("vec_chunk_embeddings", "vec_chunk_bits")

log = get_logger("kidx.store")


@dataclass
class RepairReport:
    restored: dict[str, int] = field(default_factory=dict)
    orphans_deleted: dict[str, int] = field(default_factory=dict)
    replaced: dict[str, int] = field(default_factory=dict)  # rows unlike their vector
    rebuilt: bool = False  # every vec table, from the relational vectors (`vec_behind`)
    # tables rebuilt alone (missing, of another shape, damaged shadow tables): rows refilled
    tables_rebuilt: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return (
            sum(self.restored.values())
            + sum(self.orphans_deleted.values())
            + sum(self.replaced.values())
            + self.rebuilt
            + len(self.tables_rebuilt)
        )

    def merge(self, other: RepairReport) -> None:
        for mine, theirs in (
            (self.restored, other.restored),
            (self.orphans_deleted, other.orphans_deleted),
            (self.replaced, other.replaced),
        ):
            for name, n in theirs.items():
                mine[name] = mine.get(name, 0) + n


def _restore(
    db: Database, t: VecTable, rows: list[tuple[int, bytes]], report: RepairReport
) -> None:
    if not rows:
        return
    present = set()
    for key, _ in rows:
        if db.one(f"SELECT 1 FROM {t.name} WHERE {t.key} = ?", (key,)):
            present.add(key)
    missing = [(k, v) for k, v in rows if k not in present]
    for key, vector in missing:
        db.execute(t.insert(), (key, vector))
    if missing:
        report.restored[t.name] = report.restored.get(t.name, 0) + len(missing)


def _sweep(db: Database, t: VecTable, dims: int, report: RepairReport, *, restore: bool) -> None:
    """Compare both sides in full (id sets: a scan each, cheaper than a join into vec0). Keys
    only: a missing row's vector goes from its table to the vec table in SQL (every vector
    read into a dict was 600 MB a table at 100k chunks of 1536 dimensions, each sweep).
    `REPAIR_SLICE` orphans deleted and rows restored at most, the lowest keys first: the rest
    is the next sweep's (a host's DELETE of 200k chunks made one transaction of 1.4 million
    statements, 19 s under the write lock; a worker's write waits for it)."""
    mirrored = {r[0] for r in db.all(f"SELECT {t.key} FROM {t.name}")}
    truth = {
        r[0]
        for r in db.all(
            f"SELECT {t.source_key} FROM {t.source} WHERE dimensions = ? AND {sound()}", (dims,)
        )
    }
    deleted = 0
    for key in sorted(mirrored - truth)[:REPAIR_SLICE]:
        deleted += _delete_orphan(db, t, key)
    if deleted:
        report.orphans_deleted[t.name] = deleted
    if restore:
        missing = sorted(truth - mirrored)[:REPAIR_SLICE]
        for key in missing:
            db.execute(
                f"INSERT INTO {t.name}({t.key}, embedding) SELECT {t.source_key}, "
                f"{t.value('vector')} FROM {t.source} WHERE {t.source_key} = ?",
                (key,),
            )
        if missing:
            report.restored[t.name] = len(missing)


# Rows of each vec table whose content a full repair compares with the relational vector, a
# sweep: keys compare in full each time, contents a slice at a time (a point lookup into vec0
# a row: about 0.2 s for 10k), from where the last sweep stopped, round and round.
VERIFY_SLICE = 10_000
# ... and at most this long a table, under the write lock: a lookup into vec0 reads its chunk
# of 1,024 vectors, 2 ms a row at 1536 dimensions (0.07 at 384), and a sweep held every
# writer 7-12 s at 100k x 1536. Read `VERIFY_STEP` rows at a time until it is spent.
VERIFY_SECONDS = 0.5
VERIFY_STEP = 500
# Orphans deleted and missing rows restored a table at most, a repair (`_sweep`).
REPAIR_SLICE = 10_000


class _Damaged(Exception):
    """A vec table's storage that no row-by-row mend can put right: it is rebuilt."""


def _check_slots(db: Database, t: VecTable, keys: list[int]) -> None:
    """`_Damaged` when a key's slot in the table's storage (its chunk's id list and validity
    bits, which the KNN reads) holds another id than the key, or is marked empty (a host
    swapped two ids there, zeroed the list, moved a bit): the KNN answered one chunk with
    another's vector, or never answered it, and each row's own lookup (`_rowids`), which every
    other check goes through, still held."""
    if not keys:
        return
    slots = db.all(
        f"SELECT s.rowid, s.chunk_offset, substr(c.rowids, s.chunk_offset * 8 + 1, 8), "
        f'substr(c.validity, s.chunk_offset / 8 + 1, 1) FROM "{t.name}_rowids" s '
        f'JOIN "{t.name}_chunks" c ON c.chunk_id = s.chunk_id '
        "WHERE s.rowid IN (SELECT value FROM json_each(?))",
        (json.dumps(keys),),
    )
    for key, offset, held, flags in slots:
        if held != int(key).to_bytes(8, "little", signed=True):
            raise _Damaged(f"the slot of row {key} of {t.name} holds another id")
        if not flags or not flags[0] >> (offset % 8) & 1:  # (the KNN never returns it)
            raise _Damaged(f"the slot of row {key} of {t.name} is marked empty")


def _verify(db: Database, t: VecTable, dims: int, report: RepairReport, n: int) -> None:
    """Replace the vec rows, of the next `n` keys (fewer once `VERIFY_SECONDS` is spent), that
    are not their relational vector (a host wrote into the vec table, or a quantized row
    drifted): key checks never see them."""
    cursor = f"vec_verified:{t.name}"
    after = meta_cursor(db, cursor)
    until = time.monotonic() + VERIFY_SECONDS
    done, ended, wrong = 0, False, 0
    while done < n and not ended:
        step = min(VERIFY_STEP, n - done)
        rows = db.all(  # (a row's vector only when it is not its vec row's: to be written)
            f"SELECT r.{t.source_key}, "
            f"CASE WHEN {t.value('r.vector')} IS v.embedding THEN NULL ELSE r.vector END "
            f"FROM {t.source} r JOIN {t.name} v ON v.{t.key} = r.{t.source_key} "
            f"WHERE {'1' if after is None else f'r.{t.source_key} > :after'} "
            f"AND r.dimensions = :dims AND {sound('r')} ORDER BY r.{t.source_key} LIMIT :n",
            {"after": after, "dims": dims, "n": step},
        )
        _check_slots(db, t, [key for key, _ in rows])
        for key, vector in rows:
            if vector is not None:
                db.execute(f"DELETE FROM {t.name} WHERE {t.key} = ?", (key,))
                db.execute(t.insert(), (key, vector))
                wrong += 1
        done += len(rows)
        ended = len(rows) < step  # the end: the next sweep starts again from the first key
        after = rows[-1][0] if rows else after
        if time.monotonic() > until:
            break
    if wrong:
        report.replaced[t.name] = wrong
    if ended:
        db.execute("DELETE FROM index_meta WHERE key = ?", (cursor,))
    else:
        set_meta(db, cursor, str(after))


def repair_vectors(
    db: Database,
    dimensions: int,
    *,
    item_id: int | None = None,
    orphans: bool = True,
    kept: Collection[int] | None = None,
    verify: int = VERIFY_SLICE,
) -> RepairReport:
    """Restore missing vec rows and delete orphans: of one item's tables, or everywhere.

    For one item (the pipeline's write): its own vectors are checked one by one, and orphans
    are looked for only when a table holds more vec rows than relational vectors (a count,
    not a scan: an orphan does not say which item it belonged to); `orphans=False` leaves that
    count to the caller (a bulk run counts once, not once an item: `repair_orphans`). `kept`:
    the item's chunk ids that the write kept, the only ones to check (the write has just put
    every other vector of the item into the mirror). Without an item, every table is compared
    in full, and the contents of the next `verify` rows of each (`_verify`). Runs inside the
    caller's transaction when there is one.
    """
    report = RepairReport()
    if item_id is None and db.vec_loaded and _remake(db, dimensions, report):
        report.rebuilt = True
    if not vec_ready(db, dimensions):
        return report
    with db.atomic():
        for t in VEC_TABLES:
            if item_id is None:
                _full(db, t, dimensions, report, verify)
                continue
            if t.name in _ITEM_VECTORS:
                if kept is not None and t.name not in _CHUNK_TABLES:
                    continue  # written whole by the caller
                if kept is not None and not kept:
                    continue
                rows = db.all(_ITEM_VECTORS[t.name], {"item": item_id, "d": dimensions})
                if kept is not None:
                    rows = [r for r in rows if r[0] in kept]
                _restore(db, t, rows, report)
        if item_id is not None and orphans:
            _orphans(db, dimensions, report)
    return report


def _remake(db: Database, dimensions: int, report: RepairReport) -> bool:
    """Rebuild the vec tables when the database is marked `vec_behind`, or when some are
    missing or of another shape (a host dropped or made them) while the others have this
    process's dimension: never back to it from another (a process that has not seen a model
    switch would undo it, and mark the new model's items pending). The tables rebuilt go in
    `report.tables_rebuilt` with the rows refilled, as a damaged one's do: the sweep's
    summary said nothing of a rebuild of every table."""
    declared = vec_table_dimensions(db).values()
    remade = None in declared and all(d in (None, dimensions) for d in declared)
    # One made again at another dimension (a host's CREATE with kidx's declaration), while
    # others and the index's recorded model are at this process's: no model switch did that,
    # and search was left on the slow exact fallback until some vector was written.
    stray = bool(set(declared) - {None, dimensions}) and dimensions in declared
    stray = stray and claimed(db) and db.dimensions == dimensions
    if not (vec_behind(db) or remade or stray):
        return False
    with db.atomic():  # what sync_vec_tables rebuilds, read under its write lock
        before, behind = vec_table_dimensions(db), vec_behind(db)
        if not sync_vec_tables(db, dimensions):
            return False
        for t in VEC_TABLES:
            if behind or before[t.name] != dimensions:
                report.tables_rebuilt[t.name] = int(
                    db.scalar(
                        f"SELECT count(*) FROM {t.source} WHERE dimensions = ? AND {sound()}",
                        (dimensions,),
                    )
                )
    return True


def _full(db: Database, t: VecTable, dims: int, report: RepairReport, verify: int) -> None:
    """The full repair of one table: its keys, the contents of the next `verify` rows; or,
    when its shadow tables are damaged (`vec_table_damage`) or sqlite-vec fails on it, the
    table rebuilt from the relational vectors (what no row-by-row mend can do)."""
    found = RepairReport()
    try:
        reason = vec_table_damage(db, t, dims)
        if reason is None:
            with db.atomic():
                _sweep(db, t, dims, found, restore=True)
                _verify(db, t, dims, found, verify)
    except (apsw.SQLError, apsw.CorruptError) as e:  # a shadow table of another schema, too
        reason = f"{type(e).__name__}: {e}"
    except _Damaged as e:
        reason = str(e)
    if reason is None:
        report.merge(found)
        return
    report.tables_rebuilt[t.name] = rebuild_vec_table(db, t, dims)
    db.execute("DELETE FROM index_meta WHERE key = ?", (f"vec_verified:{t.name}",))
    log.warning(
        f"{KI_EMBED} vec table rebuilt",
        table=t.name,
        reason=reason,
        refilled=report.tables_rebuilt[t.name],
    )


def repair_orphans(db: Database, dimensions: int) -> RepairReport:
    """The orphan check of item runs, once: a sweep only where a table holds more vec rows
    than relational vectors. Counted first in a read snapshot, and again under the write
    lock only where that finds more: the counts are of whole tables (0.5 s at 200,000
    chunks), and every run held the write lock for them, however small its item."""
    report = RepairReport()
    if not vec_ready(db, dimensions):
        return report
    with db.reading():
        suspect = _orphaned(db, dimensions)
    if suspect:
        with db.atomic():
            _orphans(db, dimensions, report, _orphaned(db, dimensions))
    return report


def _orphaned(db: Database, dimensions: int) -> list[VecTable]:
    """The tables an item run checks that hold more vec rows than their source has vectors
    (each source counted once: the float and the bit table share theirs)."""
    truths: dict[str, int] = {}
    found = []
    for t in VEC_TABLES:
        if t.name not in _ITEM_RUN_ORPHAN_TABLES:
            continue
        if t.source not in truths:
            truths[t.source] = db.scalar(
                f"SELECT count(*) FROM {t.source} WHERE dimensions = ? AND {sound()}",
                (dimensions,),
            )
        if db.scalar(f"SELECT count(*) FROM {t.name}") > truths[t.source]:
            found.append(t)
    return found


def _orphans(
    db: Database, dimensions: int, report: RepairReport, tables: list[VecTable] | None = None
) -> None:
    for t in _orphaned(db, dimensions) if tables is None else tables:
        _sweep(db, t, dimensions, report, restore=False)


def _delete_orphan(db: Database, t: VecTable, key: int) -> bool:
    """Delete one orphan vec row; whether it is gone. vec0 can neither delete nor insert over
    a key whose `_rowids` row leads to no vector (a host's row in that shadow table, "Could
    not fetch vector data"): that row is deleted from the shadow table itself. A row that
    still cannot be deleted is logged and left: one row never stops a repair (nor the run
    whose orphan check it is)."""
    try:
        with db.atomic():
            db.execute(f"DELETE FROM {t.name} WHERE {t.key} = ?", (key,))
        return True
    except apsw.SQLError as e:
        shadow, chunks = f"{t.name}_rowids", f"{t.name}_chunks"
        if db.table_exists(shadow) and db.table_exists(chunks):
            with db.atomic():
                stray = db.all(
                    f'DELETE FROM "{shadow}" WHERE rowid = ? AND (chunk_id IS NULL OR '
                    f'chunk_id NOT IN (SELECT chunk_id FROM "{chunks}")) RETURNING rowid',
                    (key,),
                )
            if stray:
                return True
        log.warning(
            f"{KI_EMBED} a vec row could not be deleted", table=t.name, key=key, reason=str(e)
        )
        return False
