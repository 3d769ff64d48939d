"""The item and sweep locks (tasks/lock.py) against a review's faults, in this process against
the real Redis (this test process's database, tests/stack.py; its own key space): a request key
of another type while the reruns are read (the requests already cleared were lost), a timeout
halfway through taking a group's locks (they stayed, with no run behind them), another
program's bytes at a lock key (the whole group failed), a sweep lock whose release times out,
and a database's instance named while another writer holds the file."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import apsw
import pytest
import redis
from redis.client import Pipeline

from stack import broker_url
from tasks.lock import LockSet, lock_key, only_one, rerun_key
from worker.store.db import Database

SPACE = f"locks-audit-{uuid.uuid4().hex[:8]}"


class Flaky(redis.Redis):
    """A client whose pipelines time out once they sent a command named `fail_on` (the
    command reached Redis; its answer did not come back), and whose scripts time out while
    `scripts_fail` is set."""

    fail_on: str | None = None
    scripts_fail = False

    def pipeline(self, transaction: bool = True, shard_hint: Any = None) -> Pipeline:
        client = self

        class _Pipe(Pipeline):
            def execute(self, raise_on_error: bool = True) -> list[Any]:
                names = [str(args[0]).upper() for args, _ in self.command_stack]
                answers = super().execute(raise_on_error=raise_on_error)
                if client.fail_on is not None and client.fail_on in names:
                    raise redis.TimeoutError("simulated: the answer came after the timeout")
                return answers

        return _Pipe(self.connection_pool, self.response_callbacks, transaction, shard_hint)

    def evalsha(self, *args: Any, **kwargs: Any) -> Any:
        if self.scripts_fail:
            raise redis.TimeoutError("simulated: the script's answer came after the timeout")
        return super().evalsha(*args, **kwargs)


@pytest.fixture
def client() -> Iterator[Flaky]:
    c = Flaky.from_url(broker_url())
    yield c
    c.fail_on, c.scripts_fail = None, False
    for key in c.scan_iter(f"kidx:{SPACE}:*"):
        c.delete(key)
    c.close()


def test_a_request_key_of_another_type_loses_no_other_items_request(client: Flaky) -> None:
    locks = LockSet(client, SPACE, [1, 2], "task-a", ttl=30)
    assert locks.acquire() == ([1, 2], [])
    try:
        client.set(rerun_key(SPACE, 2), "task-b")  # task B asked for item 2 again
        client.hset(rerun_key(SPACE, 1), "another", "program")
        asked = locks.take_reruns()
        # item 2's request was cleared by its GETDEL, then the WRONGTYPE raised: lost
        assert asked == {1: "", 2: "task-b"}
    finally:
        locks.release()


def test_a_timeout_while_a_groups_locks_are_taken_leaves_none_of_them(client: Flaky) -> None:
    client.fail_on = "GETDEL"  # the round trip after the SETs
    locks = LockSet(client, SPACE, [1, 2, 3], "task-a", ttl=60)
    with pytest.raises(redis.TimeoutError):
        locks.acquire()
    client.fail_on = None
    assert [client.exists(lock_key(SPACE, i)) for i in (1, 2, 3)] == [0, 0, 0]
    other = LockSet(client, SPACE, [1, 2, 3], "task-b", ttl=60)
    try:
        assert other.acquire() == ([1, 2, 3], [])  # was ([], [1, 2, 3]): coalesced on nothing
    finally:
        other.release()


def test_another_programs_bytes_at_a_lock_key_make_that_item_busy_not_the_group_fail(
    client: Flaky,
) -> None:
    client.set(lock_key(SPACE, 2), b"\xff\xfe garbage", ex=60)
    locks = LockSet(client, SPACE, [1, 2], "task-a", ttl=60)
    try:
        assert locks.acquire() == ([1], [2])  # was UnicodeDecodeError, item 1's lock left
    finally:
        locks.release()
    assert not client.exists(lock_key(SPACE, 1))


def test_a_sweep_lock_whose_release_times_out_leaves_the_sweeps_outcome(client: Flaky) -> None:
    key = f"kidx:{SPACE}:sweep:test"
    with only_one(client, key, 30) as mine:
        assert mine
        client.scripts_fail = True  # the release's script
    # no TimeoutError: the lock expires by itself
    client.scripts_fail = False
    with pytest.raises(ValueError, match="the sweep's own"), only_one(client, key + "2", 30):
        client.scripts_fail = True
        raise ValueError("the sweep's own error")


def test_an_instance_is_never_guessed_while_another_writer_holds_the_file(tmp_path: Path) -> None:
    """A path hash, kept for the connection's life, named other keys than every other
    process's: both held one item's lock."""
    path = tmp_path / "kidx.db"
    first = Database(path)
    first.execute("CREATE TABLE index_meta(key TEXT PRIMARY KEY, value TEXT)")
    second = Database(path, busy_timeout_ms=100)
    try:
        first.execute("BEGIN IMMEDIATE")
        with pytest.raises(apsw.BusyError):
            second.instance()
        first.execute("COMMIT")
        assert second.instance() == first.instance()
    finally:
        first.close()
        second.close()


def test_a_named_instance_is_read_while_another_writer_holds_the_file(tmp_path: Path) -> None:
    path = tmp_path / "kidx.db"
    first = Database(path)
    first.execute("CREATE TABLE index_meta(key TEXT PRIMARY KEY, value TEXT)")
    name = first.instance()
    second = Database(path, busy_timeout_ms=100)
    try:
        first.execute("BEGIN IMMEDIATE")
        assert second.instance() == name  # a read needs no lock: every open failed behind one
        first.execute("COMMIT")
    finally:
        first.close()
        second.close()


def test_a_named_instance_is_read_without_waiting_for_another_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The name was read inside a write transaction: every `kidx status`, `search` or `jobs`
    waited out another writer's transaction (its busy timeout, 30 s) before it answered."""
    path = tmp_path / "kidx.db"
    first = Database(path)
    first.execute("CREATE TABLE index_meta(key TEXT PRIMARY KEY, value TEXT)")
    name = first.instance()
    second = Database(path, busy_timeout_ms=30_000)
    waits: list[int] = []
    monkeypatch.setattr(second, "_busy", lambda n: waits.append(n) or False)
    second.conn.set_busy_handler(second._busy)
    try:
        first.execute("BEGIN IMMEDIATE")
        assert second.instance() == name
        assert waits == []  # the busy handler never asked: no lock was wanted
        first.execute("COMMIT")
    finally:
        first.close()
        second.close()
