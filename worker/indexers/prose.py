"""Prose: notes, files and URLs. Cut along headings and paragraphs (or by the chunk model),
written to `note_chunks`, `note_chunk_embeddings` and `vec_chunk_embeddings`, with a
whole-item vector for single-chunk content; searched by `worker.retrieval`. Kept chunks keep
their ids (and vec rows): only what changed is deleted and inserted."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Any

from worker.chunking import LLMChunker, chunk, heading_path
from worker.chunking.base import TARGET_CHUNK_SIZE, text_hash
from worker.embedding import FailureCounter, Plan
from worker.errors import StoreError
from worker.indexers.base import Indexer, IndexOptions, Planned, mirror_chunks, plan_vectors
from worker.log import CHUNK, KI_EMBED
from worker.providers.base import EmbeddingModel
from worker.store.boundaries import SqliteBoundaryCache, keep_windows
from worker.store.db import Database
from worker.store.fts import NOTES, chunk_parts, fts_insert, fts_write_item, keyword_row
from worker.store.items import Item
from worker.store.repair import repair_vectors
from worker.store.text import integer_or_null, shown
from worker.store.vec import mirror_ready, vec_delete, vec_delete_from, vec_insert, vec_replace


class Prose(Indexer):
    """Notes, files and URLs."""

    def plan(
        self, db: Database, item: Item, text: str, model: str, options: IndexOptions, ilog: Any
    ) -> Planned:
        llm = cache = None
        if options.chat is not None and not options.structure_only:
            cache = SqliteBoundaryCache(db, item.id)
            llm = LLMChunker(
                options.chat,
                cache,
                options.chunk_window,
                options.cancel,
                deadline=options.chunk_deadline,
            )
        # (only a hint for where to cut: a host's row of another type is left out, its bytes
        # are read as text to show; only when it was cut at this run's target, else a new
        # target never took effect on an item already indexed; and only chunks cut by
        # structure: the chunk model's cuts, kept by a run that fell back, are not structure's)
        previous = (
            [
                (start, shown(content))
                for start, content in db.all(
                    "SELECT start_offset, CAST(content AS BLOB) FROM note_chunks "
                    "WHERE item_id = ?1 AND typeof(start_offset) = 'integer' AND NOT EXISTS "
                    "(SELECT 1 FROM note_chunks WHERE item_id = ?1 "
                    "AND CAST(method AS BLOB) IS NOT CAST('structure' AS BLOB)) "
                    "ORDER BY chunk_index",
                    (item.id,),
                )
            ]
            if _cut_at(db, item.id) == options.chunk_target
            else []
        )
        outcome = chunk(text, previous, llm=llm, target=options.chunk_target)
        # (every window of it answered: the windows its text is made of now)
        windows = tuple(cache.used) if cache is not None and outcome.method == "llm" else None
        if outcome.fallback:
            ilog.warning(f"{CHUNK} LLM chunking fell back to structure", reason=outcome.fallback)
        dims = db.dimensions
        ilog.info(
            f"{CHUNK} chunked",
            chunk_method=str(outcome.method),
            chunk_count=len(outcome.chunks),
            dimensions=dims,
            chat_calls=llm.calls if llm else 0,
        )
        title, context = item.title, options.context_chars
        plan = plan_vectors(
            db,
            item,
            outcome.chunks,
            model,
            options,
            chunks_table="note_chunks",
            vectors_table="note_chunk_embeddings",
            # Not the title: a chunk whose heading context, summary and content are unchanged
            # keeps its vector (the seed's reuse, DESIGN 3.4), and a rename re-embedded every
            # chunk. (A Markdown note's first heading, most often its title, is in the path.)
            label="",
            # vectors kidx made with the title first: an upgrade embeds nothing again
            older_key=lambda c: text_hash(c.embedding_input(title, context)),
        )
        parts: tuple[str, ...] = ()
        if not plan.reuse:  # a new item, maybe: its keyword rows go in `write_new_notes`
            parts = tuple(chunk_parts(_headings(c), c.content) for c in outcome.chunks)
        return Planned(
            plan,
            outcome.method,
            outcome.fallback,
            outcome.asked,
            parts,
            options.chunk_target,
            windows,
        )

    def write(
        self,
        db: Database,
        item: Item,
        planned: Planned,
        model: str,
        options: IndexOptions,
        ilog: Any,
        *,
        orphans: bool,
    ) -> tuple[int, int]:
        repaired, failed = write_notes(
            db,
            item.id,
            planned.plan,
            model,
            db.dimensions,
            options.max_consecutive_failures,
            ilog,
            orphans=orphans,
        )
        if planned.windows is not None:
            keep_windows(db, item.id, planned.windows)
        if repaired:
            ilog.info(f"{KI_EMBED} repaired the mirror", repaired=repaired)
        return repaired, failed

    def write_new(
        self, db: Database, items: Sequence[tuple[Item, Planned]], model: str
    ) -> list[int]:
        written = write_new_notes(db, [(item.id, planned) for item, planned in items], model)
        for item, planned in items:
            if planned.windows is not None and item.id in written:
                keep_windows(db, item.id, planned.windows)
        return written

    def search(self, db: Database, query: str, embedder: EmbeddingModel, *, k: int = 10) -> Any:
        from worker.retrieval import search

        return search(db, query, embedder, k=k)


def _cut_at(db: Database, item_id: int) -> int | None:
    """The target an item's chunks were cut at: recorded with its state, TARGET_CHUNK_SIZE
    before it was (the only one then); None for what a host wrote there."""
    row = db.one(
        # (typed in SQL: a host's text that is not UTF-8 raised in apsw, and the item failed
        # at every run, since only a run that succeeds rewrites it)
        f"SELECT CASE WHEN chunk_target IS NULL THEN ? ELSE {integer_or_null('chunk_target')} "
        "END FROM item_index_state WHERE item_id = ?",
        (TARGET_CHUNK_SIZE, item_id),
    )
    value = row[0] if row is not None else TARGET_CHUNK_SIZE
    return value if type(value) is int else None


INSERT_CHUNK = (
    "INSERT INTO note_chunks(id, chunk_index, content, summary, method, start_offset, "
    "end_offset, headings, embed_hash, item_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
# A stray vector under a new chunk's id (its chunk deleted by hand) is replaced: REPLACE, not
# an UPSERT, whose UPDATE would fire the trigger that drops a vector a host changed (migration
# 15).
INSERT_VECTOR = (
    "INSERT OR REPLACE INTO note_chunk_embeddings(chunk_id, model, dimensions, vector) "
    "VALUES (?, ?, ?, ?)"
)


def _chunk_row(plan: Plan, i: int) -> tuple[Any, ...]:
    """Chunk i's columns, from chunk_index to embed_hash."""
    c = plan.chunks[i]
    return (
        c.index,
        c.content,
        c.summary,
        str(c.method),
        c.start,
        c.end,
        _headings(c),
        plan.hashes[i],
    )


