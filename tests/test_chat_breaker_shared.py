"""The chunk model's breaker is shared by a worker's processes: its failed calls in a row are
counted in Redis (`tasks.streak.SharedStreak` at `chat_streak_key`), so a model one process
took for down is not asked by the others (`KIDX_CHUNK__DOWN_AFTER` failed calls in all, not
that many in each process). Two `ChatModel`s stand for two pool processes, each with its own
clock; the stand-in's chat API over real HTTP; the real Redis (this test process's database)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from stack import REDIS_DB, broker_url, flush
from tasks.streak import FOREIGN_RETRY_S, TTL_SECONDS, SharedStreak, chat_streak_key
from testkit.standin import StandIn
from worker.providers.chat import ChatDown, ChatModel
from worker.settings import ChunkSettings

ASK = [{"role": "user", "content": "[[1]] text"}]
ANSWER = {"chunks": [{"start": 1, "end": 1, "summary": "s"}]}


@pytest.fixture
def client() -> Iterator[redis.Redis]:
    flush(REDIS_DB)
    c = redis.Redis.from_url(broker_url(REDIS_DB))
    yield c
    c.close()
    flush(REDIS_DB)


@pytest.fixture
def standin() -> Iterator[StandIn]:
    with StandIn(dimensions=8) as server:
        yield server


class Process:
    """A pool process's chunk model: its own clock, the shared streak."""

    def __init__(self, standin: StandIn, client: redis.Redis, key: str) -> None:
        self.now = 0.0
        settings = ChunkSettings(
            model="standin-chat", base_url=standin.base_url, max_retries=0, cool_down=60
        )
        self.chat = ChatModel(settings, clock=lambda: self.now, streak=SharedStreak(client, key))

    def ask(self) -> object:
        return self.chat.complete_json(ASK, schema={}, name="n")


@pytest.fixture
def two(standin: StandIn, client: redis.Redis) -> Iterator[tuple[Process, Process]]:
    key = chat_streak_key("test-instance")
    a, b = Process(standin, client, key), Process(standin, client, key)
    yield a, b
    a.chat.close()
    b.chat.close()


def fail(standin: StandIn, *processes: Process) -> None:
    """Each of `processes` in turn asks the model, which fails (HTTP 503)."""
    standin.chat.fail_status = 503
    for p in processes:
        with pytest.raises(Exception, match="HTTP 503"):
            p.ask()


def test_a_chunk_model_one_process_took_for_down_is_not_asked_by_another(standin, two):
    a, b = two
    fail(standin, a, a, a)
    with pytest.raises(ChatDown, match=r"3 failed calls in a row, last: .*HTTP 503"):
        b.ask()  # never failed a call itself
    assert standin.chat.requests == 3


def test_a_call_that_succeeds_anywhere_puts_it_up_for_every_process(standin, two):
    a, b = two
    fail(standin, a, a, a)
    with pytest.raises(ChatDown):
        b.ask()
    a.now = 61.0  # a's cool-down is over: it tries again, and the model answers
    standin.chat.fail_status = None
    standin.chat.script = [ANSWER, ANSWER]
    assert a.ask() == ANSWER
    assert b.ask() == ANSWER  # within b's cool-down, but the model answered since
    assert standin.chat.requests == 5


def test_a_process_that_learns_the_model_is_down_waits_what_is_left_of_the_cool_down(
    standin, two, client
):
    """It took the model for down for a whole cool-down of its own from when it learned of
    it: the one item the reconcile sweep sends as a probe, landing on such a process, asked
    nothing, sweep after sweep. It now counts from the last failed call (Redis's clock)."""
    a, b = two
    fail(standin, a, a, a)
    key = chat_streak_key("test-instance")
    client.pexpire(key, int((TTL_SECONDS - 45) * 1000))  # the last failure, 45 s ago
    with pytest.raises(ChatDown, match=r"taken for down for 1[45]s more"):
        b.ask()  # 60 s of cool-down, 45 s passed
    client.pexpire(key, int((TTL_SECONDS - 61) * 1000))
    standin.chat.fail_status = None
    standin.chat.script = [ANSWER]
    c = Process(standin, client, key)  # another process, learning of it now
    try:
        assert c.ask() == ANSWER  # the cool-down after the last failure is over
    finally:
        c.chat.close()
    assert standin.chat.requests == 4


def test_failed_calls_of_two_processes_add_up(standin, two):
    a, b = two
    fail(standin, a, b, a)
    for p in (a, b):
        with pytest.raises(ChatDown):
            p.ask()
    assert standin.chat.requests == 3  # not three a process


def test_a_worker_process_s_chunk_model_counts_in_redis(tmp_path: Path, client) -> None:
    """The runtime a pool process builds gives its chunk model the shared streak."""
    from tasks.runtime import build_runtime
    from worker.settings import load_settings

    settings = load_settings(
        db=tmp_path / "kidx.db",
        broker_url=broker_url(REDIS_DB),
        chunk={"model": "standin-chat", "base_url": "http://127.0.0.1:9/v1"},
    )
    rt = build_runtime(settings)
    try:
        assert rt.chat is not None
        streak = rt.chat.streak
        assert isinstance(streak, SharedStreak)
        assert streak.key == chat_streak_key(rt.db.instance())
        streak.failed("a cause")
        assert client.hget(streak.key, "n") == b"1"
    finally:
        rt.close()


def test_another_program_s_value_at_the_key_is_tried_again_after_a_while(client) -> None:
    """A process's chunk-model streak lives as long as the process: once it met another
    program's value at the key it counted alone for good, even after the value was deleted
    as its log asked."""
    now = [0.0]
    key = chat_streak_key("test-foreign")
    client.set(key, "not a hash")
    streak = SharedStreak(client, key, clock=lambda: now[0])
    assert streak.failed("a cause") == 1 and streak.foreign  # its own count
    assert client.get(key) == b"not a hash"  # not kidx's to delete
    client.delete(key)
    now[0] += FOREIGN_RETRY_S - 1
    assert streak.failed("a cause") == 2 and not client.exists(key)  # still its own
    now[0] += 1
    assert streak.failed("a cause") == 1  # the shared count again, from Redis
    assert client.hget(key, "n") == b"1" and not streak.foreign
