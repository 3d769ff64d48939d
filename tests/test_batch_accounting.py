"""A batch's counts when its tasks are lost: the broker (Redis restarted without persistence, or
flushed) no longer holds them, the reconcile sweep marks them lost and sends their items again in
a batch of its own; the batch they belonged to must still end. In-process: a real SQLite file,
the real Redis of this test process (tests/stack.py) as the broker, no worker."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import apsw
import pytest
import redis

from conftest import FakeEmbedder
from faultkit import fault_stack, log_lines
from scheduler.tasks import _reconcile
from stack import broker_url, flush, wait_for
from tasks import GROUP, NOTE
from tasks.broker import live_task_ids
from tasks.cancel import RunScope, mark_revoked
from tasks.producer import enqueue, send_batch
from tasks.run import BUSY_TRIES
from tasks.runtime import Runtime
from worker.app import create_app
from worker.log import Redact
from worker.reconcile import LOST, SUPERSEDED, mark_overrun
from worker.settings import load_settings
from worker.sources import Reader
from worker.store.items import add_item
from worker.store.jobs import (
    JobState,
    batch_outcome,
    create_batch,
    get_batch,
    record_end,
    record_queued_many,
    record_starts,
)


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


def test_an_attempt_a_later_attempt_superseded_is_no_overrun(rt: Runtime) -> None:
    """An attempt asked for a retry but the database (locked past its busy timeout) did not
    take its end: its row stayed `started`, and the overrun sweep ended it failed and counted
    the item a second time in its batch (ok 2 + failed 1 in a batch of 2). A later attempt of
    the same task supersedes it: it ends `retry`, not counted again."""
    db = rt.db
    item = add_item(db, kind="note", title="n", content="Words. " * 60)
    batch_id, (task_id,) = send_batch(db, [item], app=rt.app, group_size=1)  # type: ignore[attr-defined]
    record_starts(db, [(task_id, item)], NOTE, batch_id, "reindex")  # its end never recorded
    record_starts(db, [(task_id, item)], NOTE, batch_id, "reindex", attempt=1)
    batch_outcome(db, batch_id, "ok", None, abort_after=3, job=(task_id, 1))
    record_end(db, task_id, 1, JobState.SUCCESS, 10)
    limit = rt.settings.tasks.time_limit + rt.settings.tasks.lock_ttl
    db.execute(
        "UPDATE index_jobs SET started_at = datetime('now', ?) WHERE attempt = 0",
        (f"-{limit + 5} seconds",),
    )
    assert mark_overrun(db, limit) == 0
    assert db.all(
        "SELECT attempt, state, counted, error FROM index_jobs WHERE task_id = ? ORDER BY attempt",
        (task_id,),
    ) == [(0, "retry", 0, SUPERSEDED), (1, "success", 1, None)]
    batch = get_batch(db, batch_id)
    assert batch is not None
    assert (batch["state"], batch["ok"], batch["failed"]) == ("done", 1, 0)


# -- the database locked past its busy timeout, against the stack -----------------------------

BUSY = {"KIDX_BUSY_TIMEOUT_MS": "1000", "KIDX_TASKS__MAX_RETRIES": "5"}


def job_rows(db: Any, task_id: str) -> list[tuple[Any, ...]]:
    return db.all(
        "SELECT attempt, state, counted FROM index_jobs WHERE task_id = ? ORDER BY attempt",
        (task_id,),
    )


@pytest.mark.stack
def test_an_items_end_the_locked_database_refused_is_recorded_when_it_frees(tmp_path) -> None:
    """A host holds the write lock past the busy timeout while a task writes: the write fails
    and the task retries, but recording that attempt's end failed too and was never tried
    again: the row stayed `started`, for the overrun sweep to count a second time."""
    with fault_stack(tmp_path, concurrency=1, env=BUSY) as s:
        a, b = (s.note(f"Busy {n}", f"# Busy {n}\n\n" + "alpha beta. " * 50) for n in range(2))
        s.standin.delay = 1.0
        batch_id, tasks = send_batch(s.db, [a, b], app=s.app, group_size=1)
        started = "SELECT task_id FROM index_jobs WHERE task_id IN (?, ?) AND state = 'started'"
        first = wait_for(lambda: s.db.scalar(started, tasks), 30, "a task to start")
        wait_for(lambda: s.standin.requests >= 1, 30, "the task at the provider")
        host = apsw.Connection(str(tmp_path / "kidx.db"))
        try:
            host.execute("BEGIN IMMEDIATE")  # the host holds the write lock ...
            wait_for(lambda: "could not record an item's end" in s.logs, 40, "a refused record")
            host.execute("COMMIT")  # ... and lets go
        finally:
            host.close()
        s.standin.delay = 0.0
        for task_id in tasks:
            wait_for(lambda t=task_id: job_rows(s.db, t)[-1][1] == "success", 60, "success")
        rows = job_rows(s.db, first)
        # (a retry is no end: its row is not marked counted, the attempt that ends is)
        assert rows[0] == (0, "retry", 0) and rows[-1][1:] == ("success", 1), rows
        assert not s.db.scalar("SELECT count(*) FROM index_jobs WHERE state = 'started'")
        batch = get_batch(s.db, batch_id)
        assert batch is not None
        assert (batch["state"], batch["ok"], batch["failed"], batch["skipped"]) == (
            "done",
            2,
            0,
            0,
        )


@pytest.mark.stack
def test_a_task_that_meets_the_database_locked_at_its_start_is_retried(tmp_path) -> None:
    """Locked when a task starts: `record_start` raised a raw BusyError, the task failed with
    no retry, its row stayed `queued` and its batch `running`. It is retried (a single task
    and a group), and the batch counts each item once."""
    with fault_stack(tmp_path, concurrency=1, env=BUSY) as s:
        single, *grouped = (
            s.note(f"Start {n}", f"# Start {n}\n\n" + "gamma. " * 50) for n in range(3)
        )
        batch_id = create_batch(s.db, "reindex", 3)
        one = enqueue(s.db, single, app=s.app, batch_id=batch_id, reason="reindex", countdown=2)
        group = str(uuid.uuid4())
        record_queued_many(s.db, [(f"{group}:{i}", i) for i in grouped], GROUP, batch_id, "x")
        s.app.send_task(
            GROUP, args=[grouped], kwargs={"batch_id": batch_id}, task_id=group, countdown=2
        )
        host = apsw.Connection(str(tmp_path / "kidx.db"))
        try:
            host.execute("BEGIN IMMEDIATE")  # held while the tasks start
            assert not s.db.scalar("SELECT count(*) FROM index_jobs WHERE state != 'queued'")
            results = [s.app.AsyncResult(t) for t in (one, group)]

            def retried() -> set[str]:
                return {
                    line.get("task_id", "")
                    for line in log_lines(s.logs)
                    if "not started: tried again later" in line.get("event", "")
                }

            wait_for(
                lambda: {one, group} <= retried() or "FAILURE" in [r.state for r in results],
                30,
                "both tasks to meet the lock",
            )
            assert {one, group} <= retried()
            assert "FAILURE" not in [r.state for r in results]
            host.execute("COMMIT")
        finally:
            host.close()
        assert results[0].get(timeout=60)["status"] == "indexed"
        assert results[1].get(timeout=60)["indexed"] == 2
        rows = job_rows(s.db, one)
        assert rows[0] == (0, "retry", 0) and rows[-1][1:] == ("success", 1), rows
        for i in grouped:
            assert job_rows(s.db, f"{group}:{i}") == [(0, "success", 1)]
        batch = get_batch(s.db, batch_id)
        assert batch is not None
        assert (batch["state"], batch["ok"], batch["failed"], batch["skipped"]) == (
            "done",
            3,
            0,
            0,
        )


@pytest.mark.stack
def test_a_run_cancelled_while_the_database_stays_locked_waits_it_out_once(tmp_path) -> None:
    """Cancelled while a host holds the write lock: each of the group's items waited the whole
    busy timeout three times for its job row and once more for its state (two hours for a
    group of 128 at the default 30 s). The first item waits it out; the rest are tried once,
    briefly, and the run ends revoked."""
    with fault_stack(tmp_path, concurrency=1, env=BUSY) as s:
        ids = [s.note(f"Held {n}", f"# Held {n}\n\n" + "delta. " * 50) for n in range(3)]
        s.standin.delay = 2.0
        group = str(uuid.uuid4())
        record_queued_many(s.db, [(f"{group}:{i}", i) for i in ids], GROUP, None, "x")
        s.app.send_task(GROUP, args=[ids], task_id=group)
        wait_for(lambda: s.standin.requests >= 1, 30, "the task at the provider")
        host = apsw.Connection(str(tmp_path / "kidx.db"))
        try:
            host.execute("BEGIN IMMEDIATE")  # held until the run has ended
            mark_revoked(s.redis, [group])
            result = s.app.AsyncResult(group)
            wait_for(result.ready, 60, "the run to end")
            assert result.state == "REVOKED"
        finally:
            host.close()
        lines = [line.get("event", "") for line in log_lines(s.logs)]
        waited = [e for e in lines if e.startswith("could not record an item's end yet")]
        gave_up = [
            e for e in lines if e.startswith("could not record an item's end") and e not in waited
        ]
        assert len(gave_up) == 3, lines  # every item's end was tried ...
        assert len(waited) == BUSY_TRIES - 1, lines  # ... and the lock waited out once
