"""The per-item lock: redis-py's Lock, with a TTL renewed while the task runs.

A task that finds its item locked does not wait (that would hold a worker slot): it leaves a
re-run request and ends `coalesced`; the holder sees the request after its run and runs once
more. The request is written *before* trying the lock and read *after* releasing it, so one
made while a run is under way is never lost.

A lock's token names its holder: the task id, the host, the process id and that process's start
time. A process killed while holding the lock leaves it to expire with its TTL; the same task,
redelivered, takes its own lock over at once only when the holder is provably gone: its process
has ended (same host), or the key has gone unrenewed for two renew intervals (a live holder
renews it every third of the TTL). A second delivery of a task whose first is still running
(at-least-once delivery) finds a live holder and ends `coalesced`, as with any other holder.

Renewal survives Redis blips: only LockError (the lock is no longer this run's) loses it; a
connection error is tried again within a second, and the lock counts as lost only once its TTL
has passed without a renewal.

A host application may share the Redis database and leave a value of another type at one of
these keys (a list at a lock key, a hash at a re-run request's), or a string that never expires
at a lock key. That is not a lock or a request kidx made, and not kidx's to delete: the item
is refused (`LockSet.refused`, a `KeyConflict` naming the key and what to do) and nothing is
written over the value.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis
from redis.exceptions import LockError
from redis.lock import Lock

from worker.errors import KeyConflict
from worker.log import get_logger

log = get_logger("kidx.tasks")

# Delete KEYS[1] if it still holds the token ARGV[1] (read and judged stale by the caller), and
# either its holder's process is gone (ARGV[2] == '1') or its remaining TTL is still under
# ARGV[3] ms: checked here, atomically, so that a holder renewing meanwhile keeps its lock.
_TAKE_OVER = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then
  return 0
end
if ARGV[2] ~= '1' then
  local left = redis.call('pttl', KEYS[1])
  if left < 0 or left >= tonumber(ARGV[3]) then
    return 0
  end
end
return redis.call('del', KEYS[1])
"""

# Ask for a re-run (KEYS[1]: the request, ARGV: the asking task, the TTL in seconds) unless the
# key holds a value of another type, which is not kidx's to write over: a WRONGTYPE error.
_REQUEST = """
local kind = redis.call('type', KEYS[1]).ok
if kind ~= 'none' and kind ~= 'string' then
  return redis.error_reply('WRONGTYPE ' .. kind)
end
return redis.call('set', KEYS[1], ARGV[1], 'EX', ARGV[2])
"""

# How long a re-run request waits for the run holding the item, in seconds, at least: that run
# may last as long as its time limit (`keep`: the asker's time limit and lock TTL), or, inline
# from the CLI, as long as it takes. A request no run takes is taken by the item's next run.
REQUEST_KEPT = 86_400

# What a key kidx keeps a lock or a request in may hold (TYPE's answer): a string, or nothing.
OURS = (b"string", b"none")


NEVER_EXPIRES = "string that never expires"  # what a lock of kidx's never is


def not_a_lock(kind: bytes, left: object) -> bytes | str | None:
    """What a lock key holds, when it is provably no lock kidx took (TYPE's and PTTL's answers):
    a value of another type, or a string that never expires (kidx's locks are always set with
    a TTL, renewed with one); None for a lock, or nothing."""
    if kind not in OURS:
        return kind
    if kind == b"string" and left == -1:
        return NEVER_EXPIRES
    return None


# A failed renewal is tried again this soon (or at the next tick, if sooner).
RENEW_RETRY = 1.0

_me: tuple[int, str] | None = None  # (pid, holder) of this process: a fork has its own


def _stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[-1].split()


def _host() -> str:
    """This host, as a token names it: containers sharing a host name (host networking) do not
    share a pid namespace, so its id goes with the name."""
    name = socket.gethostname()
    with contextlib.suppress(OSError):
        name += "/" + os.readlink("/proc/self/ns/pid").strip("pid:[]")
    return name.replace(":", "_")


def holder() -> str:
    """This process as a lock token names it: `host:pid:start` (the start time tells a reused
    pid from the holder's; empty where /proc is not there)."""
    global _me
    pid = os.getpid()
    if _me is None or _me[0] != pid:
        fields = _stat(pid)
        start = fields[19] if fields and len(fields) > 19 else ""
        _me = (pid, f"{_host()}:{pid}:{start}")
    return _me[1]


def make_token(task_id: str) -> str:
    return f"{task_id}:{holder()}:{uuid.uuid4().hex}"


