"""The OpenAI-compatible embeddings provider: parsing, retry policy, validation, real HTTP.

Unit tests drive `OpenAIEmbeddings` through `httpx.MockTransport` with a recording `sleep` and
`rand=lambda: 1.0`, so nothing really sleeps and every backoff is exact. The second half talks
to the loopback stand-in (`testkit.standin.StandIn`) over real sockets, with no mocks at all.
"""

from __future__ import annotations

import base64
import calendar
import email.utils
import json
import os
import socket
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from testkit.standin import StandIn, vector_for
from tests.conftest import DIMS, standin_settings
from worker.errors import (
    BadAnswer,
    PermanentProviderError,
    ProviderError,
    TimedOut,
    TransientProviderError,
)
from worker.providers.base import Hooks, backoff_delay
from worker.providers.openai import (
    USER_AGENT,
    OpenAIEmbeddings,
    ProviderHTTPError,
    RetryLater,
    parse_retry_after,
)
from worker.settings import EmbeddingSettings

KEY = "sk-test-key-not-for-logs"
BASE = "https://embed.test/v1"
MOCK_DIMS = 4

Step = Callable[[httpx.Request], httpx.Response]


# -- helpers for the mock transport ----------------------------------------------------------


def texts_of(request: httpx.Request) -> list[str]:
    return list(json.loads(request.content)["input"])


def expected(texts: list[str], dims: int = MOCK_DIMS) -> np.ndarray:
    return np.asarray([vector_for(t, dims) for t in texts], dtype=np.float32)


def answer(
    *, reverse: bool = False, dims: int = MOCK_DIMS, edit: Callable[[list[Any]], Any] | None = None
) -> Step:
    """A 200 with one `vector_for` embedding per input (optionally reversed or edited)."""

    def step(request: httpx.Request) -> httpx.Response:
        data: list[Any] = [
            {"object": "embedding", "index": i, "embedding": vector_for(t, dims)}
            for i, t in enumerate(texts_of(request))
        ]
        if reverse:
            data.reverse()
        payload = {"object": "list", "data": edit(data) if edit else data}
        return httpx.Response(200, json=payload)

    return step


def status(
    code: int,
    *,
    error: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    content: bytes | None = None,
) -> Step:
    """An error answer with an OpenAI-style body (or the raw `content`)."""

    def step(request: httpx.Request) -> httpx.Response:
        if content is not None:
            return httpx.Response(code, content=content, headers=headers)
        body = {"error": error or {"message": f"fault {code}", "type": "server_error"}}
        return httpx.Response(code, json=body, headers=headers)

    return step


def raw(content: bytes, code: int = 200) -> Step:
    return lambda request: httpx.Response(
        code, content=content, headers={"content-type": "application/json"}
    )


def fail(exc: type[httpx.TransportError]) -> Step:
    def step(request: httpx.Request) -> httpx.Response:
        raise exc("simulated", request=request)

    return step


class Script:
    """Answers requests with the given steps in turn, then with `then` for ever after."""

    def __init__(self, *steps: Step, then: Step | None = None) -> None:
        self.steps = list(steps)
        self.then = then or answer()
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        step = self.steps.pop(0) if self.steps else self.then
        return step(request)

    @property
    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests]


def mock_settings(**overrides: Any) -> EmbeddingSettings:
    values: dict[str, Any] = {
        "provider": "openai",
        "model": "standin-embed",
        "base_url": BASE,
        "api_key": KEY,
        "batch_size": 8,
        "max_retries": 2,
        "backoff": 0.5,
        "backoff_max": 20.0,
        "retry_after_max": 60.0,
        "timeout": 5.0,
    }
    values.update(overrides)
    return EmbeddingSettings(**values)


Build = Callable[..., tuple[OpenAIEmbeddings, list[float]]]


@pytest.fixture
def build() -> Iterator[Build]:
    """A model over a MockTransport expecting `expect` dimensions: (model, sleeps)."""
    models: list[OpenAIEmbeddings] = []

    def make(
        script: Script, *, expect: int | None = MOCK_DIMS, rand: float = 1.0, **overrides: Any
    ) -> tuple[OpenAIEmbeddings, list[float]]:
        settings = mock_settings(**overrides)
        sleeps: list[float] = []
        client = httpx.Client(transport=httpx.MockTransport(script), base_url=settings.base_url)
        model = OpenAIEmbeddings(
            settings,
            dimensions=expect,
            client=client,
            hooks=Hooks(sleep=sleeps.append),
            rand=lambda: rand,
        )
        models.append(model)
        return model, sleeps

    yield make
    for model in models:
        model.close()


# -- answers and requests --------------------------------------------------------------------


def test_results_follow_index_when_data_comes_shuffled(build: Build) -> None:
    script = Script(then=answer(reverse=True))
    model, _ = build(script)
    texts = ["alpha", "beta", "gamma", "delta"]
    sent = answer(reverse=True)(_request(texts)).json()["data"]
    assert [item["index"] for item in sent] == [3, 2, 1, 0]  # the answer really is reversed
    np.testing.assert_array_equal(model.embed_checked(texts), expected(texts))
    assert model.embed_batch(texts) == [vector_for(t, MOCK_DIMS) for t in texts]


def test_results_follow_index_in_any_permutation(build: Build) -> None:
    order = [2, 0, 3, 1]
    model, _ = build(Script(then=answer(edit=lambda data: [data[i] for i in order])))
    texts = ["a", "bb", "ccc", "dddd"]
    np.testing.assert_array_equal(model.embed_checked(texts), expected(texts))


