"""The worker system against real processes: Redis, prefork Celery workers, the HTTP stand-in."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator

import pytest
from celery import Celery

from conftest import corpus_text, integrity
from stack import (
    API_KEY,
    Stack,
    broker_url,
    running_stack,
    wait_for,
    worker_pids,
)
from tasks.lock import lock_key
from tasks.producer import enqueue
from worker.chunking import chunk_structure
from worker.store.items import update_content

# Real worker processes (not in make test-quick); one xdist worker runs the whole module, so
# its module-scoped stack starts once.
pytestmark = [pytest.mark.stack]

RESULT_FIELDS = {
    "status",
    "chunk_method",
    "chunks",
    "reused",
    "embedded",
    "failed",
    "dimensions",
    "model",
    "duration_ms",
}
CHAPTER = "ch10-02-traits.md"
CHUNKS = len(chunk_structure(corpus_text(CHAPTER)))  # 20 or more


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("queue"), Stack) as s:
        yield s


@pytest.fixture(autouse=True)
def _fresh_standin(stack: Stack) -> None:
    stack.standin.reset()


def chunk_contents(db, item_id: int) -> list[str]:
    return [
        r[0]
        for r in db.all(
            "SELECT content FROM note_chunks WHERE item_id = ? ORDER BY chunk_index", (item_id,)
        )
    ]


def test_a_bare_celery_client_sends_a_task_by_name(stack):
    item = stack.note("Traits", corpus_text(CHAPTER))
    bare = Celery(broker=broker_url(), backend=broker_url())  # nothing of kidx
    result = bare.send_task("GenerateEmbedding", args=[item]).get(timeout=60)
    assert set(result) >= RESULT_FIELDS
    assert (
        result["status"] == "indexed" and result["chunks"] == CHUNKS and result["dimensions"] == 64
    )
    assert chunk_contents(stack.db, item) == [
        c.content for c in chunk_structure(corpus_text(CHAPTER))
    ]


def test_wrong_kind_and_unknown_item_fail_at_once_without_retry(stack):
    item = stack.note("Short", "A short note.")
    wrong = stack.app.send_task("GenerateKnowledgeItemEmbedding", args=[item])
    missing = stack.app.send_task("GenerateEmbedding", args=[987654])
    for result, words in ((wrong, "is a note"), (missing, "no item with id 987654")):
        with pytest.raises(Exception) as caught:
            result.get(timeout=30)
        assert words in str(caught.value) and "after" in str(caught.value)
        assert result.state == "FAILURE"
        assert (
            stack.db.scalar("SELECT max(attempt) FROM index_jobs WHERE task_id = ?", (result.id,))
            == 0
        )

        # An expected failure (Celery's `throws`): one line at INFO, no traceback; the cause
        # is in kidx's own error line.
        def celery_lines(task_id: str = result.id) -> list[dict]:
            return [
                json.loads(x)
                for x in stack.worker.log.splitlines()
                if x.startswith("{") and task_id in x and "raised" in x
            ]

        # Celery stores the result, then logs the failure.
        wait_for(celery_lines, 30, "Celery's line about the failure", every=0.05)
        assert all(
            "raised expected" in x["event"] and x["level"] == "info" for x in celery_lines()
        ), celery_lines()
        assert not any("exception" in x for x in celery_lines())


def test_fifty_enqueues_during_a_run_cost_at_most_two_runs(stack):
    text = corpus_text(CHAPTER)
    item = stack.note("Burst", text)
    stack.standin.delay = 0.3  # a run takes about 1.5 s: 5 requests of 4 texts
    first = enqueue(stack.db, item, app=stack.app)
    wait_for(lambda: stack.standin.requests >= 1, 30, "the first run to reach the provider")
    task_ids = [first]
    for n in range(50):
        update_content(stack.db, item, text + f"\n\nEdit number {n} of the burst.")
        task_ids.append(enqueue(stack.db, item, app=stack.app, reason="burst"))
    for task_id in task_ids:
        stack.app.AsyncResult(task_id).get(timeout=120)
    runs = stack.db.scalar(
        f"SELECT count(*) FROM index_jobs WHERE task_id IN ({','.join('?' * len(task_ids))}) "
        "AND state = 'success'",
        task_ids,
    )
    coalesced = stack.db.scalar(
        f"SELECT count(*) FROM index_jobs WHERE task_id IN ({','.join('?' * len(task_ids))}) "
        "AND state = 'coalesced'",
        task_ids,
    )
    assert 1 <= runs <= 2 and runs + coalesced == 51
    last = text + "\n\nEdit number 49 of the burst."
    rows = stack.db.all(
        "SELECT content, start_offset, end_offset FROM note_chunks "
        "WHERE item_id = ? ORDER BY chunk_index",
        (item,),
    )
    assert all(content == last[s:e] for content, s, e in rows)  # the last content, exactly
    covered = {i for _, s, e in rows for i in range(s, e)}
    assert all(i in covered for i, ch in enumerate(last) if not ch.isspace())
    assert len({s for _, s, _ in rows}) == len(rows)  # no duplicate rows
    assert stack.state(item)["status"] == "indexed"
    # The second run sent only what changed: far fewer texts than two full runs.
    assert len(stack.standin.texts) < 2 * CHUNKS
    assert "database is locked" not in stack.worker.log


def test_a_worker_process_killed_mid_task_runs_it_again(stack):
    item = stack.note("Killed", corpus_text(CHAPTER))
    stack.standin.delay = 0.4
    task_id = enqueue(stack.db, item, app=stack.app)
    wait_for(lambda: stack.standin.requests >= 1, 30, "the run to reach the provider")
    pid = wait_for(lambda: worker_pids(stack.app).get(task_id), 10, "the task's process")
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic()
    result = stack.app.AsyncResult(task_id).get(timeout=90)
    assert result["status"] == "indexed" and result["chunks"] == CHUNKS
    assert time.monotonic() - killed_at < 60
    assert integrity(stack.db) == "ok"
    mirrored = stack.db.scalar("SELECT count(*) FROM vec_chunk_embeddings")
    assert mirrored == stack.db.scalar("SELECT count(*) FROM note_chunk_embeddings")
    assert not stack.redis.exists(lock_key(stack.db.instance(), item))
    assert "WorkerLostError" in stack.worker.log or "exited" in stack.worker.log


def _own_ports() -> set[int]:
    """The local ports of this process's TCP connections (/proc: its sockets' inodes)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    ports = set()
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        with open(table) as f:
            for line in list(f)[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def test_a_lost_broker_connection_does_not_cancel_the_run_in_progress(stack):
    """Celery's `worker_cancel_long_running_tasks_on_connection_loss` sent SIGTERM to the pool
    process of a running task when the worker lost Redis, which kidx takes for `kidx cancel
    --terminate`: the item ended `cancelled`, its job `revoked`, and nothing sent it again."""
    item = stack.note("Connection lost", corpus_text(CHAPTER))
    stack.standin.delay = 1.0
    seen = stack.standin.requests
    task_id = enqueue(stack.db, item, app=stack.app)
    wait_for(lambda: stack.standin.requests > seen, 30, "the run to reach the provider")
    db = stack.redis.connection_pool.connection_kwargs["db"]
    mine = _own_ports()  # this process's connections (its Celery client's) are kept
    theirs = [
        c["id"]
        for c in stack.redis.client_list()
        if int(c["db"]) == db and int(c["addr"].rsplit(":", 1)[1]) not in mine
    ]
    for client_id in theirs:
        stack.redis.client_kill_filter(_id=client_id)
    assert theirs
    wait_for(lambda: "broker lost" in stack.worker.log, 30, "the worker to see the loss")
    stack.standin.delay = 0
    ended = wait_for(
        lambda: (s := stack.state(item)["status"]) in ("indexed", "cancelled", "failed") and s,
        60,
        "the run to end",
    )
    assert ended == "indexed"
    assert stack.db.scalar("SELECT state FROM index_jobs WHERE task_id = ?", (task_id,)) != (
        "revoked"
    )


def test_kidx_cancel_revokes_a_running_task_and_keeps_the_previous_index(stack):
    text = corpus_text(CHAPTER)
    item = stack.note("Cancelled", text)
    enqueue_result = stack.app.AsyncResult(enqueue(stack.db, item, app=stack.app))
    enqueue_result.get(timeout=60)
    before = stack.db.all(
        "SELECT c.id, c.content, e.vector FROM note_chunks c JOIN "
        "note_chunk_embeddings e ON e.chunk_id = c.id WHERE c.item_id = ?",
        (item,),
    )
    update_content(stack.db, item, text.replace("trait", "capability"))
    stack.standin.delay = 1.0
    seen = stack.standin.requests  # the first run's requests are counted already
    task_id = enqueue(stack.db, item, app=stack.app)
    wait_for(lambda: stack.standin.requests > seen, 30, "the run to reach the provider")
    sent = time.monotonic()
    out = stack.kidx("cancel", task_id)
    assert out.returncode == 0, out.stderr
    wait_for(lambda: stack.app.AsyncResult(task_id).state == "REVOKED", 15, "REVOKED")
    assert time.monotonic() - sent < 5 + 1.0 + 1
    assert stack.state(item)["status"] == "cancelled"
    after = stack.db.all(
        "SELECT c.id, c.content, e.vector FROM note_chunks c JOIN "
        "note_chunk_embeddings e ON e.chunk_id = c.id WHERE c.item_id = ?",
        (item,),
    )
    assert after == before
    assert (
        stack.db.scalar("SELECT state FROM index_jobs WHERE task_id = ?", (task_id,)) == "revoked"
    )
    assert not stack.redis.exists(lock_key(stack.db.instance(), item))
    # The next enqueue indexes normally.
    stack.standin.delay = 0
    again = stack.app.AsyncResult(enqueue(stack.db, item, app=stack.app)).get(timeout=60)
    assert again["status"] == "indexed"
    # Cancellation is not an error.
    lines = [json.loads(x) for x in stack.worker.log.splitlines() if x.startswith("{")]
    assert not [x for x in lines if x.get("task_id") == task_id and x["level"] == "error"]


def test_kidx_cancel_ends_a_provider_call_in_flight_not_at_its_answer(stack):
    """The stand-in holds its answer past any wait here (the provider's timeout is 10 s): the
    run ends at the cancellation, within the quarter second the call looks at it."""
    item = stack.note("Held", "A note whose embedding the provider holds.")
    seen = stack.standin.requests
    stack.standin.delay = 9.0
    try:
        task_id = enqueue(stack.db, item, app=stack.app)
        wait_for(lambda: stack.standin.requests > seen, 30, "the run to reach the provider")
        out = stack.kidx("cancel", task_id)
        assert out.returncode == 0, out.stderr
        result = stack.app.AsyncResult(task_id)
        wait_for(lambda: result.state == "REVOKED", 4, "REVOKED before the provider answers")
    finally:
        stack.standin.delay = 0
    assert stack.state(item)["status"] == "cancelled"
    assert stack.db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (item,)) == 0
    assert stack.standin.requests == seen + 1  # not retried


