"""A batch's counts when its tasks are lost: the broker (Redis restarted without persistence, or
flushed) no longer holds them, the reconcile sweep marks them lost and sends their items again in
a batch of its own; the batch they belonged to must still end. In-process: a real SQLite file,
the real Redis of this test process (tests/stack.py) as the broker, no worker."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from conftest import FakeEmbedder
from scheduler.tasks import _reconcile
from stack import broker_url, flush
from tasks import GROUP
from tasks.broker import live_task_ids
from tasks.cancel import RunScope
from tasks.producer import send_batch
from tasks.runtime import Runtime
from worker.app import create_app
from worker.log import Redact
from worker.reconcile import LOST
from worker.settings import load_settings
from worker.sources import Reader
from worker.store.items import add_item
from worker.store.jobs import batch_outcome, get_batch, record_starts


@pytest.fixture
def rt(db: Any, emb_settings: Any) -> Iterator[Runtime]:
    flush()
    settings = load_settings(
        db=db.path,
        broker_url=broker_url(),
        embedding=emb_settings.model_dump(),
        tasks={"group_size": 2, "concurrency": 1},
    )
    client = redis.Redis.from_url(broker_url())
    runtime = Runtime(
        settings=settings,
        db=db,
        embedder=FakeEmbedder(),
        chat=None,
        reader=Reader(),
        redis=client,
        scope=RunScope(),
        redact=Redact([]),
        pid=os.getpid(),
    )
    runtime.app = create_app(settings)  # type: ignore[attr-defined]
    yield runtime
    ping = getattr(runtime.app, "_kidx_ping", None)  # type: ignore[attr-defined]
    if ping is not None:
        ping.close()
    runtime.app.close()  # type: ignore[attr-defined]
    client.close()
    flush()


def test_a_batch_whose_tasks_the_broker_lost_ends_and_counts_each_once(rt: Runtime) -> None:
    """The sweep marked lost jobs failed and sent their items again, but never counted them in
    their own batch: its ok + failed + skipped never reached its total, and it stayed running
    for good (`kidx status`, `kidx reindex --wait`). A lost job now counts as skipped there
    (not as a failure: no abort), once, whatever a late start of its task does."""
    db = rt.db
    ids = [add_item(db, kind="note", title=f"n{i}", content="Words. " * 60) for i in range(4)]
    batch_id, sent = send_batch(db, ids, app=rt.app)  # type: ignore[attr-defined]
    assert len(sent) == 2
    assert live_task_ids(rt.redis, ["celery"]) == set(sent)
    # a worker took the first group; the second was still in the queue when the broker went
    running = db.all(
        "SELECT task_id, item_id FROM index_jobs WHERE task_id LIKE ?", (f"{sent[0]}:%",)
    )
    record_starts(db, running, GROUP, batch_id, "reindex")
    flush()  # Redis restarts without persistence: the queue is gone
    db.execute("UPDATE index_jobs SET queued_at = datetime('now', '-5 minutes')")

    summary = _reconcile(SimpleNamespace(app=rt.app), rt)  # type: ignore[arg-type]

    lost = [r[0] for r in db.all("SELECT task_id FROM index_jobs WHERE error = ?", (LOST,))]
    queued = db.all("SELECT task_id FROM index_jobs WHERE task_id LIKE ?", (f"{sent[1]}:%",))
    assert sorted(lost) == sorted(r[0] for r in queued) and len(lost) == 2
    assert summary["lost"] == 2
    assert summary["sent"] == 2 and summary["batch_id"] != batch_id
    batch = get_batch(db, batch_id)
    assert batch is not None
    assert (batch["state"], batch["ok"], batch["failed"], batch["skipped"]) == ("running", 0, 0, 2)
    assert batch["consecutive_failures"] == 0

    # the first group's items end (as tasks.run counts them): the batch is done, not aborted
    for job_id, _ in running:
        batch_outcome(db, batch_id, "ok", None, abort_after=3, job=(job_id, 0))
    batch = get_batch(db, batch_id)
    assert batch is not None
    assert (batch["state"], batch["ok"], batch["skipped"]) == ("done", 2, 2)

    # a lost task that starts after all (a redelivery) is not counted a second time
    late = lost[0]
    record_starts(db, [(late, int(late.rsplit(":", 1)[1]))], GROUP, batch_id, "reindex")
    batch_outcome(db, batch_id, "failed", "late", abort_after=1, job=(late, 0))
    assert get_batch(db, batch_id) == batch
