"""Code items: chunked along top-level definitions, written to `code_chunks` and
`vec_work_code_chunks` only, so that code never crowds out the notes' nearest neighbours;
searched on their own (`search_code`)."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass

from worker.chunking import text_hash
from worker.chunking.base import CONTEXT_CHARS
from worker.chunking.code import CodeChunk, chunk_code
from worker.embedding import Plan
from worker.errors import InvalidInput
from worker.nearest import nearest
from worker.providers.base import EmbeddingModel
from worker.store.db import Database
from worker.store.items import Item
from worker.store.vec import VEC, vec_delete, vec_ready, vec_replace

SNIPPET = 160


def code_plan(
    db: Database,
    item: Item,
    chunks: list[CodeChunk],
    model: str,
    dims: int,
    context: int = CONTEXT_CHARS,
) -> Plan:
    """Reuse a vector wherever the same input (path, lines, symbol, content) was embedded."""
    plan = Plan(
        chunks,
        lambda i: chunks[i].embedding_input(item.title, context),
        [text_hash(c.embedding_input(item.title, context)) for c in chunks],
        item_id=item.id,
    )
    pool: dict[str, list[tuple[int, bytes]]] = defaultdict(list)
    for chunk_id, embed_hash, vector in db.all(
        "SELECT c.id, c.embed_hash, e.vector FROM code_chunks c JOIN code_chunk_embeddings e "
        "ON e.chunk_id = c.id AND e.model = ? AND e.dimensions = ? WHERE c.item_id = ?",
        (model, dims, item.id),
    ):
        pool[embed_hash].append((chunk_id, vector))
    for i, h in enumerate(plan.hashes):
        if pool.get(h):
            plan.reuse[i] = pool[h].pop(0)
            plan.vectors[i] = plan.reuse[i][1]
    return plan


def plan_code(
    db: Database, item: Item, text: str, model: str, context: int = CONTEXT_CHARS
) -> tuple[Plan, list[CodeChunk]]:
    """Chunk a code item and match its chunks to their old vectors; embedding is the caller's."""
    chunks = chunk_code(text, item.source or item.title)
    if not chunks:
        raise InvalidInput(f"{item.title}: no code to index")
    return code_plan(db, item, chunks, model, db.dimensions, context), chunks


def write_code(db: Database, item: Item, plan: Plan, chunks: list[CodeChunk], model: str) -> None:
    """Replace the item's code chunks, in the caller's transaction."""
    dims = db.dimensions
    mirror = vec_ready(db, dims)
    old = [r[0] for r in db.all("SELECT id FROM code_chunks WHERE item_id = ?", (item.id,))]
    if mirror:
        vec_delete(db, "vec_work_code_chunks", old)
    db.execute("DELETE FROM code_chunks WHERE item_id = ?", (item.id,))
    for i, c in enumerate(chunks):
        chunk_id = db.scalar(
            "INSERT INTO code_chunks(item_id, chunk_index, path, start_line, end_line, content, "
            "embed_hash) VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
            (item.id, c.index, item.title, c.start_line, c.end_line, c.content, plan.hashes[i]),
        )
        vector = plan.vectors.get(i)
        if vector is None:
            continue
        db.execute(
            "INSERT INTO code_chunk_embeddings(chunk_id, model, dimensions, vector) "
            "VALUES (?, ?, ?, ?)",
            (chunk_id, model, dims, vector),
        )
        if mirror:
            vec_replace(db, "vec_work_code_chunks", chunk_id, vector)


@dataclass
class CodeHit:
    item_id: int
    path: str
    start_line: int
    end_line: int
    score: float
    snippet: str
    via: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def search_code(
    db: Database, query: str, embedder: EmbeddingModel, *, k: int = 10
) -> tuple[list[CodeHit], str, str | None]:
    """The k code chunks nearest to `query` (code only: notes are never returned here)."""
    if not query.strip():
        raise InvalidInput("the query is empty")
    found, via, reason = nearest(
        db, VEC["vec_work_code_chunks"], embedder.embed([query])[0], k, embedder.model_id
    )
    hits = []
    for chunk_id, distance in found:
        row = db.one(
            "SELECT item_id, path, start_line, end_line, content FROM code_chunks WHERE id = ?",
            (chunk_id,),
        )
        if row is not None:
            item_id, path, start, end, content = row
            snippet = " ".join(content.split())[:SNIPPET]
            hits.append(CodeHit(item_id, path, start, end, round(1 - distance, 6), snippet, via))
    return hits, via, reason
