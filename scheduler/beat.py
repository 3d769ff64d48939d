"""A beat that only sends while it holds a Redis lease, so that a second beat does nothing.

    celery -A worker.app beat --scheduler scheduler.beat:LeaderScheduler

Every tick refreshes a heartbeat key (`kidx doctor` reads it) and takes or renews the lease; a
beat that does not hold it sends nothing and checks again shortly. A beat that dies loses the
lease after its TTL, and another takes over.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Any

import redis
from celery.beat import PersistentScheduler

from tasks.lock import NEVER_EXPIRES, conflict, wrong_type
from tasks.redis_at import redis_at
from worker.log import get_logger

log = get_logger("kidx.beat")

LEASE_KEY = "kidx:beat:leader"
HEARTBEAT_KEY = "kidx:beat:heartbeat"
LEASE_TTL = 30  # seconds
TICK = 5.0  # the longest sleep between ticks, so the lease is renewed well within its TTL

# Renew the lease if we hold it; take it if it is free. -1: a value that never expires is
# there, no beat's lease (each is set with a TTL): another program's, or one made persistent;
# taken for another beat's, it stopped every sweep for good.
_LEASE = """
local v = redis.call('get', KEYS[1])
if v == ARGV[1] or not v then
  redis.call('set', KEYS[1], ARGV[1], 'EX', ARGV[2])
  return 1
end
if redis.call('pttl', KEYS[1]) == -1 then
  return -1
end
return 0
"""
# Give the lease up only if we still hold it, in one step (a GET then a DELETE could delete
# the lease another beat took in between, once ours had expired).
_RELEASE = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""


class LeaderScheduler(PersistentScheduler):
    """PersistentScheduler that sends only while it leads (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.identity = f"{socket.gethostname()}:{os.getpid()}"
        # A Redis that stops answering must not stop beat's loop for good: a tick that
        # cannot reach it sends nothing (`_lead`), and tries again at the next.
        self.redis = redis_at(self.app.conf.broker_url, TICK)
        self.leading: bool | None = None  # unknown until the first tick: both states are logged
        self.foreign = False  # another program's value at the lease key (said once)

    def _lead(self) -> bool:
        try:
            self.redis.set(HEARTBEAT_KEY, f"{time.time():.0f} {self.identity}", ex=LEASE_TTL * 2)
            answer = self.redis.eval(_LEASE, 1, LEASE_KEY, self.identity, LEASE_TTL)
        except redis.RedisError as e:
            if wrong_type(e) is None:
                log.warning("beat cannot reach Redis; not sending", reason=str(e))
            else:  # not a Redis away: said once, not every tick
                self._foreign(wrong_type(e) or "")
            got = False
        else:
            got = answer == 1
            if answer == -1:
                self._foreign(NEVER_EXPIRES)
            else:
                self.foreign = False
        if got != self.leading:
            log.info(
                "beat leads" if got else "beat follows (another beat leads)", identity=self.identity
            )
            self.leading = got
        return got

    def _foreign(self, kind: bytes | str) -> None:
        if self.foreign:
            return
        self.foreign = True
        if kind != NEVER_EXPIRES:
            with contextlib.suppress(redis.RedisError):
                kind = self.redis.type(LEASE_KEY)
        log.error(f"{conflict(self.redis, LEASE_KEY, kind)}; beat sends nothing until then")

    def tick(self, *args: Any, **kwargs: Any) -> float:
        if not self._lead():
            return TICK
        return min(super().tick(*args, **kwargs), TICK)

    def close(self) -> None:
        if self.leading:
            with contextlib.suppress(redis.RedisError):
                self.redis.eval(_RELEASE, 1, LEASE_KEY, self.identity)
        super().close()
