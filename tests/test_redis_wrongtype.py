"""Another program's value at a key kidx keeps in Redis (a host sharing the database): a list
at an item's lock key, a hash at its re-run request's, a list at the memories' or a sweep's
lock, a string where a batch's failure count (a hash) goes. Each ends in one line naming the
key and what to do, the item's job row and state say it, and the value is left as it was
(not kidx's to delete). Against the real stack: a prefork worker, the HTTP stand-in, a real
SQLite file, the real Redis (this test process's database, tests/stack.py); the lock's own
cases in this process."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from scheduler.beat import LEASE_KEY
from stack import CELERY, Proc, Stack, broker_url, running_stack, wait_for
from tasks import NOTE
from tasks.lock import ItemLock, held, lock_key, memories_key, rerun_key, sweep_key
from tasks.producer import enqueue, send_batch, send_group
from tasks.streak import streak_key
from worker.app import EMBED_MEMORIES, RECONCILE
from worker.store.jobs import group_job_id

SPACE = f"wrongtype-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    """This test process's Redis database; only the test's own keys are deleted after."""
    c = redis.Redis.from_url(broker_url())
    yield c
    for key in c.scan_iter(f"kidx:{SPACE}:*"):
        c.delete(key)
    c.close()


def test_a_lock_written_over_with_a_list_is_lost_at_once(client: redis.Redis) -> None:
    """The renewal met WRONGTYPE and took it for a Redis blip: it kept "renewing" another
    program's list until the TTL had passed, the run believing it still held the item."""
    lock = ItemLock(client, SPACE, 1, "task-a", ttl=30)
    assert lock.acquire(renew=False)
    key = lock_key(SPACE, 1)
    client.delete(key)
    client.rpush(key, "host-data")
    assert not lock.extend()
    assert lock.lost
    lock.release()
    assert client.lrange(key, 0, -1) == [b"host-data"]


def test_a_list_at_a_lock_key_is_no_lock_a_run_holds(client: redis.Redis) -> None:
    """The reconcile sweep asks which `indexing` items a run holds: a key's mere existence
    answered yes for another program's list, for good (it has no TTL)."""
    client.rpush(lock_key(SPACE, 2), "host-data")
    client.set(lock_key(SPACE, 3), "a-token", px=30_000)
    client.set(lock_key(SPACE, 4), "no TTL: no lock kidx took")
    assert held(client, SPACE, [2, 3, 4, 5]) == {3}


# -- against the stack ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("wrongtype")
    with running_stack(tmp, lambda t, si: Stack(t, si)) as s:
        yield s


def ended(stack: Stack, task_id: str) -> Any:
    """The task's result once it has ended (FAILURE included): its AsyncResult."""
    result = stack.app.AsyncResult(task_id)
    result.get(timeout=60, propagate=False)
    return result


def job(stack: Stack, task_id: str) -> tuple[str, str | None]:
    return stack.db.one("SELECT state, error FROM index_jobs WHERE task_id = ?", (task_id,))


def text(tag: str) -> str:
    return f"# {tag}\n\n" + " ".join(f"{tag}word{k}" for k in range(60)) + "."


@pytest.mark.stack
@pytest.mark.parametrize("what", ["list", "string that never expires"])
def test_no_lock_at_an_items_lock_key_fails_the_item_naming_the_key(
    stack: Stack, what: str
) -> None:
    """A list: the lock's take-over check read the key with GET: WRONGTYPE, a traceback in the
    worker log, and a job row failed with Redis's words, naming no key; the item stayed
    `pending`. A string with no TTL (kidx's locks always have one): every run of the item
    ended `coalesced`, waiting for a holder that does not exist, for good."""
    item = stack.note("Locked by a host", text("hostlist"))
    key = lock_key(stack.db.instance(), item)
    if what == "list":
        stack.redis.rpush(key, "host-data")
    else:
        stack.redis.set(key, "host-data")
    before = stack.redis.dump(key)
    try:
        task_id = enqueue(stack.db, item, app=stack.app)
        result = ended(stack, task_id)
        assert result.state == "FAILURE"
        assert key in str(result.result) and f"holds a {what}," in str(result.result)
        state, error = job(stack, task_id)
        assert state == "failed" and error is not None
        assert key in error and f"DEL {key}" in error and "\n" not in error
        row = stack.state(item)
        assert row["status"] == "failed" and key in row["last_error"]
        assert stack.redis.dump(key) == before  # left as it was
        assert "Traceback" not in stack.worker.log
    finally:
        stack.redis.delete(key)