def test_a_queued_revoked_task_never_runs_even_after_a_worker_restart(stack):
    item = stack.note("Never", "A note that is never indexed.")
    due = time.monotonic() + 6
    task_id = enqueue(stack.db, item, app=stack.app, countdown=6)
    wait_for(
        lambda: task_id in str(stack.app.control.inspect(timeout=1).scheduled()),
        10,
        "the worker to hold the delayed task",
    )
    out = stack.kidx("cancel", task_id)
    assert out.returncode == 0, out.stderr
    # The worker restarts before the task is due: the revoke must survive it.
    stack.restart_worker()
    wait_for(lambda: stack.app.AsyncResult(task_id).state == "REVOKED", 30, "REVOKED")
    # Proving that something did not happen takes its time: until the task was due, and a bit.
    time.sleep(max(0.0, due + 2 - time.monotonic()))
    assert stack.state(item)["status"] == "cancelled"  # by the worker that discarded it
    assert stack.db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (item,)) == 0
    assert (
        stack.db.scalar(
            "SELECT count(*) FROM index_jobs WHERE task_id = ? "
            "AND state NOT IN ('queued', 'revoked')",
            (task_id,),
        )
        == 0
    )  # it never ran


def test_a_dead_provider_stops_a_batch_within_three_failed_requests(stack):
    """The seed's rule (three consecutive failures abort a batch, to avoid a cascade), counted
    where the cascade happens: the provider's requests, across every group of the batch and
    both worker processes. Three times over: `kidx reindex --all` of 200 notes sends at most
    three failed requests plus the one each process may already have in flight."""
    ids = [
        stack.note(f"Batch item {i}", f"Batch note number {i} with its own text.")
        for i in range(200)
    ]
    for _ in range(3):
        stack.standin.reset()
        stack.standin.fail_status = 500
        out = stack.kidx("reindex", "--all", "--json")
        assert out.returncode == 0, out.stderr
        sent = json.loads(out.stdout)
        assert sent["tasks"] >= 2  # groups for both processes
        batch_id = sent["batch_id"]

        def ended(batch_id: int = batch_id) -> dict | None:
            b = stack.db.dicts("SELECT * FROM index_batches WHERE id = ?", (batch_id,))[0]
            return b if b["ok"] + b["failed"] + b["skipped"] >= b["total"] else None

        batch = wait_for(ended, 120, "every item of the batch to end")
        assert batch["state"] == "aborted", batch
        assert batch["abort_reason"].startswith(
            "aborted after 3 consecutive failures of the provider's requests"
        )
        assert "HTTP 500" in batch["abort_reason"]
        requests = {tuple(b["input"]) for b in stack.standin.bodies}
        assert len(stack.standin.bodies) == len(requests)  # (no retry in this stack)
        assert 3 <= len(requests) <= 3 + 2, len(requests)
        # The item whose request stopped the batch failed with the cause; the rest were
        # skipped with the batch's reason (but the earlier tests' notes, whose vectors are
        # all reused), and are left failed for `kidx retry --failed`.
        assert batch["failed"] == 1, batch
        assert batch["skipped"] >= len(ids) - 1 and batch["ok"] <= batch["total"] - len(ids)
        assert {stack.state(i)["status"] for i in ids} == {"failed"}
    out = stack.kidx("jobs", "--batch", str(batch_id))
    assert out.returncode == 0 and "aborted after 3 consecutive failures" in out.stdout
    # `kidx retry --failed` while the provider is still down: one batch, which the same rule
    # stops (one task an item, as it was, cost every item's run and its task retries).
    stack.standin.reset()
    stack.standin.fail_status = 500
    out = stack.kidx("retry", "--failed", "--wait", "--timeout", "120", "--json", timeout=150)
    assert out.returncode == 1, out.stderr  # the batch did not end `done`
    retried = json.loads(out.stdout)
    assert retried["kind"] == "retry" and retried["total"] >= len(ids), retried
    assert retried["state"] == "aborted", retried
    assert 3 <= len(stack.standin.bodies) <= 3 + 2
    # The provider recovers; `kidx retry --failed` indexes them all.
    stack.standin.reset()
    out = stack.kidx("retry", "--failed", "--wait", "--timeout", "120", "--json", timeout=150)
    assert out.returncode == 0, out.stderr
    retried = json.loads(out.stdout)
    assert retried["state"] == "done" and retried["ok"] == retried["total"] >= len(ids)
    assert {stack.state(i)["status"] for i in ids} == {"indexed"}


