"""Tasks cancelled before they ran (`kidx cancel` of a queued, reserved or waiting task): Celery
discards them in the worker's main process and no kidx code runs, so kidx records them from
Celery's `task_revoked` signal (tasks/cancel.py), and the reconcile sweep takes a cancelled task
for revoked, not lost. Against the real stack: a prefork worker with one pool process (so that
tasks wait their turn), Redis, the HTTP stand-in, a real SQLite file."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from faultkit import FaultStack, fault_stack
from stack import wait_for
from tasks import NOTE
from tasks.cancel import mark_revoked
from tasks.producer import enqueue, send_group
from worker.app import RECONCILE
from worker.reconcile import LOST
from worker.store.jobs import create_batch, get_batch, record_queued

pytestmark = [pytest.mark.stack]


@pytest.fixture(scope="module")
def s(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FaultStack]:
    with fault_stack(tmp_path_factory.mktemp("cancel-queued"), concurrency=1) as stack:
        yield stack


@pytest.fixture(autouse=True)
def _fresh_standin(s: FaultStack) -> None:
    s.standin.reset()


def text(tag: str) -> str:
    return f"# {tag}\n\n" + f"{tag} words of a short note. " * 30


def rows(s: FaultStack, item_id: int) -> list[tuple[Any, ...]]:
    return s.db.all(
        "SELECT task_id, attempt, state, counted, error FROM index_jobs WHERE item_id = ? "
        "ORDER BY rowid",
        (item_id,),
    )


def cancel(s: FaultStack, *task_ids: str) -> None:
    """What `kidx cancel` does (in this process: the CLI's start-up took seconds under a full
    suite, and the tasks it was to cancel ran meanwhile), and the worker has taken the revoke
    (it reached its control queue)."""
    before = s.worker.log.count("revoke received")
    ids = list(dict.fromkeys(t.split(":")[0] for t in task_ids))  # a group's job ids
    mark_revoked(s.redis, ids)
    s.app.control.revoke(ids)
    wait_for(lambda: s.worker.log.count("revoke received") > before, 30, "the worker's revoke")


def test_tasks_cancelled_while_queued_end_revoked_and_their_batch_ends(s: FaultStack) -> None:
    """A task revoked in the queue left its job rows `queued` and its batch `running` (`kidx
    reindex --wait` waited for good), until the sweep called it lost and sent the cancelled
    item again. Its rows end revoked, each counted skipped, and its items are cancelled."""
    blocker = s.note("Blocker", text("blocker"))
    single, first, second, after = (s.note(f"Queued {n}", text(f"q{n}")) for n in range(4))
    s.standin.delay = 120.0  # the only pool process is busy until the cancel is taken
    running = enqueue(s.db, blocker, app=s.app)
    wait_for(lambda: s.standin.requests >= 1, 30, "the blocker at the provider")
    batch_id = create_batch(s.db, "reindex", 3)
    one = enqueue(s.db, single, app=s.app, batch_id=batch_id, reason="reindex")
    group = send_group(s.db, s.app, [first, second], batch_id, "reindex")
    cancel(s, one, f"{group}:{first}")  # a group's item job id cancels its group
    last = enqueue(s.db, after, app=s.app)  # runs after the discarded ones
    s.standin.delay = 0.0
    assert s.app.AsyncResult(running).get(timeout=60)["status"] == "indexed"
    assert s.app.AsyncResult(last).get(timeout=60)["status"] == "indexed"
    assert s.app.AsyncResult(one).state == s.app.AsyncResult(group).state == "REVOKED"
    assert rows(s, single) == [(one, 0, "revoked", 1, "cancelled")]
    assert rows(s, first) == [(f"{group}:{first}", 0, "revoked", 1, "cancelled")]
    assert rows(s, second) == [(f"{group}:{second}", 0, "revoked", 1, "cancelled")]
    batch = get_batch(s.db, batch_id)
    assert batch is not None
    assert (batch["state"], batch["ok"], batch["failed"], batch["skipped"]) == ("done", 0, 0, 3)
    assert {s.state(i)["status"] for i in (single, first, second)} == {"cancelled"}
    assert s.db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (single,)) == 0


def test_a_retry_cancelled_while_it_waits_for_its_countdown_ends_revoked(s: FaultStack) -> None:
    """A task's retry waits for its countdown in the worker: cancelled then, it is discarded
    with no row of its own. It gets one, revoked, and its batch counts it skipped."""
    item = s.note("Retried", text("retried"))
    batch_id = create_batch(s.db, "reindex", 1)
    task_id = str(uuid.uuid4())
    record_queued(s.db, task_id, NOTE, item, batch_id, "reindex")
    # its first attempt failed and asked for a retry (counted as such in the batch)
    s.db.execute("UPDATE index_jobs SET state = 'retry', counted = 1 WHERE task_id = ?", (task_id,))
    s.app.send_task(
        NOTE,
        args=[item],
        kwargs={"reason": "reindex", "batch_id": batch_id},
        task_id=task_id,
        retries=1,
        countdown=6,  # time for the revoke to arrive first, however busy the machine
    )
    wait_for(
        lambda: task_id in str(s.app.control.inspect(timeout=1).scheduled()),
        20,
        "the worker to hold the retry for its countdown",
    )
    cancel(s, task_id)
    wait_for(lambda: s.app.AsyncResult(task_id).state == "REVOKED", 30, "the retry discarded")
    wait_for(lambda: len(rows(s, item)) == 2, 10, "the retry's row")
    assert rows(s, item)[1] == (task_id, 1, "revoked", 1, "cancelled")
    batch = get_batch(s.db, batch_id)
    assert batch is not None and (batch["state"], batch["skipped"]) == ("done", 1)
    assert s.state(item)["status"] == "cancelled"


def test_the_sweep_takes_a_cancelled_task_for_revoked_not_lost(s: FaultStack) -> None:
    """A queued task the broker no longer holds was called lost (failed, counted as lost, its
    item sent again as lost) even when kidx knew it was revoked (its worker could not record
    the discard: the database was locked). It ends revoked, as its worker would have ended it;
    only a task kidx has no revoke of is lost."""
    cancelled, lost = s.note("Cancelled", text("cancelled")), s.note("Lost", text("lost"))
    batch_id = create_batch(s.db, "reindex", 2)
    record_queued(s.db, "revoked-task", NOTE, cancelled, batch_id, "reindex")
    record_queued(s.db, "lost-task", NOTE, lost, batch_id, "reindex")
    mark_revoked(s.redis, ["revoked-task"])
    s.db.execute(  # queued three minutes ago, and in no queue of the broker
        "UPDATE index_jobs SET queued_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-180 seconds') "
        "WHERE task_id IN ('revoked-task', 'lost-task')"
    )
    summary = s.app.send_task(RECONCILE).get(timeout=60)
    assert summary["lost"] == 1
    assert rows(s, cancelled)[0] == ("revoked-task", 0, "revoked", 1, "cancelled")
    assert rows(s, lost)[0] == ("lost-task", 0, "failed", 1, LOST)
    batch = get_batch(s.db, batch_id)
    assert batch is not None
    assert (batch["state"], batch["failed"], batch["skipped"]) == ("done", 0, 2)