MAX_ROWID = 2**63 - 1


def _first_free_above(db: Database, n: int) -> int | None:
    """The first of n ids above the highest chunk's, or None when SQLite's largest rowid
    leaves no room for them."""
    top = db.scalar("SELECT max(id) FROM note_chunks") or 0
    return top + 1 if top <= MAX_ROWID - n else None


def _new_chunk_ids(db: Database, n: int) -> list[int]:
    """Ids for n new chunks: above the highest, or, when a host's row holds an id so high
    that there is no room (SQLite's largest rowid), free ones at random, as SQLite itself then
    picks them."""
    first = _first_free_above(db, n)
    if first is not None:
        return list(range(first, first + n))
    ids: set[int] = set()
    while len(ids) < n:
        candidate = random.randrange(1, MAX_ROWID)
        if db.one("SELECT 1 FROM note_chunks WHERE id = ?", (candidate,)) is None:
            ids.add(candidate)
    return sorted(ids)


def _headings(chunk: Any) -> str:
    return heading_path(chunk.headings)


def _out_of_the_way(db: Database, item_id: int) -> None:
    """Move the item's chunks to indexes below zero that no row of it holds, out of the way of
    UNIQUE(item_id, chunk_index) while kept chunks move: free by what the rows hold, not by
    arithmetic on it (`-1 - chunk_index` met a host's -1, 'x' or 2.0 and failed the item at
    every run)."""
    rows = db.all(
        "SELECT id, CASE WHEN typeof(chunk_index) IN ('integer', 'real') THEN chunk_index END "
        "FROM note_chunks WHERE item_id = ?",
        (item_id,),
    )
    # a REAL equal to an integer is that integer to the UNIQUE index
    taken = {int(v) for _, v in rows if v is not None and float(v).is_integer()}
    free = (n for n in itertools.count(-1, -1) if n not in taken)
    moves = [(next(free), cid) for cid, _ in rows]
    db.executemany("UPDATE note_chunks SET chunk_index = ? WHERE id = ?", moves)