def test_worker_logs_are_json_with_ids_prefixes_and_no_key(stack):
    item = stack.note("Logged", corpus_text("ch04-03-slices.md"))
    task_id = enqueue(stack.db, item, app=stack.app)
    stack.app.AsyncResult(task_id).get(timeout=60)
    log = stack.worker.log
    assert API_KEY not in log
    lines = [json.loads(x) for x in log.splitlines() if x.startswith("{")]
    ours = [x for x in lines if x.get("task_id") == task_id]
    assert any(x["event"].startswith("[Chunk]") and x["item_id"] == item for x in ours)
    assert any(x["event"] == "[KI Embed] indexed" and x["item_id"] == item for x in ours)
    assert all("timestamp" in x and "level" in x for x in lines)


def test_reindex_all_wait_shows_a_summary_and_jobs_list_the_runs(stack):
    out = stack.kidx("reindex", "--all", "--wait", "--timeout", "120", timeout=150)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "done:" in out.stdout and "failed" in out.stdout
    jobs = json.loads(stack.kidx("jobs", "--json").stdout)
    assert jobs and {"task_id", "state", "duration_ms", "error", "item_id"} <= set(jobs[0])
    out = stack.kidx("enqueue", "1", "--json")
    assert out.returncode == 0 and json.loads(out.stdout)[0]["item_id"] == 1


