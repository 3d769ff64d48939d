"""Failed provider requests in a row, shared by every worker process (the engine's `Streak`,
kept in Redis):

* a batch's (`streak_key`): a dead embedding provider stops the whole batch after three failed
  requests, plus at most the one each process already had in flight, rather than three a group;
* the chunk model's (`chat_streak_key`): a chunk model taken for down by one process is by all
  (`KIDX_CHUNK__DOWN_AFTER` failed calls in all, not that many in each process).

Redis not answering does not fail a run: the count is then the run's own, as with no batch.
Nor does another program's value at the key (a string where the hash goes, a count that is no
integer): the run counts its own, says once which key to delete, and leaves the value as it is.
The key names the database (its `Database.instance()`) as well as the batch (batch ids are per
database, and two kidx databases may share a Redis), and expires a day after its last change.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from tasks.lock import conflict, wrong_type
from worker.embedding import Streak
from worker.log import get_logger

log = get_logger("kidx.tasks")

TTL_SECONDS = 86_400
# How long a process counts its own after meeting another program's value at the key.
FOREIGN_RETRY_S = 60.0


def streak_key(space: str, batch_id: int) -> str:
    return f"kidx:{space}:streak:batch:{batch_id}"


def chat_streak_key(space: str) -> str:
    return f"kidx:{space}:streak:chat"


class SharedStreak(Streak):
    """The shared count: a hash of `n` (failed requests in a row) and `cause` (the last one).
    Thread-safe as its Redis client is (the chunk model's is asked from one thread a run)."""

    def __init__(
        self, client: redis.Redis, key: str, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.client, self.key, self.clock = client, key, clock
        self._foreign_at: float | None = None  # when another program's value was met there
        self._said = False

    @property
    def foreign(self) -> bool:
        """Another program's value at the key, met in the last `FOREIGN_RETRY_S`: the count is
        this process's own. Then the key is tried again (a chunk model's streak lives as long
        as its process: once met, the shared count was never used again, even after the
        value was deleted as the log asked)."""
        if self._foreign_at is not None and self.clock() - self._foreign_at >= FOREIGN_RETRY_S:
            self._foreign_at = None
        return self._foreign_at is not None

    def _not_ours(self, e: redis.RedisError | ValueError) -> None:
        """Whether `e` says the key holds what kidx did not write (another type, a count that
        is no integer): the run's own count from then on, said once (the value is not kidx's
        to delete). Any other error is Redis not answering now: the next call tries again."""
        kind = wrong_type(e)
        if kind is None and "not an integer" not in str(e) and not isinstance(e, ValueError):
            return
        self._foreign_at = self.clock()
        if not self._said:
            self._said = True
            problem = str(conflict(self.client, self.key, kind or "count that is no integer"))
            log.error(f"{problem}; until then each run counts its own failed requests")

    def current(self) -> tuple[int, str]:
        if self.foreign:
            return super().current()
        try:
            n, cause = self.client.hmget(self.key, "n", "cause")
            return int(n or 0), (cause or b"").decode("utf-8", "replace")
        except (redis.RedisError, ValueError) as e:
            self._not_ours(e)
        return super().current()

    def failed(self, cause: str) -> int:
        mine = super().failed(cause)
        if self.foreign:
            return mine
        try:
            pipe = self.client.pipeline()  # MULTI/EXEC: the count and its cause together
            pipe.hincrby(self.key, "n", 1)
            pipe.hset(self.key, "cause", cause[:500])
            pipe.expire(self.key, TTL_SECONDS)
            n, _, _ = pipe.execute()
        except redis.RedisError as e:
            self._not_ours(e)
            return mine
        return int(n)

    def since_failure(self) -> float | None:
        """From the key's time to live, which every failed request sets to TTL_SECONDS (Redis's
        clock: no two hosts' clocks compared); None when Redis does not say."""
        if self.foreign:
            return None
        try:
            left = self.client.pttl(self.key)
        except redis.RedisError as e:
            self._not_ours(e)
            return None
        if not isinstance(left, int) or left < 0:
            return None
        return max(0.0, TTL_SECONDS - left / 1000)

    def ok(self) -> None:
        super().ok()
        if self.foreign:
            return
        try:  # after every request that succeeded
            self.client.pipeline().hset(self.key, "n", 0).expire(self.key, TTL_SECONDS).execute()
        except redis.RedisError as e:
            self._not_ours(e)
