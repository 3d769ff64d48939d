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
from worker.reconcile import LOST, mark_overrun
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


def test_a_run_killed_at_the_hard_time_limit_ends_failed_in_its_batch_and_its_item(
    rt: Runtime,
) -> None:
    """Celery kills a run at the hard time limit and tells kidx nothing: its rows stayed
    `started` and its items `indexing`, taken for busy until the visibility timeout (an hour),
    then sent again on every sweep, and its batch never ended. Past the time limit and the
    lock's TTL, the sweep ends them failed: the row, the item (an attempt more, for the retry
    sweep's backoff) and its count in the batch (a refusal: no abort); a run still young, or an
    item another run has taken since, is left alone."""
    db = rt.db
    ids = [add_item(db, kind="note", title=f"n{i}", content="Words. " * 60) for i in range(3)]
    batch_id, _ = send_batch(db, ids, app=rt.app)  # type: ignore[attr-defined]
    jobs = db.all("SELECT task_id, item_id FROM index_jobs ORDER BY item_id")
    record_starts(db, jobs, GROUP, batch_id, "reindex")
    for job_id, item_id in jobs:
        run = job_id.split(":", 1)[0]
        db.execute(
            "UPDATE item_index_state SET status = 'indexing', last_task_id = ? WHERE item_id = ?",
            ("another-run" if item_id == ids[1] else run, item_id),
        )
    limit = rt.settings.tasks.time_limit + rt.settings.tasks.lock_ttl
    db.execute(
        "UPDATE index_jobs SET started_at = datetime('now', ?) WHERE item_id != ?",
        (f"-{limit + 5} seconds", ids[2]),
    )

    summary = _reconcile(SimpleNamespace(app=rt.app), rt)  # type: ignore[arg-type]

    assert summary["overrun"] == 2
    states = {r[0]: r[1:] for r in db.all("SELECT item_id, status, attempts FROM item_index_state")}
    assert states[ids[0]] == ("failed", 1)  # killed: failed, for the retry sweep
    assert states[ids[1]] == ("indexing", 0)  # another run's since
    assert states[ids[2]] == ("indexing", 0)  # still within the limit
    rows = dict(
        db.all(
            f"SELECT item_id, state FROM index_jobs WHERE task_id IN ({','.join('?' * len(jobs))})",
            [j for j, _ in jobs],
        )
    )
    assert rows == {ids[0]: "failed", ids[1]: "failed", ids[2]: "started"}
    batch = get_batch(db, batch_id)
    assert batch is not None
    assert (batch["state"], batch["failed"], batch["consecutive_failures"]) == ("running", 2, 0)
    assert mark_overrun(db, limit) == 0  # once
