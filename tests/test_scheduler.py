"""The sweeps and beat against real processes: Redis, a prefork worker, beat, the stand-in."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from conftest import corpus_text
from scheduler import beat
from scheduler.beat import HEARTBEAT_KEY, LEASE_KEY
from stack import CELERY, Proc, Stack, running_stack, wait_for
from tasks import broker
from tasks.broker import live_task_ids
from tasks.lock import sweep_key
from tasks.producer import enqueue
from worker.app import beat_schedule
from worker.settings import load_settings
from worker.store.items import get_state
from worker.store.jobs import record_queued

# Real worker processes (not in make test-quick); one xdist worker runs the whole module, so
# its module-scoped stack starts once.
pytestmark = [pytest.mark.stack]

CHAPTER = "ch04-03-slices.md"


class SweepStack(Stack):
    """Model A has 384 dimensions here (the stand-in answers the `dimensions` it is sent)."""

    def __init__(self, tmp: Path, standin: object) -> None:
        super().__init__(
            tmp,
            standin,
            worker="sweeper",
            env={
                "KIDX_EMBEDDING__DIMENSIONS": "384",
                "KIDX_SCHEDULER__RETRY_BACKOFF": "1",
                "KIDX_SCHEDULER__RETRY_MAX_ATTEMPTS": "3",
            },
        )

    def sweep(self, name: str = "kidx.reconcile") -> dict:
        return self.app.send_task(name).get(timeout=60)

    def wait_idle(self, timeout: float = 60) -> None:
        """Until no task is queued or running."""
        wait_for(
            lambda: (
                not self.db.scalar(
                    "SELECT count(*) FROM index_jobs WHERE state IN ('queued', 'started')"
                )
            ),
            timeout,
            "the queue to drain",
            every=0.1,
        )


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SweepStack]:
    with running_stack(tmp_path_factory.mktemp("sweeps"), SweepStack) as s:
        yield s


@pytest.fixture(autouse=True)
def _fresh_standin(stack: SweepStack) -> None:
    stack.standin.reset()


def indexed_note(stack: SweepStack, title: str, text: str) -> int:
    item = stack.note(title, text)
    stack.app.AsyncResult(enqueue(stack.db, item, app=stack.app)).get(timeout=60)
    assert stack.state(item)["status"] == "indexed"
    return item


def test_one_sweep_mends_vec_rows_without_any_embedding_call(stack):
    item = indexed_note(stack, "Mend", corpus_text(CHAPTER))
    ids = [r[0] for r in stack.db.all("SELECT id FROM note_chunks WHERE item_id = ?", (item,))]
    for cid in ids[:3]:
        stack.db.execute("DELETE FROM vec_chunk_embeddings WHERE chunk_id = ?", (cid,))
    orphan = np.ones(384, dtype="<f4").tobytes()
    stack.db.execute(
        "INSERT INTO vec_chunk_embeddings(chunk_id, embedding) VALUES (777777, ?)", (orphan,)
    )
    stack.standin.reset()
    summary = stack.sweep()
    assert summary["repaired"]["restored"]["vec_chunk_embeddings"] == 3
    assert summary["repaired"]["orphans_deleted"]["vec_chunk_embeddings"] == 1
    assert stack.standin.requests == 0
    mirrored = stack.db.scalar("SELECT count(*) FROM vec_chunk_embeddings")
    assert mirrored == stack.db.scalar("SELECT count(*) FROM note_chunk_embeddings")


@pytest.mark.parametrize(
    ("name", "kind"), [("kidx.reconcile", "reconcile"), ("kidx.retry_sweep", "retry")]
)
def test_a_sweep_runs_alone_and_beat_lets_a_queued_one_expire(stack, name, kind):
    """Two sweeps of a kind that a backed-up queue delivered together would each send the
    same items: the second finds the first's lock and does nothing."""
    item = stack.note(
        f"Alone {kind}", "A note the sweep would send."
    )  # pending: reconcile sends it
    key = sweep_key(stack.db.instance(), kind)
    assert stack.redis.set(key, "another sweep", ex=60)
    try:
        assert stack.sweep(name) == {"skipped": f"another {kind} sweep is running"}
        assert stack.db.scalar("SELECT count(*) FROM index_jobs WHERE item_id = ?", (item,)) == 0
    finally:
        stack.redis.delete(key)
    assert "skipped" not in stack.sweep(name) and not stack.redis.exists(key)
    stack.wait_idle()
    schedule = beat_schedule(load_settings(scheduler={"reconcile_every": 600}))
    assert schedule["kidx-reconcile"]["options"] == {"expires": 600}
    assert beat_schedule(load_settings())["kidx-retry-sweep"]["options"]["expires"] >= 60


