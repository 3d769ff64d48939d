"""LLM chunking and the chat provider against a hostile chat server (a third audit).

Over real HTTP to the loopback stand-in (`testkit.standin.StandIn`) with a real SQLite file:
what the server says that ends up in a fallback's reason (a refusal, an error message) must be
storable and sendable; a 200 carrying an error must say it; a 400 is read from the server's
own words (not the model's name); JSON in a code fence or after <think> is JSON; a model that
takes no temperature but its default is asked without one."""

from __future__ import annotations

import json
from typing import Any

import pytest

from conftest import chat_model
from testkit.standin import StandIn
from testkit.standin_chat import ChatReply, automatic_chunks
from worker.bulk import index_item
from worker.chunking import ChunkMethod, LLMChunker, chunk
from worker.chunking.llm import windows_of
from worker.indexers import IndexOptions
from worker.providers.http import ProviderHTTPError
from worker.store.items import add_item, get_state

TEXT = "# Title\n\n" + "\n\n".join(f"Paragraph {i}. " + "word " * 60 for i in range(20))


def stored(db: Any, item_id: int) -> list[tuple[int, int, str, str]]:
    return db.all(
        "SELECT start_offset, end_offset, content, method FROM note_chunks WHERE item_id = ? "
        "ORDER BY chunk_index",
        (item_id,),
    )


# -- 1. a lone surrogate in what the server says ----------------------------------------------
# JSON may escape a lone surrogate ("\ud800"): it parses, but UTF-8 cannot carry it. In a
# refusal asked again, the correction could not be sent (the fallback blamed the item's text);
# in the last answer's refusal or an HTTP error's message, the fallback's reason could not be
# stored and the item failed.


@pytest.mark.parametrize(
    "last",
    [ChatReply(refusal="I will not \ud800 do it"), ChatReply(status=400, content="bad \udfff")],
    ids=["refusal", "http-400"],
)
def test_a_lone_surrogate_in_the_reason_is_replaced_and_the_item_indexed(
    db, embedder, chat, standin, last
):
    standin.chat.script = ["not JSON at all", last]
    item = add_item(db, kind="note", title="T", content=TEXT)
    result = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert result.status == "indexed" and result.chunk_method == "structure"
    assert "\ufffd" in result.fallback
    state = get_state(db, item)
    assert state["status"] == "indexed" and "\ufffd" in state["last_error"]
    assert all(content == TEXT[a:b] for a, b, content, _ in stored(db, item))


def test_a_refusal_with_a_lone_surrogate_is_asked_again_with_the_reason(
    db, embedder, chat, standin
):
    standin.chat.script = [ChatReply(refusal="I will not \ud800 do it")]  # then the automatic
    item = add_item(db, kind="note", title="T", content=TEXT)
    result = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert standin.chat.requests == len(windows_of(TEXT, 6000)) + 1  # the first asked twice
    assert result.chunk_method == "llm" and result.fallback is None
    assert "refused: I will not \ufffd do it" in standin.chat.bodies[1]["messages"][-1]["content"]


# -- 2. HTTP 200 with an error body -----------------------------------------------------------
# Some gateways answer an upstream failure with 200 and an OpenAI-style {"error": ...}: the
# fallback's reason said only "the answer has no choices[0].message", not what went wrong.

KEY = "sk-audit3-SECRETSECRETSECRET0123456789"


@pytest.mark.parametrize(
    "error",
    [
        {"message": f"upstream model overloaded (key {KEY})", "code": 502},
        f"upstream model overloaded (key {KEY})",
    ],
    ids=["object", "string"],
)
def test_a_200_answer_with_an_error_body_falls_back_saying_the_error(
    standin: StandIn, error: object
) -> None:
    standin.raw_answer = (200, {}, json.dumps({"error": error}).encode())
    model = chat_model(standin, api_key=KEY)
    try:
        outcome = chunk(TEXT, llm=LLMChunker(model))
    finally:
        model.close()
    assert outcome.method == ChunkMethod.STRUCTURE
    assert "upstream model overloaded" in outcome.fallback, outcome.fallback
    assert KEY not in outcome.fallback and "***" in outcome.fallback


# -- 3. a 400 taken for a refusal of the schema ----------------------------------------------
# Whether a 400 was about `response_format` was read from the whole message, the model's name
# and the base URL included: with "schema" in the model's name any 400 (a prompt over the
# context) switched the process to json_object for good, and the call was made twice.


