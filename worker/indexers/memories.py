"""Memories: short texts embedded whole (no chunking), in `memories` / `vec_memories`, found
only by a memory search. Not items: no task or sweep runs them; `add_memory` plans (the text
whole), embeds and writes at once."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from worker.errors import InvalidInput
from worker.nearest import nearest
from worker.providers.base import EmbeddingModel, to_blob
from worker.store.db import Database
from worker.store.text import shown
from worker.store.vec import VEC, vec_ready, vec_replace

MAX_MEMORY = 2000  # characters: longer texts are notes, which are chunked


@dataclass
class MemoryHit:
    memory_id: int
    score: float
    content: str
    via: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


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
    vector = to_blob(embedder.embed([text])[0])
    dims = db.dimensions
    with db.atomic():
        memory_id = int(db.scalar("INSERT INTO memories(content) VALUES (?) RETURNING id", (text,)))
        db.execute(
            "INSERT INTO memory_embeddings(memory_id, model, dimensions, vector) "
            "VALUES (?, ?, ?, ?)",
            (memory_id, embedder.model_id, dims, vector),
        )
        if vec_ready(db, dims):
            vec_replace(db, "vec_memories", memory_id, vector)
    return memory_id


def search_memories(
    db: Database, query: str, embedder: EmbeddingModel, *, k: int = 10
) -> tuple[list[MemoryHit], str, str | None]:
    if not query.strip():
        raise InvalidInput("the query is empty")
    found, via, reason = nearest(
        db, VEC["vec_memories"], embedder.embed([query])[0], k, embedder.model_id
    )
    hits = []
    for memory_id, distance in found:
        content = db.scalar("SELECT CAST(content AS BLOB) FROM memories WHERE id = ?", (memory_id,))
        if content is not None:  # bytes a host wrote are shown, not raised (store.text)
            hits.append(MemoryHit(memory_id, round(1.0 - distance, 6), shown(content), via))
    return hits, via, reason
