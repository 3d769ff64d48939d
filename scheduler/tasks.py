"""The sweep tasks beat sends: reconcile (mend the mirror, send what drifted) and the retry sweep
(send failed items again, with growing delays). Each sends its items as a batch, so three
consecutive failures abort it like any batch. One sweep of a kind runs at a time per database
(a Redis lock, not waited for): two that a backed-up queue delivered together would each find
the same items not yet sent, and send them twice."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import redis
from celery import Task, shared_task

from tasks.base import KidxTask
from tasks.broker import live_task_ids
from tasks.cancel import revoked_key
from tasks.lock import held, only_one, sweep_key
from tasks.memories import no_arguments
from tasks.producer import send_batch
from tasks.runtime import Runtime, runtime
from worker.app import EMBED_MEMORIES, RECONCILE, RETRY_SWEEP
from worker.errors import InvalidInput, KeyConflict, StaleConfig
from worker.indexers.memories import memories_missing
from worker.log import get_logger
from worker.reconcile import (
    Backoff,
    close_lost_retries,
    due_retries,
    mark_lost,
    mark_overrun,
    queued_jobs,
    reconcile,
    record_sweep,
)
from worker.store.jobs import end_discarded

log = get_logger("kidx.scheduler")


@contextlib.contextmanager
def alone(rt: Runtime, sweep: str) -> Iterator[bool]:
    """Whether this is the only sweep of its kind running now (the lock, held meanwhile; it
    expires after the hard time limit, should the process die holding it)."""
    key = sweep_key(rt.db.instance(), sweep)
    with only_one(rt.redis, key, rt.settings.tasks.time_limit) as only:
        if not only:
            log.info(f"{sweep} sweep skipped: another one is running")
        yield only


@shared_task(
    base=KidxTask, name=RECONCILE, bind=True, throws=(KeyConflict, InvalidInput, StaleConfig)
)
def reconcile_sweep(self: Task, /, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Repair vec rows at once; send the items that need a run as a `reconcile` batch, and
    the memories that need a vector to `kidx.embed_memories`. No arguments (refused in one
    line)."""
    no_arguments(RECONCILE, args, kwargs)
    rt = runtime(self.app)
    with alone(rt, "reconcile") as only:
        return _reconcile(self, rt) if only else {"skipped": "another reconcile sweep is running"}


def _reconcile(self: Task, rt: Runtime) -> dict[str, Any]:
    settings = rt.settings
    s = settings.scheduler
    model = rt.embedder.model_id if rt.embedder is not None else settings.embedding.model
    lost = _lost_jobs(rt, self.app.conf.task_default_queue)
    overrun = mark_overrun(rt.db, settings.tasks.time_limit + settings.tasks.lock_ttl)
    lost_retries = close_lost_retries(rt.db, settings.tasks.visibility_timeout)
    drift = reconcile(
        rt.db,
        model=model,
        max_items=s.max_items,
        horizon=settings.tasks.visibility_timeout,
        # an `indexing` item without its lock: its run died
        locked=lambda ids: held(rt.redis, rt.db.instance(), ids),
        provider=rt.embedder is not None,  # without one, skipped items would only be skipped again
        backoff=Backoff(s.retry_max_attempts, s.retry_backoff, s.retry_backoff_max),
        rechunk=_rechunk(rt, s.max_items),
    )
    batch_id = None
    if drift.to_index:
        batch_id, _ = send_batch(rt.db, drift.to_index, kind="reconcile", app=self.app)
    # Memories a host wrote or changed, or that an earlier model embedded: a task embeds them.
    memories = memories_missing(rt.db, model) if rt.embedder is not None else 0
    if memories:
        self.app.send_task(EMBED_MEMORIES)
    summary = {
        "repaired": drift.repaired,
        "found": {k: len(v) for k, v in drift.found.items()},
        "busy": drift.busy,
        "sent": len(drift.to_index),
        "batch_id": batch_id,
        "memories_to_embed": memories,
        "lost": lost,
        "overrun": overrun,
        "lost_retries": lost_retries,
    }
    record_sweep(rt.db, "reconcile", summary)
    log.info("reconcile sweep", **summary)
    return summary


