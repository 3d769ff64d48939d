"""Embedding providers: OpenAI-compatible over httpx, a local sentence-transformers model, or
none."""

from __future__ import annotations

from typing import TYPE_CHECKING

from worker.providers.base import EmbeddingModel, Hooks, from_blob, to_blob
from worker.settings import ChunkSettings, EmbeddingSettings

if TYPE_CHECKING:
    from worker.embedding import Streak
    from worker.providers.chat import ChatModel

__all__ = ["EmbeddingModel", "Hooks", "build_chat", "build_embedder", "from_blob", "to_blob"]


def build_chat(
    settings: ChunkSettings, *, hooks: Hooks | None = None, streak: Streak | None = None
) -> ChatModel | None:
    """The chunk model, or None when KIDX_CHUNK__MODEL is empty (structural chunking only);
    `streak`: its failed calls in a row, when kept beyond this process."""
    if not settings.model:
        return None
    from worker.providers.chat import ChatModel

    return ChatModel(settings, hooks=hooks, streak=streak)


def build_embedder(
    settings: EmbeddingSettings, *, dimensions: int | None, hooks: Hooks | None = None
) -> EmbeddingModel | None:
    """The configured provider expecting `dimensions`, or None for `none` (the pipeline skips);
    `hooks`: the caller's cancellable wait and metrics."""
    if settings.provider == "none":
        return None
    if settings.provider == "local":
        from worker.providers.local import LocalEmbeddings

        return LocalEmbeddings(settings, dimensions=dimensions, hooks=hooks)
    from worker.providers.openai import OpenAIEmbeddings

    return OpenAIEmbeddings(settings, dimensions=dimensions, hooks=hooks)
