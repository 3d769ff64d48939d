"""Chunkers: structural now, LLM boundaries later; `chunk()` picks and falls back."""

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


def chunk(text: str) -> list[Chunk]:
    """Chunk an item's text with the best method available (structural, for now)."""
    return chunk_structure(text)
