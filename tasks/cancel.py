"""Cancellation is a revoke, not a failure.

Celery's plain `revoke()` does not reach a running task, and `terminate=True` sends its process
SIGTERM, mid-write. So:

* Every worker's `revoke` remote-control command (the one `kidx cancel` and Flower's revoke
  button send) is Celery's own, wrapped: it first records the task id in Redis, where the
  running task looks between steps, then calls Celery's handler (which keeps revokes of queued
  tasks, and with `--statedb` across restarts).
* While a task runs, SIGTERM sets a flag instead of killing it mid-write: the run stops at its
  next step (within one provider call), rolls back, and the task marks itself REVOKED. With no
  task running, SIGTERM does what it always did.
* The check also covers waiting: a provider's backoff sleeps on the token, not on time.sleep.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis
from celery.utils.functional import maybe_list
from celery.worker import control

from worker.errors import Cancelled
from worker.log import get_logger

log = get_logger("kidx.tasks")

REVOKED_TTL = 7 * 24 * 3600
TERMINATED = threading.Event()  # set by SIGTERM in a pool process while a task runs
_running = threading.Event()


def revoked_key(task_id: str) -> str:
    return f"kidx:revoked:{task_id}"


def mark_revoked(client: redis.Redis, task_ids: list[str]) -> None:
    for task_id in task_ids:
        client.set(revoked_key(task_id), "1", ex=REVOKED_TTL)


class CancelToken:
    """Whether this task run was cancelled; callable, as the pipeline's `cancel` check."""

    def __init__(self, client: redis.Redis, task_id: str, *, poll: float = 0.25) -> None:
        self.client = client
        self.task_id = task_id
        self.poll = poll
        self._checked = 0.0
        self._cancelled = False

    def __call__(self) -> bool:
        if self._cancelled or TERMINATED.is_set():
            self._cancelled = True
            return True
        now = time.monotonic()
        if now - self._checked >= self.poll:
            self._checked = now
            try:
                self._cancelled = bool(self.client.exists(revoked_key(self.task_id)))
            except redis.RedisError:
                return False  # Redis away: carry on; the lock and the result need it anyway
        return self._cancelled

    def sleep(self, seconds: float) -> None:
        """Wait like time.sleep, but end with Cancelled as soon as the run is cancelled."""
        deadline = time.monotonic() + seconds
        while True:
            if self():
                raise Cancelled("cancelled while waiting to retry the provider")
            left = deadline - time.monotonic()
            if left <= 0:
                return
            TERMINATED.wait(min(left, self.poll))


class RunScope:
    """The cancel token of the run under way in this process, for what is built once a process:
    a provider's wait before a retry (its `Hooks.sleep`) ends as soon as that run is cancelled."""

    def __init__(self) -> None:
        self.token: CancelToken | None = None

    def sleep(self, seconds: float) -> None:
        token = self.token
        if token is None:
            time.sleep(seconds)
        else:
            token.sleep(seconds)

    @contextmanager
    def running(self, token: CancelToken) -> Iterator[None]:
        self.token = token
        try:
            yield
        finally:
            self.token = None


@contextmanager
def running() -> Iterator[None]:
    """The span in which SIGTERM cancels the task instead of ending the process.

    The handler is installed here, per run, not when the pool process starts: billiard resets
    SIGTERM to its own exit handler after Celery's process-init signal has been sent.
    """
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if in_main else None
    _running.set()
    try:
        yield
    finally:
        _running.clear()
        if in_main:
            signal.signal(signal.SIGTERM, previous)


def reset() -> None:
    """A new task run: forget a terminate aimed at the run before."""
    TERMINATED.clear()


def _on_sigterm(signum: int, frame: Any) -> None:
    if _running.is_set():
        TERMINATED.set()
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


# -- the worker's revoke command, wrapped -----------------------------------------------------

_celery_revoke = control.Panel.data["revoke"]


@control.control_command(
    name="revoke",
    variadic="task_id",
    signature="[id1 [id2 [... [idN]]]]",
)
def revoke(
    state: Any, task_id: Any, terminate: bool = False, signal: Any = None, **kwargs: Any
) -> Any:
    """Revoke tasks by id: recorded where a running task looks, then Celery's own revoke."""
    ids = [str(t) for t in maybe_list(task_id) or []]
    try:
        client = redis.Redis.from_url(state.app.conf.broker_url)
        mark_revoked(client, ids)
        client.close()
    except redis.RedisError as e:
        log.warning("could not record the revoke in Redis", task_ids=ids, reason=str(e))
    log.info("revoke received", task_ids=ids, terminate=bool(terminate))
    return _celery_revoke(state, task_id, terminate=terminate, signal=signal, **kwargs)