def test_items_without_index_are_taken_in_position(build: Build) -> None:
    def drop_index(data: list[Any]) -> list[Any]:
        return [{"embedding": item["embedding"]} for item in data]

    model, _ = build(Script(then=answer(edit=drop_index)))
    np.testing.assert_array_equal(model.embed_checked(["x", "y"]), expected(["x", "y"]))


def _request(texts: list[str]) -> httpx.Request:
    return httpx.Request("POST", BASE + "/embeddings", json={"input": texts})


def test_request_is_a_post_to_embeddings_asking_for_base64(build: Build) -> None:
    script = Script()
    model, _ = build(script, model="text-embedding-3-small")
    model.embed_checked(["one", "two"])
    (request,) = script.requests
    assert request.method == "POST"
    assert str(request.url) == BASE + "/embeddings"
    body = json.loads(request.content)
    assert body["model"] == "text-embedding-3-small"
    assert body["input"] == ["one", "two"]
    assert body["encoding_format"] == "base64"


def b64(vector: list[float]) -> str:
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


def test_base64_vectors_are_decoded_as_little_endian_float32(build: Build) -> None:
    def encode(data: list[Any]) -> list[Any]:
        return [{**item, "embedding": b64(item["embedding"])} for item in data]

    model, _ = build(Script(then=answer(edit=encode, reverse=True)))
    texts = ["a", "bb", "ccc"]
    np.testing.assert_array_equal(model.embed_checked(texts), expected(texts))


@pytest.mark.parametrize(
    ("embedding", "why"),
    [("not base64 at all!", "is not base64"), (base64.b64encode(b"12345").decode(), "5 bytes")],
)
def test_a_broken_base64_vector_is_a_bad_answer(build: Build, embedding: str, why: str) -> None:
    def garble(data: list[Any]) -> list[Any]:
        return [{**item, "embedding": embedding} for item in data]

    model, _ = build(Script(then=answer(edit=garble)))
    with pytest.raises(BadAnswer, match=why) as caught:
        model.embed_checked(["x"])
    assert caught.value.per_input


def test_a_server_refusing_base64_is_asked_for_floats_from_then_on(build: Build) -> None:
    refuse = status(400, error={"message": "'encoding_format' must be 'float'", "type": "invalid"})
    script = Script(refuse)
    model, _ = build(script)
    texts = ["one", "two"]
    np.testing.assert_array_equal(model.embed_checked(texts), expected(texts))
    model.embed_checked(["three"])
    assert [b.get("encoding_format") for b in script.bodies] == ["base64", None, None]


def test_another_400_is_not_taken_for_a_base64_refusal(build: Build) -> None:
    script = Script(status(400, error={"message": "input too long", "type": "invalid"}))
    model, _ = build(script)
    with pytest.raises(ProviderHTTPError, match="input too long"):
        model.embed_checked(["x"])
    assert len(script.requests) == 1 and model.encoding_format == "base64"


def test_float_encoding_by_setting_sends_none_and_reads_lists(build: Build) -> None:
    script = Script()
    model, _ = build(script, encoding_format="float")
    np.testing.assert_array_equal(model.embed_checked(["x"]), expected(["x"]))
    assert "encoding_format" not in script.bodies[0]


@pytest.mark.parametrize(
    ("model_name", "dimensions", "sent"),
    [
        ("text-embedding-3-small", 256, True),
        ("text-embedding-3-large", 1024, True),
        ("some-unknown-model", 4, True),
        ("text-embedding-ada-002", 1536, False),
        ("nomic-embed-text", 768, False),
        ("text-embedding-3-small", None, False),
        ("some-unknown-model", None, False),
    ],
)
def test_dimensions_sent_only_when_the_settings_say_so(
    build: Build, model_name: str, dimensions: int | None, sent: bool
) -> None:
    script = Script()
    model, _ = build(script, expect=None, model=model_name, dimensions=dimensions)
    assert model.settings.sends_dimensions() is sent
    model.embed_checked(["x"])
    (body,) = script.bodies
    if sent:
        assert body["dimensions"] == dimensions
    else:
        assert "dimensions" not in body


def test_sends_dimensions_needs_the_openai_provider() -> None:
    local = EmbeddingSettings(provider="local", model="some-unknown-model", dimensions=8)
    assert local.sends_dimensions() is False
    assert mock_settings(model="some-unknown-model", dimensions=8).sends_dimensions() is True


def test_default_client_carries_key_user_agent_timeouts_and_base_url() -> None:
    settings = mock_settings(timeout=7.5, connect_timeout=1.5)
    model = OpenAIEmbeddings(settings, dimensions=MOCK_DIMS)
    try:
        assert model.client.headers["authorization"] == f"Bearer {KEY}"
        assert model.client.headers["user-agent"] == USER_AGENT
        assert model.client.timeout.read == 7.5
        assert model.client.timeout.connect == 1.5
        assert str(model.client.base_url).rstrip("/") == BASE
    finally:
        model.close()


@pytest.mark.parametrize("api_key", [None, ""])
def test_no_authorization_header_without_a_key(api_key: str | None) -> None:
    model = OpenAIEmbeddings(mock_settings(api_key=api_key), dimensions=MOCK_DIMS)
    try:
        assert "authorization" not in model.client.headers
        assert model.client.headers["user-agent"] == USER_AGENT
    finally:
        model.close()


def test_injected_client_still_sends_key_and_user_agent(build: Build) -> None:
    script = Script()
    model, _ = build(script)
    model.embed_checked(["x"])
    (request,) = script.requests
    assert request.headers["authorization"] == f"Bearer {KEY}"
    assert request.headers["user-agent"] == USER_AGENT


