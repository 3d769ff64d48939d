"""Documents that cost far more to extract than their size: PDFs whose few KB make pypdf read
content for hours (a stream of operators drawn by every page, a form drawn thousands of times),
HTML whose element count makes trafilatura take minutes. Each is refused with a one-line reason
(InvalidInput: retrying cannot help), by the file reader, the URL fetcher and a real worker;
normal documents read as before.

The PDFs are written here byte by byte (`bomb_pdf`), with FlateDecode streams."""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from test_sources import ARTICLE, ARTICLE_HEADINGS, chapter, make_pdf, refused

from conftest import serving
from stack import Stack, running_stack
from tasks.producer import enqueue
from worker.errors import InvalidInput
from worker.settings import FilesSettings, UrlSettings
from worker.sources.files import html_to_markdown, read_file
from worker.sources.pdf import pdf_text
from worker.sources.urls import fetch_url
from worker.store.items import add_item

# What each bomb is held to here: a small limit, so that the refusal comes after a second or
# two, where pypdf would read without the limit for a minute or more.
PDF_LIMIT = 2_000_000
REFUSED_PDF = (
    r"reading its text means reading over 2000000 bytes of page content \(unpacked, each time "
    r"a page or form draws it, fonts included\); refused \(a decompression bomb\?\)"
)
EMPTY_TEXT = b"BT /F1 12 Tf () Tj ET\n"  # an operator that shows nothing: no text budget spent


def _stream(data: bytes, head: bytes = b"") -> bytes:
    packed = zlib.compress(data, 9)
    return (
        b"<< "
        + head
        + b"/Length %d /Filter /FlateDecode >>\nstream\n" % len(packed)
        + packed
        + b"\nendstream"
    )


def bomb_pdf(
    content: bytes, pages: int = 1, forms: list[bytes] | None = None, fonts: int = 1
) -> bytes:
    """A PDF of `pages` pages that all draw one content stream, `content`, in Helvetica (/F1;
    `fonts`: as many names /F1, /F2, ... for it in the resources); `forms`: form XObjects /X0,
    /X1, ..., each able to draw the next (/X0 draws /X1 ...)."""
    objects: list[bytes] = []

    def add(body: bytes) -> int:
        objects.append(body)
        return len(objects)

    font = add(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    names = b" ".join(b"/F%d %d 0 R" % (n, font) for n in range(1, fonts + 1))
    fonts_ = b"/Font %d 0 R" % add(b"<< %s >>" % names)
    xobject = b""
    for i, data in reversed(list(enumerate(forms or []))):  # the last first: each draws the next
        head = b"/Type /XObject /Subtype /Form /BBox [0 0 612 792] /Resources << %s%s >> " % (
            fonts_,
            xobject,
        )
        xobject = b" /XObject << /X%d %d 0 R >>" % (i, add(_stream(data, head)))
    contents = add(_stream(content))
    tree = len(objects) + pages + 1
    kids = [
        add(
            b"<< /Type /Page /Parent %d 0 R /MediaBox [0 0 612 792] /Resources << %s%s >> "
            b"/Contents %d 0 R >>" % (tree, fonts_, xobject, contents)
        )
        for _ in range(pages)
    ]
    assert (
        add(
            b"<< /Type /Pages /Kids [%s] /Count %d >>"
            % (b" ".join(b"%d 0 R" % k for k in kids), pages)
        )
        == tree
    )
    return _assembled(objects, add(b"<< /Type /Catalog /Pages %d 0 R >>" % tree))


def _assembled(objects: list[bytes], catalog: int) -> bytes:
    """A PDF file of `objects` (numbered from 1), its cross-reference table and trailer."""
    out = bytearray(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n")
    offsets = []
    for number, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % number + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % at for at in offsets)
    out += b"trailer\n<< /Size %d /Root %d 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (
        len(objects) + 1,
        catalog,
        xref,
    )
    return bytes(out)