def holder_gone(token: str, task_id: str) -> bool:
    """Whether `token` is one of `task_id`'s and the process holding it has ended: on this
    host, the pid is no more, a zombie, or another process's (its start time differs).
    False when that cannot be known (another host, a token of another form)."""
    parts = token.rsplit(":", 4)
    if len(parts) != 5 or parts[0] != task_id or parts[1] != _host():
        return False
    try:
        pid = int(parts[2])
    except ValueError:
        return False
    if pid == os.getpid():
        return False  # this very process: a run of it holds the lock
    fields = _stat(pid)
    if fields is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False  # alive, another user's
        return False
    return fields[0] in ("Z", "X") or (bool(parts[3]) and fields[19] != parts[3])


def conflict(client: redis.Redis, key: str, kind: bytes | str) -> KeyConflict:
    """The error for `key` holding a value of another type (`kind`, TYPE's answer): what to do,
    in one line."""
    kind = kind.decode() if isinstance(kind, bytes) else kind
    db = client.connection_pool.connection_kwargs.get("db", 0)
    return KeyConflict(
        f"Redis key {key} holds a {kind}, not what kidx keeps there: another program wrote it, "
        f"and kidx neither uses nor deletes it; find what wrote it, then delete the key "
        f"(redis-cli -n {db} DEL {key})"
    )