# -- retry policy ----------------------------------------------------------------------------


# 507, 520-529: an origin's or a gateway's passing errors (Cloudflare's 522, "overloaded" 529)
@pytest.mark.parametrize("code", [408, 409, 429, 500, 502, 503, 504, 507, 520, 522, 529])
def test_retryable_status_is_retried_then_transient(build: Build, code: int) -> None:
    error = {"message": "busy, try again", "type": "server_error", "code": "rate_limit_exceeded"}
    script = Script(then=status(code, error=error))
    model, sleeps = build(script, max_retries=2)
    with pytest.raises(TransientProviderError) as info:
        model.embed_checked(["x"])
    assert len(script.requests) == 3
    assert sleeps == [0.5, 1.0]
    message = str(info.value)
    assert f"HTTP {code}" in message
    assert "3 attempts" in message
    assert "busy, try again" in message
    assert not isinstance(info.value, PermanentProviderError)
    assert isinstance(info.value, RetryLater)
    assert info.value.retry_after is None


@pytest.mark.parametrize("code", [408, 429, 500, 503])
def test_retryable_status_recovers_on_retry(build: Build, code: int) -> None:
    script = Script(status(code), status(code))
    model, sleeps = build(script, max_retries=2)
    np.testing.assert_array_equal(model.embed_checked(["x", "y"]), expected(["x", "y"]))
    assert len(script.requests) == 3
    assert sleeps == [0.5, 1.0]
    assert script.bodies[0] == script.bodies[2]


def test_no_retries_when_max_retries_is_zero(build: Build) -> None:
    script = Script(then=status(503))
    model, sleeps = build(script, max_retries=0)
    with pytest.raises(TransientProviderError, match=r"HTTP 503.*after 1 attempts"):
        model.embed_checked(["x"])
    assert len(script.requests) == 1
    assert sleeps == []


@pytest.mark.parametrize(
    ("code", "per_input"),
    [
        *[(400, True), (401, False), (403, False), (404, False), (413, True), (422, True)],
        *[(501, False), (505, False)],  # what the server cannot do, asked again
    ],
)
def test_permanent_status_is_never_retried(build: Build, code: int, per_input: bool) -> None:
    error = {"message": "you cannot do that", "type": "invalid_request_error", "code": "nope"}
    script = Script(then=status(code, error=error, headers={"Retry-After": "1"}))
    model, sleeps = build(script, max_retries=3)
    with pytest.raises(ProviderHTTPError) as info:
        model.embed_checked(["x"])
    assert len(script.requests) == 1
    assert sleeps == []
    assert isinstance(info.value, PermanentProviderError)
    assert not isinstance(info.value, TransientProviderError)
    assert info.value.status == code
    assert info.value.per_input is per_input
    assert f"HTTP {code} nope: you cannot do that" in str(info.value)


def test_error_message_from_a_non_json_body_is_collapsed(build: Build) -> None:
    body = b"<html>\n  Bad   request\n</html>"
    model, _ = build(Script(then=status(400, content=body)))
    with pytest.raises(ProviderHTTPError, match=r"HTTP 400: <html> Bad request </html>"):
        model.embed_checked(["x"])


def test_error_message_is_cut_to_200_characters(build: Build) -> None:
    error = {"message": "y" * 1000, "type": "invalid_request_error"}
    model, _ = build(Script(then=status(400, error=error)))
    with pytest.raises(ProviderHTTPError) as info:
        model.embed_checked(["x"])
    assert "y" * 200 in str(info.value)
    assert "y" * 201 not in str(info.value)


@pytest.mark.parametrize(
    "error",
    [
        {"message": "You exceeded your current quota", "type": "x", "code": "insufficient_quota"},
        {"message": "You exceeded your current quota", "type": "insufficient_quota"},
        {"message": "insufficient_quota: check your plan and billing details"},
    ],
)
def test_429_with_exhausted_quota_is_not_retried(build: Build, error: dict[str, Any]) -> None:
    script = Script(then=status(429, error=error, headers={"Retry-After": "1"}))
    model, sleeps = build(script, max_retries=3)
    with pytest.raises(ProviderHTTPError) as info:
        model.embed_checked(["x"])
    assert len(script.requests) == 1
    assert sleeps == []
    assert info.value.status == 429
    assert info.value.per_input is False
    assert not isinstance(info.value, TransientProviderError)


@pytest.mark.parametrize(
    ("headers", "wait"),
    [
        ({"Retry-After": "7"}, 7.0),
        ({"Retry-After": "2.5"}, 2.5),
        ({"retry-after-ms": "1500"}, 1.5),
        ({"retry-after-ms": "250", "Retry-After": "9"}, 0.25),
        ({"Retry-After": "60"}, 60.0),  # exactly the cap is still honoured
    ],
)
def test_retry_after_is_honoured_under_the_cap(
    build: Build, headers: dict[str, str], wait: float
) -> None:
    script = Script(status(429, headers=headers))
    model, sleeps = build(script, retry_after_max=60.0)
    np.testing.assert_array_equal(model.embed_checked(["x"]), expected(["x"]))
    assert len(script.requests) == 2
    assert sleeps == [wait]


def test_retry_after_as_http_date_is_honoured(build: Build) -> None:
    date = email.utils.formatdate(time.time() + 10, usegmt=True)
    script = Script(status(503, headers={"Retry-After": date}))
    model, sleeps = build(script)
    model.embed_checked(["x"])
    assert len(script.requests) == 2
    (wait,) = sleeps
    assert 8.0 < wait <= 10.0  # the date has whole seconds


