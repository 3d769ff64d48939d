"""What a worker process builds once: the database connection, the embedding provider, a Redis
client. Built lazily in the pool process itself (after the fork: an SQLite connection must not
cross one), and again if the process id changes."""

from __future__ import annotations

import os
from dataclasses import dataclass

import redis

from worker.providers import EmbeddingModel, build_chat, build_embedder
from worker.providers.chat import ChatModel
from worker.settings import Settings
from worker.sources import Reader
from worker.store import Database, open_store


@dataclass
class Runtime:
    settings: Settings
    db: Database
    embedder: EmbeddingModel | None
    chat: ChatModel | None
    reader: Reader
    redis: redis.Redis
    pid: int


_current: Runtime | None = None


def get_runtime(settings: Settings) -> Runtime:
    global _current
    if _current is None or _current.pid != os.getpid():
        if settings.embedding.provider == "local":
            _share_cpus(settings.tasks.concurrency)
        db = open_store(settings)
        embedder = build_embedder(settings.embedding, dimensions=db.dimensions)
        chat = build_chat(settings.chunk)
        from tasks.metrics import timed

        if embedder is not None:
            embedder.embed_batch = timed("embedding", embedder.embed_batch)  # type: ignore[method-assign]
        if chat is not None:
            chat.complete_json = timed("chat", chat.complete_json)  # type: ignore[method-assign]
        _current = Runtime(
            settings=settings,
            db=db,
            embedder=embedder,
            chat=chat,
            reader=Reader(settings.files, settings.urls),
            redis=redis.Redis.from_url(settings.broker_url),
            pid=os.getpid(),
        )
    return _current


def close_runtime() -> None:
    """At the process's end: close the database (no -wal/-shm left behind) and the clients."""
    global _current
    if _current is not None and _current.pid == os.getpid():
        for client in (_current.embedder, _current.chat):
            if client is not None:
                client.close()
        _current.redis.close()
        _current.db.close()
    _current = None


def _share_cpus(processes: int) -> None:
    """N pool processes each running torch on every core fight over them: give each its share."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, processes)))
