"""Note, file and URL items: their chunks in `note_chunks`, vectors in `note_chunk_embeddings`
and the vec tables, the whole-item vector of single-chunk content, and the repair of the mirror.
Kept chunks keep their ids (and vec rows): only what changed is deleted and inserted."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import apsw

from worker.chunking import Chunk, text_hash
from worker.chunking.base import CONTEXT_CHARS
from worker.embedding import FailureCounter, Plan
from worker.log import KI_EMBED
from worker.store.db import Database
from worker.store.repair import repair_vectors
from worker.store.vec import vec_delete, vec_ready, vec_replace


def note_plan(
    db: Database,
    item_id: int,
    title: str,
    chunks: list[Chunk],
    model: str,
    dims: int,
    context: int = CONTEXT_CHARS,
) -> Plan:
    """Match new chunks to old vectors by the hash of the embedder input, wherever they moved."""
    plan = Plan(
        chunks,
        lambda i: chunks[i].embedding_input(title, context),
        [text_hash(c.embedding_input(title, context)) for c in chunks],
        item_id=item_id,
    )
    pool: dict[str, list[tuple[int, bytes]]] = defaultdict(list)
    for chunk_id, embed_hash, vector in db.all(
        "SELECT c.id, c.embed_hash, e.vector FROM note_chunks c "
        "JOIN note_chunk_embeddings e ON e.chunk_id = c.id AND e.model = ? AND e.dimensions = ? "
        "WHERE c.item_id = ? ORDER BY c.chunk_index",
        (model, dims, item_id),
    ):
        pool[embed_hash].append((chunk_id, vector))
    for i, h in enumerate(plan.hashes):
        if pool.get(h):
            plan.reuse[i] = pool[h].pop(0)
            plan.vectors[i] = plan.reuse[i][1]
    return plan


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
    writes that failed). Three failed vec writes in a row raise IndexAborted (rolled back).
    `orphans=False`: the caller looks for orphan vec rows itself (repair_vectors)."""
    counter = FailureCounter(limit, ilog)
    vec_failed = 0
    mirror = vec_ready(db, dims)
    current = {
        cid: h
        for cid, h in db.all("SELECT id, embed_hash FROM note_chunks WHERE item_id = ?", (item_id,))
    }
    keep = {i: old for i, (old, _) in plan.reuse.items() if current.get(old) == plan.hashes[i]}
    gone = [cid for cid in current if cid not in set(keep.values())]
    if gone:
        if mirror:
            vec_delete(db, "vec_chunk_embeddings", gone)
        db.execute(f"DELETE FROM note_chunks WHERE id IN ({','.join('?' * len(gone))})", gone)
    # Out of the way of UNIQUE(item_id, chunk_index) while kept chunks move.
    db.execute(
        "UPDATE note_chunks SET chunk_index = -1 - chunk_index WHERE item_id = ?", (item_id,)
    )

    def row(i: int) -> tuple[Any, ...]:
        c = plan.chunks[i]
        headings = " > ".join(c.headings)
        return (
            c.index,
            c.content,
            c.summary,
            str(c.method),
            c.start,
            c.end,
            headings,
            plan.hashes[i],
        )

    db.executemany(
        "UPDATE note_chunks SET chunk_index = ?, content = ?, summary = ?, method = ?, "
        "start_offset = ?, end_offset = ?, headings = ?, embed_hash = ? WHERE id = ?",
        [(*row(i), old) for i, old in keep.items()],
    )
    # New chunks get their ids here (the write lock is held: nobody else can take them), so
    # that their rows go in one statement each way rather than three round trips a chunk.
    new = [i for i in range(len(plan.chunks)) if i not in keep]
    first = (db.scalar("SELECT max(id) FROM note_chunks") or 0) + 1
    ids = {i: first + n for n, i in enumerate(new)}
    db.executemany(
        "INSERT INTO note_chunks(id, chunk_index, content, summary, method, start_offset, "
        "end_offset, headings, embed_hash, item_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [(ids[i], *row(i), item_id) for i in new],
    )
    vectors = [(ids[i], plan.vectors[i]) for i in new if plan.vectors.get(i) is not None]
    db.executemany(
        "INSERT INTO note_chunk_embeddings(chunk_id, model, dimensions, vector) "
        "VALUES (?, ?, ?, ?)",
        [(chunk_id, model, dims, vector) for chunk_id, vector in vectors],
    )
    if mirror and vectors:
        vec_failed = _mirror_chunks(db, vectors, plan, ids, counter)
    _write_whole_item(db, item_id, plan, model, dims, mirror)
    report = repair_vectors(db, dims, item_id=item_id, orphans=orphans, kept=set(keep.values()))
    if report.total:
        ilog.info(
            f"{KI_EMBED} repaired the mirror",
            restored=report.restored,
            orphans_deleted=report.orphans_deleted,
        )
    return report.total, vec_failed


def _mirror_chunks(
    db: Database,
    vectors: list[tuple[int, bytes]],
    plan: Plan,
    ids: dict[int, int],
    counter: FailureCounter,
) -> int:
    """The new chunks' vec rows (DELETE + INSERT: a stray row may hold an id), all at once;
    when that fails, row by row, each failure counted (three in a row abort). Returns the
    rows that failed."""
    try:
        with db.atomic():
            vec_delete(db, "vec_chunk_embeddings", [chunk_id for chunk_id, _ in vectors])
            db.executemany(
                "INSERT INTO vec_chunk_embeddings(chunk_id, embedding) VALUES (?, ?)", vectors
            )
        counter.ok()
        return 0
    except apsw.Error:
        pass
    index_of = {chunk_id: plan.chunks[i].index for i, chunk_id in ids.items()}
    failed = 0
    for chunk_id, vector in vectors:
        try:
            with db.atomic():
                vec_replace(db, "vec_chunk_embeddings", chunk_id, vector)
        except apsw.Error as e:
            failed += 1
            counter.fail(index_of[chunk_id], f"vec write: {e}")
        else:
            counter.ok()
    return failed


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