def test_retry_after_is_honoured_on_every_retry(build: Build) -> None:
    script = Script(then=status(503, headers={"Retry-After": "3"}))
    model, sleeps = build(script, max_retries=3)
    with pytest.raises(RetryLater, match="after 4 attempts"):
        model.embed_checked(["x"])
    assert sleeps == [3.0, 3.0, 3.0]
    assert len(script.requests) == 4


@pytest.mark.parametrize(
    ("headers", "wait"),
    [
        ({"Retry-After": "120"}, 120.0),
        ({"retry-after-ms": "90000"}, 90.0),
        ({"Retry-After": "60.5"}, 60.5),
    ],
)
def test_retry_after_above_the_cap_raises_at_once(
    build: Build, headers: dict[str, str], wait: float
) -> None:
    script = Script(then=status(429, headers=headers))
    model, sleeps = build(script, max_retries=4, retry_after_max=60.0)
    with pytest.raises(RetryLater) as info:
        model.embed_checked(["x"])
    assert len(script.requests) == 1
    assert sleeps == []
    assert info.value.retry_after == wait
    assert isinstance(info.value, TransientProviderError)
    assert f"asked to wait {wait:g}s" in str(info.value)
    assert "HTTP 429" in str(info.value)


def test_retry_after_is_honoured_up_to_the_cap_in_all_not_each(build: Build) -> None:
    """Every 429 asking 60 s, the cap: a call waited 4 x 60 s, three calls of a batch 720 s,
    past the task's soft time limit, instead of leaving the wait to the queue."""
    script = Script(then=status(429, headers={"Retry-After": "25"}))
    model, sleeps = build(script, max_retries=4, retry_after_max=60.0)
    with pytest.raises(RetryLater) as info:
        model.embed_checked(["x"])
    assert sleeps == [25.0, 25.0]  # a third would make 75 s in all
    assert len(script.requests) == 3
    assert info.value.retry_after == 25.0


def test_retry_after_date_above_the_cap_raises_at_once(build: Build) -> None:
    date = email.utils.formatdate(time.time() + 3600, usegmt=True)
    script = Script(then=status(503, headers={"Retry-After": date}))
    model, sleeps = build(script, retry_after_max=60.0)
    with pytest.raises(RetryLater) as info:
        model.embed_checked(["x"])
    assert sleeps == []
    assert info.value.retry_after is not None
    assert 3590 < info.value.retry_after <= 3600


def test_exponential_backoff_capped_without_retry_after(build: Build) -> None:
    script = Script(then=status(500))
    model, sleeps = build(script, max_retries=6, backoff=0.5, backoff_max=5.0)
    with pytest.raises(TransientProviderError, match="after 7 attempts"):
        model.embed_checked(["x"])
    assert sleeps == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert len(script.requests) == 7


def test_backoff_is_scaled_by_the_jitter(build: Build) -> None:
    script = Script(then=status(502))
    model, sleeps = build(script, max_retries=3, backoff=1.0, backoff_max=100.0, rand=0.25)
    with pytest.raises(TransientProviderError):
        model.embed_checked(["x"])
    assert sleeps == [0.25, 0.5, 1.0]


@pytest.mark.parametrize(
    "headers",
    [
        {"Retry-After": "soon"},
        # no wait above 0: requests sent back to back, with no backoff at all
        {"Retry-After": "-5"},
        {"retry-after-ms": "-5000"},
        {"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"},
    ],
)
def test_unparsable_retry_after_falls_back_to_backoff(
    build: Build, headers: dict[str, str]
) -> None:
    script = Script(status(503, headers=headers), status(503, headers=headers))
    model, sleeps = build(script, backoff=0.5)
    model.embed_checked(["x"])
    assert sleeps == [0.5, 1.0]


@pytest.mark.parametrize(
    ("attempt", "base", "cap", "rand", "delay"),
    [
        (0, 0.5, 20.0, 1.0, 0.5),
        (3, 0.5, 20.0, 1.0, 4.0),
        (10, 0.5, 20.0, 1.0, 20.0),
        (2, 1.0, 20.0, 0.5, 2.0),
        (5, 1.0, 20.0, 0.0, 0.0),
        (1, 0.0, 20.0, 1.0, 0.0),
    ],
)
def test_backoff_delay(attempt: int, base: float, cap: float, rand: float, delay: float) -> None:
    assert backoff_delay(attempt, base, cap, rand) == delay


@pytest.mark.parametrize(
    ("exc", "cause"),
    [
        (httpx.ReadTimeout, "timed out after 5s"),
        (httpx.ConnectTimeout, "timed out"),
        (httpx.WriteTimeout, "timed out"),
        (httpx.PoolTimeout, "timed out"),
        (httpx.ConnectError, "connection failed (ConnectError: simulated)"),
        (httpx.ReadError, "connection failed (ReadError: simulated)"),
        (httpx.RemoteProtocolError, "connection failed (RemoteProtocolError: simulated)"),
    ],
)
def test_timeouts_and_connection_errors_are_retried(
    build: Build, exc: type[httpx.TransportError], cause: str
) -> None:
    script = Script(then=fail(exc))
    model, sleeps = build(script, max_retries=2)
    with pytest.raises(TransientProviderError) as info:
        model.embed_checked(["x"])
    # no answer in time: TimedOut (a batch of several texts would go again in halves)
    assert isinstance(info.value, TimedOut) == (exc in (httpx.ReadTimeout, httpx.WriteTimeout))
    assert len(script.requests) == 3
    assert sleeps == [0.5, 1.0]
    assert cause in str(info.value)
    assert "after 3 attempts" in str(info.value)