def wrong_type(answer: object) -> str | None:
    """The type named by a WRONGTYPE error among a pipeline's answers (`_REQUEST`'s `list`, or
    Redis's own `WRONGTYPE Operation against a key ...`, which redis-py's MULTI/EXEC puts
    after `Command # 1 (...) of pipeline caused error: `), or None for any other answer."""
    if not isinstance(answer, redis.ResponseError):
        return None
    text = str(answer)
    _, wrapped, inner = text.partition(" of pipeline caused error: ")
    words = (inner if wrapped else text).split()
    if not words or words[0] != "WRONGTYPE":
        return None
    return words[1] if len(words) == 2 else "value of another type"


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
    the same work already); it expires after `ttl`, should the process die holding it.
    KeyConflict when the key holds what is no lock (`not_a_lock`): no holder will ever
    release it, and skipping every run as "another one is running" would hide that for good."""
    lock = client.lock(key, timeout=ttl, thread_local=False)
    if not lock.acquire(blocking=False):
        kind, left = client.pipeline(transaction=True).type(key).pttl(key).execute()
        if (what := not_a_lock(kind, left)) is not None:
            raise conflict(client, key, what)
        yield False
        return
    try:
        yield True
    finally:
        try:
            lock.release()
        except LockError:  # it expired: another run may hold it now
            pass
        except redis.RedisError as e:  # it expires by itself; the sweep's outcome is what counts
            log.warning("a sweep lock could not be released", key=key, reason=str(e))


def rerun_key(space: str, item_id: int) -> str:
    return f"kidx:{space}:rerun:item:{item_id}"


def held(client: redis.Redis, space: str, item_ids: list[int]) -> set[int]:
    """Which of these items a run holds the lock of now (one round trip): what is no lock
    (`not_a_lock`: its item's run is refused) is not held."""
    pipe = client.pipeline(transaction=False)
    for item_id in item_ids:
        pipe.type(lock_key(space, item_id))
        pipe.pttl(lock_key(space, item_id))
    answers = pipe.execute()
    return {
        i
        for n, i in enumerate(item_ids)
        if answers[2 * n] == b"string" and not_a_lock(answers[2 * n], answers[2 * n + 1]) is None
    }


class ItemLock:
    """Held by one task run at a time, for one item."""

    def __init__(
        self,
        client: redis.Redis,
        space: str,
        item_id: int,
        task_id: str,
        ttl: int,
        *,
        keep: int = REQUEST_KEPT,
    ) -> None:
        self.client = client
        self.space = space
        self.item_id = item_id
        self.task_id = task_id
        self.ttl = ttl
        self.keep = keep
        self.key = lock_key(space, item_id)
        self.lock: Lock = client.lock(self.key, timeout=ttl, thread_local=False)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None
        self._renewed = 0.0  # monotonic time of the last renewal (or of the acquire)
        self.lost = False

    def request_rerun(self, pipe: redis.client.Pipeline | None = None) -> None:
        """Ask the holder for one more run (on `pipe`, when given, for LockSet, whose answer is
        then a WRONGTYPE error for a key holding a value of another type; else KeyConflict)."""
        key = rerun_key(self.space, self.item_id)
        try:
            kept = max(self.ttl * 10, self.keep)
            (pipe or self.client).eval(_REQUEST, 1, key, self.task_id, kept)
        except redis.ResponseError as e:
            if (kind := wrong_type(e)) is None:
                raise
            raise conflict(self.client, key, kind) from None

    def take_rerun(self) -> bool:
        """Whether a re-run was requested (and clear the request)."""
        return self.client.getdel(rerun_key(self.space, self.item_id)) is not None

    @property
    def interval(self) -> float:
        """How often a holder renews the lock."""
        return self.ttl / 3

    def acquire(self, *, renew: bool = True) -> bool:
        """Take the lock; `renew=False`: the caller extends it (LockSet: one thread for all)."""
        token = make_token(self.task_id)
        self._renewed = time.monotonic()  # before the request: the TTL runs from no later
        if not self.lock.acquire(blocking=False, token=token):
            why = self._take_over()
            if why is None or not self.lock.acquire(blocking=False, token=token):
                return False
            log.warning(
                f"took over the lock of an earlier run of this task ({why})",
                item_id=self.item_id,
                task_id=self.task_id,
            )
        if renew:
            self._stop.clear()
            self._renewer = threading.Thread(target=self._renew, daemon=True, name="kidx-lock")
            self._renewer.start()
        return True

    def _take_over(self) -> str | None:
        """Delete the lock if an earlier run of this task holds it and is provably gone; why,
        or None (a live holder, another task's, or the lock changed meanwhile). A live holder
        is a second delivery's first run, still going: taking its lock would have both index
        the item at once, and the older read could write last."""
        pipe = self.client.pipeline(transaction=True)
        pipe.type(self.key)
        pipe.get(self.key)
        pipe.pttl(self.key)
        kind, value, left = pipe.execute(raise_on_error=False)
        if (what := not_a_lock(kind, left)) is not None:  # nobody will release it; not kidx's
            raise conflict(self.client, self.key, what)
        if value is None or isinstance(value, Exception):
            return None
        # (another program's bytes: not this task's, never a UnicodeDecodeError for the group)
        token = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
        if token.rsplit(":", 4)[0] != self.task_id:
            return None
        gone = holder_gone(token, self.task_id)
        # Unrenewed for two intervals: its TTL is below one (a renewal resets it to the TTL).
        floor = int(self.ttl * 1000 - 2 * self.interval * 1000)
        if not gone and not 0 <= left < floor:
            return None
        if not self.client.eval(_TAKE_OVER, 1, self.key, token, "1" if gone else "0", floor):
            return None
        return "its process has ended" if gone else "it was no longer renewed"

    def extend(self) -> bool:
        """Renew the TTL; whether it was renewed now. A LockError means the lock is no longer
        this run's (expired, taken): `lost`, logged, and the run goes on. A Redis error
        leaves it held, to be renewed at the next try; `lost` only once the TTL has passed
        since the last renewal, when the key has expired and another run may hold it. A value
        of another type written over the lock (WRONGTYPE) is no lock of this run's: lost."""
        if self.lost:
            return False
        tried = time.monotonic()
        try:
            self.lock.extend(self.ttl, replace_ttl=True)
        except LockError as e:
            self._lose(str(e))
            return False
        except redis.RedisError as e:
            if wrong_type(e) is not None:  # another program's value now: certainly not ours
                self._lose(f"{self.key} now holds a value of another type ({e})")
                return False
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
        self,
        client: redis.Redis,
        space: str,
        item_ids: list[int],
        task_id: str,
        ttl: int,
        *,
        keep: int = REQUEST_KEPT,
    ) -> None:
        self.client = client
        self.space = space
        self.ttl = ttl
        self.task_id = task_id
        self.locks = [ItemLock(client, space, i, task_id, ttl, keep=keep) for i in item_ids]
        self.held: list[ItemLock] = []
        self.refused: dict[int, str] = {}  # item -> why it cannot be locked (KeyConflict)
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    def acquire(self) -> tuple[list[int], list[int]]:
        """(items locked, items busy): a busy item gets a re-run request, as a single run's.
        Each item's request is written before its lock is tried, as ItemLock does. An item
        whose lock key holds what is no lock (`not_a_lock`), or whose request key a value of
        another type, is neither: it is `refused` (item -> the KeyConflict's line), and the
        value is left as it is."""
        tokens = [make_token(self.task_id) for _ in self.locks]
        try:
            return self._acquire(tokens)
        except BaseException:
            # A timeout or a foreign value halfway: the locks set so far are given back (each
            # only if it still holds its token), or they stayed with no run behind them and
            # every task asking for those items ended `coalesced` onto nothing.
            # In one round trip (one each timed out in turn: 128 items, 5 s, ten minutes):
            # a lock taken over from this task's earlier run holds a token of its own.
            pipe = self.client.pipeline(transaction=False)
            for lock, token in zip(self.locks, tokens, strict=True):
                for held in {token.encode(), lock.lock.local.token or token.encode()}:
                    lock.lock.lua_release(keys=[lock.key], args=[held], client=pipe)
            self.held = []
            with contextlib.suppress(redis.RedisError):
                pipe.execute(raise_on_error=False)
            raise

    def _acquire(self, tokens: list[str]) -> tuple[list[int], list[int]]:
        now = time.monotonic()
        pipe = self.client.pipeline(transaction=False)
        for lock, token in zip(self.locks, tokens, strict=True):
            lock.request_rerun(pipe)
            pipe.set(lock.key, token, nx=True, px=self.ttl * 1000)
            pipe.type(lock.key)
            pipe.pttl(lock.key)
        answers = pipe.execute(raise_on_error=False)
        busy = []
        for i, (lock, token) in enumerate(zip(self.locks, tokens, strict=True)):
            asked, ok, kind, left = answers[4 * i : 4 * i + 4]
            for answer in (asked, ok, kind, left):  # but a wrong type: as before, raised
                if isinstance(answer, Exception) and wrong_type(answer) is None:
                    raise answer
            if (bad := wrong_type(asked)) is not None:
                problem = conflict(self.client, rerun_key(self.space, lock.item_id), bad)
                if ok is True:  # taken all the same: given back at once
                    lock.lock.lua_release(keys=[lock.key], args=[token], client=self.client)
                self.refused[lock.item_id] = str(problem)
            elif ok is True:  # as redis-py's Lock.acquire records its token, for release and extend
                lock.lock.local.token = self.client.get_encoder().encode(token)
                lock._renewed = now
                self.held.append(lock)
            elif (what := not_a_lock(kind, left)) is not None:
                self.refused[lock.item_id] = str(conflict(self.client, lock.key, what))
            else:
                try:
                    taken = lock.acquire(renew=False)  # a stale lock of this task's earlier run
                except KeyConflict as e:  # written there meanwhile
                    self.refused[lock.item_id] = str(e)
                    continue
                if taken:
                    self.held.append(lock)
                else:
                    busy.append(lock.item_id)
        pipe = self.client.pipeline(transaction=False)
        for lock in self.held:  # this run covers every request made until now
            pipe.getdel(rerun_key(self.space, lock.item_id))
        _requests(self.held, pipe.execute(raise_on_error=False))
        self._renewer = threading.Thread(target=self._renew, daemon=True, name="kidx-locks")
        self._renewer.start()
        return [lock.item_id for lock in self.held], busy

    def _renew(self) -> None:
        interval = self.ttl / 3
        wait = interval
        while not self._stop.wait(wait):
            renewed = [lock.extend() for lock in list(self.held) if not lock.lost]
            wait = interval if all(renewed) else min(interval, RENEW_RETRY)

    def take_reruns(self) -> dict[int, str]:
        """The held items someone asked to run again since the lock was taken, each with the
        id of the task that asked (the requests are cleared: this run covers them)."""
        if not self.held:
            return {}
        pipe = self.client.pipeline(transaction=False)
        for lock in self.held:
            pipe.getdel(rerun_key(self.space, lock.item_id))
        # (every answer read, as at release: one key of another type raised before the others'
        # answers were looked at, and the requests their GETDEL had cleared were lost)
        return _requests(self.held, pipe.execute(raise_on_error=False))

    def release_one(self, item_id: int) -> None:
        """Let one item go before the others (a run of its own is coming for it)."""
        for lock in self.held:
            if lock.item_id == item_id:
                self.held.remove(lock)
                lock.release()
                return

    def release(self) -> dict[int, str]:
        """Release every lock held; returns the items whose re-run was asked for meanwhile,
        each with the id of the task that asked (read after the release, as ItemLock's caller
        does)."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(timeout=5)
        if not self.held:
            return {}
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
        return _requests(self.held, pipe.execute(raise_on_error=False))


def _requests(locks: list[ItemLock], asked: list[Any]) -> dict[int, str]:
    """item -> the task id that asked for its re-run (a request's value), for those asked. A
    request key that another program filled with a value of another type since it was asked
    for (a WRONGTYPE answer) is logged, left, and taken as a request from an unknown task:
    a re-run of an item that did not change costs one look at the database, and a lost one
    would leave an edit unindexed. Any other error is raised, after the whole answer is read."""
    found: dict[int, str] = {}
    for lock, a in zip(locks, asked, strict=True):
        if isinstance(a, Exception):
            if wrong_type(a) is None:
                raise a
            key = rerun_key(lock.space, lock.item_id)
            log.error(
                str(conflict(lock.client, key, wrong_type(a) or "value of another type")),
                item_id=lock.item_id,
                task_id=lock.task_id,
            )
            found[lock.item_id] = ""
        elif a is not None:
            found[lock.item_id] = a.decode(errors="replace") if isinstance(a, bytes) else str(a)
    return found