def test_an_item_edited_directly_in_the_database_is_indexed_by_the_next_sweep(stack):
    item = indexed_note(stack, "Direct", "The first version, indexed through kidx.")
    stack.db.execute(
        "UPDATE knowledge_items SET content = 'A second version, written by a host "
        "application straight into the table.' WHERE id = ?",
        (item,),
    )
    summary = stack.sweep()
    assert summary["sent"] >= 1 and summary["found"]["changed"] >= 1
    stack.wait_idle()
    content = stack.db.scalar("SELECT content FROM note_chunks WHERE item_id = ?", (item,))
    assert content.startswith("A second version")
    assert stack.sweep()["found"]["changed"] == 0  # nothing left to do


def test_a_memory_a_host_inserts_is_embedded_after_the_next_sweep(stack):
    stack.db.execute("INSERT INTO memories(content) VALUES ('The user reads the Rust book.')")
    summary = stack.sweep()
    assert summary["memories_to_embed"] >= 1  # the sweep sent kidx.embed_memories
    wait_for(
        lambda: (
            not stack.db.scalar(
                "SELECT count(*) FROM memories m WHERE NOT EXISTS (SELECT 1 FROM memory_embeddings "
                "e WHERE e.memory_id = m.id)"
            )
        ),
        60,
        "the worker to embed the memory",
        every=0.1,
    )
    assert stack.sweep()["memories_to_embed"] == 0
    assert stack.db.scalar("SELECT count(*) FROM vec_memories") == stack.db.scalar(
        "SELECT count(*) FROM memory_embeddings"
    )


def test_a_queued_task_the_broker_lost_is_sent_again_by_the_next_sweep(stack):
    """A `queued` job whose message is in no queue and not delivered (Redis restarted without
    persistence) is marked failed and its item sent again at once, not after the visibility
    timeout; one whose message a worker holds (kombu's `unacked` hash) is left alone."""
    lost_item = stack.note("Lost", "A note whose task the broker lost.")
    held_item = stack.note("Held", "A note whose task a worker holds.")
    record_queued(stack.db, "lost-task", "GenerateEmbedding", lost_item, None, "test")
    record_queued(stack.db, "held-task:7", "kidx.index_group", held_item, None, "test")
    stack.db.execute(
        "UPDATE index_jobs SET queued_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-300 seconds') "
        "WHERE task_id IN ('lost-task', 'held-task:7')"
    )
    client = redis.Redis.from_url(stack.settings.broker_url)
    message = {"headers": {"id": "held-task"}, "body": "", "properties": {}}
    client.hset("unacked", "test-tag", json.dumps([message, "", "celery"]))
    try:
        summary = stack.sweep()
    finally:
        client.hdel("unacked", "test-tag")
        client.close()
    assert summary["lost"] == 1
    lost = stack.db.one("SELECT state, error FROM index_jobs WHERE task_id = 'lost-task'")
    assert lost[0] == "failed" and lost[1].startswith("lost:")
    assert stack.db.scalar("SELECT state FROM index_jobs WHERE task_id = 'held-task:7'") == (
        "queued"
    )
    wait_for(lambda: stack.state(lost_item)["status"] == "indexed", 60, "the lost item indexed")
    assert stack.state(held_item)["status"] != "indexed"  # busy: its task is held
    stack.db.execute("DELETE FROM index_jobs WHERE task_id = 'held-task:7'")


def test_a_lost_task_of_an_item_that_looks_indexed_is_sent_again(stack):
    """The sweep marked such a job failed and sent nothing: the item looked up to date, so a
    file's changed source was never read again (nor an admin's retry run). Its item is now
    `pending`, and the same sweep sends it."""
    item = indexed_note(stack, "Lost again", "A note indexed once, whose next task was lost.")
    record_queued(stack.db, "lost-again", "GenerateEmbedding", item, None, "test")
    stack.db.execute(
        "UPDATE index_jobs SET queued_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-300 seconds') "
        "WHERE task_id = 'lost-again'"
    )
    summary = stack.sweep()
    assert summary["lost"] == 1 and summary["found"]["pending"] >= 1, summary
    wait_for(
        lambda: stack.db.scalar(
            "SELECT count(*) FROM index_jobs WHERE item_id = ? AND reason = 'reconcile' "
            "AND state = 'success'",
            (item,),
        ),
        60,
        "the sweep's run of the item",
    )
    assert stack.state(item)["status"] == "indexed"