@pytest.mark.stack
def test_a_group_indexes_its_other_items_when_one_lock_key_holds_a_hash(stack: Stack) -> None:
    """The error escaped the group's lock taking: every item of the group failed with it, and
    the locks already taken for the others were left to expire."""
    bad = stack.note("Hash at its lock", text("hashlock"))
    good = [stack.note(f"Fine {n}", text(f"fine{n}")) for n in range(2)]
    space = stack.db.instance()
    key = lock_key(space, bad)
    stack.redis.hset(key, "owner", "host")
    try:
        task_id = send_group(stack.db, stack.app, [bad, *good], None, "test")
        result = ended(stack, task_id)
        assert result.state == "FAILURE"
        assert f"item {bad}:" in str(result.result) and key in str(result.result)
        assert job(stack, group_job_id(task_id, bad))[0] == "failed"
        for item in good:
            assert job(stack, group_job_id(task_id, item)) == ("success", None)
            assert stack.state(item)["status"] == "indexed"
            assert not stack.redis.exists(lock_key(space, item))
        assert stack.redis.hgetall(key) == {b"owner": b"host"}
    finally:
        stack.redis.delete(key)


@pytest.mark.stack
def test_a_hash_at_a_rerun_request_key_is_not_written_over(stack: Stack) -> None:
    """The request was a plain SET: another program's hash at the key was replaced without a
    word. The item is refused, naming the key, and the hash stays."""
    item = stack.note("Request key taken", text("hashrerun"))
    key = rerun_key(stack.db.instance(), item)
    stack.redis.hset(key, "field", "value")
    try:
        task_id = stack.app.send_task(NOTE, args=[item]).id  # as a host sends it
        assert ended(stack, task_id).state == "FAILURE"
        state, error = job(stack, task_id)
        assert state == "failed" and error is not None and key in error
        assert stack.redis.hgetall(key) == {b"field": b"value"}
        assert not stack.redis.exists(lock_key(stack.db.instance(), item))  # given back
        # an attempt: the retry sweep sent it at its first backoff for good, never at the last
        attempts = "SELECT attempts FROM item_index_state WHERE item_id = ?"
        assert stack.db.scalar(attempts, (item,)) == 1
        again = stack.app.send_task(NOTE, args=[item]).id
        assert ended(stack, again).state == "FAILURE" and stack.db.scalar(attempts, (item,)) == 2
    finally:
        stack.redis.delete(key)


@pytest.mark.stack
def test_a_list_at_the_memories_or_a_sweep_lock_fails_the_task_naming_the_key(
    stack: Stack,
) -> None:
    """SET NX failed on the list and the task took it for another run under way: every run
    ended "skipped" (SUCCESS), for good, and the memories were never embedded."""
    space = stack.db.instance()
    for name, key in (
        (EMBED_MEMORIES, memories_key(space)),
        (RECONCILE, sweep_key(space, "reconcile")),
    ):
        stack.redis.rpush(key, "host-data")
        try:
            result = ended(stack, stack.app.send_task(name).id)
            assert result.state == "FAILURE", (name, result.result)
            assert key in str(result.result) and "holds a list" in str(result.result)
            assert stack.redis.lrange(key, 0, -1) == [b"host-data"]
        finally:
            stack.redis.delete(key)


