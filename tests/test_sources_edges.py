"""Files and URLs at their edges (audit): charsets that name codecs which are not text
encodings."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from worker.errors import InvalidInput
from worker.settings import FilesSettings, UrlSettings
from worker.sources.files import decode_text, read_file
from worker.sources.urls import fetch_url

NON_TEXT_CODECS = ["base64", "hex", "rot13", "zlib"]
PAGE = """<!doctype html><html><head><meta charset="{charset}"><title>Ownership</title></head>
<body><article><h1>Ownership</h1>
<p>Ownership is a set of rules that govern how a Rust program manages memory. Some languages
have garbage collection; in others the programmer must allocate and free the memory. Café.</p>
<p>Rust uses a third approach: memory is managed through a system of ownership with a set of
rules that the compiler checks. If any of the rules are violated, the program won't compile.</p>
</article></body></html>"""


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "root").mkdir()
    return tmp_path / "root"


# -- charsets --------------------------------------------------------------------------------


@pytest.mark.parametrize("charset", NON_TEXT_CODECS)
def test_a_meta_charset_naming_a_non_text_codec_is_read_as_utf8(root: Path, charset: str) -> None:
    # codecs.lookup knows base64, hex, rot13 and zlib, but bytes.decode raises LookupError for
    # them: the item failed as a bug. Now they count as unknown names: UTF-8.
    (root / "page.html").write_bytes(PAGE.format(charset=charset).encode("utf-8"))
    text = read_file(root / "page.html", FilesSettings(roots=[root]))
    assert "Café" in text and "third approach" in text


@pytest.mark.parametrize("charset", NON_TEXT_CODECS)
def test_decode_text_with_a_non_text_codec_falls_back_to_utf8(charset: str) -> None:
    assert decode_text("Café".encode(), "page", charset) == "Café"
    with pytest.raises(InvalidInput, match=r"^page: is not UTF-8 text"):
        decode_text(b"caf\xe9", "page", charset)


def test_a_text_codec_that_fails_other_than_on_a_byte_is_refused_clearly() -> None:
    # "undefined" is a text codec that raises a bare UnicodeError, which nothing caught.
    with pytest.raises(InvalidInput, match=r"^page: is not undefined text .*convert it to UTF-8"):
        decode_text(b"abc", "page", "undefined")


class _Pages(BaseHTTPRequestHandler):
    routes: ClassVar[dict[str, tuple[str, bytes]]] = {}

    def do_GET(self) -> None:
        ctype, body = self.routes[self.path]
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def pages() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Pages)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.mark.parametrize("charset", NON_TEXT_CODECS)
def test_a_content_type_charset_naming_a_non_text_codec_is_read_as_utf8(
    pages: str, charset: str
) -> None:
    _Pages.routes = {
        "/plain": (f"text/plain; charset={charset}", "Café au lait".encode()),
        "/html": (f"text/html; charset={charset}", PAGE.format(charset="utf-8").encode()),
        "/meta": ("text/html", PAGE.format(charset=charset).encode()),
    }
    settings = UrlSettings(allow_hosts=["127.0.0.1"], timeout=5)
    assert fetch_url(f"{pages}/plain", settings).text == "Café au lait"
    for path in ("/html", "/meta"):
        text = fetch_url(f"{pages}{path}", settings).text
        assert "Café" in text and "third approach" in text
