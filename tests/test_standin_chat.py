"""The chat-completions stand-in over real HTTP: unit parsing, the automatic model, the script,
every switch, and that embeddings keep working on the same server."""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from testkit.standin import StandIn, vector_for
from testkit.standin_chat import ChatReply, ChatScript, automatic_chunks, parse_units

MODEL = "gpt-standin"
SCHEMA_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "chunk_boundaries", "strict": True, "schema": {"type": "object"}},
}
INSTRUCTIONS = "Group the numbered units into chunks. Answer JSON only."


@pytest.fixture
def standin() -> Iterator[StandIn]:
    with StandIn(dimensions=8) as server:
        yield server


@pytest.fixture
def chat(standin: StandIn) -> ChatScript:
    return standin.chat


@pytest.fixture
def client(standin: StandIn) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=standin.base_url, timeout=5.0) as http:
        yield http


def user_message(units: list[str]) -> str:
    return INSTRUCTIONS + "\n\n" + "\n".join(f"[[{i}]] {u}" for i, u in enumerate(units, 1))


def request_body(units: list[str], response_format: object = None) -> dict[str, Any]:
    return {
        "model": MODEL,
        "temperature": 0,
        "messages": [
            {"role": "system", "content": INSTRUCTIONS},
            {"role": "user", "content": user_message(units)},
        ],
        "response_format": response_format or SCHEMA_FORMAT,
    }


def complete(client: httpx.Client, units: list[str], **kwargs: Any) -> httpx.Response:
    return client.post("/chat/completions", json=request_body(units), **kwargs)


def message_of(response: httpx.Response) -> dict[str, Any]:
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    return choice["message"]


def content_of(response: httpx.Response) -> Any:
    return json.loads(message_of(response)["content"])


def error_of(response: httpx.Response) -> dict[str, Any]:
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "code"}
    assert error["message"]
    return error


def paragraphs(count: int, size: int) -> list[str]:
    return [f"Paragraph {i}: " + "word " * ((size - 14) // 5) for i in range(1, count + 1)]


# -- parsing and the automatic model ---------------------------------------------------------


def test_units_are_parsed_from_a_realistic_message(chat: ChatScript, client: httpx.Client) -> None:
    content = (
        "Split this document into chunks.\nReturn JSON.\n\n"
        "[[1]] # Title\n"
        "[[2]] First paragraph\nspans two lines.\n"
        "[[3]] ```rust\nfn main() {}\n[[9]] not a marker: wrong id\n```\n"
        "[[4]] Last one"
    )
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    assert client.post("/chat/completions", json=body).status_code == 200
    assert chat.units == [
        "# Title",
        "First paragraph\nspans two lines.",
        "```rust\nfn main() {}\n[[9]] not a marker: wrong id\n```",
        "Last one",
    ]
    assert parse_units("no markers here") == []
    assert parse_units("[[1]] a\n\n") == ["a\n"]  # only one trailing newline is stripped


def test_units_come_from_the_last_user_message_and_content_parts(
    chat: ChatScript, client: httpx.Client
) -> None:
    messages = [
        {"role": "user", "content": "[[1]] old"},
        {"role": "assistant", "content": "{}"},
        {"role": "user", "content": [{"type": "text", "text": "[[1]] new\n[[2]] two"}]},
    ]
    response = client.post("/chat/completions", json={"model": MODEL, "messages": messages})
    assert chat.units == ["new", "two"]
    assert [(c["start"], c["end"]) for c in content_of(response)["chunks"]] == [(1, 2)]


def test_automatic_answer_covers_all_units_with_sizes_near_target(
    chat: ChatScript, client: httpx.Client
) -> None:
    units = [*paragraphs(40, 200), "  spaced\n\tout   " + "x" * 200]
    response = complete(client, units)
    assert response.headers["content-type"] == "application/json"
    chunks = content_of(response)["chunks"]
    assert chunks[0]["start"] == 1
    assert chunks[-1]["end"] == len(units)
    for before, after in itertools.pairwise(chunks):
        assert after["start"] == before["end"] + 1
    sizes = [sum(len(u) for u in units[c["start"] - 1 : c["end"]]) for c in chunks]
    assert len(chunks) > 5
    assert all(chat.target <= size <= 1500 for size in sizes[:-1]), sizes
    for chunk in chunks:
        assert 0 < len(chunk["summary"]) <= 80
        assert chunk["summary"] == " ".join(units[chunk["start"] - 1].split())[:80]
    assert automatic_chunks(["  spaced\n\tout  "])["chunks"][0]["summary"] == "spaced out"


def test_automatic_answer_respects_target_and_the_hard_limit(
    chat: ChatScript, client: httpx.Client
) -> None:
    chat.target = 400
    chunks = content_of(complete(client, ["x" * 100] * 10))["chunks"]
    assert [(c["start"], c["end"]) for c in chunks] == [(1, 4), (5, 8), (9, 10)]
    chat.target = 900  # 700 + 700 stays within 1500; 800 + 800 would pass it
    chunks = content_of(complete(client, ["a" * 700, "b" * 700, "c"]))["chunks"]
    assert [(c["start"], c["end"]) for c in chunks] == [(1, 2), (3, 3)]
    chunks = content_of(complete(client, ["a" * 800, "b" * 800, "c" * 2000, "d"]))["chunks"]
    assert [(c["start"], c["end"]) for c in chunks] == [(1, 1), (2, 2), (3, 3), (4, 4)]


def test_no_units_answers_no_chunks(client: httpx.Client) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "nothing numbered"}]}
    assert content_of(client.post("/chat/completions", json=body)) == {"chunks": []}


