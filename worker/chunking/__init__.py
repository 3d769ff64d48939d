"""Chunkers: structural now, LLM boundaries later; `chunk()` picks and falls back."""

from collections.abc import Sequence

from worker.chunking.base import (
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    OVERLAP_SIZE,
    Chunk,
    ChunkMethod,
    text_hash,
)
from worker.chunking.structure import chunk_structure

__all__ = [
    "MAX_CHUNK_SIZE",
    "MIN_CHUNK_SIZE",
    "OVERLAP_SIZE",
    "Chunk",
    "ChunkMethod",
    "chunk",
    "chunk_structure",
    "text_hash",
]


def chunk(text: str, previous: Sequence[tuple[int, str]] | None = None) -> list[Chunk]:
    """Chunk an item's text with the best method available (structural, for now).

    `previous`: the item's current chunks as (start offset, content), so that an edit re-cuts
    only the chunks it touched.
    """
    return chunk_structure(text, previous=previous)
