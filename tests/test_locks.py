"""The item lock (tasks/lock.py) under the faults it must survive: a Redis blip while it is
renewed, a second delivery of a task whose first still runs, the holder's process killed, and a
run cancelled while other tasks wait on it (their re-run requests). The lock's own cases run in
this process against the real Redis (this test process's database, tests/stack.py); the rest
against the real stack: a prefork worker, the HTTP stand-in, a real SQLite file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from stack import ROOT, Stack, broker_url, running_stack, wait_for
from tasks import KNOWLEDGE_ITEM
from tasks.lock import ItemLock, LockSet, lock_key
from tasks.producer import enqueue
from worker.chunking import text_hash
from worker.store.items import add_item, update_content


class Blippy(redis.Redis):
    """A client whose next `failures` script calls (a lock's EXTEND) meet a connection error,
    as in a blip; counts the calls that fail and those that succeed after the first failure."""

    failures = 0
    failed = 0
    after = 0

    def evalsha(self, *args: Any, **kwargs: Any) -> Any:
        if self.failures:
            self.failures -= 1
            self.failed += 1
            raise redis.ConnectionError("simulated blip: connection reset by peer")
        answer = super().evalsha(*args, **kwargs)
        if self.failed:
            self.after += 1
        return answer


@pytest.fixture
def client() -> Iterator[Blippy]:
    """A client of this test process's Redis database; the test's keys (its own lock space,
    SPACE) are deleted afterwards, and nothing else: the module's stack shares the database."""
    c = Blippy.from_url(broker_url())
    yield c
    for key in c.scan_iter(f"kidx:{SPACE}:*"):
        c.delete(key)
    c.close()


SPACE = f"locks-test-{uuid.uuid4().hex[:8]}"


def test_a_redis_blip_while_renewing_does_not_lose_the_lock(client: Blippy) -> None:
    """One EXTEND met a connection error and the lock was never renewed again: it expired
    under a live run and another task took the item. It is tried again, and stays held."""
    locks = LockSet(client, SPACE, [1], "task-a", ttl=3)
    assert locks.acquire() == ([1], [])
    try:
        client.failures = 1  # the next renewal meets the blip; Redis answers right after
        lock = locks.held[0]
        # three renewals after the blip: the lock has outlived the TTL it was taken with
        wait_for(lambda: client.after >= 3 or lock.lost, 15, "renewals after the blip")
        assert client.failed == 1 and not lock.lost
        assert client.pttl(lock_key(SPACE, 1)) > 0
        other = LockSet(redis.Redis.from_url(broker_url()), SPACE, [1], "task-b", ttl=3)
        held, busy = other.acquire()
        other.release()
        assert (held, busy) == ([], [1])  # still this run's
    finally:
        asked = locks.release()
    assert asked == {1: "task-b"}  # the other task's request, and who made it


def test_renewal_gives_up_only_when_the_ttl_has_passed(client: Blippy) -> None:
    """Redis away for good: the lock is tried again until its TTL has passed without a
    renewal (it has expired then, and another run may hold it), not given up at once."""
    lock = ItemLock(client, SPACE, 2, "task-c", ttl=3)
    assert lock.acquire()
    try:
        client.failures = 10**6
        wait_for(lambda: lock.lost, 15, "the lock to be given up")
        assert client.failed >= 2  # tried again before giving up
    finally:
        client.failures = 0
        lock.release()


def test_a_lock_taken_by_another_is_lost_at_once(client: Blippy) -> None:
    lock = ItemLock(client, SPACE, 3, "task-d", ttl=3)
    assert lock.acquire()
    try:
        client.set(lock_key(SPACE, 3), "another-run:token", px=60_000)  # expired and taken
        wait_for(lambda: lock.lost, 10, "the lock to be lost")
        assert client.failed == 0
    finally:
        lock.release()
    assert client.get(lock_key(SPACE, 3)) == b"another-run:token"  # not released: not ours


def test_the_tasks_redis_client_gives_up_on_a_redis_that_never_answers(
    tmp_path: Path, mute
) -> None:
    """A server that accepts and stays silent (a hung Redis): without a socket timeout a call
    waited for good, and the lock's renewal thread with it, while the lock expired. redis-py's
    own retries (three, each reconnecting) then made a call wait many times its timeout: a
    call is one attempt (tasks/redis_at.py)."""
    import threading

    from tasks.runtime import redis_client
    from worker.settings import load_settings

    settings = load_settings(db=tmp_path / "k.db", broker_url=mute.url, tasks={"lock_ttl": 3})
    client = redis_client(settings)
    outcome: list[BaseException | None] = []

    def ping() -> None:
        try:
            client.ping()
            outcome.append(None)
        except BaseException as e:  # what it raised is the assertion
            outcome.append(e)

    caller = threading.Thread(target=ping, daemon=True)
    caller.start()
    caller.join(timeout=10)  # the call gives up after 0.5 s (a sixth of the TTL)
    try:
        assert not caller.is_alive(), "the call still waits"
        assert isinstance(outcome[0], redis.TimeoutError)
        assert mute.connections == 1  # not retried
    finally:
        client.close()


HOLD = """
import sys, redis
from tasks.lock import ItemLock
lock = ItemLock(redis.Redis.from_url(sys.argv[1]), sys.argv[2], 4, sys.argv[3], ttl=30)
assert lock.acquire()
print("held", flush=True)
sys.stdin.read()
"""


def holder(task_id: str) -> subprocess.Popen[str]:
    """Another process holding item 4's lock for `task_id` (a pool process running it)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, broker_url(), SPACE, task_id],
        cwd=str(ROOT),
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def test_a_live_run_of_the_same_task_keeps_its_lock_and_a_dead_ones_is_taken_over(
    client: Blippy,
) -> None:
    """A second delivery of a task (at-least-once delivery) took over the lock of its first,
    still running: both indexed the item at once. Only a holder provably gone is taken over:
    its process has ended (killed: a zombie not yet reaped counts as ended)."""
    task_id = str(uuid.uuid4())
    proc = holder(task_id)
    try:
        second = ItemLock(client, SPACE, 4, task_id, ttl=30)
        assert not second.acquire()  # alive: the second delivery ends coalesced
        os.kill(proc.pid, signal.SIGKILL)
        wait_for(
            lambda: Path(f"/proc/{proc.pid}/stat").read_text().split(") ")[1][0] == "Z",
            10,
            "the holder to die",
        )
        assert second.acquire()  # gone: taken over at once, not after the TTL
        second.release()
    finally:
        proc.kill()
        proc.wait(10)
    other = holder("another-task")
    try:
        os.kill(other.pid, signal.SIGKILL)
        other.wait(10)
        assert not ItemLock(client, SPACE, 4, task_id, ttl=30).acquire()  # not this task's
    finally:
        other.kill()


def test_a_lock_of_the_same_task_from_elsewhere_is_taken_over_once_no_longer_renewed(
    client: Blippy,
) -> None:
    """A holder on another host cannot be looked at: its lock is taken over once it has gone
    unrenewed for two renew intervals (a third of the TTL left), never while it is renewed."""
    task_id = str(uuid.uuid4())
    key = lock_key(SPACE, 5)
    token = f"{task_id}:elsewhere/1:123:456:{uuid.uuid4().hex}"
    client.set(key, token, px=25_000)  # renewed lately
    assert not ItemLock(client, SPACE, 5, task_id, ttl=30).acquire()
    client.set(key, token, px=5_000)  # two renewals missed
    lock = ItemLock(client, SPACE, 5, task_id, ttl=30)
    assert lock.acquire()
    lock.release()


# -- against the stack ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("locks")
    (tmp / "docs").mkdir()
    env = {"KIDX_FILES__ROOTS": str(tmp / "docs")}
    with running_stack(tmp, lambda t, si: Stack(t, si, env=env)) as s:
        yield s


def sections(tag: str, n: int) -> str:
    words = " ".join(f"{tag}word{k}" for k in range(100))
    return "\n\n".join(f"## {tag} part {j}\n\n{words}." for j in range(n))


@pytest.mark.stack
def test_a_second_delivery_of_a_running_task_is_coalesced_and_the_edit_indexed(
    stack: Stack,
) -> None:
    """The same task delivered again while its first delivery runs (kombu restoring unacked
    messages, a host resending the id): the second ends coalesced, the first runs the item
    once more, and the file's edit made between the two reads is what the index holds."""
    stack.standin.reset()
    path = stack.tmp / "docs" / "guide.md"
    path.write_text("# Guide\n\n" + sections("old", 2))
    item = add_item(stack.db, kind="file", title="Guide", content="", source=str(path))
    stack.standin.delay = 2.0
    task_id = str(uuid.uuid4())
    stack.app.send_task(KNOWLEDGE_ITEM, args=[item], task_id=task_id)
    wait_for(lambda: stack.standin.requests >= 1, 30, "the first delivery at the provider")
    path.write_text("# Guide\n\nThe new version two of the guide.")
    stack.app.send_task(KNOWLEDGE_ITEM, args=[item], task_id=task_id)  # delivered again
    wait_for(
        lambda: (
            "coalesced: the item" in stack.worker.log or "took over the lock" in stack.worker.log
        ),
        30,
        "the second delivery to meet the lock",
    )
    stack.standin.delay = 0.0
    assert "took over the lock" not in stack.worker.log
    done = f"{KNOWLEDGE_ITEM}[{task_id}] succeeded"
    wait_for(lambda: stack.worker.log.count(done) >= 2, 60, "both deliveries to end")
    chunks = [
        r[0] for r in stack.db.all("SELECT content FROM note_chunks WHERE item_id = ?", (item,))
    ]
    assert chunks and all("version two" in c for c in chunks), chunks
    assert stack.state(item)["status"] == "indexed"
    assert not stack.redis.exists(lock_key(stack.db.instance(), item))


@pytest.mark.stack
def test_a_cancelled_run_sends_again_the_items_other_tasks_asked_it_to_rerun(
    stack: Stack,
) -> None:
    """A task found its item being indexed and ended coalesced, trusting the running task to
    run it once more; that task was then cancelled, and the request went with it: the edit
    was never indexed. The cancelled run sends the item again, as a run of its own."""
    stack.standin.reset()
    item = stack.note("Edited", sections("first", 2))
    stack.app.AsyncResult(enqueue(stack.db, item, app=stack.app)).get(timeout=60)
    update_content(stack.db, item, sections("second", 2))
    stack.standin.delay = 2.0
    running = enqueue(stack.db, item, app=stack.app, reason="reindex")
    wait_for(lambda: stack.standin.requests >= 3, 30, "the run at the provider")
    edit = sections("third", 2)
    update_content(stack.db, item, edit)
    host = enqueue(stack.db, item, app=stack.app, reason="host edit")
    assert stack.app.AsyncResult(host).get(timeout=30)["status"] == "coalesced"
    out = stack.kidx("cancel", running)  # meant for that run, not for the host's task
    assert out.returncode == 0, out.stderr
    wait_for(lambda: stack.app.AsyncResult(running).state == "REVOKED", 30, "the run revoked")
    again = stack.db.all(
        "SELECT task_id FROM index_jobs WHERE item_id = ? AND reason = 'changed'", (item,)
    )
    assert len(again) == 1  # sent before the run ended revoked
    stack.standin.delay = 0.0
    stack.app.AsyncResult(again[0][0]).get(timeout=60)
    indexed = "SELECT status, indexed_hash FROM item_index_state WHERE item_id = ?"
    assert stack.db.one(indexed, (item,)) == ("indexed", text_hash(edit))