def test_answer_has_the_openai_completion_shape(client: httpx.Client) -> None:
    body = complete(client, ["alpha", "beta"]).json()
    assert body["id"] == "chatcmpl-standin-1"
    assert body["object"] == "chat.completion"
    assert isinstance(body["created"], int)
    assert abs(body["created"] - time.time()) < 60
    assert body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["index"] == 0
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["role"] == "assistant"
    assert choice["message"]["refusal"] is None
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0
    assert usage["completion_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert complete(client, ["x"]).json()["id"] == "chatcmpl-standin-2"


# -- the scripted queue ----------------------------------------------------------------------


def test_scripted_string_is_returned_verbatim(chat: ChatScript, client: httpx.Client) -> None:
    chat.script.append("Sure! Here are your chunks: {oops")
    assert message_of(complete(client, ["a"]))["content"] == "Sure! Here are your chunks: {oops"


def test_scripted_dict_and_list_are_returned_as_json(
    chat: ChatScript, client: httpx.Client
) -> None:
    answer = {"chunks": [{"start": 1, "end": 1, "summary": "scripted"}]}
    chat.script += [answer, [1, 2]]
    assert content_of(complete(client, ["a", "b"])) == answer
    assert content_of(complete(client, ["a", "b"])) == [1, 2]


def test_scripted_reply_with_an_error_status(chat: ChatScript, client: httpx.Client) -> None:
    chat.script += [ChatReply(status=500), ChatReply(content="overloaded", status=503)]
    first, second = complete(client, ["a"]), complete(client, ["a"])
    assert (first.status_code, second.status_code) == (500, 503)
    assert error_of(first)["type"] == "server_error"
    assert error_of(second)["message"] == "overloaded"
    assert complete(client, ["a"]).status_code == 200


def test_scripted_reply_with_a_refusal(chat: ChatScript, client: httpx.Client) -> None:
    chat.script.append(ChatReply(refusal="I can't help with that."))
    message = message_of(complete(client, ["a"]))
    assert message == {"role": "assistant", "content": None, "refusal": "I can't help with that."}


def test_scripted_reply_cut_off_by_length(chat: ChatScript, client: httpx.Client) -> None:
    chat.script.append(ChatReply(content='{"chunks": [{"start": 1, "en', finish_reason="length"))
    body = complete(client, ["a"]).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"] == '{"chunks": [{"start": 1, "en'


def test_scripted_reply_delay(chat: ChatScript, client: httpx.Client) -> None:
    chat.script.append(ChatReply(content="{}", delay=0.5))
    with pytest.raises(httpx.ReadTimeout):
        complete(client, ["a"], timeout=0.1)
    assert content_of(complete(client, ["a"]))["chunks"] == [{"start": 1, "end": 1, "summary": "a"}]


def test_scripted_callable_gets_the_units(chat: ChatScript, client: httpx.Client) -> None:
    seen: list[list[str]] = []

    def one_chunk(units: list[str]) -> object:
        seen.append(units)
        return {"chunks": [{"start": 1, "end": len(units), "summary": units[-1]}]}

    def broken(units: list[str]) -> object:
        return ChatReply(content="not json " + units[0])

    chat.script += [one_chunk, broken, lambda units: None]
    units = ["one", "two\nlines", "three"]
    assert content_of(complete(client, units)) == {
        "chunks": [{"start": 1, "end": 3, "summary": "three"}]
    }
    assert seen == [units]
    assert message_of(complete(client, units))["content"] == "not json one"
    assert content_of(complete(client, units)) == automatic_chunks(units)  # None: automatic


def test_callable_errors_and_bad_items_are_500_json(chat: ChatScript, client: httpx.Client) -> None:
    def boom(units: list[str]) -> object:
        raise RuntimeError("scripted bug")

    chat.script += [boom, 42]  # type: ignore[list-item]
    first, second = complete(client, ["a"]), complete(client, ["a"])
    assert (first.status_code, second.status_code) == (500, 500)
    assert "scripted bug" in error_of(first)["message"]
    assert "int" in error_of(second)["message"]
    assert complete(client, ["a"]).status_code == 200


def test_queue_is_consumed_in_order_then_the_automatic_model_answers(
    chat: ChatScript, client: httpx.Client
) -> None:
    chat.script += ["first", {"n": 2}, ChatReply(content="third")]
    contents = [message_of(complete(client, ["u1", "u2"]))["content"] for _ in range(4)]
    assert contents[:3] == ["first", '{"n": 2}', "third"]
    assert json.loads(contents[3]) == automatic_chunks(["u1", "u2"])
    assert chat.script == []


# -- switches --------------------------------------------------------------------------------


def test_fail_status_with_fail_times_then_recovers(chat: ChatScript, client: httpx.Client) -> None:
    chat.fail_status, chat.fail_times, chat.retry_after = 429, 2, 1.5
    chat.script.append("kept for later")
    failed = [complete(client, ["a"]) for _ in range(2)]
    assert [r.status_code for r in failed] == [429, 429]
    assert error_of(failed[0])["code"] == "rate_limit_exceeded"
    assert failed[0].headers["retry-after"] == "1.5"
    assert chat.fail_times == 0
    served = complete(client, ["a"])
    assert message_of(served)["content"] == "kept for later"  # failures did not eat the script
    assert "retry-after" not in served.headers
    assert chat.requests == 3


def test_fail_status_without_fail_times_always_fails(
    chat: ChatScript, client: httpx.Client
) -> None:
    chat.fail_status, chat.error_code = 500, "overloaded"
    responses = [complete(client, ["a"]) for _ in range(3)]
    assert [r.status_code for r in responses] == [500, 500, 500]
    assert error_of(responses[0])["code"] == "overloaded"


def test_delay_times_out_a_short_client_and_the_server_keeps_serving(
    chat: ChatScript, client: httpx.Client
) -> None:
    chat.delay = 0.15
    started = time.monotonic()
    assert complete(client, ["slow"]).status_code == 200
    assert time.monotonic() - started >= 0.15
    chat.delay = 0.5
    with pytest.raises(httpx.ReadTimeout):
        complete(client, ["a"], timeout=0.1)
    chat.delay = 0.0
    assert content_of(complete(client, ["after"]))["chunks"][0]["summary"] == "after"
    assert chat.requests == 3


def test_stop_wakes_a_delayed_chat_request() -> None:
    server = StandIn(dimensions=8).start()
    server.chat.delay = 30.0
    took: list[float] = []

    def stop_once_requested() -> None:
        deadline = time.monotonic() + 5.0
        while server.chat.requests == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        started = time.monotonic()
        server.stop()  # joins handler threads for up to 2 s: fast only if the delay woke
        took.append(time.monotonic() - started)

    stopper = threading.Thread(target=stop_once_requested)
    stopper.start()
    try:
        # The woken handler may still answer before its connection is cut, or not: both are fine.
        with contextlib.suppress(httpx.TransportError):
            url = server.base_url + "/chat/completions"
            httpx.post(url, json=request_body(["a"]), timeout=5.0)
    finally:
        stopper.join(5.0)
        server.stop()
    assert took and took[0] < 1.0


def test_reject_json_schema_only_rejects_schemas(chat: ChatScript, client: httpx.Client) -> None:
    chat.reject_json_schema = True
    chat.script.append("scripted")
    rejected = complete(client, ["a"])
    assert rejected.status_code == 400
    error = error_of(rejected)
    assert "response_format json_schema is not supported" in error["message"]
    assert error["type"] == "invalid_request_error"
    body = request_body(["a"], response_format={"type": "json_object"})
    assert message_of(client.post("/chat/completions", json=body))["content"] == "scripted"
    chat.reject_json_schema = False
    assert complete(client, ["a"]).status_code == 200


def test_refusal_switch_answers_every_request_with_a_refusal(
    chat: ChatScript, client: httpx.Client
) -> None:
    chat.refusal = "I'm sorry, I cannot do that."
    chat.script.append("not reached")
    for _ in range(2):
        response = complete(client, ["a"])
        assert message_of(response) == {
            "role": "assistant",
            "content": None,
            "refusal": "I'm sorry, I cannot do that.",
        }
        assert response.json()["choices"][0]["finish_reason"] == "stop"
    assert chat.script == ["not reached"]


def test_switch_precedence_fail_then_reject_then_refusal(
    chat: ChatScript, client: httpx.Client
) -> None:
    chat.fail_status, chat.fail_times = 503, 1
    chat.reject_json_schema, chat.refusal = True, "no"
    assert complete(client, ["a"]).status_code == 503
    assert complete(client, ["a"]).status_code == 400
    body = request_body(["a"], response_format={"type": "json_object"})
    assert message_of(client.post("/chat/completions", json=body))["refusal"] == "no"


# -- malformed requests ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"[1, 2]",
        b"{}",
        b'{"model": "m", "messages": []}',
        b'{"model": "m", "messages": "hi"}',
        b'{"model": 5, "messages": [{"role": "user", "content": "[[1]] a"}]}',
    ],
)
def test_malformed_requests_are_400_json(
    chat: ChatScript, client: httpx.Client, body: bytes
) -> None:
    chat.script.append("not reached")
    response = client.post(
        "/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert error_of(response)["type"] == "invalid_request_error"
    assert chat.requests == 1
    assert chat.script == ["not reached"]


def test_get_on_the_chat_path_is_404(client: httpx.Client) -> None:
    assert client.get("/chat/completions").status_code == 404


# -- counters, reset and living beside embeddings --------------------------------------------


def test_counters_record_requests_bodies_and_last_units(
    chat: ChatScript, client: httpx.Client
) -> None:
    chat.fail_status, chat.fail_times = 500, 1
    first, second = request_body(["lost"]), request_body(["kept", "too"])
    headers = {"Authorization": "Bearer sk-test"}
    assert client.post("/chat/completions", json=first, headers=headers).status_code == 500
    assert client.post("/chat/completions", json=second, headers=headers).status_code == 200
    client.post("/chat/completions", content=b"nope")
    assert chat.requests == 3
    assert chat.bodies == [first, second]
    assert chat.units == []
    assert [h["authorization"] for h in chat.headers[:2]] == ["Bearer sk-test"] * 2


def test_reset_clears_chat_counters_script_and_switches(
    standin: StandIn, client: httpx.Client
) -> None:
    chat = standin.chat
    complete(client, ["a", "b"])
    chat.delay, chat.fail_status, chat.fail_times, chat.retry_after = 0.01, 500, 3, 2
    chat.error_code, chat.reject_json_schema, chat.refusal = "x", True, "no"
    chat.target, chat.max_chars, chat.script = 10, 20, ["left over"]
    standin.reset()
    assert standin.chat is chat
    assert (chat.requests, chat.bodies, chat.headers, chat.units, chat.script) == (
        0,
        [],
        [],
        [],
        [],
    )
    assert (chat.delay, chat.fail_status, chat.fail_times, chat.retry_after) == (
        0.0,
        None,
        None,
        None,
    )
    assert (chat.error_code, chat.reject_json_schema, chat.refusal) == (None, False, None)
    assert (chat.target, chat.max_chars) == (900, 1500)
    assert content_of(complete(client, ["a", "b"])) == automatic_chunks(["a", "b"])


def test_embeddings_still_work_alongside_chat(standin: StandIn, client: httpx.Client) -> None:
    standin.chat.fail_status = 503
    assert complete(client, ["a"]).status_code == 503
    response = client.post("/embeddings", json={"model": "e", "input": ["x"]})
    assert response.status_code == 200
    assert response.json()["data"][0]["embedding"] == vector_for("x", 8)
    standin.fail_status = 500
    standin.chat.fail_status = None
    assert complete(client, ["a"]).status_code == 200
    assert client.post("/embeddings", json={"model": "e", "input": ["x"]}).status_code == 500
    assert (standin.requests, standin.chat.requests) == (2, 2)
    assert standin.texts == ["x"]
