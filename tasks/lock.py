"""The per-item lock: redis-py's Lock, with a TTL renewed while the task runs.

A task that finds its item locked does not wait (that would hold a worker slot): it leaves a
re-run request and ends `coalesced`; the holder sees the request after its run and runs once
more. The request is written *before* trying the lock and read *after* releasing it, so one
made while a run is under way is never lost. A process killed while holding the lock leaves it
to expire with its TTL; the same task, redelivered, recognises its own stale lock (the token
starts with the task id) and takes it over at once.

Renewal survives Redis blips: only LockError (the lock is no longer this run's) loses it; a
connection error is tried again within a second, and the lock counts as lost only once its TTL
has passed without a renewal.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Iterator

import redis
from redis.exceptions import LockError
from redis.lock import Lock

from worker.log import get_logger

log = get_logger("kidx.tasks")

# Delete KEYS[1] if its value starts with ARGV[1] (a previous run of the same task).
_TAKE_OVER = """
local v = redis.call('get', KEYS[1])
if v and string.sub(v, 1, string.len(ARGV[1])) == ARGV[1] then
  return redis.call('del', KEYS[1])
end
return 0
"""

# A failed renewal is tried again this soon (or at the next tick, if sooner).
RENEW_RETRY = 1.0


def lock_key(space: str, item_id: int) -> str:
    """`space`: the database's instance name (`Database.instance()`): item ids are per
    database, and two databases may share a Redis."""
    return f"kidx:{space}:lock:item:{item_id}"


def memories_key(space: str) -> str:
    """The lock of the run that embeds a database's memories (tasks/memories.py)."""
    return f"kidx:{space}:lock:memories"


def sweep_key(space: str, sweep: str) -> str:
    """The lock of a database's running sweep of one kind (scheduler/tasks.py)."""
    return f"kidx:{space}:lock:sweep:{sweep}"


@contextlib.contextmanager
def only_one(client: redis.Redis, key: str, ttl: float) -> Iterator[bool]:
    """Whether this process holds `key` for the block (not waited for: another holder is doing
    the same work already); it expires after `ttl`, should the process die holding it."""
    lock = client.lock(key, timeout=ttl, thread_local=False)
    if not lock.acquire(blocking=False):
        yield False
        return
    try:
        yield True
    finally:
        with contextlib.suppress(LockError):  # it expired: another run may hold it now
            lock.release()


def rerun_key(space: str, item_id: int) -> str:
    return f"kidx:{space}:rerun:item:{item_id}"


def held(client: redis.Redis, space: str, item_ids: list[int]) -> set[int]:
    """Which of these items a run holds the lock of now (one round trip)."""
    pipe = client.pipeline(transaction=False)
    for item_id in item_ids:
        pipe.exists(lock_key(space, item_id))
    return {i for i, n in zip(item_ids, pipe.execute(), strict=True) if n}


class ItemLock:
    """Held by one task run at a time, for one item."""

    def __init__(
        self, client: redis.Redis, space: str, item_id: int, task_id: str, ttl: int
    ) -> None:
        self.client = client
        self.space = space
        self.item_id = item_id
        self.task_id = task_id
        self.ttl = ttl
        self.key = lock_key(space, item_id)
        self.lock: Lock = client.lock(self.key, timeout=ttl, thread_local=False)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._renewed = 0.0  # monotonic time of the last renewal (or of the acquire)
        self.lost = False

    def request_rerun(self, pipe: redis.client.Pipeline | None = None) -> None:
        """Ask the holder for one more run (on `pipe`, when given, for LockSet)."""
        (pipe or self.client).set(
            rerun_key(self.space, self.item_id), self.task_id, ex=max(self.ttl * 10, 600)
        )

    def take_rerun(self) -> bool:
        """Whether a re-run was requested (and clear the request)."""
        return self.client.getdel(rerun_key(self.space, self.item_id)) is not None

    @property
    def interval(self) -> float:
        """How often a holder renews the lock."""
        return self.ttl / 3

    def acquire(self, *, renew: bool = True) -> bool:
        """Take the lock; `renew=False`: the caller extends it (LockSet: one thread for all)."""
        token = f"{self.task_id}:{uuid.uuid4().hex}"
        self._renewed = time.monotonic()  # before the request: the TTL runs from no later
        if not self.lock.acquire(blocking=False, token=token):
            stale = self.client.eval(_TAKE_OVER, 1, self.key, f"{self.task_id}:")
            if not stale or not self.lock.acquire(blocking=False, token=token):
                return False
            log.warning(
                "took over the lock of an earlier run of this task (its process died)",
                item_id=self.item_id,
                task_id=self.task_id,
            )
        if renew:
            self._stop.clear()
            self._renewer = threading.Thread(target=self._renew, daemon=True, name="kidx-lock")
            self._renewer.start()
        return True

    def extend(self) -> bool:
        """Renew the TTL; whether it was renewed now. A LockError means the lock is no longer
        this run's (expired, taken): `lost`, logged, and the run goes on. A Redis error
        leaves it held, to be renewed at the next try; `lost` only once the TTL has passed
        since the last renewal, when the key has expired and another run may hold it."""
        if self.lost:
            return False
        tried = time.monotonic()
        try:
            self.lock.extend(self.ttl, replace_ttl=True)
        except LockError as e:
            self._lose(str(e))
            return False
        except redis.RedisError as e:
            if tried - self._renewed >= self.ttl:
                self._lose(f"not renewed within its TTL: {e}")
            else:
                log.warning(
                    "could not renew the item lock; trying again",
                    item_id=self.item_id,
                    task_id=self.task_id,
                    reason=str(e),
                )
            return False
        self._renewed = tried
        return True

    def _lose(self, reason: str) -> None:
        self.lost = True
        log.warning(
            "item lock lost while running",
            item_id=self.item_id,
            task_id=self.task_id,
            reason=reason,
        )

    def next_renewal(self, renewed: bool) -> float:
        """Seconds to the next renewal: the interval, or sooner after a failed one."""
        return self.interval if renewed else min(self.interval, RENEW_RETRY)

    def _renew(self) -> None:
        wait = self.interval
        while not self._stop.wait(wait):
            renewed = self.extend()
            if self.lost:
                return
            wait = self.next_renewal(renewed)

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
            self._renewer = None
        try:
            self.lock.release()
        except (LockError, redis.RedisError) as e:  # expired or taken over
            log.warning(
                "item lock was already gone at release",
                item_id=self.item_id,
                task_id=self.task_id,
                reason=str(e),
            )