@pytest.mark.parametrize("exc", [httpx.ReadTimeout, httpx.ConnectError])
def test_timeout_or_connection_error_recovers(
    build: Build, exc: type[httpx.TransportError]
) -> None:
    script = Script(fail(exc))
    model, sleeps = build(script, max_retries=1)
    np.testing.assert_array_equal(model.embed_checked(["x"]), expected(["x"]))
    assert len(script.requests) == 2
    assert sleeps == [0.5]


def test_last_failure_is_the_one_reported(build: Build) -> None:
    script = Script(fail(httpx.ReadTimeout), then=status(502))
    model, _ = build(script, max_retries=1)
    with pytest.raises(RetryLater) as info:
        model.embed_checked(["x"])
    assert "HTTP 502" in str(info.value)
    assert "timed out" not in str(info.value)


# -- unusable answers ------------------------------------------------------------------------


def _repeat_first(data: list[Any]) -> list[Any]:
    return [data[0], {**data[1], "index": 0}]


@pytest.mark.parametrize(
    ("step", "match"),
    [
        (lambda r: httpx.Response(200, json={"object": "list"}), "no 'data' list"),
        (lambda r: httpx.Response(200, json={"data": None}), "no 'data' list"),
        (lambda r: httpx.Response(200, json={"data": "vectors"}), "no 'data' list"),
        (lambda r: httpx.Response(200, json=[[0.1, 0.2]]), "no 'data' list"),
        (raw(b"null"), "no 'data' list"),
        (answer(edit=_repeat_first), "repeated index 0"),
        (answer(edit=lambda d: [{**d[0], "index": "0"}, d[1]]), "bad or repeated index '0'"),
        (answer(edit=lambda d: d[:1]), "asked for 2 vectors, got 1"),
        (answer(edit=lambda d: [*d, {"index": 2, "embedding": [1.0] * 4}]), "got 3"),
        (answer(edit=lambda d: [{**d[0], "index": 1}, {**d[1], "index": 2}]), "not 0 to 1"),
        (answer(edit=lambda d: []), "asked for 2 vectors, got 0"),
        (answer(edit=lambda d: [d[0], {"index": 1}]), "item 1 of 'data' has no embedding"),
        (answer(edit=lambda d: [d[0], "vector"]), "item 1 of 'data' has no embedding"),
        (answer(edit=lambda d: [{**d[0], "embedding": "AAAA"}, d[1]]), "item 0"),
    ],
)
def test_unusable_answer_is_bad_answer_and_not_retried(
    build: Build, step: Step, match: str
) -> None:
    script = Script(then=step)
    model, sleeps = build(script, max_retries=3)
    with pytest.raises(BadAnswer, match=match):
        model.embed_checked(["x", "y"])
    assert len(script.requests) == 1
    assert sleeps == []


@pytest.mark.parametrize(
    "body", [b"<html>oops</html>", b"", b'{"data": [', b"\xff\xfe\xfa garbage"]
)
def test_a_200_that_is_not_json_is_asked_again_then_refused(build: Build, body: bytes) -> None:
    """A gateway's or a proxy's page in place of the answer, once: asked again as a 5xx is
    (a BadAnswer at once failed every item of a bulk run); the same every time: BadAnswer."""
    script = Script(raw(body), then=answer())
    model, sleeps = build(script, max_retries=3)
    assert len(model.embed_checked(["x", "y"])) == 2
    assert len(script.requests) == 2 and len(sleeps) == 1
    script = Script(then=raw(body))
    model, sleeps = build(script, max_retries=3)
    with pytest.raises(BadAnswer, match=r"not JSON.*after 4 attempts") as info:
        model.embed_checked(["x", "y"])
    assert len(script.requests) == 4 and info.value.per_input is False


@pytest.mark.parametrize(
    "error", [{"message": "upstream timed out", "code": 504}, "upstream timed out"]
)
def test_a_200_carrying_an_error_is_transient_in_the_server_s_words(build: Build, error) -> None:
    script = Script(then=lambda r: httpx.Response(200, json={"error": error}))
    model, _ = build(script, max_retries=3)
    with pytest.raises(TransientProviderError, match="the answer is an error: upstream timed"):
        model.embed_checked(["x", "y"])


# -- validation in the base class ------------------------------------------------------------


def test_wrong_dimension_is_bad_answer_for_the_whole_batch(build: Build) -> None:
    model, _ = build(Script(then=answer(dims=4)), expect=8)
    with pytest.raises(BadAnswer) as info:
        model.embed_checked(["x", "y"])
    assert info.value.per_input is False
    message = str(info.value)
    assert "4 dimensions" in message
    assert "expects 8" in message


def test_unknown_dimension_accepts_what_comes(build: Build) -> None:
    model, _ = build(Script(then=answer(dims=5)), expect=None)
    assert model.embed_checked(["x"]).shape == (1, 5)


