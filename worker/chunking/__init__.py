"""Chunkers: LLM boundaries when a chunk model is configured and works, structural otherwise
(LLM chunking preferred, structure its fallback); `chunk()` picks and falls back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from worker.chunking.base import (
    FELL_BACK,
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    OVERLAP_SIZE,
    TARGET_CHUNK_SIZE,
    Chunk,
    ChunkMethod,
    heading_path,
    heading_titles,
    text_hash,
)
from worker.chunking.llm import ChunkingFailed, LLMChunker, chunk_llm
from worker.chunking.structure import chunk_structure
from worker.errors import Cancelled, input_failure

__all__ = [
    "FELL_BACK",
    "MAX_CHUNK_SIZE",
    "MIN_CHUNK_SIZE",
    "OVERLAP_SIZE",
    "Chunk",
    "ChunkMethod",
    "Chunking",
    "LLMChunker",
    "chunk",
    "chunk_structure",
    "heading_path",
    "heading_titles",
    "text_hash",
]


@dataclass
class Chunking:
    """The chunks, the method that made them, and why LLM chunking fell back, if it did
    (`asked`: whether the model was asked at all: `ChunkingFailed.asked`)."""

    chunks: list[Chunk]
    method: ChunkMethod
    fallback: str | None = None
    asked: bool = False


def chunk(
    text: str,
    previous: Sequence[tuple[int, str]] | None = None,
    *,
    llm: LLMChunker | None = None,
    target: int = TARGET_CHUNK_SIZE,
) -> Chunking:
    """Chunk an item's text: with the chunk model when there is one, else (or when it fails)
    structurally. `previous`: the item's current chunks as (start offset, content), so that an
    edit re-cuts only the chunks it touched."""
    fallback, asked = None, False
    if llm is not None:
        try:
            return Chunking(chunk_llm(text, llm), ChunkMethod.LLM, asked=True)
        except ChunkingFailed as e:
            fallback, asked = str(e), e.asked
        except Cancelled:
            raise
        except Exception as e:
            # A bug or an answer not foreseen: the seed says an unusable answer falls back to
            # structure; it must not fail the item, every run, told as a bug. But an
            # interruption (Celery's soft time limit) stops the run (`input_failure`).
            if not input_failure(e):
                raise
            fallback = f"the LLM chunker failed unexpectedly: {type(e).__name__}: {str(e)[:200]}"
            asked = True
    chunks = chunk_structure(text, previous=previous, target=target)
    return Chunking(chunks, ChunkMethod.STRUCTURE, fallback, asked)