def write_notes(
    db: Database,
    item_id: int,
    plan: Plan,
    model: str,
    dims: int,
    limit: int,
    ilog: Any,
    *,
    orphans: bool = True,
) -> tuple[int, int]:
    """Write an item's chunks and vectors in the caller's transaction: (vec rows repaired, vec
    writes that failed; why each failed goes in `plan.unmirrored`, for the item's state and
    result). Three failed vec writes in a row raise IndexAborted (rolled back).
    `orphans=False`: the caller looks for orphan vec rows itself (repair_vectors)."""
    counter = FailureCounter(limit, ilog)
    vec_failed = 0
    mirror = mirror_ready(db, dims)
    current = {  # (as bytes: see plan_vectors)
        cid: shown(h)
        for cid, h in db.all(
            "SELECT id, CAST(embed_hash AS BLOB) FROM note_chunks WHERE item_id = ?", (item_id,)
        )
    }
    keep = {i: old for i, (old, _) in plan.reuse.items() if current.get(old) == plan.hashes[i]}
    gone = [cid for cid in current if cid not in set(keep.values())]
    if gone:
        if mirror:
            vec_delete(db, "vec_chunk_embeddings", gone)
        # a statement an id: an IN list of 40k chunks (a 12 MB note) passes SQLite's limit of
        # 32,766 bound values
        db.executemany("DELETE FROM note_chunks WHERE id = ?", [(cid,) for cid in gone])
    _out_of_the_way(db, item_id)

    db.executemany(
        "UPDATE note_chunks SET chunk_index = ?, content = ?, summary = ?, method = ?, "
        "start_offset = ?, end_offset = ?, headings = ?, embed_hash = ? WHERE id = ?",
        [(*_chunk_row(plan, i), old) for i, old in keep.items()],
    )
    # New chunks get their ids here (the write lock is held: nobody else can take them), so
    # that their rows go in one statement each way rather than three round trips a chunk.
    new = [i for i in range(len(plan.chunks)) if i not in keep]
    ids = dict(zip(new, _new_chunk_ids(db, len(new)), strict=True))
    db.executemany(INSERT_CHUNK, [(ids[i], *_chunk_row(plan, i), item_id) for i in new])
    vectors = [(ids[i], plan.vectors[i]) for i in new if plan.vectors.get(i) is not None]
    db.executemany(INSERT_VECTOR, [(chunk_id, model, dims, vector) for chunk_id, vector in vectors])
    # A new chunk whose embedding failed must not inherit a vector left under its id (a chunk
    # a host deleted by hand, foreign keys off): it would count as embedded, and the next run
    # would reuse it for good.
    if bare := [ids[i] for i in new if plan.vectors.get(i) is None]:
        db.executemany(
            "DELETE FROM note_chunk_embeddings WHERE chunk_id = ?", [(cid,) for cid in bare]
        )
        if mirror:
            vec_delete(db, "vec_chunk_embeddings", bare)
    if mirror and vectors:
        position = {chunk_id: i for i, chunk_id in ids.items()}
        rows = [(position[chunk_id], chunk_id, vector) for chunk_id, vector in vectors]
        plan.unmirrored = mirror_chunks(db, "vec_chunk_embeddings", rows, plan, counter)
        vec_failed = len(plan.unmirrored)
    _write_whole_item(db, item_id, plan, model, dims, mirror)
    fts_write_item(db, NOTES, item_id, current)
    report = repair_vectors(db, dims, item_id=item_id, orphans=orphans, kept=set(keep.values()))
    if report.total:
        ilog.info(
            f"{KI_EMBED} repaired the mirror",
            restored=report.restored,
            orphans_deleted=report.orphans_deleted,
        )
    return report.total, vec_failed


