"""Sources, second audit: compressed bodies cut short, empty answers, text DOCX hides in its
structures, AES PDFs, line ends, separator lines, legacy charset labels, wrapped PDF headings,
UTF-16 source files. Real files under tmp_path, a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import gzip
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from worker.errors import InvalidInput, SourceUnavailable
from worker.providers.http import JSONClient, RetryLater, _Inflater
from worker.settings import HTTPProviderSettings, UrlSettings
from worker.sources.urls import fetch_url

ALLOWED = UrlSettings(allow_hosts=["127.0.0.1"], timeout=10, connect_timeout=5)

# path -> the replies to give, in turn (the last one again once they run out):
# (status, headers, body); a header of None is not sent.
Reply = tuple[int, dict[str, str | None], bytes]


class Server:
    """A server on 127.0.0.1 whose replies each test sets, for GET and POST alike."""

    def __init__(self) -> None:
        self.routes: dict[str, list[Reply]] = {}
        self.hits: dict[str, int] = {}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def reply(self) -> None:
                path = self.path
                if self.command == "POST":
                    self.rfile.read(int(self.headers.get("Content-Length", 0)))
                hit = server.hits[path] = server.hits.get(path, 0) + 1
                replies = server.routes.get(path, [(404, {}, b"no such route")])
                status, headers, body = replies[min(hit, len(replies)) - 1]
                self.send_response(status)
                headers = {"Content-Length": str(len(body)), **headers}
                for key, value in headers.items():
                    if value is not None:
                        self.send_header(key, value)
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = reply

            def log_message(self, *args: object) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join(timeout=10)


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server()
    yield s
    s.close()


def paragraphs(n: int) -> bytes:
    return "".join(
        f"Paragraph {i}: the quick brown fox, {i * 7919 % 10007}.\n\n" for i in range(n)
    ).encode()


def compressed(data: bytes, coding: str) -> bytes:
    """`data` in a content coding: gzip, zlib-wrapped deflate, or raw deflate."""
    wbits = {"gzip": 31, "deflate": 15, "raw-deflate": -15}[coding]
    packer = zlib.compressobj(9, zlib.DEFLATED, wbits)
    return packer.compress(data) + packer.flush()


# -- 1. a compressed body cut short -------------------------------------------------------------


@pytest.mark.parametrize("coding", ["gzip", "deflate", "raw-deflate"])
def test_a_compressed_page_cut_short_is_unavailable_not_indexed_in_part(
    server: Server, coding: str
) -> None:
    """The HTTP message is whole (its Content-Length matches), the compressed stream in it is
    not: half the page used to be indexed as the whole page."""
    text = paragraphs(400)
    whole = compressed(text, coding)
    header = "deflate" if coding == "raw-deflate" else coding
    kind = {"Content-Type": "text/plain; charset=utf-8", "Content-Encoding": header}
    server.routes["/cut"] = [(200, kind, whole[: len(whole) // 2])]
    server.routes["/whole"] = [(200, kind, whole)]
    with pytest.raises(SourceUnavailable, match=r"/cut: the compressed body ended early"):
        fetch_url(f"{server.url}/cut", ALLOWED)
    assert fetch_url(f"{server.url}/whole", ALLOWED).text == text.decode()


def test_a_gzip_page_of_two_members_is_read_whole_and_one_cut_in_the_second_is_refused(
    server: Server,
) -> None:
    first, second = paragraphs(50), paragraphs(300)[5000:]
    body = gzip.compress(first) + gzip.compress(second)
    kind = {"Content-Type": "text/plain; charset=utf-8", "Content-Encoding": "gzip"}
    server.routes["/two"] = [(200, kind, body)]
    server.routes["/cut"] = [(200, kind, body[:-20])]
    assert fetch_url(f"{server.url}/two", ALLOWED).text == (first + second).decode()
    with pytest.raises(SourceUnavailable, match="compressed body ended early"):
        fetch_url(f"{server.url}/cut", ALLOWED)


def test_a_gzip_member_whose_magic_is_split_between_two_reads_is_not_lost() -> None:
    """The raw body comes in reads of whatever size: a second member's two-byte magic may be
    split between two. Its first byte alone used to end the body: the member was dropped."""
    first, second = b"first member. ", b"second member."
    body = gzip.compress(first) + gzip.compress(second)
    cut = len(gzip.compress(first)) + 1
    inflater = _Inflater("gzip")
    out = inflater.decode(body[:cut], 1000) + inflater.decode(body[cut:], 1000)
    assert out + inflater.flush(1000) == first + second


def test_a_provider_answer_cut_short_is_retried_and_the_whole_one_used(server: Server) -> None:
    """The embedding and chat providers read their answers the same way: a gzip answer cut
    short was "not JSON", a permanent failure; it may come whole next time."""
    answer = (
        b'{"data": [{"index": 0, "embedding": [0.5, 0.25]}], "padding": "' + b"x" * 4000 + b'"}'
    )
    whole = gzip.compress(answer)
    kind = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    server.routes["/v1/embeddings"] = [(200, kind, whole[: len(whole) // 2]), (200, kind, whole)]
    settings = HTTPProviderSettings(base_url=f"{server.url}/v1", max_retries=2, timeout=10)
    client = JSONClient(settings, model="m", log_prefix="test", sleep=lambda _: None)
    try:
        got = client.post("/embeddings", {"input": ["a"]})
    finally:
        client.close()
    assert got["data"][0]["embedding"] == [0.5, 0.25]
    assert server.hits["/v1/embeddings"] == 2


def test_a_provider_answer_always_cut_short_is_transient(server: Server) -> None:
    whole = gzip.compress(b'{"data": []}' + b" " * 2000)
    kind = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
    server.routes["/v1/embeddings"] = [(200, kind, whole[:-12])]
    settings = HTTPProviderSettings(base_url=f"{server.url}/v1", max_retries=1, timeout=10)
    client = JSONClient(settings, model="m", log_prefix="test", sleep=lambda _: None)

    try:
        with pytest.raises(RetryLater, match=r"cut short.*compressed body ended early"):
            client.post("/embeddings", {"input": ["a"]})
    finally:
        client.close()


# -- 9. nothing in the body -------------------------------------------------------------------


def test_no_content_and_an_empty_page_say_so_before_the_missing_type(server: Server) -> None:
    server.routes["/204"] = [(204, {"Content-Length": None}, b"")]
    server.routes["/empty-html"] = [(200, {"Content-Type": "text/html"}, b"")]
    server.routes["/empty-untyped"] = [(200, {}, b"")]
    # neither type nor length: the body is read to the end of the connection
    server.routes["/empty-unframed"] = [(200, {"Content-Length": None}, b"")]
    server.routes["/untyped"] = [(200, {}, b"some bytes")]
    server.routes["/empty-gzip"] = [
        (200, {"Content-Type": "text/plain", "Content-Encoding": "gzip"}, gzip.compress(b""))
    ]
    with pytest.raises(InvalidInput, match=r"/204: no content \(HTTP 204 No Content\)$"):
        fetch_url(f"{server.url}/204", ALLOWED)
    for path in ("/empty-html", "/empty-untyped", "/empty-unframed", "/empty-gzip"):
        with pytest.raises(InvalidInput, match=rf"{path}: the page is empty \(HTTP 200, no body\)"):
            fetch_url(f"{server.url}{path}", ALLOWED)
    with pytest.raises(InvalidInput, match="content type none given is not allowed"):
        fetch_url(f"{server.url}/untyped", ALLOWED)