def drawn_by_every_page(pages: int = 40) -> bytes:
    """A stream of 45,000 operators that show nothing (1 MB unpacked), drawn by every page of
    a PDF of 9 KB: pypdf reads it again for each page, a second and more each time."""
    return bomb_pdf(EMPTY_TEXT * 45_000, pages)


def drawn_form(*, nested: bool = False) -> bytes:
    """30 pages that draw a small form 2,000 times each (0.8 s a page: pypdf sets the form up
    again at every use); or (`nested`) one page that draws a form once, which draws the small
    one 4,000 times."""
    shown = b"BT /F1 12 Tf 10 10 Td (y) Tj ET\n" + b"BT () Tj ET\n" * 20
    if nested:
        return bomb_pdf(b"/X0 Do\n", 1, forms=[b"/X1 Do\n" * 4_000, shown])
    return bomb_pdf(b"/X0 Do\n" * 2_000, 30, forms=[shown])


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "root").mkdir()
    return tmp_path / "root"


def limited(root: Path, **limits: int) -> FilesSettings:
    return FilesSettings(roots=[root], **{"max_pdf_content_bytes": PDF_LIMIT, **limits})


# -- PDF ---------------------------------------------------------------------------------------


def test_a_stream_drawn_by_every_page_is_refused_once_its_reading_passes_the_limit(root: Path):
    bomb = drawn_by_every_page()
    assert len(bomb) < 10_000
    (root / "pages.pdf").write_bytes(bomb)
    message = refused(REFUSED_PDF, lambda: read_file(root / "pages.pdf", limited(root)))
    assert message.startswith(f"{root / 'pages.pdf'}: ")


@pytest.mark.parametrize("nested", [False, True], ids=["drawn-by-pages", "drawn-by-a-form"])
def test_a_form_drawn_thousands_of_times_is_refused(root: Path, nested: bool):
    """Nested, the refusal comes while pypdf reads a form; pypdf logs and skips any error in a
    form and goes on with the page, which then ends: the refusal is raised again there."""
    (root / "forms.pdf").write_bytes(drawn_form(nested=nested))
    refused(REFUSED_PDF, lambda: read_file(root / "forms.pdf", limited(root)))


def test_fonts_set_up_again_for_every_page_count_towards_the_limit(root: Path):
    """2,000 names for one font in the resources of 40 pages (a PDF of 30 KB): pypdf sets each
    up again for every page (0.1 s a page; 5 s with 100,000 names), whatever the page draws."""
    bomb = bomb_pdf(b"BT /F1 12 Tf 10 10 Td (x) Tj ET", 40, fonts=2_000)
    assert len(bomb) < 40_000
    (root / "fonts.pdf").write_bytes(bomb)
    refused(REFUSED_PDF, lambda: read_file(root / "fonts.pdf", limited(root)))


def test_normal_pdfs_read_as_before_within_the_default_limit(root: Path):
    """The chapter (fpdf) and a page drawing a form a few times: the same text with the default
    limit as with none, the form's text included."""
    chapter_pdf = make_pdf(chapter())
    forms = bomb_pdf(
        b"BT /F1 12 Tf 72 700 Td (Page text) Tj ET\n/X0 Do\n/X0 Do\n/X0 Do\n",
        2,
        forms=[b"BT /F1 12 Tf 72 600 Td (Form text) Tj ET"],
    )
    for name, data in (("chapter.pdf", chapter_pdf), ("forms.pdf", forms)):
        (root / name).write_bytes(data)
        text = read_file(root / name, FilesSettings(roots=[root]))
        assert text == pdf_text(data, name, limit=10**9, max_content=10**12)
    assert text.count("Form text") == 6 and text.count("Page text") == 2


# -- HTML --------------------------------------------------------------------------------------


def paragraphs(n: int) -> str:
    """An article of `n` short paragraphs: n + 6 elements."""
    body = "".join(
        f"<p>Paragraph number {i} of the article, with a few words.</p>" for i in range(n)
    )
    head = "<!doctype html><html><head><title>Many</title></head>"
    return f"{head}<body><article>{body}</article></body></html>"


