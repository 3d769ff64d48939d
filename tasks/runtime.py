"""What a worker process builds once and hands down: the settings, the database connection,
the providers (built with the process's cancellable wait and its metrics, not patched after),
a Redis client. Kept on the Celery app the tasks run in (`task.app`), built after the fork (an
SQLite connection must not cross one) and again if the process id changes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import redis

from tasks.cancel import RunScope
from tasks.redis_at import redis_at
from tasks.streak import SharedStreak, chat_streak_key
from worker.log import Redact
from worker.providers import EmbeddingModel, Hooks, build_chat, build_embedder
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
    scope: RunScope  # the run under way: what a provider's retry wait asks
    redact: Redact  # every configured secret, for what a task stores or says
    pid: int

    def close(self) -> None:
        """At the process's end: close the database (no -wal/-shm left behind), the clients."""
        for client in (self.embedder, self.chat):
            if client is not None:
                client.close()
        self.redis.close()
        self.db.close()


def runtime(app: Any) -> Runtime:
    """This process's runtime for `app` (a Celery app made by `worker.app.create_app`)."""
    rt: Runtime | None = getattr(app, "kidx_runtime", None)
    if rt is None or rt.pid != os.getpid():
        configured_at = getattr(app, "kidx_configured_at", None)
        rt = app.kidx_runtime = build_runtime(app.kidx_settings, configured_at=configured_at)
    return rt


def close_runtime(app: Any) -> None:
    rt: Runtime | None = getattr(app, "kidx_runtime", None)
    if rt is not None and rt.pid == os.getpid():
        rt.close()
    app.kidx_runtime = None


def build_runtime(settings: Settings, *, configured_at: float | None = None) -> Runtime:
    """`configured_at`: when the worker read `settings` (a pool process replaced after a
    model switch must not switch the index back: `connect`)."""
    from tasks.metrics import observe_provider

    if settings.embedding.provider == "local":
        _share_cpus(settings.tasks.concurrency)
    db = open_store(settings, configured_at=configured_at)
    scope = RunScope()
    hooks = Hooks(sleep=scope.sleep, observe=observe_provider, cancelled=scope.cancelled)
    client = redis_client(settings)
    chat_streak = SharedStreak(client, chat_streak_key(db.instance()))
    return Runtime(
        settings=settings,
        db=db,
        embedder=build_embedder(settings.embedding, dimensions=db.dimensions, hooks=hooks),
        chat=build_chat(settings.chunk, hooks=hooks, streak=chat_streak),
        reader=Reader(settings.files, settings.urls),
        redis=client,
        scope=scope,
        redact=Redact(settings.secrets()),
        pid=os.getpid(),
    )


def redis_client(settings: Settings) -> redis.Redis:
    """The tasks' Redis client (item locks, revokes, batch streaks). A Redis that accepts and
    then never answers (a hung host, a full network buffer) must not hold a call for good: the
    lock's renewal thread would wait in it while the lock expires under the run. A call gives
    up within a sixth of the lock's TTL, and the renewal tries again (tasks/lock.py)."""
    patience = max(0.5, settings.tasks.lock_ttl / 6)
    return redis_at(settings.broker_url, patience)


def _share_cpus(processes: int) -> None:
    """N pool processes each running torch on every core fight over them: give each its share."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, processes)))
