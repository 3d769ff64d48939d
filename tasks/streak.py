"""A batch's failed provider requests in a row, shared by its runs in every worker process (the
engine's `Streak`, kept in Redis): a dead provider stops the whole batch after three failed
requests, plus at most the one each process already had in flight, rather than three a group.

Redis not answering does not fail a run: the count is then the run's own, as with no batch.
The key names the database (its `Database.instance()`) as well as the batch (batch ids are per
database, and two kidx databases may share a Redis), and expires a day after its last change.
"""

from __future__ import annotations

import contextlib

import redis

from worker.embedding import Streak

TTL_SECONDS = 86_400


def streak_key(space: str, batch_id: int) -> str:
    return f"kidx:{space}:streak:batch:{batch_id}"


class BatchStreak(Streak):
    """The shared count: a hash of `n` (failed requests in a row) and `cause` (the last one)."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        super().__init__()
        self.client, self.key = client, key

    def current(self) -> tuple[int, str]:
        try:
            n, cause = self.client.hmget(self.key, "n", "cause")
        except redis.RedisError:
            return super().current()
        return int(n or 0), (cause or b"").decode("utf-8", "replace")

    def failed(self, cause: str) -> int:
        mine = super().failed(cause)
        try:
            pipe = self.client.pipeline()  # MULTI/EXEC: the count and its cause together
            pipe.hincrby(self.key, "n", 1)
            pipe.hset(self.key, "cause", cause[:500])
            pipe.expire(self.key, TTL_SECONDS)
            n, _, _ = pipe.execute()
        except redis.RedisError:
            return mine
        return int(n)

    def ok(self) -> None:
        super().ok()
        with contextlib.suppress(redis.RedisError):  # after every request that succeeded
            self.client.pipeline().hset(self.key, "n", 0).expire(self.key, TTL_SECONDS).execute()
