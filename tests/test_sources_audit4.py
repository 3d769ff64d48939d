"""Sources against a fourth review: what a host's row or a server's answer raised that no check
named (a NUL in a file's path, a redirect to `mailto:`, a port past 65535) failed every item of
a bulk run as a bug; a Location that cannot be parsed was retried as an outage; and fec0::/10
passed for a public address."""

from __future__ import annotations

import errno
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from typing import ClassVar

import pytest

from conftest import FakeEmbedder, serving
from worker import sources
from worker.bulk import index_items
from worker.errors import InvalidInput, KidxError, SourceUnavailable
from worker.indexers import IndexOptions
from worker.settings import FilesSettings, UrlSettings
from worker.sources import Reader
from worker.sources.urls import check_url, fetch_url
from worker.store.items import add_item, get_state

TEXT = "# Notes\n\n" + "A paragraph of plain words that says enough to be a chunk. " * 8


class _Moved(BaseHTTPRequestHandler):
    """A redirect to the Location its path names (`/mailto`, `/data`, `/bracket`)."""

    TARGETS: ClassVar[dict[str, str]] = {
        "/mailto": "mailto:webmaster@example.com",
        "/data": "data:text/plain,hello",
        "/bracket": "http://[::1",
    }

    def do_GET(self) -> None:
        self.send_response(302)
        self.send_header("Location", self.TARGETS[self.path])
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def moved() -> Iterator[str]:
    with serving(_Moved) as base:
        yield base


@pytest.mark.parametrize("target", ["mailto", "data", "bracket"])
def test_a_redirect_to_a_url_that_is_not_valid_is_invalid_input(moved: str, target: str) -> None:
    """`mailto:` and `data:` raised httpx's InvalidURL out of the fetch; `http://[::1` came back
    a transport error, an outage retried for good."""
    settings = UrlSettings(allow_hosts=["127.0.0.1"], timeout=5)
    with pytest.raises(InvalidInput, match="URL that is not valid"):
        fetch_url(f"{moved}/{target}", settings)


@pytest.mark.parametrize("port", ["0", "65536", "99999999999999999999"])
def test_a_port_out_of_range_is_refused_when_the_url_is_added(port: str) -> None:
    """65536 reached port 0 of the resolver's modulo; 20 digits raised OverflowError."""
    with pytest.raises(InvalidInput, match="not between 1 and 65535"):
        check_url(f"http://example.com:{port}/")
    assert check_url("http://example.com:65535/") == "http://example.com:65535/"


def test_a_site_local_ipv6_address_is_not_public() -> None:
    settings = UrlSettings(timeout=5)
    with pytest.raises(InvalidInput, match="resolves to fec0::1, which is not a public"):
        fetch_url("http://intranet.example/", settings, resolve=lambda host, port: ["fec0::1"])


def test_a_nul_in_a_file_s_path_fails_that_item_alone(db, host, tmp_path) -> None:
    """A host's source with a NUL in it: resolve() raised a bare ValueError, and the bulk run
    failed the item before it with this one's error and never read the one after."""
    root = tmp_path / "files"
    root.mkdir()
    (root / "a.md").write_text(TEXT, encoding="utf-8")
    reader = Reader(FilesSettings(roots=[root]))
    first = add_item(db, kind="file", title="a", content="", source=str(root / "a.md"))
    host.execute(
        "INSERT INTO knowledge_items(kind, title, source) VALUES (?, 'b', ?), (?, 'c', ?)",
        ("file", f"{root}/b\0.md", "code", f"{root}/c\0.py"),
    )
    nul_file, nul_code = first + 1, first + 2
    last = add_item(db, kind="file", title="d", content="", source=str(root / "a.md"))
    out = index_items(
        db,
        [first, nul_file, nul_code, last],
        embedder=FakeEmbedder(),
        options=IndexOptions(reader=reader),
    )
    assert out[first].status == out[last].status == "indexed"
    for item in (nul_file, nul_code):
        assert isinstance(out[item], InvalidInput) and "NUL" in str(out[item])
        assert get_state(db, item)["status"] == "failed"


class _SoftLimit(Exception):
    """Stands for Celery's soft time limit: an Exception no source raises on its input."""


_SoftLimit.__module__ = "billiard.exceptions"


def test_a_source_s_unnamed_failure_is_that_item_s_and_an_interruption_goes_on_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Reader.text is the backstop: Python's or a library's exception on what the source gave
    becomes this item's InvalidInput; an interruption (the soft time limit) is not caught."""
    item = type("Item", (), {"id": 7, "kind": "url", "source": "http://x/", "unreadable": None})
    raised: list[BaseException] = [OSError(errno.EIO, "Input/output error")]

    def fails(reader: Reader, item: object, cancel: object) -> str:
        raise raised[0]

    monkeypatch.setitem(sources._READ, "url", fails)
    with pytest.raises(SourceUnavailable, match=r"url 7: cannot be read \(OSError: .*Input/out"):
        Reader().text(item)  # type: ignore[arg-type]  (the disk's, for now: retried)
    raised[0] = ValueError("embedded null byte")
    with pytest.raises(InvalidInput, match=r"url 7: cannot be read \(ValueError: embedded"):
        Reader().text(item)  # type: ignore[arg-type]
    raised[0] = _SoftLimit("soft time limit")
    with pytest.raises(_SoftLimit):
        Reader().text(item)  # type: ignore[arg-type]
    raised[0] = InvalidInput("its own words")
    with pytest.raises(KidxError, match=r"^its own words$"):
        Reader().text(item)  # type: ignore[arg-type]


def test_a_page_that_never_closes_its_divs_is_read_to_its_end(tmp_path) -> None:
    """libxml2 stops at elements nested 256 deep unless asked for huge trees: 400 unclosed
    entries of a changelog were indexed as their first 252, the item `indexed`."""
    from worker.sources.files import read_file

    entries = "".join(
        f"<div class='entry'><p>Entry {i} of the changelog, with enough words to count.</p>\n"
        for i in range(400)
    )
    page = tmp_path / "changelog.html"
    page.write_text(f"<html><body><h1>Changelog</h1>{entries}</body></html>", encoding="utf-8")
    text = read_file(page, FilesSettings(roots=[tmp_path]))
    assert "Entry 0 of" in text and "Entry 399 of" in text


def test_a_page_nested_past_the_parser_s_limit_is_refused_not_cut(tmp_path) -> None:
    from worker.sources.files import html_text

    deep = "<div>" * 5_000 + "<p>the text in the middle</p>"
    with pytest.raises(InvalidInput, match=r"parser stopped before its end .*would be lost"):
        html_text(f"<html><body>{deep}</body></html>".encode(), "deep.html")


def test_a_text_node_over_10_mb_as_utf_8_is_read_whole() -> None:
    """3.5 MB of windows-1252 passes the 10 MB limit for HTML and is 10.5 MB as UTF-8:
    libxml2 dropped the paragraph and everything after it."""
    from worker.sources.files import html_text

    data = b"<html><body><h1>Head</h1><p>" + "\u20ac".encode("cp1252") * 3_500_000
    text = html_text(data + b"</p><p>The end of the page.</p></body></html>", "p", "cp1252")
    assert text is not None and "The end of the page." in text and text.count("\u20ac") > 3e6
