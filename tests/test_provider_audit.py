"""Defects an audit found in the embedding providers, each through the pipeline over real HTTP
(the loopback stand-in, or a small raw server here) and a real SQLite file."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import tracemalloc
from pathlib import Path

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from testkit.standin import StandIn
from tests.conftest import DIMS, standin_settings
from worker.bulk import index_item
from worker.errors import BadAnswer, IndexAborted, InvalidInput, KidxError
from worker.indexers.memories import add_memory, embed_memories, search_memories
from worker.providers import build_embedder
from worker.providers.base import EmbeddingModel
from worker.providers.http import parse_retry_after
from worker.retrieval import search_chunks
from worker.store import Database, connect
from worker.store.items import add_item, get_state

ABSURD_DATE = "Mon, 01 Jan 99999999999999999999 00:00:00 GMT"


def _answer_of(numbers: str, count: int = 1) -> bytes:
    data = ",".join(f'{{"index":{i},"embedding":[{numbers}]}}' for i in range(count))
    return f'{{"data":[{data}]}}'.encode()


# -- 1. a JSON integer no float holds --------------------------------------------------------


def test_an_integer_too_large_for_a_float_fails_the_item_with_a_clear_error(
    db: Database, embedder: EmbeddingModel, standin: StandIn
) -> None:
    """`np.asarray` raised OverflowError for 1 followed by 400 zeros: the run crashed with a
    traceback and the item kept "OverflowError: ..." as its reason."""
    dims = embedder.dimensions or 0
    standin.raw_answer = (200, {}, _answer_of(",".join(["1" + "0" * 400] + ["0"] * (dims - 1))))
    item = add_item(db, kind="note", title="T", content="A short note about anything at all.")
    with pytest.raises(IndexAborted, match="a number too large for a float"):
        index_item(db, item, embedder=embedder)
    state = get_state(db, item)
    assert state["status"] == "failed"
    assert "too large for a float" in state["last_error"]
    assert db.scalar("SELECT count(*) FROM note_chunks") == 0
    with pytest.raises(BadAnswer, match="too large for a float"):
        add_memory(db, "a memory", embedder)
    assert db.scalar("SELECT count(*) FROM memories") == 0


# -- 2. a Retry-After date no datetime holds -------------------------------------------------


def test_a_429_with_an_absurd_retry_after_date_is_retried_as_usual(
    db: Database, embedder: EmbeddingModel, standin: StandIn
) -> None:
    """`parsedate_to_datetime` raised OverflowError on the year 99999999999999999999: the run
    crashed instead of backing off and trying again."""
    standin.fail_status, standin.fail_times, standin.retry_after = 429, 1, ABSURD_DATE
    item = add_item(db, kind="note", title="T", content="A short note about anything at all.")
    assert index_item(db, item, embedder=embedder).status == "indexed"
    assert standin.requests == 2


_DATES = st.builds(
    "{}, {} {} {} {}:{}:{} {}".format,
    st.sampled_from(["Mon", "Sun", "", "Xyz"]),
    st.integers(-(10**25), 10**25),
    st.sampled_from(["Jan", "Feb", "Dec", "Foo"]),
    st.integers(-(10**25), 10**25),
    st.integers(-(10**25), 10**25),
    st.integers(-(10**5), 10**5),
    st.integers(-(10**5), 10**5),
    st.one_of(st.sampled_from(["GMT", "UTC", "-0000", "EST"]), st.integers().map("{:+05d}".format)),
)
_VALUES = st.one_of(
    _DATES,
    st.text(st.characters(min_codepoint=32, max_codepoint=126)),
    st.binary().filter(lambda b: not set(b) & set(b"\r\n\0")),
)


@given(name=st.sampled_from(["retry-after", "retry-after-ms"]), value=_VALUES)
def test_parse_retry_after_never_raises(name: str, value: str | bytes) -> None:
    """Whatever a server writes there, the answer is a wait or no wait, never an exception."""
    wait = parse_retry_after(httpx.Headers({name: value}), now=0.0)
    assert wait is None or (wait >= 0.0 and wait != float("inf"))


# -- 3. NO_PROXY alone kept the per-read timeouts --------------------------------------------

PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")


class Trickle:
    """A raw HTTP server on 127.0.0.1 that answers 200 and then one byte every 0.1 s until
    stopped: each read gets bytes in time, only a deadline on the whole call ends it."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.base_url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            conn, _ = self.sock.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
                while not self.stop.wait(0.1):
                    conn.sendall(b"1\r\n \r\n")

    def close(self) -> None:
        self.stop.set()
        self.sock.close()
        self.thread.join(10)