@pytest.mark.stack
def test_a_string_at_a_batch_streak_key_is_said_once_and_the_batch_indexes(
    stack: Stack,
) -> None:
    """Every HMGET and HINCRBY met WRONGTYPE, taken for Redis not answering: the batch's
    shared count silently became each run's own, and nothing said why."""
    items = [stack.note(f"Streak {n}", text(f"streak{n}")) for n in range(2)]
    # The batch's id is the next one: the key is written before the batch is sent.
    nxt = int(stack.db.scalar("SELECT coalesce(max(id), 0) + 1 FROM index_batches"))
    key = streak_key(stack.db.instance(), nxt)
    stack.redis.set(key, "not a hash")
    try:
        batch_id, task_ids = send_batch(stack.db, items, app=stack.app, group_size=1)
        assert batch_id == nxt
        for task_id in task_ids:
            assert ended(stack, task_id).state == "SUCCESS"
        assert all(stack.state(i)["status"] == "indexed" for i in items)
        said = [
            r for r in _records(stack) if key in str(r.get("event")) and r.get("level") == "error"
        ]
        assert said and "each run counts its own" in said[0]["event"]
        assert len(said) <= len(task_ids)  # once a run, not once a request
        assert stack.redis.get(key) == b"not a hash"
    finally:
        stack.redis.delete(key)


@pytest.mark.stack
def test_an_inline_run_names_the_key_not_an_unreachable_broker(stack: Stack) -> None:
    """`kidx index --inline` takes the same locks: the WRONGTYPE read as the broker being
    unreachable ("start Redis"), with no result for any item."""
    item = stack.note("Inline", text("inline"))
    key = lock_key(stack.db.instance(), item)
    stack.redis.rpush(key, "host-data")
    try:
        out = stack.kidx("index", str(item), "--inline", "--json")
        assert out.returncode == 1, out.stderr
        assert "unreachable" not in out.stderr and "Traceback" not in out.stderr
        [result] = json.loads(out.stdout)
        assert result["status"] == "failed" and key in result["error"]
        assert stack.state(item)["status"] == "failed"
        assert stack.redis.lrange(key, 0, -1) == [b"host-data"]
    finally:
        stack.redis.delete(key)


@pytest.mark.stack
@pytest.mark.parametrize(
    ("value", "said"), [("list", "holds a list"), ("string", "holds a string that never expires")]
)
def test_a_list_at_the_beat_lease_is_named_not_taken_for_redis_away(
    stack: Stack, value: str, said: str
) -> None:
    """The lease script met WRONGTYPE and beat said, every five seconds, that it could not
    reach Redis: the operator looked at a Redis that answered, while nothing was sent. A
    string that never expires (no beat's lease: each has a TTL) was taken for another beat's
    lease, and beat followed it for good, its heartbeat saying all was well."""
    if value == "list":
        stack.redis.rpush(LEASE_KEY, "host-data")
    else:
        stack.redis.set(LEASE_KEY, "another-host:1")
    beat = Proc(
        [*CELERY, "beat", "--loglevel=INFO", f"--schedule={stack.tmp}/beat-{value}.db"],
        stack.env,
        stack.tmp / f"beat-{value}.log",
    )
    try:
        lines = wait_for(
            lambda: [
                line
                for line in beat.log.splitlines()
                if "cannot reach Redis" in line or LEASE_KEY in line
            ],
            30,
            "beat to say why it does not lead",
        )
        assert f"{LEASE_KEY} {said}" in lines[0] and "DEL" in lines[0], lines[0]
        assert "cannot reach Redis" not in beat.log
        assert stack.redis.type(LEASE_KEY) == value.encode()  # not kidx's to delete
    finally:
        beat.stop()
        stack.redis.delete(LEASE_KEY)


def _records(stack: Stack) -> list[dict[str, Any]]:
    """The worker's JSON log records (other lines, Celery's own, skipped)."""
    found = []
    for line in stack.worker.log.splitlines():
        start = line.find("{")
        if start < 0:
            continue
        try:
            record = json.loads(line[start:])
        except ValueError:
            continue
        if isinstance(record, dict):
            found.append(record)
    return found
