"""The sweep tasks beat sends: reconcile (mend the mirror, send what drifted) and the retry sweep
(send failed items again, with growing delays). Each sends its items as a batch, so three
consecutive failures abort it like any batch."""

from __future__ import annotations

from typing import Any

from celery import Task, shared_task

from tasks.lock import held
from tasks.producer import send_batch
from tasks.runtime import runtime
from worker.app import EMBED_MEMORIES, RECONCILE, RETRY_SWEEP
from worker.indexers.memories import memories_missing
from worker.log import get_logger
from worker.reconcile import due_retries, reconcile, record_sweep

log = get_logger("kidx.scheduler")


@shared_task(name=RECONCILE, bind=True)
def reconcile_sweep(self: Task) -> dict[str, Any]:
    """Repair vec rows at once; send the items that need a run as a `reconcile` batch, and
    the memories that need a vector to `kidx.embed_memories`."""
    rt = runtime(self.app)
    settings = rt.settings
    model = rt.embedder.model_id if rt.embedder is not None else settings.embedding.model
    drift = reconcile(
        rt.db,
        model=model,
        max_items=settings.scheduler.max_items,
        horizon=settings.tasks.visibility_timeout,
        # an `indexing` item without its lock: its run died
        locked=lambda ids: held(rt.redis, rt.db.instance(), ids),
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
    }
    record_sweep(rt.db, "reconcile", summary)
    log.info("reconcile sweep", **summary)
    return summary


@shared_task(name=RETRY_SWEEP, bind=True)
def retry_sweep(self: Task) -> dict[str, Any]:
    """Send failed items whose backoff has passed as a `retry` batch."""
    rt = runtime(self.app)
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