def _rechunk(rt: Runtime, most: int) -> int:
    """How many items that fell back to structure this sweep sends for the chunk model: none
    without one; while it is taken for down, one, whose run asks it once the cool-down after
    the model's last failed call has passed (within it, the probe asks nothing and is no
    attempt); a success puts it up for every process, and the next sweep sends the rest."""
    if rt.chat is None:
        return 0
    return 1 if rt.chat.taken_for_down() else most


# A task recorded as queued this long ago and not in the broker was lost, not on its way
# (between the row and the broker's list is a few milliseconds).
LOST_AFTER = 120.0


def _lost_jobs(rt: Runtime, queue: str) -> int:
    """Mark the queued jobs whose task a Redis broker no longer holds (`tasks.broker`) as
    failed, so that this sweep sends their items again rather than waiting for the visibility
    timeout; how many. Another broker, or one too full to read, is not looked at. A task
    that kidx knows was revoked (`kidx:revoked:<id>`) was discarded by a worker, not lost: its
    rows end `revoked` (its batch counts it skipped), and its item is not sent again."""
    if urlsplit(rt.settings.broker_url).scheme not in ("redis", "rediss", "unix"):
        return 0
    stale = queued_jobs(rt.db, older_than=LOST_AFTER)
    if not stale:
        return 0
    try:
        live = live_task_ids(rt.redis, [queue])
    except redis.RedisError as e:
        log.warning("could not read the broker's queues", reason=str(e))
        return 0
    if live is None:
        return 0
    gone = [job for job in stale if job.split(":", 1)[0] not in live]  # a group's `task:item`
    revoked = _revoked(rt, sorted({job.split(":", 1)[0] for job in gone}))
    if revoked is None:
        return 0
    for task_id in revoked:  # cancelled while queued, its discard not recorded: not lost
        end_discarded(rt.db, task_id, 0, "cancelled")
    if revoked:
        log.info("tasks cancelled while queued: recorded as revoked", tasks=len(revoked))
    lost = [job for job in gone if job.split(":", 1)[0] not in revoked]
    if lost:
        mark_lost(rt.db, lost)
        log.warning("tasks lost by the broker: their items are sent again", jobs=len(lost))
    return len(lost)


def _revoked(rt: Runtime, task_ids: list[str]) -> set[str] | None:
    """Which of these tasks `kidx cancel` (or a revoke through a worker) revoked: the broker no
    longer holds them because a worker discarded them, not because they were lost; a worker
    records that itself (`tasks.cancel`), unless its database was locked at the time."""
    if not task_ids:
        return set()
    pipe = rt.redis.pipeline(transaction=False)
    for task_id in task_ids:
        pipe.exists(revoked_key(task_id))
    try:
        found = pipe.execute()
    except redis.RedisError as e:  # unknown: none is called lost on this sweep
        log.warning("could not read the revokes", reason=str(e))
        return None
    return {t for t, n in zip(task_ids, found, strict=True) if n}


@shared_task(
    base=KidxTask, name=RETRY_SWEEP, bind=True, throws=(KeyConflict, InvalidInput, StaleConfig)
)
def retry_sweep(self: Task, /, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Send failed items whose backoff has passed as a `retry` batch. No arguments (refused in
    one line)."""
    no_arguments(RETRY_SWEEP, args, kwargs)
    rt = runtime(self.app)
    with alone(rt, "retry") as only:
        return _retry(self, rt) if only else {"skipped": "another retry sweep is running"}


def _retry(self: Task, rt: Runtime) -> dict[str, Any]:
    settings = rt.settings
    s = settings.scheduler
    due = due_retries(
        rt.db,
        max_attempts=s.retry_max_attempts,
        backoff=s.retry_backoff,
        backoff_max=s.retry_backoff_max,
        horizon=settings.tasks.visibility_timeout,
    )[: s.max_items]
    batch_id = send_batch(rt.db, due, kind="retry", app=self.app)[0] if due else None
    summary = {"sent": len(due), "batch_id": batch_id}
    record_sweep(rt.db, "retry_sweep", summary)
    log.info("retry sweep", **summary)
    return summary