def test_the_broker_reader_finds_queued_and_delivered_tasks_and_ignores_strangers(stack):
    queue = f"idle-{time.monotonic_ns()}"  # no worker consumes it
    plain = stack.app.send_task("kidx.nothing", queue=queue)
    urgent = stack.app.send_task("kidx.nothing", queue=queue, priority=5)
    client = redis.Redis.from_url(stack.settings.broker_url)
    try:
        client.lpush(queue, b"not json", json.dumps({"headers": {"id": 42}}))
        client.hset("unacked", "test-tag", json.dumps([{"headers": {"id": "running"}}, "", ""]))
        live = live_task_ids(client, [queue])
        assert live is not None and {plain.id, urgent.id, "running"} <= live
        assert 42 not in live and len(live & {plain.id, urgent.id}) == 2
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(broker, "MAX_MESSAGES", 1)
            assert live_task_ids(client, [queue]) is None  # too many to read: nothing is lost
    finally:
        client.delete(*[queue] + [f"{queue}{broker.SEP}{step}" for step in broker.PRIORITY_STEPS])
        client.hdel("unacked", "test-tag")
        client.close()


def test_a_failed_item_is_retried_with_growing_delays_and_then_left_to_an_admin(stack):
    stack.standin.fail_status = 401  # permanent: each run fails at once
    item = stack.note("Refused", "The provider refuses this one every time.")
    # Each wait counts from a failure the test cannot time exactly, so each is bounded from
    # below by what the test can time: from before the send of the attempt that failed to after
    # the sweep that sent the next one (a run may fail before `get` or the sweep returns).
    enqueued_at = time.monotonic()
    with pytest.raises(Exception, match="401"):
        stack.app.AsyncResult(enqueue(stack.db, item, app=stack.app)).get(timeout=60)
    sends: list[tuple[float, float]] = []  # (sweep called, sweep returned) of each send
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        called = time.monotonic()
        if stack.sweep("kidx.retry_sweep")["sent"]:
            sends.append((called, time.monotonic()))
            stack.wait_idle()
        if len(sends) >= 2 and time.monotonic() - sends[-1][1] > 6:
            break
        time.sleep(0.2)
    assert len(sends) == 2  # attempts 2 and 3; after the third failure it waits for an admin
    first, second = sends[0][1] - enqueued_at, sends[1][1] - sends[0][0]
    assert first >= 1.0 and second >= 2.0  # backoff 1 s, then 2 s
    state = get_state(stack.db, item)
    assert state["status"] == "failed"
    assert stack.db.scalar("SELECT attempts FROM item_index_state WHERE item_id = ?", (item,)) == 3
    out = stack.kidx("retry", str(item))  # the admin's retry still goes through
    assert out.returncode == 0


def test_two_beats_send_each_sweep_once(stack):
    env = {
        **stack.env,
        "KIDX_SCHEDULER__RECONCILE_EVERY": "1",
        "KIDX_SCHEDULER__RETRY_EVERY": "3600",
    }
    pending = stack.note("Pending", "A note added without a task: the sweep finds it.")
    before = stack.worker.log.count('"event": "reconcile sweep"')
    started = time.monotonic()
    beats = [
        Proc(
            [*CELERY, "beat", "--loglevel=INFO", f"--schedule={stack.tmp}/beat-{n}.db"],
            env,
            stack.tmp / f"beat-{n}.log",
        )
        for n in (1, 2)
    ]
    try:
        wait_for(
            lambda: stack.redis.exists(HEARTBEAT_KEY) and stack.redis.exists(LEASE_KEY),
            30,
            "a beat to take the lease",
        )
        wait_for(lambda: stack.state(pending)["status"] == "indexed", 60, "the sweep to index it")
        # Three more sweeps: from two beats, in half the time (the count below then exceeds
        # one beat's worth for the time elapsed).
        seen = stack.worker.log.count('"event": "reconcile sweep"')
        wait_for(
            lambda: stack.worker.log.count('"event": "reconcile sweep"') >= seen + 3,
            30,
            "three more sweeps",
        )
        logs = [b.log for b in beats]
    finally:
        for b in beats:
            b.stop()
    elapsed = time.monotonic() - started
    runs = stack.db.scalar("SELECT count(*) FROM index_jobs WHERE item_id = ?", (pending,))
    assert runs == 1
    leading = [log for log in logs if '"event": "beat leads"' in log]
    following = [log for log in logs if '"event": "beat follows (another beat leads)"' in log]
    assert len(leading) == 1 and len(following) == 1
    sweeps = stack.worker.log.count('"event": "reconcile sweep"') - before
    assert 3 <= sweeps <= elapsed + 2  # one beat's worth (every second), not two


