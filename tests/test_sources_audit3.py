"""Sources against a review's hostile pages: charsets that are no character set (UTF-7 and the
escape codecs gave lone surrogates, which failed every item of a bulk run; punycode and idna
decode in time that grows with the square of the text), host names idna refuses (its
error escaped as a bug, from a URL or from a redirect's Location), and an answer whose header
is too large to read."""

from __future__ import annotations

from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler

import pytest

from conftest import serving
from worker.errors import InvalidInput
from worker.settings import UrlSettings
from worker.sources.decoding import NOT_CHARSETS, _decode, decode_html, decode_text
from worker.sources.urls import check_url, fetch_url


@pytest.mark.parametrize("charset", ["utf-7", "UTF7", "punycode", "idna", "unicode-escape"])
def test_a_charset_that_is_no_character_set_is_read_as_utf8(charset: str) -> None:
    data = b"+2AA- caf\\u00e9 -" + b"9" * 1000
    assert decode_text(data, "page", charset=charset) == data.decode("ascii")
    html = b'<meta charset="' + charset.encode() + b'"><p>+2AA- \\ud800</p>'
    assert "\\ud800" in decode_html(html, "page") and "+2AA-" in decode_html(html, "page")


def test_a_codec_that_gives_a_lone_surrogate_is_refused_for_that_text_alone() -> None:
    assert "unicode_escape" not in NOT_CHARSETS  # (the codec's own name; its label is listed)
    with pytest.raises(InvalidInput, match=r"lone surrogate U\+D800 .*convert it to UTF-8"):
        _decode(b"caf\\ud800", "unicode_escape", "page")


class _Redirect(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(302)
        self.send_header("Location", "http://xn--a.example/")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def redirecting() -> Iterator[str]:
    with serving(_Redirect) as base:
        yield f"{base}/moved"


def test_a_host_name_idna_refuses_is_invalid_input_in_a_url_and_in_a_redirect(redirecting):
    for url in ("http://xn--/", "http://xn--a.example/"):
        with pytest.raises(InvalidInput, match="not a valid URL"):
            check_url(url)
    settings = UrlSettings(allow_hosts=["127.0.0.1"], timeout=5)
    with pytest.raises(InvalidInput, match="answered with a URL that is not valid"):
        fetch_url(redirecting, settings)


class _Padded(BaseHTTPRequestHandler):
    """An answer with as many 1 KB headers as its path says."""

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        for n in range(int(self.path.strip("/"))):
            self.send_header(f"X-Pad-{n}", "p" * 1000)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def padded() -> Iterator[str]:
    with serving(_Padded) as base:
        yield base


def test_an_answer_whose_header_is_too_large_to_read_is_invalid_input_not_retried(padded):
    """It was SourceUnavailable: retried, and failed again the same way each time."""
    settings = UrlSettings(allow_hosts=["127.0.0.1"], timeout=5)
    assert fetch_url(f"{padded}/50", settings).text == "hello"  # 50 KB of header is read
    with pytest.raises(InvalidInput, match="header too large to read"):
        fetch_url(f"{padded}/1000", settings)