def test_a_400_not_about_the_format_is_not_taken_for_a_schema_refusal(standin: StandIn) -> None:
    standin.chat.script = [ChatReply(status=400, content="maximum context length exceeded")]
    model = chat_model(standin, model="acme-json-schema-7b")
    ask = [{"role": "user", "content": "[[1]] text"}]
    try:
        with pytest.raises(ProviderHTTPError, match="maximum context length"):
            model.complete_json(ask, schema={}, name="n")
        assert model.schema_supported and standin.chat.requests == 1
        model.complete_json(ask, schema={}, name="n")  # still asked with the schema
        standin.chat.reject_json_schema = True  # a refusal of the schema still switches
        assert model.complete_json(ask, schema={}, name="n")["chunks"][0]["end"] == 1
    finally:
        model.close()
    kinds = [b["response_format"]["type"] for b in standin.chat.bodies]
    assert kinds == ["json_schema", "json_schema", "json_schema", "json_object"]
    assert not model.schema_supported


# -- 4. JSON in a code fence, or after the model's reasoning --------------------------------
# A server that does not enforce the format (json_object ignored) lets many models answer
# ```json ... ```, or <think>...</think> then the JSON: every answer was "not JSON", asked
# again, then structure: with a working chunk model, LLM chunking never ran.


def _fenced(units: list[str]) -> str:
    return "```json\n" + json.dumps(automatic_chunks(units)) + "\n```"


def _after_thinking(units: list[str]) -> str:
    return "<think>\nGroup by size {not json}.\n</think>\n\n" + json.dumps(automatic_chunks(units))


@pytest.mark.parametrize(
    ("garbage", "wrap"),
    [
        ("```json\n{not json}\n```", _fenced),
        ("```json\n{}", _fenced),
        ("Sure: ```json\n{}\n```", _fenced),
        ("<think>unfinished {}", _after_thinking),
    ],
    ids=["fenced-garbage", "unclosed-fence", "prose-first", "unclosed-think"],
)
def test_a_wrapped_json_answer_is_used(db, embedder, chat, standin, garbage, wrap) -> None:
    windows = windows_of(TEXT, 6000)
    standin.chat.script = [garbage] + [wrap] * len(windows)  # only the JSON inside is taken
    item = add_item(db, kind="note", title="T", content=TEXT)
    result = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert result.chunk_method == "llm" and result.fallback is None
    assert standin.chat.requests == len(windows) + 1  # the garbage asked again, no other
    assert "not JSON" in standin.chat.bodies[1]["messages"][-1]["content"]
    rows = stored(db, item)
    assert rows and all(content == TEXT[a:b] and m == "llm" for a, b, content, m in rows)


# -- 5. a model that accepts no temperature but its default ---------------------------------
# OpenAI's reasoning models answer `temperature: 0` with a 400 ("Unsupported value:
# 'temperature' does not support 0 with this model"); kidx has no setting for it, so with such
# a chunk model every item fell back to structure, and every item paid the request again.

NO_TEMPERATURE = ChatReply(
    status=400,
    content="Unsupported value: 'temperature' does not support 0 with this model. "
    "Only the default (1) value is supported.",
)


def test_a_model_that_refuses_temperature_0_is_asked_without_it(db, embedder, chat, standin):
    standin.chat.script = [NO_TEMPERATURE]  # then the automatic model
    item = add_item(db, kind="note", title="T", content=TEXT)
    result = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert result.chunk_method == "llm" and result.fallback is None
    bodies = standin.chat.bodies
    assert bodies[0]["temperature"] == 0 and all("temperature" not in b for b in bodies[1:])
    assert {b["response_format"]["type"] for b in bodies} == {"json_schema"}
    assert standin.chat.requests == len(windows_of(TEXT, 6000)) + 1  # remembered


def test_a_refused_temperature_and_schema_are_both_left_out(standin: StandIn) -> None:
    standin.chat.reject_json_schema = True  # answered before the script is read
    standin.chat.script = [NO_TEMPERATURE]
    model = chat_model(standin)
    try:
        answer = model.complete_json([{"role": "user", "content": "[[1]] a"}], schema={}, name="n")
    finally:
        model.close()
    assert answer["chunks"][0]["end"] == 1
    sent = [(b.get("temperature"), b["response_format"]["type"]) for b in standin.chat.bodies]
    assert sent == [(0, "json_schema"), (0, "json_object"), (None, "json_object")]


def test_a_400_about_the_temperature_twice_is_not_a_loop(standin: StandIn) -> None:
    standin.chat.script = [NO_TEMPERATURE, NO_TEMPERATURE]
    model = chat_model(standin)
    try:
        with pytest.raises(ProviderHTTPError, match="temperature"):
            model.complete_json([{"role": "user", "content": "[[1]] a"}], schema={}, name="n")
    finally:
        model.close()
    assert standin.chat.requests == 2
