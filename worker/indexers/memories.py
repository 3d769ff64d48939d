"""Memories: short texts embedded whole (no chunking), in `memories` / `vec_memories`, found
only by a memory search. Not knowledge items (no task or sweep runs them), but planned, written
and searched through the same interface: `add_memory` plans the text as one chunk, embeds it
and writes it at once."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from worker.chunking import Chunk, text_hash
from worker.embedding import Plan
from worker.errors import InvalidInput, KidxError
from worker.indexers.base import Indexer, IndexOptions, Planned
from worker.log import get_logger
from worker.nearest import nearest
from worker.providers.base import EmbeddingModel, to_blob
from worker.store.db import Database
from worker.store.items import Item
from worker.store.text import shown
from worker.store.vec import VEC, vec_ready, vec_replace

MAX_MEMORY = 2000  # characters: longer texts are notes, which are chunked

log = get_logger("kidx.memories")


@dataclass
class MemoryHit:
    memory_id: int
    score: float
    content: str
    via: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class Memories(Indexer):
    """Memories: an `Item` of kind `memory` whose id is the memory's."""

    def plan(
        self, db: Database, item: Item, text: str, model: str, options: IndexOptions, ilog: Any
    ) -> Planned:
        """The text whole, one chunk; its vector kept if this model already made it."""
        chunks = [Chunk(0, 0, len(text), text)]
        plan = Plan(chunks, lambda i: text, [text_hash(text)], item_id=item.id)
        row = db.one(
            "SELECT vector FROM memory_embeddings WHERE memory_id = ? AND model = ? "
            "AND dimensions = ?",
            (item.id, model, db.dimensions),
        )
        if row is not None:
            plan.reuse[0] = (item.id, row[0])
            plan.vectors[0] = row[0]
        return Planned(plan)

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
        vector, dims = planned.plan.vectors[0], db.dimensions
        db.execute(
            "INSERT INTO memory_embeddings(memory_id, model, dimensions, vector) "
            "VALUES (?, ?, ?, ?) ON CONFLICT(memory_id) DO UPDATE SET model = excluded.model, "
            "dimensions = excluded.dimensions, vector = excluded.vector",
            (item.id, model, dims, vector),
        )
        if vec_ready(db, dims):
            vec_replace(db, "vec_memories", item.id, vector)
        return 0, 0

    def search(
        self, db: Database, query: str, embedder: EmbeddingModel, *, k: int = 10
    ) -> tuple[list[MemoryHit], str, str | None]:
        if not query.strip():
            raise InvalidInput("the query is empty")
        found, via, reason = nearest(
            db, VEC["vec_memories"], embedder.embed([query])[0], k, embedder.model_id
        )
        hits = []
        for memory_id, distance in found:
            content = db.scalar(
                "SELECT CAST(content AS BLOB) FROM memories WHERE id = ?", (memory_id,)
            )
            if content is not None:  # bytes a host wrote are shown, not raised (store.text)
                hits.append(MemoryHit(memory_id, round(1.0 - distance, 6), shown(content), via))
        return hits, via, reason


MEMORIES = Memories()


def add_memory(db: Database, text: str, embedder: EmbeddingModel) -> int:
    """Embed `text` whole and store it; its id. The vector is made before the transaction."""
    text = text.strip()
    if not text:
        raise InvalidInput("the memory is empty")
    if len(text) > MAX_MEMORY:
        raise InvalidInput(
            f"a memory is a short text (at most {MAX_MEMORY} characters, this one has "
            f"{len(text)}); add it as a note instead"
        )
    vector = embedder.embed_checked([text])[0]  # the memory's embedder input is its text
    with db.atomic():
        memory_id = int(db.scalar("INSERT INTO memories(content) VALUES (?) RETURNING id", (text,)))
        _write_vector(db, memory_id, text, vector, embedder.model_id)
    return memory_id


def _write_vector(db: Database, memory_id: int, text: str, vector: Any, model: str) -> None:
    """A memory's vector and its mirror, through the indexer, in the caller's transaction."""
    memory = Item(memory_id, "memory", "", None, text, None)
    options = IndexOptions()
    planned = MEMORIES.plan(db, memory, text, "", options, log)
    planned.plan.vectors[0] = to_blob(vector)
    MEMORIES.write(db, memory, planned, model, options, log, orphans=False)


def search_memories(
    db: Database, query: str, embedder: EmbeddingModel, *, k: int = 10
) -> tuple[list[MemoryHit], str, str | None]:
    return MEMORIES.search(db, query, embedder, k=k)


# Memories with no vector of this model and dimension: written by a host with plain SQL, changed
# since (a trigger drops the vector of a changed text), or embedded by a model used before.
_MISSING = (
    "SELECT m.id, CAST(m.content AS BLOB) FROM memories m LEFT JOIN memory_embeddings e "
    "ON e.memory_id = m.id AND e.model = :model AND e.dimensions = :dims "
    "WHERE e.memory_id IS NULL AND length(trim(CAST(m.content AS TEXT))) > 0"
)


def memories_missing(db: Database, model: str) -> int:
    """How many memories have no vector of `model` at the index's dimension."""
    return int(
        db.scalar(f"SELECT count(*) FROM ({_MISSING})", {"model": model, "dims": db.dimensions})
    )


@dataclass
class MemoryBackfill:
    """What `embed_memories` did: memories embedded, left for a later run, and why it stopped
    early (a provider error), if it did."""

    embedded: int = 0
    left: int = 0
    error: str | None = None

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def embed_memories(db: Database, embedder: EmbeddingModel, *, limit: int = 512) -> MemoryBackfill:
    """Embed up to `limit` memories that have no vector of this model (`memories_missing`), a
    batch a request and a write transaction, each memory as `add_memory` writes it. A text
    changed or deleted while its batch was embedded is not written (the next run takes the
    new text). A provider error stops the run with what was written kept: the error is
    returned, not raised, for a sweep to report and try again later. A host's empty row is
    left alone: it has nothing to find."""
    report = MemoryBackfill()
    params = {"model": embedder.model_id, "dims": db.dimensions, "limit": limit}
    rows = db.all(f"{_MISSING} ORDER BY m.id LIMIT :limit", params)
    for start in range(0, len(rows), embedder.batch_size):
        batch = [
            (memory_id, raw, shown(raw))
            for memory_id, raw in rows[start : start + embedder.batch_size]
        ]
        try:
            vectors = embedder.embed_checked([text for _, _, text in batch])
        except KidxError as e:
            report.error = f"{type(e).__name__}: {e}"
            break
        with db.atomic():
            for (memory_id, raw, text), vector in zip(batch, vectors, strict=True):
                now = db.scalar(
                    "SELECT CAST(content AS BLOB) FROM memories WHERE id = ?", (memory_id,)
                )
                if now != raw:
                    continue  # changed or deleted meanwhile
                _write_vector(db, memory_id, text, vector, embedder.model_id)
                report.embedded += 1
    report.left = memories_missing(db, embedder.model_id)
    if report.embedded or report.error:
        log.info("memories embedded", **report.as_dict())
    return report
