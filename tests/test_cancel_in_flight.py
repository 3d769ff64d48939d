"""A cancellation reaches a provider call in flight: the call ends within a fraction of a second
(`Cancelled`, not a failure), not when the provider answers or its timeout passes, for the
embedding model and the chunk model alike, over real HTTP to the loopback stand-in."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from testkit.standin import StandIn
from tests.conftest import standin_settings
from worker.errors import Cancelled
from worker.providers.base import Hooks
from worker.providers.chat import ChatModel
from worker.providers.openai import OpenAIEmbeddings
from worker.settings import ChunkSettings

HELD = 20.0  # how long the stand-in holds each answer: far past what a test waits
CANCEL_AFTER = 0.5


@pytest.fixture
def standin() -> Iterator[StandIn]:
    with StandIn(dimensions=8) as server:
        server.delay = HELD
        server.chat.delay = HELD
        yield server


def cancelled_after(seconds: float) -> tuple[Hooks, float]:
    """Hooks whose run is cancelled `seconds` from now (as `kidx cancel` would mark it)."""
    at = time.monotonic() + seconds
    return Hooks(cancelled=lambda: time.monotonic() >= at), at


def test_an_embedding_call_in_flight_ends_at_the_cancellation(standin: StandIn) -> None:
    hooks, at = cancelled_after(CANCEL_AFTER)
    model = OpenAIEmbeddings(
        standin_settings(standin, timeout=HELD * 2, max_retries=3), dimensions=8, hooks=hooks
    )
    try:
        with pytest.raises(Cancelled):
            model.embed(["a text whose answer is held"])
        ended = time.monotonic()
    finally:
        model.close()
    assert ended - at < 2.0  # not the held answer, not the timeout
    assert standin.requests == 1  # cancelled, not retried


def test_a_chat_call_in_flight_ends_at_the_cancellation(standin: StandIn) -> None:
    hooks, at = cancelled_after(CANCEL_AFTER)
    chat = ChatModel(
        ChunkSettings(
            model="standin-chat", base_url=standin.base_url, timeout=HELD * 2, max_retries=3
        ),
        hooks=hooks,
    )
    messages = [{"role": "user", "content": "[[1]] one unit\n[[2]] another"}]
    try:
        with pytest.raises(Cancelled):
            chat.complete_json(messages, schema={"type": "object"}, name="chunk_boundaries")
        ended = time.monotonic()
        # A cancellation says nothing of the model: it is not one failed call towards "down".
        assert chat.streak.current()[0] == 0
    finally:
        chat.close()
    assert ended - at < 2.0
    assert standin.chat.requests == 1


def test_without_a_cancellation_a_held_answer_still_arrives(standin: StandIn) -> None:
    """The check looks every quarter second; a run not cancelled gets the provider's answer."""
    standin.delay = 1.0
    hooks = Hooks(cancelled=lambda: False)
    model = OpenAIEmbeddings(standin_settings(standin, timeout=10), dimensions=None, hooks=hooks)
    try:
        vectors = model.embed(["held one second, then answered"])
    finally:
        model.close()
    assert len(vectors) == 1 and len(vectors[0]) > 0
    assert standin.requests == 1
