"""Providers against a fourth review: a chat answer that takes the fence pattern quadratic
time, a batch that times out whole, and a provider that starts refusing every text."""

from __future__ import annotations

import json
import signal
import socketserver
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from conftest import FakeEmbedder, standin_settings
from testkit.standin import StandIn
from worker.bulk import index_item, index_items
from worker.errors import BadAnswer, IndexAborted
from worker.indexers.memories import embed_memories
from worker.providers import build_embedder
from worker.providers.chat import _unwrapped
from worker.store.db import Database
from worker.store.items import add_item


@contextmanager
def bounded(seconds: int) -> Iterator[None]:
    """SIGALRM after `seconds`: a pattern that backtracks without end fails the test rather
    than hanging the suite (the work is linear: milliseconds)."""

    def stop(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("blank", [" ", "\t"])
def test_a_fence_followed_by_a_million_blanks_is_unwrapped_in_linear_time(blank: str) -> None:
    """Two blank runs either side of an optional `json` split a run of blanks in as many ways
    as it is long: "```" and 16,000 spaces took 1.3 s, a 1 MB answer hours (the chunk
    deadline does not look at CPU)."""
    answer = "```" + blank * 1_000_000
    with bounded(20):
        assert _unwrapped(answer) == answer  # not a fenced answer: left as it is


@pytest.mark.parametrize("opening", ["```json\n", "```JSON \n", "``` json\t\r\n", "```\n"])
def test_fenced_json_is_still_unwrapped(opening: str) -> None:
    body = json.dumps({"chunks": [{"start": 1, "end": 2}]})
    assert _unwrapped(f"  {opening}{body}\n```  ") == body


# A CPU server's large model: 0.15 s a text, a 1 s timeout. A batch of 8 takes 1.2 s, of 4 0.6.
PER_TEXT, TIMEOUT = 0.15, 1.0


def slow_embedder(standin: StandIn, db: Database):
    standin.delay_per_text = PER_TEXT
    settings = standin_settings(standin, timeout=TIMEOUT, max_retries=2)
    return build_embedder(settings, dimensions=db.dimensions)


def test_a_batch_that_times_out_goes_in_halves_and_the_size_that_answered_is_kept(
    db: Database, standin: StandIn
) -> None:
    """A full batch the server cannot embed within the timeout was sent whole again at every
    retry, then text by text, for every batch (at the defaults, 154 s for 64 texts before a
    vector came back, past the soft time limit for a document of four batches)."""
    embedder = slow_embedder(standin, db)
    text = "\n\n".join(f"# Part {n}\n\nParagraph {n}. " + "word " * 40 for n in range(12))
    item = add_item(db, kind="note", title="T", content=text)
    result = index_item(db, item, embedder=embedder)
    assert (result.status, result.chunks, result.embedded) == ("indexed", 12, 12)
    assert [len(b["input"]) for b in standin.bodies] == [8, 4, 4, 4]
    assert embedder.batch_size == 4


def test_memories_whose_batch_times_out_go_in_halves(db: Database, standin: StandIn) -> None:
    embedder = slow_embedder(standin, db)
    db.executemany(
        "INSERT INTO memories(content) VALUES (?)", [(f"Memory {n}: tea.",) for n in range(12)]
    )
    report = embed_memories(db, embedder)
    assert (report.embedded, report.refused, report.error) == (12, 0, None)
    assert [len(b["input"]) for b in standin.bodies] == [8, 4, 4, 4]
    assert embedder.batch_size == 4


class TurnsAfterItsFirstAnswer(FakeEmbedder):
    """A provider that answers once, then refuses every text alone (NaN in every vector)."""

    def embed_batch(self, texts: list[str]) -> Any:
        if self.calls:
            self.calls.append(list(texts))
            raise BadAnswer("NaN in the vector", per_input=True)
        return super().embed_batch(texts)


def test_a_provider_that_turns_to_refusing_every_text_stops_the_run(db: Database) -> None:
    """The stop counted only a run that had embedded nothing yet: one good answer first, and
    every later item cost a request a text (37 requests for 40 notes), all failing alike."""
    ids = [add_item(db, kind="note", title=f"t{i}", content=f"Note {i}. " * 5) for i in range(40)]
    fake = TurnsAfterItsFirstAnswer()
    out = index_items(db, ids, embedder=fake)
    assert [out[i].status for i in ids[:8]] == ["indexed"] * 8  # the first answer's
    assert all(isinstance(out[i], IndexAborted) for i in ids[8:])
    assert "embedded no text of 3 items" in str(out[ids[-1]])
    assert len(fake.calls) <= 1 + 2 * (1 + 8)  # two batches at most after it turned


class _DrippingProxy(socketserver.BaseRequestHandler):
    """A forward proxy whose answer comes a byte every 0.2 s: each read within any timeout,
    the whole far past it (about 12 s for this body)."""

    BODY = json.dumps({"data": [{"index": 0, "embedding": [0.5, 0.5, 0.5, 0.5]}]}).encode()

    def handle(self) -> None:
        head = b""
        while b"\r\n\r\n" not in head and len(head) < 65536:
            part = self.request.recv(4096)
            if not part:
                return
            head += part
        self.server.requests.append(head.split(b"\r\n", 1)[0])  # type: ignore[attr-defined]
        answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
        answer += b"Content-Length: %d\r\n\r\n" % len(self.BODY)
        self.request.sendall(answer)
        for i in range(len(self.BODY)):
            if self.server.stopping.wait(0.2):  # type: ignore[attr-defined]
                return
            try:
                self.request.sendall(self.BODY[i : i + 1])
            except OSError:
                return  # the client gave up: as it should


@pytest.fixture
def dripping_proxy() -> Iterator[socketserver.ThreadingTCPServer]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _DrippingProxy)
    server.daemon_threads = True
    server.requests = []  # type: ignore[attr-defined]
    server.stopping = threading.Event()  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.stopping.set()  # type: ignore[attr-defined]
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)