def test_html_over_the_element_or_byte_limit_is_refused(root: Path):
    (root / "many.html").write_text(paragraphs(5_000), encoding="utf-8")
    few = FilesSettings(roots=[root], max_html_elements=1_000)
    refused(
        r"many\.html: the HTML has over 1000 elements, the limit for HTML \(finding the main "
        r"text of more takes minutes\)",
        lambda: read_file(root / "many.html", few),
    )
    (root / "article.html").write_text(ARTICLE, encoding="utf-8")
    small = FilesSettings(roots=[root], max_html_bytes=1_000)
    size = len(ARTICLE.encode())
    refused(
        rf"article\.html: {size} bytes of HTML is over the limit of 1000 bytes for HTML",
        lambda: read_file(root / "article.html", small),
    )


def test_normal_html_reads_as_before(root: Path):
    (root / "article.html").write_text(ARTICLE, encoding="utf-8")
    (root / "many.html").write_text(paragraphs(5_000), encoding="utf-8")
    files = FilesSettings(roots=[root])
    assert read_file(root / "article.html", files) == html_to_markdown(ARTICLE)
    assert read_file(root / "many.html", files) == html_to_markdown(paragraphs(5_000))
    for heading in ARTICLE_HEADINGS:
        assert heading in read_file(root / "article.html", files).splitlines()


# -- URLs --------------------------------------------------------------------------------------


@pytest.fixture
def site() -> Iterator[str]:
    """/pages.pdf (the stream every page draws), /many.html (5,000 paragraphs)."""
    routes = {
        "/pages.pdf": (drawn_by_every_page(), "application/pdf"),
        "/many.html": (paragraphs(5_000).encode(), "text/html; charset=utf-8"),
    }

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body, media = routes[self.path]
            self.send_response(200)
            self.send_header("Content-Type", media)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    with serving(Handler) as base:
        yield base


def test_the_url_fetcher_holds_pdf_and_html_to_the_same_limits(site: str):
    urls = UrlSettings(
        allow_hosts=["127.0.0.1"], max_pdf_content_bytes=PDF_LIMIT, max_html_elements=1_000
    )
    refused(
        rf"{re.escape(site)}/pages\.pdf: {REFUSED_PDF}",
        lambda: fetch_url(f"{site}/pages.pdf", urls),
    )
    refused(
        rf"{re.escape(site)}/many\.html: the HTML has over 1000 elements",
        lambda: fetch_url(f"{site}/many.html", urls),
    )
    # Within the defaults, the page reads as before.
    page = fetch_url(f"{site}/many.html", UrlSettings(allow_hosts=["127.0.0.1"]))
    assert page.text == html_to_markdown(paragraphs(5_000))


# -- a real worker -----------------------------------------------------------------------------


@pytest.mark.stack
def test_a_worker_fails_a_pdf_bomb_at_once_with_the_reason_and_indexes_nothing(tmp_path: Path):
    """Through GenerateKnowledgeItemEmbedding on a real worker: the task fails with the
    refusal (not at the soft time limit, which pypdf would reach long before the end), once,
    with no retry, the item `failed` with the reason, nothing embedded."""
    root = tmp_path / "root"
    root.mkdir()
    (root / "pages.pdf").write_bytes(drawn_by_every_page())
    (root / "many.html").write_text(paragraphs(5_000), encoding="utf-8")
    env = {
        "KIDX_FILES__ROOTS": str(root),
        "KIDX_FILES__MAX_PDF_CONTENT_BYTES": str(PDF_LIMIT),
        "KIDX_FILES__MAX_HTML_ELEMENTS": "1000",
        "KIDX_TASKS__SOFT_TIME_LIMIT": "20",
        "KIDX_TASKS__TIME_LIMIT": "30",
    }
    with running_stack(tmp_path / "stack", lambda tmp, si: Stack(tmp, si, env=env)) as stack:
        for name, reason in (("pages.pdf", REFUSED_PDF), ("many.html", r"over 1000 elements")):
            item = add_item(stack.db, kind="file", title=name, content="", source=str(root / name))
            result = stack.app.AsyncResult(enqueue(stack.db, item, app=stack.app))
            with pytest.raises(Exception) as caught:
                result.get(timeout=90)
            assert re.search(reason, str(caught.value)), str(caught.value)
            assert result.state == "FAILURE"
            state = stack.state(item)
            assert state["status"] == "failed" and re.search(reason, state["last_error"])
            jobs = stack.db.all("SELECT state, attempt FROM index_jobs WHERE item_id = ?", (item,))
            assert jobs == [("failed", 0)]
            assert (
                stack.db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (item,)) == 0
            )
        assert stack.standin.texts == []