class LockSet:
    """The locks of a group run's items: taken and released in one round trip to Redis each
    way (pipelines of what ItemLock does alone), renewed by one thread (not one an item)."""

    def __init__(
        self, client: redis.Redis, space: str, item_ids: list[int], task_id: str, ttl: int
    ) -> None:
        self.client = client
        self.space = space
        self.ttl = ttl
        self.task_id = task_id
        self.locks = [ItemLock(client, space, i, task_id, ttl) for i in item_ids]
        self.held: list[ItemLock] = []
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self) -> tuple[list[int], list[int]]:
        """(items locked, items busy): a busy item gets a re-run request, as a single run's.
        Each item's request is written before its lock is tried, as ItemLock does."""
        tokens = [f"{self.task_id}:{uuid.uuid4().hex}" for _ in self.locks]
        now = time.monotonic()
        pipe = self.client.pipeline(transaction=False)
        for lock in self.locks:
            lock.request_rerun(pipe)
        for lock, token in zip(self.locks, tokens, strict=True):
            pipe.set(lock.key, token, nx=True, px=self.ttl * 1000)
        taken = pipe.execute()[len(self.locks) :]
        busy = []
        for lock, token, ok in zip(self.locks, tokens, taken, strict=True):
            if ok:  # as redis-py's Lock.acquire records its token, for release and extend
                lock.lock.local.token = self.client.get_encoder().encode(token)
                lock._renewed = now
                self.held.append(lock)
            elif lock.acquire(renew=False):  # a stale lock of this task's earlier run
                self.held.append(lock)
            else:
                busy.append(lock.item_id)
        pipe = self.client.pipeline(transaction=False)
        for lock in self.held:  # this run covers every request made until now
            pipe.getdel(rerun_key(self.space, lock.item_id))
        pipe.execute()
        self._renewer = threading.Thread(target=self._renew, daemon=True, name="kidx-locks")
        self._renewer.start()
        return [lock.item_id for lock in self.held], busy

    def _renew(self) -> None:
        interval = self.ttl / 3
        wait = interval
        while not self._stop.wait(wait):
            renewed = [lock.extend() for lock in list(self.held) if not lock.lost]
            wait = interval if all(renewed) else min(interval, RENEW_RETRY)

    def take_reruns(self) -> list[int]:
        """The held items someone asked to run again since the lock was taken (the requests
        are cleared: this run covers them)."""
        if not self.held:
            return []
        pipe = self.client.pipeline(transaction=False)
        for lock in self.held:
            pipe.getdel(rerun_key(self.space, lock.item_id))
        asked = pipe.execute()
        return [lock.item_id for lock, a in zip(self.held, asked, strict=True) if a is not None]

    def release_one(self, item_id: int) -> None:
        """Let one item go before the others (a run of its own is coming for it)."""
        for lock in self.held:
            if lock.item_id == item_id:
                self.held.remove(lock)
                lock.release()
                return

    def release(self) -> list[int]:
        """Release every lock held; returns the items whose re-run was asked for meanwhile
        (read after the release, as ItemLock's caller does)."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
        if not self.held:
            return []
        pipe = self.client.pipeline(transaction=False)
        for lock in self.held:
            lock.lock.lua_release(keys=[lock.lock.name], args=[lock.lock.local.token], client=pipe)
        released = pipe.execute(raise_on_error=False)
        for lock, ok in zip(self.held, released, strict=True):
            if ok is not True and ok != 1:  # expired or taken over
                log.warning(
                    "item lock was already gone at release",
                    item_id=lock.item_id,
                    task_id=self.task_id,
                    reason=str(ok),
                )
        pipe = self.client.pipeline(transaction=False)
        for lock in self.held:
            pipe.getdel(rerun_key(self.space, lock.item_id))
        asked = pipe.execute()
        return [lock.item_id for lock, a in zip(self.held, asked, strict=True) if a is not None]
