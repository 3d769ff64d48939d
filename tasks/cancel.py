"""Cancellation is a revoke, not a failure.

Celery's plain `revoke()` does not reach a running task, and `terminate=True` sends its process
SIGTERM, mid-write. So:

* Every worker's `revoke` remote-control command (the one `kidx cancel` and Flower's revoke
  button send) is Celery's own, wrapped: it first records the task id in Redis, where the
  running task looks between steps, then calls Celery's handler (which keeps revokes of queued
  tasks, and with `--statedb` across restarts).
* While a task runs, SIGTERM sets a flag instead of killing it mid-write: the run stops at its
  next step (a provider call in flight ends within a quarter second of it, one through a proxy
  at its timeout), rolls back, and the task marks itself REVOKED. With no task running, SIGTERM
  does what it always did.
* The check also covers waiting: a provider's backoff sleeps on the token, not on time.sleep.
* A task revoked while queued or reserved never reaches kidx code: Celery discards it. Its
  `task_revoked` signal (in the worker's main process) records what its run would have: its
  job rows end `revoked`, counted skipped in their batch, its items `cancelled`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import apsw
import redis
from celery import current_app, signals
from celery.utils.functional import maybe_list
from celery.worker import control

from tasks import GROUP, KNOWLEDGE_ITEM, NOTE, attempt_of
from tasks.redis_at import redis_at
from worker.errors import Cancelled, KidxError
from worker.log import get_logger
from worker.store.db import Database
from worker.store.items import Status
from worker.store.jobs import end_discarded

log = get_logger("kidx.tasks")

REVOKED_TTL = 7 * 24 * 3600
# Seconds without a look at Redis after it did not answer: a Redis that accepts and never
# answers held each look for its socket timeout (5 s), and a provider's answer being read, with
# a look every quarter second, for that long each time. A revoke is then seen this much later
# (SIGTERM, Flower's terminate, at once).
AWAY_S = 30.0
# Seconds a revoke waits to record itself in Redis (in the worker's main process: its
# remote-control handler must not wait for good on a Redis that never answers)
REVOKE_PATIENCE_S = 5.0
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
                # Redis away: carry on (the lock and the result need it anyway), and look again
                # after a while, not at every wait
                self._checked = time.monotonic() + AWAY_S
                return False
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

    def cancelled(self) -> bool:
        """Whether the run under way was cancelled (a provider's call in flight looks)."""
        token = self.token
        return token is not None and token()

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
        client = redis_at(state.app.conf.broker_url, REVOKE_PATIENCE_S)
        mark_revoked(client, ids)
        client.close()
    except redis.RedisError as e:
        log.warning("could not record the revoke in Redis", task_ids=ids, reason=str(e))
    log.info("revoke received", task_ids=ids, terminate=bool(terminate))
    return _celery_revoke(state, task_id, terminate=terminate, signal=signal, **kwargs)


# -- a task discarded before it ran -----------------------------------------------------------

INDEXING_TASKS = (NOTE, KNOWLEDGE_ITEM, GROUP)


@signals.task_revoked.connect
def _discarded(
    sender: Any = None,
    request: Any = None,
    terminated: bool = False,
    expired: bool = False,
    **_: Any,
) -> None:
    """A task revoked while queued or reserved, or expired: Celery discards it in the worker's
    main process and no kidx code runs, so its job rows would stay `queued` (its batch
    `running`, `kidx reindex --wait` waiting) until the reconcile sweep called them lost and
    sent the cancelled items again. Recorded here as a run that sees its revoke before the
    start records it (`end_discarded`); an expired task's items end `failed`, for the retry
    sweep. A terminated task was running: its run records its own revoke."""
    name = getattr(sender, "name", None) or getattr(request, "task", None)
    if terminated or request is None or name not in INDEXING_TASKS:
        return
    task_id = str(request.id)
    if expired:
        error, status = "not run: its task expired before it started", Status.FAILED
    else:
        error, status = "cancelled", Status.CANCELLED
    settings = getattr(getattr(sender, "app", None) or current_app, "kidx_settings", None)
    if settings is None:
        return
    attempt = 0 if name == GROUP else attempt_of(getattr(request, "retries", 0))
    try:
        # A connection of its own, not a runtime's (no providers in the main process), and
        # not kept open: the main process forks the pool's processes.
        db = Database(settings.db, busy_timeout_ms=settings.busy_timeout_ms, create=False)
        try:
            ended = end_discarded(db, task_id, attempt, error, status)
        finally:
            db.close()
    except (apsw.Error, KidxError) as e:  # the reconcile sweep still finds it (`kidx:revoked`)
        log.warning(
            "could not record a discarded task", task_id=task_id, reason=f"{type(e).__name__}: {e}"
        )
        return
    log.info("task discarded before it ran: recorded", task_id=task_id, jobs=ended, error=error)