@pytest.mark.parametrize("token", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_finite_values_are_bad_answer(build: Build, token: bytes) -> None:
    body = b'{"data": [{"index": 0, "embedding": [0.1, 0.2, %s, 0.4]}]}' % token
    script = Script(then=raw(body))
    model, sleeps = build(script)
    with pytest.raises(BadAnswer, match="NaN or infinite") as info:
        model.embed_checked(["x"])
    assert info.value.per_input is True
    assert len(script.requests) == 1
    assert sleeps == []


def test_unequal_vectors_or_non_numbers_are_bad_answer(build: Build) -> None:
    for edit in (
        lambda d: [d[0], {**d[1], "embedding": d[1]["embedding"][:2]}],
        lambda d: [d[0], {**d[1], "embedding": ["a", "b", "c", "d"]}],
    ):
        model, _ = build(Script(then=answer(edit=edit)))
        with pytest.raises(BadAnswer, match=r"unequal length or not numbers|values that are not"):
            model.embed_checked(["x", "y"])


def test_empty_vectors_are_bad_answer(build: Build) -> None:
    model, _ = build(Script(then=answer(edit=lambda d: [{**d[0], "embedding": []}])), expect=None)
    with pytest.raises(BadAnswer, match="empty vectors"):
        model.embed_checked(["x"])


def test_embed_splits_into_batches_of_batch_size(build: Build) -> None:
    script = Script()
    model, _ = build(script, batch_size=3)
    texts = [f"text {i}" for i in range(8)]
    vectors = model.embed(texts)
    assert [texts_of(r) for r in script.requests] == [texts[0:3], texts[3:6], texts[6:8]]
    assert vectors.dtype == np.float32
    np.testing.assert_array_equal(vectors, expected(texts))


def test_embed_of_nothing_makes_no_request(build: Build) -> None:
    script = Script()
    model, _ = build(script)
    assert model.embed([]).shape == (0, MOCK_DIMS)
    assert script.requests == []


def test_embed_stops_at_the_first_failing_batch(build: Build) -> None:
    script = Script(answer(), status(401))
    model, _ = build(script, batch_size=2)
    with pytest.raises(ProviderHTTPError):
        model.embed(["a", "b", "c", "d", "e", "f"])
    assert len(script.requests) == 2


# -- parse_retry_after -----------------------------------------------------------------------

NOW = calendar.timegm((2015, 10, 21, 7, 28, 0))


@pytest.mark.parametrize(
    ("headers", "wait"),
    [
        ({}, None),
        ({"Retry-After": ""}, None),
        ({"Retry-After": "soon"}, None),
        ({"Retry-After": "5"}, 5.0),
        ({"Retry-After": "0"}, None),  # no wait above 0: the backoff decides
        ({"Retry-After": "1.5"}, 1.5),
        ({"Retry-After": " 3 "}, 3.0),
        ({"Retry-After": "-3"}, None),
        ({"retry-after-ms": "250"}, 0.25),
        ({"Retry-After-Ms": "2000"}, 2.0),
        ({"retry-after-ms": "0"}, None),
        ({"retry-after-ms": "-10"}, None),
        ({"retry-after-ms": "-10", "Retry-After": "4"}, 4.0),
        ({"retry-after-ms": "abc"}, None),
        ({"retry-after-ms": "abc", "Retry-After": "4"}, 4.0),
        ({"retry-after-ms": "", "Retry-After": "2"}, 2.0),
        ({"retry-after-ms": "100", "Retry-After": "9"}, 0.1),
        ({"Retry-After": "Wed, 21 Oct 2015 07:28:30 GMT"}, 30.0),
        ({"Retry-After": "Wed, 21 Oct 2015 07:27:00 GMT"}, None),  # in the past
        ({"Retry-After": "Wed, 21 Oct 2015 09:28:10 +0200"}, 10.0),
        ({"Retry-After": "Wednesday, 21-Oct-15 07:28:20 GMT"}, 20.0),  # RFC 850
        ({"Retry-After": "Wed, 21 Oct 2015 25:28:00 GMT"}, None),
        ({"Retry-After": "Wed, 32 Foo 2015"}, None),
    ],
)
def test_parse_retry_after(headers: dict[str, str], wait: float | None) -> None:
    assert parse_retry_after(httpx.Headers(headers), now=NOW) == wait


def test_parse_retry_after_date_uses_the_clock_without_now() -> None:
    date = email.utils.formatdate(time.time() + 100, usegmt=True)
    wait = parse_retry_after(httpx.Headers({"Retry-After": date}))
    assert wait is not None
    assert 98.0 < wait <= 100.0


@pytest.fixture
def local_time_utc_minus_5() -> Iterator[None]:
    old = os.environ.get("TZ")
    os.environ["TZ"] = "EST5"  # POSIX: five hours west of UTC, no zoneinfo file needed
    time.tzset()
    try:
        yield
    finally:
        if old is None:
            del os.environ["TZ"]
        else:
            os.environ["TZ"] = old
        time.tzset()


def test_parse_retry_after_gmt_date_ignores_local_time(local_time_utc_minus_5: None) -> None:
    headers = httpx.Headers({"Retry-After": "Wed, 21 Oct 2015 07:28:30 GMT"})
    assert parse_retry_after(headers, now=NOW) == 30.0


def test_parse_retry_after_asctime_date_is_gmt(local_time_utc_minus_5: None) -> None:
    headers = httpx.Headers({"Retry-After": "Wed Oct 21 07:28:30 2015"})
    assert parse_retry_after(headers, now=NOW) == 30.0


@pytest.mark.parametrize("name", ["Retry-After", "retry-after-ms"])
@pytest.mark.parametrize("value", ["inf", "nan"])
def test_parse_retry_after_rejects_non_finite_values(name: str, value: str) -> None:
    assert parse_retry_after(httpx.Headers({name: value}), now=NOW) is None


# -- the key stays out of messages -----------------------------------------------------------


def _messages(exc: BaseException) -> list[str]:
    """The text of an exception and of everything chained to it."""
    seen: list[str] = []
    current: BaseException | None = exc
    while current is not None and len(seen) < 10:
        seen += [str(current), repr(current), *map(str, current.args)]
        current = current.__cause__ or current.__context__
    return seen


def test_key_echoed_by_the_server_is_not_in_the_message(build: Build) -> None:
    error = {"message": f"Incorrect API key provided: {KEY}.", "code": "invalid_api_key"}
    model, _ = build(Script(then=status(401, error=error)))
    with pytest.raises(ProviderHTTPError) as info:
        model.embed_checked(["x"])
    assert not any(KEY in text for text in _messages(info.value))


# -- over real HTTP, against the stand-in ----------------------------------------------------


@pytest.fixture
def real(standin: StandIn) -> Iterator[Callable[..., OpenAIEmbeddings]]:
    """OpenAIEmbeddings with its own httpx client, pointed at the stand-in."""
    models: list[OpenAIEmbeddings] = []

    def make(**overrides: Any) -> OpenAIEmbeddings:
        model = OpenAIEmbeddings(standin_settings(standin, **overrides), dimensions=DIMS)
        models.append(model)
        return model

    yield make
    for model in models:
        model.close()


TEXTS = ["The Rust book", "ownership and borrowing", "é ü ß", "", "traits\nand generics"]


def test_real_batch_returns_the_standin_vectors_in_order(
    standin: StandIn, real: Callable[..., OpenAIEmbeddings]
) -> None:
    vectors = real().embed(TEXTS)
    np.testing.assert_array_equal(vectors, expected(TEXTS, DIMS))
    assert standin.requests == 1
    assert standin.texts == TEXTS
    (body,) = standin.bodies
    assert body["encoding_format"] == "base64"
    assert body["dimensions"] == DIMS
    assert body["model"] == "standin-embed"
    # Asked for floats, the same vectors come back as JSON numbers.
    np.testing.assert_array_equal(real(encoding_format="float").embed(TEXTS), vectors)
    assert "encoding_format" not in standin.bodies[-1]


def test_real_shuffled_answer_is_still_ordered(
    standin: StandIn, real: Callable[..., OpenAIEmbeddings]
) -> None:
    standin.shuffle = True
    np.testing.assert_array_equal(real().embed(TEXTS), expected(TEXTS, DIMS))


def test_real_batches_of_batch_size(
    standin: StandIn, real: Callable[..., OpenAIEmbeddings]
) -> None:
    texts = [f"chunk {i}" for i in range(19)]
    np.testing.assert_array_equal(real(batch_size=8).embed(texts), expected(texts, DIMS))
    assert standin.requests == 3
    assert [len(b["input"]) for b in standin.bodies] == [8, 8, 3]


def test_real_503_recovers_on_the_retry(
    standin: StandIn, real: Callable[..., OpenAIEmbeddings]
) -> None:
    standin.fail_status, standin.fail_times = 503, 1
    np.testing.assert_array_equal(real().embed(TEXTS), expected(TEXTS, DIMS))
    assert standin.requests == 2
    assert standin.texts == TEXTS


def test_real_429_retry_after_is_waited_for(
    standin: StandIn, real: Callable[..., OpenAIEmbeddings]
) -> None:
    standin.fail_status, standin.fail_times, standin.retry_after = 429, 1, 0.2
    model = real(backoff=0.01, backoff_max=0.01)  # backoff alone would wait 10 ms at most
    started = time.monotonic()
    np.testing.assert_array_equal(model.embed(["x"]), expected(["x"], DIMS))
    assert time.monotonic() - started >= 0.2
    assert standin.requests == 2


def test_real_429_retry_after_above_the_cap_gives_up_at_once(
    standin: StandIn, real: Callable[..., OpenAIEmbeddings]
) -> None:
    standin.fail_status, standin.retry_after = 429, 120
    with pytest.raises(RetryLater) as info:
        real(retry_after_max=60.0, max_retries=3).embed(["x"])
    assert info.value.retry_after == 120.0
    assert standin.requests == 1


def test_real_slow_answer_times_out_after_every_attempt(
    standin: StandIn, real: Callable[..., OpenAIEmbeddings]
) -> None:
    standin.delay = 2.0
    with pytest.raises(TransientProviderError, match="timed out") as info:
        real(timeout=0.2, max_retries=1).embed(["x"])
    assert standin.requests == 2
    assert "after 2 attempts" in str(info.value)


def test_real_non_json_answer_is_bad_answer(
    standin: StandIn, real: Callable[..., OpenAIEmbeddings]
) -> None:
    standin.garbage = True
    with pytest.raises(BadAnswer, match="not JSON"):
        real(max_retries=1, backoff=0.01).embed(["x"])
    assert standin.requests == 2


@pytest.mark.parametrize(
    ("switch", "value", "match"),
    [
        ("wrong_count", 1, "asked for 3 vectors, got 4"),
        ("wrong_count", -1, "asked for 3 vectors, got 2"),
        ("nan", True, "NaN or infinite"),
        ("dimensions", 32, "32 dimensions, the index expects 64"),
    ],
)
def test_real_unusable_answers_are_bad_answer(
    standin: StandIn, real: Callable[..., OpenAIEmbeddings], switch: str, value: Any, match: str
) -> None:
    setattr(standin, switch, value)
    with pytest.raises(BadAnswer, match=match):
        real().embed(["a", "b", "c"])
    assert standin.requests == 1


def test_real_poisoned_input_is_permanent_per_input(
    standin: StandIn, real: Callable[..., OpenAIEmbeddings]
) -> None:
    standin.poison = "POISON"
    with pytest.raises(ProviderHTTPError) as info:
        real().embed(["fine", "has POISON in it"])
    assert info.value.status == 400
    assert info.value.per_input is True
    assert standin.requests == 1


def test_real_request_carries_key_and_user_agent(
    standin: StandIn, real: Callable[..., OpenAIEmbeddings]
) -> None:
    real().embed(["x"])
    (headers,) = standin.headers
    assert headers["authorization"] == f"Bearer {KEY}"
    assert headers["user-agent"] == USER_AGENT


def test_real_request_without_key_has_no_authorization(
    standin: StandIn, real: Callable[..., OpenAIEmbeddings]
) -> None:
    real(api_key=None).embed(["x"])
    (headers,) = standin.headers
    assert "authorization" not in headers


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_real_key_never_appears_in_exception_messages(
    standin: StandIn, real: Callable[..., OpenAIEmbeddings]
) -> None:
    model = real(timeout=0.2, retry_after_max=60.0)
    faults: list[dict[str, Any]] = [
        {"fail_status": 401},
        {"fail_status": 403},
        {"fail_status": 400, "error_code": "context_length_exceeded"},
        {"fail_status": 429, "error_code": "insufficient_quota"},
        {"fail_status": 503},
        {"fail_status": 429, "retry_after": 120},
        {"garbage": True},
        {"wrong_count": 1},
        {"nan": True},
        {"dimensions": 8},
        {"delay": 2.0},
    ]
    messages: list[str] = []
    for fault in faults:
        standin.reset()
        for name, value in fault.items():
            setattr(standin, name, value)
        with pytest.raises(ProviderError) as info:
            model.embed(["a", "b"])
        assert standin.headers, fault
        assert all(h["authorization"] == f"Bearer {KEY}" for h in standin.headers), fault
        assert str(info.value), fault
        messages += _messages(info.value)

    refused = OpenAIEmbeddings(
        standin_settings(standin, base_url=f"http://127.0.0.1:{_closed_port()}/v1"),
        dimensions=DIMS,
    )
    try:
        with pytest.raises(TransientProviderError, match="connection failed") as info:
            refused.embed(["a"])
    finally:
        refused.close()
    messages += _messages(info.value)

    assert len(messages) > 3 * len(faults)
    leaks = [m for m in messages if KEY in m or "Bearer" in m or "not-for-logs" in m]
    assert leaks == []


def _gzip(data: bytes) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    return packer.compress(data) + packer.flush()


def test_real_compressed_answers_are_read_within_a_bound(
    standin: StandIn, real: Callable[..., OpenAIEmbeddings]
) -> None:
    """httpx inflated every layer of `gzip, gzip` whole: ~500 bytes of answer took 200 MB and
    more before a size was looked at. Now at most the bound is unpacked, and past it the
    answer is a BadAnswer, not an out-of-memory."""
    model = real(max_retries=0)
    model.http.max_answer_bytes = 1_000_000
    payload = {"data": [{"index": 0, "embedding": vector_for("a", DIMS)}]}
    standin.raw_answer = (200, {"Content-Encoding": "gzip"}, _gzip(json.dumps(payload).encode()))
    np.testing.assert_array_equal(model.embed(["a"]), expected(["a"], DIMS))  # gzip is fine

    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    bomb = b"".join(packer.compress(bytes(1 << 20)) for _ in range(200)) + packer.flush()
    cases = [
        ("gzip, gzip", _gzip(bomb), "compressed more than once"),
        ("gzip", bomb, "over the size limit of 1000000 bytes"),
        ("br", b"...", "content coding 'br' is not supported"),
    ]
    for coding, body, match in cases:
        standin.raw_answer = (200, {"Content-Encoding": coding}, body)
        tracemalloc.start()
        try:
            with pytest.raises(BadAnswer, match=match):
                model.embed(["a"])
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 20 * 2**20, f"{coding}: {peak / 2**20:.0f} MB to refuse a 200 MB bomb"
    # an error answer that is a bomb: refused unread, the status still said
    standin.raw_answer = (400, {"Content-Encoding": "gzip"}, bomb)
    with pytest.raises(ProviderHTTPError, match=r"HTTP 400$"):
        model.embed(["a"])


def _leaked_prefix(secret: str, messages: list[str]) -> str | None:
    """The longest start of `secret`, 8 characters or more, found in any of `messages`."""
    for n in range(len(secret), 7, -1):
        if any(secret[:n] in m for m in messages):
            return secret[:n]
    return None


@pytest.mark.parametrize("where", ["message", "body"])
def test_real_key_echoed_across_the_200_character_cut_is_masked(
    standin: StandIn, real: Callable[..., OpenAIEmbeddings], where: str
) -> None:
    """The server's text was cut to 200 characters before the key was masked: a key
    crossing the cut kept its first part in the message (and in logs and the item)."""
    model = real(max_retries=0)
    text = "Incorrect API key provided; " + "x" * 138 + f" the key you sent was {KEY}."
    assert text.index(KEY) < 200 < text.index(KEY) + len(KEY)
    body = json.dumps({"error": {"message": text}}) if where == "message" else text
    standin.raw_answer = (401, {}, body.encode())
    with pytest.raises(ProviderHTTPError) as info:
        model.embed(["a"])
    assert "***" in str(info.value)
    assert _leaked_prefix(KEY, _messages(info.value)) is None
