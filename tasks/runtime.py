"""What a worker process builds once: the database connection, the embedding provider, a Redis
client. Built lazily in the pool process itself (after the fork: an SQLite connection must not
cross one), and again if the process id changes."""

from __future__ import annotations

import os
from dataclasses import dataclass

import redis

from worker.providers import EmbeddingModel, build_embedder
from worker.settings import Settings
from worker.store import Database, open_store


@dataclass
class Runtime:
    settings: Settings
    db: Database
    embedder: EmbeddingModel | None
    redis: redis.Redis
    pid: int


_current: Runtime | None = None


def get_runtime(settings: Settings) -> Runtime:
    global _current
    if _current is None or _current.pid != os.getpid():
        db = open_store(settings)
        _current = Runtime(
            settings=settings,
            db=db,
            embedder=build_embedder(settings.embedding, dimensions=db.dimensions),
            redis=redis.Redis.from_url(settings.broker_url),
            pid=os.getpid(),
        )
    return _current
