"""kidx's own Redis clients (locks, revokes, streaks, sweeps, beat's lease, the CLI's checks):
each call gives up within its timeout, in one attempt.

Whether redis-py retries a call that timed out is a default that has changed between its
versions and differs by how a client is made: in 8.2 a client from `Redis(...)` retries ten
times, reconnecting (against a Redis that accepts and never answers, one call with a 0.2 s
timeout took 6 s and eleven connections), one from `Redis.from_url` not at all. With retries,
an item lock's renewal (a 10 s timeout) would wait minutes while the lock expired under the
run. So the policy is set here: a timeout is not retried; a refused or dropped connection is,
once, at once (a Redis restarting)."""

from __future__ import annotations

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry


def redis_at(url: str, timeout: float | None) -> redis.Redis:
    """A client of the Redis at `url` whose calls give up after `timeout` seconds (connecting
    included); None: never (only where a blocking wait is meant)."""
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout,
        socket_connect_timeout=timeout,
        retry=Retry(NoBackoff(), 1, supported_errors=(redis.ConnectionError,)),
    )
