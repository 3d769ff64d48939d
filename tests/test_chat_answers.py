"""Chat answers no parser expected: LLM chunking falls back to structure, it never fails the item.

The seed says a failed call or an unparsable answer falls back to structural chunking; JSON
nested too deeply (RecursionError), a number past Python's 4300 digits (ValueError) or a
`message` that is not an object used to escape `chunk()`, and the item ended failed, told as a
bug, on every run. Over real HTTP to the loopback stand-in (`testkit.standin.StandIn`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from testkit.standin import StandIn
from worker.chunking import ChunkMethod, LLMChunker, chunk, chunk_structure
from worker.errors import Cancelled
from worker.providers.chat import ChatModel, Refused
from worker.settings import ChunkSettings

TEXT = "# Title\n\n" + "\n\n".join(f"Paragraph {i}. " + "word " * 60 for i in range(20))
DEEP = "[" * 100_000 + "]" * 100_000
HUGE_NUMBER = "1" * 5000


@pytest.fixture
def chat(standin: StandIn) -> Iterator[ChatModel]:
    model = ChatModel(
        ChunkSettings(model="standin-chat", base_url=standin.base_url, max_retries=0, timeout=5)
    )
    yield model
    model.close()


def completion(message: Any) -> bytes:
    return json.dumps({"choices": [{"message": message, "finish_reason": "stop"}]}).encode()


def falls_back(chat: ChatModel, match: str) -> None:
    outcome = chunk(TEXT, llm=LLMChunker(chat))
    assert outcome.method == ChunkMethod.STRUCTURE
    assert outcome.fallback is not None and match in outcome.fallback, outcome.fallback
    assert [c.content for c in outcome.chunks] == [c.content for c in chunk_structure(TEXT)]


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (DEEP, "nests too deeply"),
        (HUGE_NUMBER, "not usable JSON"),
        ('{"chunks": [{"start": ' + HUGE_NUMBER + ', "end": 1, "summary": "x"}]}', "not usable"),
    ],
    ids=["deep", "huge-number", "huge-number-inside"],
)
def test_content_no_parser_takes_falls_back(
    standin: StandIn, chat: ChatModel, content: str, match: str
) -> None:
    standin.chat.script = [content, content]  # asked twice: once more with the reason
    falls_back(chat, match)
    assert standin.chat.requests == 2


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (DEEP.encode(), "nests too deeply"),
        (b'{"choices": ' + HUGE_NUMBER.encode() + b"}", "not JSON"),
        (completion("sure, here you go"), "is not an object"),
        (completion(["content", "{}"]), "is not an object"),
        (json.dumps({"choices": [["message"]]}).encode(), "no choices[0].message"),
        (json.dumps({"choices": ["message"]}).encode(), "no choices[0].message"),
    ],
    ids=[
        "deep-body",
        "huge-number-body",
        "message-a-string",
        "message-a-list",
        "choice-a-list",
        "choice-a-string",
    ],
)
def test_a_body_of_unexpected_shape_falls_back(
    standin: StandIn, chat: ChatModel, body: bytes, match: str
) -> None:
    standin.raw_answer = (200, {}, body)
    falls_back(chat, match)


class Broken:
    """A chat model with a bug: what chunk() does when something not foreseen escapes."""

    model_id = "broken"

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def complete_json(self, messages: Any, *, schema: Any, name: str, until: Any = None) -> Any:
        raise self.error


def test_any_error_from_the_llm_chunker_falls_back_with_the_reason() -> None:
    outcome = chunk(TEXT, llm=LLMChunker(Broken(AttributeError("'str' has no attribute 'get'"))))
    assert outcome.method == ChunkMethod.STRUCTURE
    assert outcome.fallback == (
        "the LLM chunker failed unexpectedly: AttributeError: 'str' has no attribute 'get'"
    )


@pytest.mark.parametrize("error", [Cancelled("cancelled"), KeyboardInterrupt()])
def test_a_cancellation_is_not_a_fallback(error: BaseException) -> None:
    with pytest.raises(type(error)):
        chunk(TEXT, llm=LLMChunker(Broken(error)))


def test_a_refusal_quoting_the_key_across_the_cut_is_masked(standin: StandIn) -> None:
    """The refusal was cut to 200 characters and never masked: the key could show."""
    key = "sk-proj-SECRETSECRETSECRETSECRET0123456789"
    model = ChatModel(
        ChunkSettings(
            model="standin-chat", base_url=standin.base_url, api_key=key, max_retries=0, timeout=5
        )
    )
    refusal = "I cannot do that; " + "y" * 160 + f" (your key is {key})"
    assert refusal.index(key) < 200 < refusal.index(key) + len(key)
    standin.chat.refusal = refusal
    try:
        with pytest.raises(Refused) as info:
            model.complete_json([{"role": "user", "content": "x"}], schema={}, name="n")
    finally:
        model.close()
    assert "***" in str(info.value)
    assert not any(key[:n] in str(info.value) for n in range(8, len(key) + 1))