@pytest.fixture
def no_proxies(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    return monkeypatch


def test_no_proxy_alone_keeps_the_deadline_on_the_whole_call(
    tmp_path: Path, no_proxies: pytest.MonkeyPatch, standin: StandIn
) -> None:
    """`getproxies()` returns {'no': ...} for NO_PROXY alone, which is truthy: the client took
    httpx's transport and its per-read timeouts, and a server trickling its answer held a call
    as long as it liked (20 s with a 2 s timeout). A proxy that applies is still used."""
    no_proxies.setenv("NO_PROXY", "localhost")
    server = Trickle()
    try:
        settings = standin_settings(standin, base_url=server.base_url, timeout=0.5, max_retries=0)
        db = connect(tmp_path / "kidx.db", embedding=settings)
        embedder = build_embedder(settings, dimensions=db.dimensions)
        item = add_item(db, kind="note", title="T", content="A short note about anything.")
        outcome: list[BaseException] = []

        def run() -> None:
            try:
                index_item(db, item, embedder=embedder)
            except BaseException as e:  # handed to the test
                outcome.append(e)

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        runner.join(30)  # an outer bound only: the call ends at its own deadline
        assert not runner.is_alive(), "the call was still held by the trickling server"
    finally:
        server.close()
    assert len(outcome) == 1 and isinstance(outcome[0], IndexAborted)
    assert outcome[0].transient and "timed out after 0.5s" in str(outcome[0])
    assert get_state(db, item)["status"] == "failed"
    embedder.close()
    db.close()

    # a proxy from the environment that applies to the base URL is still used (the stand-in
    # serves as one: it answers the absolute-form request line by its path)
    no_proxies.setenv("HTTP_PROXY", f"http://127.0.0.1:{standin.port}")
    proxied = build_embedder(
        standin_settings(standin, base_url="http://embed.invalid/v1", max_retries=0),
        dimensions=DIMS,
    )
    assert proxied is not None
    assert proxied.embed(["x"]).shape == (1, DIMS)
    assert standin.texts == ["x"]
    proxied.close()


# -- 4. the answer cap bounds what the request can need --------------------------------------


def test_an_answer_bigger_than_its_request_can_need_is_refused_unparsed(
    db: Database, embedder: EmbeddingModel, standin: StandIn
) -> None:
    """Any answer under 64 MB was parsed: 63 MB of "0.1," for one vector cost 760 MB. Now an
    answer is bounded by what its batch of vectors can take, and refused past it unread."""
    dims = embedder.dimensions or 0
    standin.raw_answer = (200, {}, _answer_of(",".join(["0.1"] * (4 << 20))))  # 16 MB
    item = add_item(db, kind="note", title="T", content="A short note about anything at all.")
    tracemalloc.start()
    try:
        with pytest.raises(IndexAborted, match=r"over the size limit of \d+ bytes") as info:
            index_item(db, item, embedder=embedder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert f"vector(s) of {dims} dimensions" in str(info.value)
    assert peak < 12 << 20, f"{peak >> 20} MB to refuse a 16 MB answer for one vector"
    assert get_state(db, item)["status"] == "failed"
    assert db.scalar("SELECT count(*) FROM note_chunks") == 0

    # a full batch of the longest floats, indented, as floats though base64 was asked: taken
    longest = "-1.2345678901234567e-05"
    vectors = [{"index": i, "embedding": [float(longest)] * dims} for i in range(8)]
    body = json.dumps({"data": vectors}, indent=4).replace(repr(float(longest)), longest)
    standin.raw_answer = (200, {}, body.encode())
    assert embedder.embed([f"t{i}" for i in range(8)]).shape == (8, dims)


# -- 5. a lone surrogate in a text -----------------------------------------------------------


def test_a_lone_surrogate_in_a_query_or_memory_is_invalid_input(
    db: Database, embedder: EmbeddingModel, standin: StandIn
) -> None:
    """httpx raised a bare UnicodeEncodeError for a str a Python host decoded with
    surrogateescape; now it is InvalidInput saying where, nothing sent, nothing written."""
    where = "lone surrogate U[+]DCE9 at character 3"
    with pytest.raises(InvalidInput, match=where):
        add_memory(db, "caf\udce9 au lait", embedder)
    with pytest.raises(InvalidInput, match=where):
        search_memories(db, "caf\udce9", embedder)
    with pytest.raises(InvalidInput, match=where):
        search_chunks(db, "caf\udce9", embedder)
    assert standin.requests == 0
    assert db.scalar("SELECT count(*) FROM memories") == 0

    # a note cannot hold one (SQLite text is UTF-8): bytes that are not UTF-8, written by a
    # host with plain SQL, fail that item alone, with the reason
    db.execute(
        "INSERT INTO knowledge_items(kind, title, content) VALUES ('note', 'T', ?)", (b"caf\xe9",)
    )
    item = int(db.scalar("SELECT max(id) FROM knowledge_items"))
    with pytest.raises(KidxError):
        index_item(db, item, embedder=embedder)
    assert "not UTF-8" in get_state(db, item)["last_error"]


@pytest.mark.parametrize(
    ("no_proxy", "url", "through_proxy"),
    [
        ("127.0.0.0/8", "http://127.0.0.1:8080/v1", False),
        ("10.0.0.0/8, 192.168.0.0/16", "http://192.168.3.4/v1", False),
        ("10.0.0.0/8", "http://192.168.3.4/v1", True),
        ("fd00::/8", "http://[fd12::1]:9000/v1", False),
        ("10.0.0.0/8", "http://ten.example/v1", True),  # a name is not looked up
        ("not/a-network,10.0.0.0/33", "http://10.1.2.3/v1", True),  # bad entries ignored
    ],
)
def test_a_network_in_no_proxy_exempts_its_addresses(
    no_proxies: pytest.MonkeyPatch, no_proxy: str, url: str, through_proxy: bool
) -> None:
    from worker.providers.http import proxied

    no_proxies.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    no_proxies.setenv("NO_PROXY", no_proxy)
    assert proxied(url) is through_proxy


def test_a_provider_in_a_no_proxy_network_is_reached_directly(
    no_proxies: pytest.MonkeyPatch, standin: StandIn
) -> None:
    """The proxy refuses every connection: the provider answers only when reached directly."""
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    no_proxies.setenv("HTTP_PROXY", f"http://127.0.0.1:{port}")
    no_proxies.setenv("NO_PROXY", "127.0.0.0/8")
    embedder = build_embedder(standin_settings(standin, max_retries=0), dimensions=DIMS)
    assert embedder is not None
    try:
        assert embedder.embed(["direct"]).shape == (1, DIMS)
    finally:
        embedder.close()
    assert standin.texts == ["direct"]


# -- 7. a second review: values that are no numbers, and a key the server quotes back --------

KEY = "sk-test-key-not-for-logs"


@pytest.mark.parametrize("value", ['"0.5"', "true", f'"Bearer {KEY}"', '"' + "x" * 200_000 + '"'])
def test_a_vector_value_that_is_no_number_fails_the_item_and_is_never_stored(
    db: Database, embedder: EmbeddingModel, standin: StandIn, value: str
) -> None:
    """numpy read "0.5" and true as 0.5 and 1.0 (the item was indexed with them), and quoted
    whatever string it could not read in the item's stored error: the key, or 200 KB."""
    dims = embedder.dimensions or 0
    standin.raw_answer = (200, {}, _answer_of(",".join([value] + ["0.1"] * (dims - 1))))
    item = add_item(db, kind="note", title="T", content="A short note about anything at all.")
    with pytest.raises(IndexAborted, match="values that are not numbers"):
        index_item(db, item, embedder=embedder)
    state = get_state(db, item)
    assert state["status"] == "failed"
    assert KEY not in state["last_error"] and len(state["last_error"]) < 1000
    assert db.scalar("SELECT count(*) FROM note_chunks") == 0


def test_an_index_that_quotes_the_key_is_masked_and_cut_in_the_items_error(
    db: Database, embedder: EmbeddingModel, standin: StandIn
) -> None:
    dims = embedder.dimensions or 0
    vector = ",".join(["0.1"] * dims)
    for index in (f'"Bearer {KEY}"', '"' + "i" * 500_000 + '"'):
        body = f'{{"data":[{{"index":{index},"embedding":[{vector}]}}]}}'
        standin.raw_answer = (200, {}, body.encode())
        item = add_item(db, kind="note", title="T", content="A short note about anything.")
        with pytest.raises(IndexAborted, match="bad or repeated index"):
            index_item(db, item, embedder=embedder)
        error = get_state(db, item)["last_error"]
        assert KEY not in error and len(error) < 1000


@pytest.mark.parametrize("key", ["sk-abc/def+ghi", 'sk-ab"cd\\ef'])
def test_a_key_the_server_quotes_json_escaped_is_masked(standin: StandIn, key: str) -> None:
    """Masking looked for the key as written; a body with no `error` member (FastAPI's
    `detail`) is shown as raw text, where the key is JSON-escaped (`/` maybe as `\\/`)."""
    escaped = json.dumps(key)[1:-1]
    slashed = escaped.replace("/", "\\/")  # as PHP and others write it
    bodies = [json.dumps({"detail": f"invalid api key {key}"}), f'{{"detail": "{slashed}"}}']
    model = build_embedder(standin_settings(standin, api_key=key), dimensions=DIMS)
    assert model is not None
    try:
        for body in bodies:
            standin.raw_answer = (401, {}, body.encode())
            with pytest.raises(KidxError) as info:
                model.embed_checked(["x"])
            shown = str(info.value)
            assert "***" in shown, shown
            assert escaped not in shown and slashed not in shown
    finally:
        model.close()


def test_a_provider_whose_batch_limit_is_under_the_batch_size_gets_halves_then_smaller_batches(
    db: Database, embedder: EmbeddingModel, standin: StandIn
) -> None:
    """A 413 for a batch (text-embeddings-inference refuses over 32 texts) cost a refused
    request and one request a text, for every batch, for good: 23 requests here, not 13."""
    standin.max_batch = 3
    text = "\n\n".join(f"# Part {n}\n\nParagraph {n}. " + "word " * 40 for n in range(20))
    item = add_item(db, kind="note", title="T", content=text)
    assert embedder.batch_size == 8
    result = index_item(db, item, embedder=embedder)
    assert result.status == "indexed" and result.chunks == 20 and result.embedded == 20
    assert embedder.batch_size == 2  # the halves that went whole
    assert standin.requests == 7 + 6  # 8 -> 4, 4 -> 2 x 4; then 12 texts 2 at a time
    assert all(len(b["input"]) <= 3 for b in standin.bodies[-6:])


def test_memories_whose_batch_is_refused_as_too_large_go_in_halves_then_smaller_batches(
    db: Database, embedder: EmbeddingModel, standin: StandIn
) -> None:
    """The memory backfill sent a batch refused as too large (413) text by text: a request a
    memory, for every batch (23 requests here, not 13), and learnt no batch size."""
    standin.max_batch = 3
    db.executemany(
        "INSERT INTO memories(content) VALUES (?)",
        [(f"Memory {n}: likes tea.",) for n in range(20)],
    )
    report = embed_memories(db, embedder)
    assert (report.embedded, report.refused, report.error) == (20, 0, None)
    assert embedder.batch_size == 2  # the halves that went whole
    assert standin.requests == 7 + 6  # 8 -> 4, 4 -> 2 x 4; then 12 memories 2 at a time
    vectors = db.all("SELECT memory_id FROM memory_embeddings ORDER BY 1")
    assert db.all("SELECT memory_id FROM vec_memories ORDER BY 1") == vectors
    assert len(vectors) == 20


def test_a_memory_refused_as_too_large_alone_is_skipped_and_the_others_embedded(
    db: Database, embedder: EmbeddingModel, standin: StandIn
) -> None:
    """Halving ends at the memory the provider refuses alone: it is recorded as refused, its
    batch's others are embedded, and nothing is learnt (not every text went whole)."""
    standin.poison, standin.poison_status = "TOO-BIG", 413
    texts = [f"Memory {n}." for n in range(8)]
    texts[5] = "TOO-BIG memory."
    db.executemany("INSERT INTO memories(content) VALUES (?)", [(t,) for t in texts])
    report = embed_memories(db, embedder)
    assert (report.embedded, report.refused, report.error) == (7, 1, None)
    assert standin.requests == 1 + 2 + 2 + 2  # 8; 4, 4; 2, 2 of the second; 1, 1
    assert embedder.batch_size == 8


def test_a_host_s_thousands_of_unreadable_memories_are_recorded_as_read_not_held(
    db: Database, embedder: EmbeddingModel
) -> None:
    """Each refusal held its text until the end of the run: 3,000 rows of 8 KB that are not
    UTF-8 took 24 MB (a million, 8 GB). They are recorded as they are read now (8 MB here)."""
    bad = b"\xff" + b"a" * 7_990
    db.executemany(
        "INSERT INTO memories(content) VALUES (?)", [(bad + b"%d" % n,) for n in range(3000)]
    )
    db.execute("INSERT INTO memories(content) VALUES ('The user likes tea.')")
    tracemalloc.start()
    try:
        report = embed_memories(db, embedder)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (report.embedded, report.unreadable, report.error) == (1, 3000, None)
    assert db.scalar("SELECT count(*) FROM memory_refusals") == 3000
    assert peak < 14 << 20, f"{peak >> 20} MB to read past 24 MB of unreadable memories"


def test_a_query_past_the_longest_is_refused_before_anything_is_embedded(
    db: Database, embedder: EmbeddingModel, standin: StandIn
) -> None:
    """A 10 MB query made the local model's tokenizer take 1.5 GB, for the answer its first
    256 tokens give."""
    from worker.retrieval import QUERY_MAX

    for search in (search_chunks, search_memories):
        with pytest.raises(InvalidInput, match=f"at most {QUERY_MAX}"):
            search(db, "word " * (QUERY_MAX // 5) + "x", embedder)
    assert standin.requests == 0


def test_texts_each_refused_as_too_large_abort_their_item_in_a_few_requests(
    db: Database, embedder: EmbeddingModel, standin: StandIn
) -> None:
    """Halving walked the tree to every text: 64 texts each refused cost 127 requests."""
    standin.poison, standin.poison_status = "TOO-BIG", 413
    text = "\n\n".join(f"# Part {n}\n\nTOO-BIG paragraph {n}. " + "word " * 40 for n in range(20))
    item = add_item(db, kind="note", title="T", content=text)
    with pytest.raises(IndexAborted):
        index_item(db, item, embedder=embedder)
    assert get_state(db, item)["status"] == "failed"
    assert standin.requests <= 8  # 8, 4, 2, 1, 1, 2, 1 texts: the third refused alone aborts
    assert embedder.batch_size == 8  # nothing went whole: nothing learnt


def test_a_short_last_batch_refused_as_too_large_teaches_no_batch_size(
    db: Database, embedder: EmbeddingModel, standin: StandIn
) -> None:
    """A last batch of 4 refused, its halves of 2 taken: 2 was learnt, whatever the limit."""
    standin.max_batch = 3
    text = "\n\n".join(f"# Part {n}\n\nParagraph {n}. " + "word " * 40 for n in range(4))
    item = add_item(db, kind="note", title="T", content=text)
    assert index_item(db, item, embedder=embedder).embedded == 4
    assert standin.requests == 3 and embedder.batch_size == 8