def _fonts_pdf(pages: int, fonts: int, names: int = 0) -> bytes:
    """`pages` pages, each using `fonts` fonts that share one /ToUnicode map of one range of
    65,536 codes (and, with `names`, an /Encoding /Differences array of that many names)."""
    objs: list[bytes] = []

    def add(body: bytes) -> int:
        objs.append(body)
        return len(objs)

    cmap = (
        b"/CIDInit /ProcSet findresource begin 12 dict begin begincmap\n"
        b"1 begincodespacerange <0000> <FFFF> endcodespacerange\n"
        b"1 beginbfrange\n<0000> <FFFF> <0041>\nendbfrange\n"
        b"endcmap CMapName currentdict /CMap defineresource pop end end"
    )
    tu = add(b"<< /Length %d >>\nstream\n" % len(cmap) + cmap + b"\nendstream")
    enc = add(b"<< /Type /Encoding /Differences [1 " + b"/a" * names + b"] >>")
    font = b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /ToUnicode %d 0 R%s >>"
    extra = b" /Encoding %d 0 R" % enc if names else b""
    fs = [add(font % (tu, extra)) for _ in range(fonts)]
    fontdict = add(b"<< " + b" ".join(b"/F%d %d 0 R" % (i, f) for i, f in enumerate(fs)) + b" >>")
    content = b"BT /F0 12 Tf 72 720 Td (page text) Tj ET"
    c = add(b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream")
    tree = len(objs) + pages + 1
    page = b"<< /Type /Page /Parent %d 0 R /MediaBox [0 0 612 792] /Resources << /Font %d 0 R >>"
    kids = [add(page % (tree, fontdict) + b" /Contents %d 0 R >>" % c) for _ in range(pages)]
    refs = b" ".join(b"%d 0 R" % k for k in kids)
    assert add(b"<< /Type /Pages /Kids [%s] /Count %d >>" % (refs, pages)) == tree
    return _assembled(objs, add(b"<< /Type /Catalog /Pages %d 0 R >>" % tree))


def test_a_font_s_map_ranges_and_differences_are_counted_in_the_pdf_s_work() -> None:
    """pypdf sets up each font again at every page: a /ToUnicode line `<0000> <FFFF> <0041>`
    is 65,536 codes (0.15 s each time), a /Differences array of 99,000 names 7 ms. Both were
    charged 50 bytes a font: a 10 KB PDF took 22 s at 0.2% of the budget, and hours with more
    pages. Now refused before pypdf sets them up, within the budget a page's content has."""
    data = _fonts_pdf(pages=2, fonts=8)
    assert len(data) < 10_000
    with pytest.raises(InvalidInput, match="fonts included"):
        pdf_text(data, "fonts.pdf", limit=10**9, max_content=1_000_000)
    assert pdf_text(data, "fonts.pdf", limit=10**9, max_content=10**8).strip()
    # a font's /Differences: a sixteenth of a byte a name, at every page that uses it
    import io

    import pypdf

    from worker.sources.pdf import NAMES_PER_BYTE, _PdfWork

    def font_cost(names: int) -> int:
        reader = pypdf.PdfReader(io.BytesIO(_fonts_pdf(pages=1, fonts=1, names=names)))
        font = reader.pages[0]["/Resources"]["/Font"]["/F0"].get_object()
        return _PdfWork("x.pdf", 10**9)._font(font)

    assert font_cost(99_000) - font_cost(0) == 99_000 // NAMES_PER_BYTE > 0


def streams_pdf(count: int, unpacked: int) -> bytes:
    """One page whose /Contents is `count` streams of `unpacked` spaces each (a few hundred
    bytes of flate apiece)."""
    objects = [b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    first = len(objects) + 1
    objects += [_stream(b" " * unpacked) for _ in range(count)]
    contents = b" ".join(b"%d 0 R" % n for n in range(first, first + count))
    objects.append(
        b"<< /Type /Page /Parent %d 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 1 0 R"
        b" >> >> /Contents [%s] >>" % (len(objects) + 2, contents)
    )
    objects.append(b"<< /Type /Pages /Kids [%d 0 R] /Count 1 >>" % len(objects))
    objects.append(b"<< /Type /Catalog /Pages %d 0 R >>" % len(objects))
    return _assembled(objects, len(objects))


def test_a_page_of_many_streams_is_refused_at_the_first_past_the_limit(
    root: Path, monkeypatch: pytest.MonkeyPatch
):
    """Every stream of a page was unpacked (and kept, by pypdf) before their sum was charged:
    40 streams of 70 MB in a 15 KB PDF held 2.8 GB. Each is charged as it is unpacked now."""
    from worker.sources import pdf

    unpacked: list[int] = []
    size = pdf._PdfWork._size
    monkeypatch.setattr(
        pdf._PdfWork, "_size", staticmethod(lambda s: unpacked.append(size(s)) or unpacked[-1])
    )
    bomb = streams_pdf(40, 1_500_000)
    assert len(bomb) < 100_000
    (root / "streams.pdf").write_bytes(bomb)
    refused(REFUSED_PDF, lambda: read_file(root / "streams.pdf", limited(root)))
    assert sum(unpacked) <= PDF_LIMIT + 1_500_000, len(unpacked)  # two streams, not forty


def test_a_stream_that_unpacks_past_the_budget_is_refused_before_it_is_all_unpacked(root: Path):
    """pypdf unpacks a stream up to 75 MB before anything can be charged; its limit is the
    budget now (at least UNPACKED_MIN)."""
    from worker.sources.pdf import UNPACKED_MIN

    (root / "big.pdf").write_bytes(bomb_pdf(b" " * (UNPACKED_MIN + 1_000_000)))
    message = refused("unpacks to over", lambda: read_file(root / "big.pdf", limited(root)))
    assert f"over {UNPACKED_MIN} bytes" in message


def test_a_map_of_ranges_never_closed_is_read_in_one_pass():
    """`beginbfrange` 20,000 times and no `endbfrange`: a lazy regex searched to the end from
    each (50 s for a 1 KB PDF). Closed ranges are found as before."""
    from worker.sources.pdf import _bfranges

    assert list(_bfranges(b"beginbfrange " * 20_000)) == []
    data = b"x beginbfrange <01> <02> <0041> endbfrange y beginbfrange <10> <1F> <0030> endbfrange"
    assert list(_bfranges(data)) == [b" <01> <02> <0041> ", b" <10> <1F> <0030> "]
    font = b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /ToUnicode 5 0 R >>"
    page = (
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 4 0 R"
        b" >> >> /Contents 6 0 R >>"
    )
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        page,
        font,
        _stream(b"beginbfrange " * 3_000),
        _stream(b"BT /F1 12 Tf 72 700 Td (Hello there) Tj ET"),
    ]
    assert "Hello there" in pdf_text(_assembled(objects, 1), "map.pdf", limit=1_000_000)
