"""The item lock (tasks/lock.py) under the faults it must survive: a Redis blip while it is
renewed. In this process, against the real Redis (this test process's database,
tests/stack.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from stack import broker_url, wait_for
from tasks.lock import ItemLock, LockSet, lock_key


class Blippy(redis.Redis):
    """A client whose next `failures` script calls (a lock's EXTEND) meet a connection error,
    as in a blip; counts the calls that fail and those that succeed after the first failure."""

    failures = 0
    failed = 0
    after = 0

    def evalsha(self, *args: Any, **kwargs: Any) -> Any:
        if self.failures:
            self.failures -= 1
            self.failed += 1
            raise redis.ConnectionError("simulated blip: connection reset by peer")
        answer = super().evalsha(*args, **kwargs)
        if self.failed:
            self.after += 1
        return answer


@pytest.fixture
def client() -> Iterator[Blippy]:
    """A client of this test process's Redis database; the test's keys (its own lock space,
    SPACE) are deleted afterwards, and nothing else: the module's stack shares the database."""
    c = Blippy.from_url(broker_url())
    yield c
    for key in c.scan_iter(f"kidx:{SPACE}:*"):
        c.delete(key)
    c.close()


SPACE = f"locks-test-{uuid.uuid4().hex[:8]}"


def test_a_redis_blip_while_renewing_does_not_lose_the_lock(client: Blippy) -> None:
    """One EXTEND met a connection error and the lock was never renewed again: it expired
    under a live run and another task took the item. It is tried again, and stays held."""
    locks = LockSet(client, SPACE, [1], "task-a", ttl=3)
    assert locks.acquire() == ([1], [])
    try:
        client.failures = 1  # the next renewal meets the blip; Redis answers right after
        lock = locks.held[0]
        # three renewals after the blip: the lock has outlived the TTL it was taken with
        wait_for(lambda: client.after >= 3 or lock.lost, 15, "renewals after the blip")
        assert client.failed == 1 and not lock.lost
        assert client.pttl(lock_key(SPACE, 1)) > 0
        other = LockSet(redis.Redis.from_url(broker_url()), SPACE, [1], "task-b", ttl=3)
        held, busy = other.acquire()
        other.release()
        assert (held, busy) == ([], [1])  # still this run's
    finally:
        asked = locks.release()
    assert list(asked) == [1]  # the other task's request


def test_renewal_gives_up_only_when_the_ttl_has_passed(client: Blippy) -> None:
    """Redis away for good: the lock is tried again until its TTL has passed without a
    renewal (it has expired then, and another run may hold it), not given up at once."""
    lock = ItemLock(client, SPACE, 2, "task-c", ttl=3)
    assert lock.acquire()
    try:
        client.failures = 10**6
        wait_for(lambda: lock.lost, 15, "the lock to be given up")
        assert client.failed >= 2  # tried again before giving up
    finally:
        client.failures = 0
        lock.release()


def test_a_lock_taken_by_another_is_lost_at_once(client: Blippy) -> None:
    lock = ItemLock(client, SPACE, 3, "task-d", ttl=3)
    assert lock.acquire()
    try:
        client.set(lock_key(SPACE, 3), "another-run:token", px=60_000)  # expired and taken
        wait_for(lambda: lock.lost, 10, "the lock to be lost")
        assert client.failed == 0
    finally:
        lock.release()
    assert client.get(lock_key(SPACE, 3)) == b"another-run:token"  # not released: not ours