def test_a_beat_gives_up_only_a_lease_it_still_holds(stack):
    """Its lease expired and another beat took it: closing must not delete the other's (the
    release is one step in Redis, not a GET then a DELETE)."""
    key = "kidx:test:lease"
    stack.redis.set(key, "host:2 (the new leader)", ex=60)
    try:
        assert stack.redis.eval(beat._RELEASE, 1, key, "host:1") == 0
        assert stack.redis.get(key) == b"host:2 (the new leader)"
        assert stack.redis.eval(beat._RELEASE, 1, key, "host:2 (the new leader)") == 1
        assert not stack.redis.exists(key)
    finally:
        stack.redis.delete(key)


def test_a_model_switch_reindexes_everything_while_search_keeps_answering(stack):
    ids = [
        indexed_note(stack, f"Switch {i}", f"Note {i} about moving values in Rust.")
        for i in range(4)
    ]
    stack.env.update({"KIDX_EMBEDDING__MODEL": "standin-big", "KIDX_EMBEDDING__DIMENSIONS": "1536"})
    try:
        stack.restart_worker()  # the new model's process rebuilds the vec tables at 1536
        out = stack.kidx("search", "Note 1 about moving values in Rust.", "--json")
        assert out.returncode == 0, out.stderr  # answers during the switch, and says so
        assert "not indexed with standin-big yet" in out.stderr
        summary = stack.sweep()
        assert summary["sent"] >= len(ids)  # every item is pending after the rebuild
        stack.wait_idle(90)
        assert {get_state(stack.db, i)["model"] for i in ids} == {"standin-big"}
        assert {get_state(stack.db, i)["dimensions"] for i in ids} == {1536}
        status = json.loads(stack.kidx("status", "--summary", "--json").stdout)
        assert "standin-big (1536)" in status["by_model"]
        hits = json.loads(
            stack.kidx(
                "search",
                "Note 1 about moving values in Rust.",
                "--json",
                "-k",
                "3",
                "--mode",
                "vector",
            ).stdout
        )
        assert hits and hits[0]["via"] == "vec"
    finally:
        stack.env.update(
            {"KIDX_EMBEDDING__MODEL": "standin-embed", "KIDX_EMBEDDING__DIMENSIONS": "384"}
        )
        stack.restart_worker()  # the module's later tests run on model A again


def test_kidx_status_shows_counts_sweeps_and_batches(stack):
    """Self-contained: the module's other tests may run before it or not."""
    item = indexed_note(stack, "Status", "A note that kidx status counts.")
    stack.sweep()  # sends whatever an earlier test left pending, and records itself
    stack.wait_idle()
    out = stack.kidx("status", "--summary")
    assert out.returncode == 0, out.stderr
    lines = {line.split(None, 1)[0]: line for line in out.stdout.splitlines() if line.strip()}
    indexed = stack.db.scalar("SELECT count(*) FROM item_index_state WHERE status = 'indexed'")
    assert f"indexed: {indexed}" in lines["status"]
    assert "standin-embed" in lines["model"]
    assert "last reconcile" in out.stdout
    summary = json.loads(stack.kidx("status", "--summary", "--json").stdout)
    assert summary["by_status"]["indexed"] == indexed >= 1
    assert "reconcile" in summary["last_sweeps"]
    assert json.loads(stack.kidx("status", str(item), "--json").stdout)["status"] == "indexed"
    full = stack.kidx("status")  # the counts, then every item's row
    assert full.returncode == 0 and "last reconcile" in full.stdout and "indexed" in full.stdout