@pytest.mark.parametrize("scheme", ["http://", ""])
def test_a_provider_through_a_proxy_gets_the_timeout_in_all(
    dripping_proxy: socketserver.ThreadingTCPServer, monkeypatch: pytest.MonkeyPatch, scheme: str
) -> None:
    """Through HTTP(S)_PROXY, httpx's own transport timed each read alone: an answer a byte
    every 0.2 s never tripped a 1 s timeout, and a chunk deadline of 5 s waited 67 s. A proxy
    given without its scheme (`127.0.0.1:3128`, as curl takes it) is an http one too."""
    from worker.errors import TransientProviderError
    from worker.providers.openai import OpenAIEmbeddings
    from worker.settings import EmbeddingSettings

    port = dripping_proxy.server_address[1]
    for name in ("NO_PROXY", "no_proxy", "ALL_PROXY", "all_proxy", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HTTP_PROXY", f"{scheme}127.0.0.1:{port}")
    monkeypatch.setenv("http_proxy", f"{scheme}127.0.0.1:{port}")
    settings = EmbeddingSettings(
        provider="openai",
        model="m",
        base_url="http://provider.example/v1",
        dimensions=4,
        timeout=1.0,
        max_retries=0,
        encoding_format="float",
    )
    model = OpenAIEmbeddings(settings, dimensions=4)
    try:
        with pytest.raises(TransientProviderError, match="timed out"):
            model.embed(["x"])
    finally:
        model.close()
    assert dripping_proxy.requests == [  # type: ignore[attr-defined]
        b"POST http://provider.example/v1/embeddings HTTP/1.1"
    ]


class RefusesPoison(FakeEmbedder):
    """Refuses, as one input's fault, a request holding POISON; embeds the rest."""

    def embed_batch(self, texts: list[str]) -> Any:
        if any("POISON" in t for t in texts):
            self.calls.append(list(texts))
            raise BadAnswer("input refused by the provider", per_input=True)
        return super().embed_batch(texts)


def test_refused_items_in_a_row_among_embedded_ones_never_stop_the_run(db: Database) -> None:
    """Five notes in a row the provider refuses, in the middle of forty it embeds: they fail
    alone; every other is indexed (counted in a row with no regard to the others' vectors in
    the same requests, three of them stopped the run)."""
    bad = set(range(10, 15))
    ids = [
        add_item(db, kind="note", title=f"t{i}", content=f"Note {i}{' POISON' * (i in bad)}. " * 5)
        for i in range(40)
    ]
    out = index_items(db, ids, embedder=RefusesPoison())
    assert [n for n, i in enumerate(ids) if isinstance(out[i], IndexAborted)] == sorted(bad)
    assert all(out[i].status == "indexed" for n, i in enumerate(ids) if n not in bad)