def write_new_notes(db: Database, items: Sequence[tuple[int, Planned]], model: str) -> list[int]:
    """What `write_notes` writes for items that have no chunk and no whole-item vector yet,
    for all of them at once: a statement per table, not a dozen an item (a bulk run of new
    notes spent most of its write lock on those, and FTS5 flushes its pending rows at each
    savepoint). Items deleted meanwhile, or that have rows, are left out (`write_notes`
    handles them, the repair included); the ids written are returned. Raises what the
    database raised: the caller rolls back and writes the items one by one."""
    ids = [item_id for item_id, _ in items]
    marks = ",".join("?" * len(ids))
    titles = dict(
        db.all(f"SELECT id, CAST(title AS BLOB) FROM knowledge_items WHERE id IN ({marks})", ids)
    )
    taken = {
        r[0]
        for r in db.all(
            f"SELECT item_id FROM note_chunks WHERE item_id IN ({marks}) UNION "
            f"SELECT item_id FROM note_embeddings WHERE item_id IN ({marks})",
            ids + ids,
        )
    }
    new = [(item_id, p) for item_id, p in items if item_id in titles and item_id not in taken]
    if not new:
        return []
    dims = db.dimensions
    first = _first_free_above(db, sum(len(p.plan.chunks) for _, p in new))
    if first is None:
        raise StoreError("no room above the highest chunk id: the items go one by one")
    next_id = first
    chunks, vectors, wholes, keywords = [], [], [], []
    for item_id, planned in new:
        plan, parts = planned.plan, planned.keyword_parts
        title = shown(titles[item_id])
        for i in range(len(plan.chunks)):
            row = _chunk_row(plan, i)
            chunks.append((next_id, *row, item_id))
            vectors.append((next_id, plan.vectors[i]))
            made = parts[i] if len(parts) == len(plan.chunks) else None
            keywords.append(keyword_row(next_id, title, row[6], row[1], made))
            next_id += 1
        if len(plan.chunks) == 1:  # single-chunk content: its vector is the item's too
            wholes.append((item_id, plan.vectors[0]))
    db.executemany(INSERT_CHUNK, chunks)
    db.executemany(INSERT_VECTOR, [(chunk_id, model, dims, v) for chunk_id, v in vectors])
    db.executemany(
        "INSERT INTO note_embeddings(item_id, model, dimensions, vector) VALUES (?, ?, ?, ?)",
        [(item_id, model, dims, v) for item_id, v in wholes],
    )
    # Rows under the new ids (a host's leftovers: no live chunk has an id that high) go first.
    if mirror_ready(db, dims):
        vec_delete_from(db, "vec_chunk_embeddings", first)
        vec_insert(db, "vec_chunk_embeddings", vectors)
        vec_delete(db, "vec_note_embeddings", [key for key, _ in wholes])
        vec_insert(db, "vec_note_embeddings", wholes)
    if db.table_exists(NOTES.name):
        db.execute(f"DELETE FROM {NOTES.name} WHERE rowid >= ?", (first,))
        fts_insert(db, NOTES, keywords)
    return [item_id for item_id, _ in new]


def _write_whole_item(
    db: Database, item_id: int, plan: Plan, model: str, dims: int, mirror: bool
) -> None:
    """Single-chunk content also gets a whole-item vector (`vec_note_embeddings`), so
    the note itself can be recalled; it is the chunk's vector, as the chunk is the whole text.
    Content of several chunks has none."""
    vector = plan.vectors.get(0) if len(plan.chunks) == 1 else None
    had = db.one("SELECT 1 FROM note_embeddings WHERE item_id = ?", (item_id,)) is not None
    if had:  # a vec row without its relational one is an orphan: the repair deletes those
        db.execute("DELETE FROM note_embeddings WHERE item_id = ?", (item_id,))
    if mirror and (had or vector is not None):
        vec_delete(db, "vec_note_embeddings", [item_id])
    if vector is None:
        return
    db.execute(
        "INSERT INTO note_embeddings(item_id, model, dimensions, vector) VALUES (?, ?, ?, ?)",
        (item_id, model, dims, vector),
    )
    if mirror:
        vec_replace(db, "vec_note_embeddings", item_id, vector)