def test_a_transient_failure_is_retried_with_backoff_and_then_succeeds(stack):
    item = stack.note("Flaky", corpus_text("ch04-03-slices.md"))
    # The first run's three requests (its batch, two texts alone) are refused; the retry is
    # served.
    stack.standin.fail_status, stack.standin.fail_times = 503, 3
    task_id = enqueue(stack.db, item, app=stack.app)
    result = stack.app.AsyncResult(task_id).get(timeout=60)
    assert result["status"] == "indexed"
    runs = stack.db.all(
        "SELECT attempt, state, error FROM index_jobs WHERE task_id = ? ORDER BY attempt",
        (task_id,),
    )
    assert [(a, s) for a, s, _ in runs] == [(0, "retry"), (1, "success")]
    assert "HTTP 503" in runs[0][2] and "after" in runs[0][2]


def test_a_permanent_failure_is_not_retried(stack):
    item = stack.note("Refused", "A note the provider refuses outright.")
    stack.standin.fail_status = 401
    task_id = enqueue(stack.db, item, app=stack.app)
    with pytest.raises(Exception, match="HTTP 401"):
        stack.app.AsyncResult(task_id).get(timeout=60)
    runs = stack.db.all("SELECT attempt, state FROM index_jobs WHERE task_id = ?", (task_id,))
    assert runs == [(0, "failed")]
    assert stack.standin.requests == 1
