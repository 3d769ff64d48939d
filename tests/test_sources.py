"""Files and URLs into text: real files under tmp_path, a real HTTP server on 127.0.0.1.

The server is allowed only where a test says so (`UrlSettings(allow_hosts=["127.0.0.1"])`);
everything else shows a refusal with a clear message, and that no request was made.
"""

from __future__ import annotations

import contextlib
import io
import ipaddress
import re
import socket
import struct
import subprocess
import sys
import threading
import tracemalloc
import zipfile
import zlib
from collections.abc import Callable, Iterator
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import docx
import httpx
import pytest
from fpdf import FPDF
from markdown_it import MarkdownIt

from worker.bulk import index_item
from worker.chunking import chunk_structure
from worker.errors import InvalidInput, SourceUnavailable
from worker.indexers import IndexOptions
from worker.settings import FilesSettings, UrlSettings
from worker.sources import Reader
from worker.sources import files as files_module
from worker.sources.files import read_file
from worker.sources.pdf import pdf_text
from worker.sources.urls import Fetched, fetch_url
from worker.store.items import add_item, get_state

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "rustbook"
CHAPTER = "ch04-01-what-is-ownership.md"
MARKERS = ("NAV-MARKER", "SCRIPT-MARKER", "FOOTER-MARKER")
LIMIT = 10_000

ARTICLE = """<!doctype html><html><head><meta charset="utf-8"><title>Ownership notes</title>
<script>var tracking = "SCRIPT-MARKER in the head";</script></head><body>
<nav><ul><li><a href="/">Home</a></li><li><a href="/about">NAV-MARKER About us</a></li>
<li><a href="/blog">Blog</a></li></ul></nav>
<article><h1>Understanding Ownership</h1>
<p>Ownership is a set of rules that govern how a program manages memory. Some languages have
garbage collection that looks for memory no longer used while the program runs; in others the
programmer must explicitly allocate and free the memory.</p>
<h2>The Stack and the Heap</h2>
<p>Both the stack and the heap are parts of memory available to your code at runtime, but they
are structured in different ways. The stack stores values in the order it gets them and removes
the values in the opposite order: last in, first out.</p>
<h2>Ownership Rules</h2>
<p>Each value has an owner. There can only be one owner at a time. When the owner goes out of
scope, the value will be dropped, and its memory is returned to the allocator.</p>
</article>
<footer><p>FOOTER-MARKER Copyright 2024 Example Corp. All rights reserved.</p></footer>
<script>console.log("SCRIPT-MARKER at the end");</script></body></html>"""
ARTICLE_HEADINGS = ("# Understanding Ownership", "## The Stack and the Heap", "## Ownership Rules")


# -- documents built from the corpus ----------------------------------------------------------


def chapter() -> str:
    path = CORPUS / CHAPTER
    if not path.is_file():
        raise FileNotFoundError(f"the corpus must be beside the checkout: {path}")
    return path.read_text(encoding="utf-8")


def headings_of(markdown: str) -> list[tuple[int, str]]:
    """(level, title) of the chapter's headings, blockquoted ones included."""
    found = re.findall(r"^(?:> )?(#{1,6}) (.+)$", markdown, re.M)
    return [(len(marks), title.strip()) for marks, title in found]


def plain(title: str) -> str:
    return title.replace("`", "")


def latin1(text: str) -> str:
    """What fpdf's core fonts can encode: curly quotes and dashes made plain."""
    table = str.maketrans({"‘": "'", "’": "'", "“": '"', "”": '"', "—": "-", "–": "-", "…": "..."})
    return text.translate(table).encode("latin-1", "replace").decode("latin-1")


def chapter_blocks(markdown: str) -> Iterator[tuple[str, int, str]]:
    """("heading", level, title), ("code", 0, code) or ("text", 0, paragraph)."""
    markdown = re.sub(r"^> ?", "", markdown, flags=re.M)
    for block in re.split(r"\n\s*\n", markdown):
        block = block.strip()
        m = re.fullmatch(r"(#{1,6}) (.+)", block)
        if m:
            yield "heading", len(m.group(1)), plain(m.group(2))
        elif block.startswith("```"):
            yield "code", 0, "\n".join(block.splitlines()[1:-1])
        elif block:
            yield "text", 0, " ".join(block.split())


def make_pdf(markdown: str, *, user_password: str | None = None) -> bytes:
    """Headings in a bigger bold font, body in Helvetica, code in Courier."""
    pdf = FPDF()
    if user_password:
        pdf.set_encryption(owner_password="owner", user_password=user_password)
    pdf.add_page()
    sizes = {1: 22, 2: 18, 3: 15, 4: 13}
    for kind, level, text in chapter_blocks(markdown):
        if kind == "heading":
            pdf.set_font("Helvetica", "B", sizes.get(level, 12))
            pdf.multi_cell(0, 9, latin1(text), new_x="LMARGIN", new_y="NEXT")
        elif kind == "code":
            pdf.set_font("Courier", "", 9)
            pdf.multi_cell(0, 4.5, latin1(text), new_x="LMARGIN", new_y="NEXT")
        else:
            pdf.set_font("Helvetica", "", 11)
            pdf.multi_cell(0, 6, latin1(text), new_x="LMARGIN", new_y="NEXT")
        pdf.ln(2)
    return bytes(pdf.output())


def make_html(markdown: str) -> str:
    body = MarkdownIt().render(markdown)
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>Ownership</title>"
        "<script>var x = 'SCRIPT-MARKER';</script></head><body>"
        "<nav><a href='/'>Home</a> <a href='/toc'>NAV-MARKER Contents</a></nav>"
        f"<main>{body}</main><footer>FOOTER-MARKER Licensed MIT</footer></body></html>"
    )


@pytest.fixture(scope="module")
def chapter_pdf() -> bytes:
    return make_pdf(chapter())


@pytest.fixture
def root(tmp_path: Path) -> Path:
    (tmp_path / "root").mkdir()
    return tmp_path / "root"


@pytest.fixture
def files(root: Path) -> FilesSettings:
    return FilesSettings(roots=[root])


def refused(match: str, call: Callable[[], object]) -> str:
    with pytest.raises(InvalidInput, match=match) as info:
        call()
    message = str(info.value)
    assert "\n" not in message
    return message


# -- files: each type keeps its headings ------------------------------------------------------


def test_markdown_is_read_as_is(root: Path, files: FilesSettings) -> None:
    (root / "ownership.md").write_text(chapter(), encoding="utf-8")
    assert read_file(root / "ownership.md", files) == chapter()


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32", "utf-8-sig"])
def test_text_with_a_bom_decodes(root: Path, files: FilesSettings, encoding: str) -> None:
    text = "# Überschrift\n\nCafé “quoted” 日本語\n"
    data = text.encode(encoding)
    if encoding == "utf-16-be":
        data = b"\xfe\xff" + data
    (root / "notes.txt").write_bytes(data)
    assert read_file(root / "notes.txt", files) == text


def test_html_file_keeps_the_chapters_headings(root: Path, files: FilesSettings) -> None:
    (root / "ownership.html").write_text(make_html(chapter()), encoding="utf-8")
    text = read_file(root / "ownership.html", files)
    lines = set(text.splitlines())
    assert "## What Is Ownership?" in lines
    for level, title in headings_of(chapter()):
        assert f"{'#' * level} {title}" in lines
    assert not [m for m in MARKERS if m in text]
    chunks = chunk_structure(text)
    for _, title in headings_of(chapter()):
        assert any(title in c.content for c in chunks), title
        assert any(title in c.headings for c in chunks), title


def test_pdf_file_keeps_the_chapters_headings(
    root: Path, files: FilesSettings, chapter_pdf: bytes
) -> None:
    (root / "ownership.pdf").write_bytes(chapter_pdf)
    text = read_file(root / "ownership.pdf", files)
    assert "the program won't compile" in " ".join(text.split())  # the body is there too
    lines = text.splitlines()
    for _, title in headings_of(chapter()):
        assert any(re.fullmatch(rf"#+ {re.escape(plain(title))}", line) for line in lines), title
    chunks = chunk_structure(text)
    for _, title in headings_of(chapter()):
        assert any(plain(title) in c.content for c in chunks), title
        assert any(plain(title) in c.headings for c in chunks), title


def test_pdf_pages_are_separated_by_a_blank_line(chapter_pdf: bytes) -> None:
    import pypdf

    pages = [p.extract_text() for p in pypdf.PdfReader(__import__("io").BytesIO(chapter_pdf)).pages]
    assert len(pages) > 2
    text = pdf_text(chapter_pdf, "ownership.pdf", limit=10**6)
    last_line_of_first = pages[0].rstrip().splitlines()[-1].strip()
    first_line_of_second = pages[1].strip().splitlines()[0].strip()
    i = text.index(last_line_of_first) + len(last_line_of_first)
    assert text[i:].lstrip(" ").startswith("\n\n")
    assert first_line_of_second in text[i : i + 200]


def test_docx_headings_lists_and_tables(root: Path, files: FilesSettings) -> None:
    document = docx.Document()
    document.add_paragraph("The Book", style="Title")
    for kind, level, text in chapter_blocks(chapter()):
        if kind == "heading":
            document.add_heading(text, level=level - 1)
        else:
            document.add_paragraph(text)
    document.add_paragraph("first rule", style="List Bullet")
    document.add_paragraph("second rule", style="List Bullet")
    table = document.add_table(rows=2, cols=2)
    for (r, c), value in zip([(0, 0), (0, 1), (1, 0), (1, 1)], ["Kind", "Where", "i32", "stack"]):
        table.cell(r, c).text = value
    document.save(root / "ownership.docx")
    text = read_file(root / "ownership.docx", files)
    lines = text.splitlines()
    assert lines[0] == "# The Book"
    assert "# What Is Ownership?" in lines
    assert "## Ownership Rules" in lines
    assert "### Variables and Data Interacting with Move" in lines
    assert "- first rule\n- second rule" in text
    assert "| Kind | Where |\n| --- | --- |\n| i32 | stack |" in text
    assert any(line.startswith("_Ownership_ is a set of rules") for line in lines)


def test_article_html_file_gives_the_article_only(root: Path, files: FilesSettings) -> None:
    (root / "article.htm").write_text(ARTICLE, encoding="utf-8")
    text = read_file(root / "article.htm", files)
    for heading in ARTICLE_HEADINGS:
        assert heading in text.splitlines()
    assert "last in, first out" in text
    assert not [m for m in MARKERS if m in text]
    assert "Home" not in text and "About us" not in text


def test_html_charset_from_meta(root: Path, files: FilesSettings) -> None:
    page = ARTICLE.replace('charset="utf-8"', 'charset="windows-1252"').replace("Some", "Café")
    (root / "latin.html").write_bytes(page.encode("cp1252"))
    assert "Café languages" in read_file(root / "latin.html", files)


def test_unknown_suffix_text_is_read(root: Path, files: FilesSettings) -> None:
    (root / "notes.conf").write_text("key = value\n", encoding="utf-8")
    assert read_file(root / "notes.conf", files) == "key = value\n"


# -- files: refusals --------------------------------------------------------------------------


def test_no_roots_means_no_files(root: Path) -> None:
    (root / "a.md").write_text("# A\n")
    refused("KIDX_FILES__ROOTS", lambda: read_file(root / "a.md", FilesSettings()))


def test_path_outside_the_roots(tmp_path: Path, files: FilesSettings) -> None:
    (tmp_path / "secret.md").write_text("# secret\n")
    message = refused(
        "outside the allowed folders", lambda: read_file(tmp_path / "secret.md", files)
    )
    assert "secret.md" in message
    sneaky = tmp_path / "root" / ".." / "secret.md"
    refused("outside the allowed folders", lambda: read_file(sneaky, files))


def test_symlink_that_leads_outside(tmp_path: Path, root: Path, files: FilesSettings) -> None:
    (tmp_path / "secret.md").write_text("# secret\n")
    (root / "link.md").symlink_to(tmp_path / "secret.md")
    message = refused("outside the allowed folders", lambda: read_file(root / "link.md", files))
    assert "link.md" in message and "resolves to" in message
    (root / "linkdir").symlink_to(tmp_path, target_is_directory=True)
    refused("outside", lambda: read_file(root / "linkdir" / "secret.md", files))


@pytest.mark.parametrize("depth", [1, 2])
def test_a_folder_swapped_for_a_symlink_after_the_check_is_not_followed(
    tmp_path: Path, root: Path, files: FilesSettings, monkeypatch: pytest.MonkeyPatch, depth: int
) -> None:
    """The race: the path is checked (resolved under the roots), then someone who may write
    under the roots swaps a folder on the way for a symlink out of them, then it is opened."""
    outside = tmp_path / "outside" / "a" / "b"
    outside.mkdir(parents=True)
    inside = root / "a" / "b"
    inside.mkdir(parents=True)
    for folder, text in ((outside, "# secret\n"), (inside, "# mine\n")):
        (folder / "f.md").write_text(text)
    swapped = root / "a" if depth == 1 else inside
    real = files_module.resolve_under_roots

    def check_then_swap(path: Any, settings: FilesSettings) -> Path:
        resolved = real(path, settings)
        swapped.rename(swapped.with_name("moved"))
        swapped.symlink_to(tmp_path / "outside" / "a" if depth == 1 else outside)
        return resolved

    monkeypatch.setattr(files_module, "resolve_under_roots", check_then_swap)
    refused("cannot be opened", lambda: read_file(inside / "f.md", files))


def test_symlink_inside_the_roots_reads_the_target(root: Path, files: FilesSettings) -> None:
    (root / "real.md").write_text("# Real\n")
    (root / "alias.md").symlink_to(root / "real.md")
    assert read_file(root / "alias.md", files) == "# Real\n"


def test_directory_missing_and_too_big(root: Path, files: FilesSettings) -> None:
    (root / "sub").mkdir()
    refused(r"sub: is a directory", lambda: read_file(root / "sub", files))
    refused(r"nothing\.md: no such file", lambda: read_file(root / "nothing.md", files))
    (root / "big.md").write_text("x" * 101)
    small = FilesSettings(roots=[root], max_bytes=100)
    refused(
        r"big\.md: 101 bytes is over the size limit of 100 bytes",
        lambda: read_file(root / "big.md", small),
    )


def test_binary_files(root: Path, files: FilesSettings) -> None:
    (root / "blob.dat").write_bytes(b"abc\x00\x01\x02def")
    refused(
        r"blob\.dat: binary or unsupported file type", lambda: read_file(root / "blob.dat", files)
    )
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(64))
    refused(r"image\.png: binary or unsupported", lambda: read_file(root / "image.png", files))
    (root / "sheet.xlsx").write_bytes(b"PK\x03\x04notreallyazip")
    refused(r"sheet\.xlsx: binary or unsupported", lambda: read_file(root / "sheet.xlsx", files))


def test_empty_and_blank_files(root: Path, files: FilesSettings) -> None:
    (root / "empty.md").write_bytes(b"")
    refused(r"empty\.md: the file is empty", lambda: read_file(root / "empty.md", files))
    (root / "blank.txt").write_text("  \n\t\n")
    refused(r"blank\.txt: contains only white space", lambda: read_file(root / "blank.txt", files))


def test_invalid_utf8_names_the_byte_and_offset(root: Path, files: FilesSettings) -> None:
    (root / "latin.txt").write_bytes(b"hello \xff world")
    refused(
        r"latin\.txt: is not UTF-8 text \(byte 0xff at offset 6\); convert it to UTF-8",
        lambda: read_file(root / "latin.txt", files),
    )


def test_damaged_and_encrypted_documents(root: Path, files: FilesSettings) -> None:
    (root / "locked.pdf").write_bytes(make_pdf("# Secret\n\ntext\n", user_password="pw"))
    refused(r"locked\.pdf: the PDF is encrypted", lambda: read_file(root / "locked.pdf", files))
    (root / "broken.pdf").write_bytes(b"%PDF-1.7\nthis is not a pdf at all\n")
    refused(r"broken\.pdf: unreadable PDF", lambda: read_file(root / "broken.pdf", files))
    (root / "broken.docx").write_bytes(b"PK\x03\x04 truncated")
    refused(r"broken\.docx: unreadable DOCX", lambda: read_file(root / "broken.docx", files))
    page = "<html><head><title>T</title></head><body><script>go()</script><img src=a.png></body>"
    (root / "empty.html").write_text(page + "</html>")
    refused(r"empty\.html: no main text", lambda: read_file(root / "empty.html", files))


# -- decompression bombs ---------------------------------------------------------------------


def make_docx(paragraphs: int, *, blob: bytes = b"") -> bytes:
    """A DOCX of `paragraphs` identical paragraphs of 1,000 characters (deflated XML shrinks
    them some 300 times), with `blob` as an image part if given."""
    document = docx.Document()
    document.add_paragraph("seed")
    buf = io.BytesIO()
    document.save(buf)
    source = zipfile.ZipFile(buf)
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as archive:
        for info in source.infolist():
            data = source.read(info.filename)
            if info.filename == "word/document.xml":
                head, tail = data.split(b"seed")
                para = b"</w:t></w:r></w:p><w:p><w:r><w:t>" + b"word " * 200
                data = head + para * paragraphs + tail
            archive.writestr(info.filename, data)
        if blob:
            archive.writestr("word/media/image1.png", blob)
    return out.getvalue()


def lie_about_size(data: bytes, member: str, size: int) -> bytes:
    """The zip with `member`'s uncompressed size in the central directory set to `size`."""
    name = member.encode()
    at = data.index(b"PK\x01\x02")
    while data[at + 46 : at + 46 + len(name)] != name:
        at = data.index(b"PK\x01\x02", at + 4)
    return data[: at + 24] + struct.pack("<I", size) + data[at + 28 :]


def test_a_docx_that_unpacks_to_too_much_xml_is_refused(root: Path) -> None:
    bomb = make_docx(3_000)  # 3 MB of XML in a file of a few KB
    (root / "bomb.docx").write_bytes(bomb)
    assert len(bomb) < 50_000
    files = FilesSettings(roots=[root], max_xml_bytes=2_000_000)
    refused(
        r"bomb\.docx: the document's XML unpacks to \d{7} bytes, over the limit of 2000000 "
        r"bytes \(a decompression bomb\?\)",
        lambda: read_file(root / "bomb.docx", files),
    )
    # Declared sizes can lie; zipfile inflates no more than declared (what the check relies
    # on), so the lie ends in a refusal, never in the 3 MB. (This holds without the check.)
    (root / "liar.docx").write_bytes(lie_about_size(bomb, "word/document.xml", 1_000))
    refused(
        r"liar\.docx: unreadable DOCX \(BadZipFile", lambda: read_file(root / "liar.docx", files)
    )
    # Within the limit, the same document is read.
    assert read_file(root / "bomb.docx", FilesSettings(roots=[root])).count("word") == 600_000


def test_a_docx_that_unpacks_to_too_much_in_all_is_refused(root: Path) -> None:
    (root / "blob.docx").write_bytes(make_docx(1, blob=b"\x89PNG\r\n\x1a\n" + bytes(3_000_000)))
    files = FilesSettings(roots=[root], max_bytes=500_000)
    refused(
        r"blob\.docx: the document's content unpacks to \d{7} bytes, over the limit of 2000000 "
        r"bytes",
        lambda: read_file(root / "blob.docx", files),
    )
    # An image is held, not parsed: it does not count as XML. XML it is, though, however
    # much white space comes before its first `<`.
    files = FilesSettings(roots=[root], max_xml_bytes=2_000_000)
    assert read_file(root / "blob.docx", files)
    (root / "padded.docx").write_bytes(make_docx(1, blob=b" " * 3_000_000 + b"<x/>"))
    refused(
        r"padded\.docx: the document's XML unpacks to \d{7} bytes",
        lambda: read_file(root / "padded.docx", files),
    )


def test_a_docx_bomb_is_refused_by_the_indexer_and_nothing_is_indexed(
    db: Any, embedder: Any, standin: Any, root: Path
) -> None:
    (root / "bomb.docx").write_bytes(make_docx(3_000))
    reader = Reader(FilesSettings(roots=[root], max_xml_bytes=2_000_000))
    item = add_item(db, kind="file", title="bomb", content="", source=str(root / "bomb.docx"))
    with pytest.raises(InvalidInput, match="unpacks to"):
        index_item(db, item, embedder=embedder, options=IndexOptions(reader=reader))
    state = get_state(db, item)
    assert state["status"] == "failed" and "XML unpacks to" in state["last_error"]
    assert db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (item,)) == 0
    assert db.scalar("SELECT content FROM knowledge_items WHERE id = ?", (item,)) == ""
    assert standin.texts == []


def test_a_small_compressed_document_with_a_huge_text_is_refused(root: Path) -> None:
    """Its text, counted as it is extracted, is held to the size limit in characters:
    refused, not cut short."""
    (root / "long.docx").write_bytes(make_docx(1_000))  # a million characters
    pdf = FPDF()
    pdf.set_font("Helvetica", "", 8)
    for _ in range(5):
        pdf.add_page()
        pdf.text(10, 10, "word " * 10_000)  # one line, as long as it is
    (root / "long.pdf").write_bytes(bytes(pdf.output()))
    for name, limit in (("long.docx", 500_000), ("long.pdf", 50_000)):
        size = (root / name).stat().st_size
        files = FilesSettings(roots=[root], max_bytes=limit)
        assert size <= files.max_bytes < len(read_file(root / name, FilesSettings(roots=[root])))
        refused(
            rf"{re.escape(name)}: the text extracted is over the size limit of "
            rf"{files.max_bytes} characters",
            lambda: read_file(root / name, files),  # noqa: B023
        )


# -- a real HTTP server on 127.0.0.1 ----------------------------------------------------------

BOMB_MB = 200


def gzipped(data: bytes, wbits: int = 31) -> bytes:
    packer = zlib.compressobj(9, zlib.DEFLATED, wbits)
    return packer.compress(data) + packer.flush()


@cache
def gzip_bomb() -> bytes:
    """BOMB_MB of zeros, gzipped: about 200 KB."""
    packer = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(1 << 20)
    return b"".join(packer.compress(block) for _ in range(BOMB_MB)) + packer.flush()


class Site:
    """The routes the URL tests fetch, and what the server saw."""

    def __init__(self, pdf: bytes) -> None:
        self.pdf = pdf
        self.paths: list[str] = []
        self.headers: list[dict[str, str]] = []
        self.release = threading.Event()  # ends the slow page's wait at teardown
        self.stream_done = threading.Event()
        self.stream_completed = False
        self.base = ""
        self.port = 0


def make_handler(site: Site) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = 10

        def log_message(self, format: str, *args: object) -> None:
            pass

        def reply(
            self,
            code: int,
            body: bytes,
            ctype: str = "text/html; charset=utf-8",
            headers: dict[str, str] | None = None,
        ) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(body)

        def redirect(self, location: str, code: int = 302) -> None:
            self.reply(code, b"", headers={"Location": location})

        def do_GET(self) -> None:
            site.paths.append(self.path)
            site.headers.append(dict(self.headers.items()))
            path = self.path
            if path == "/article":
                self.reply(200, ARTICLE.encode())
            elif path == "/chapter.pdf":
                self.reply(200, site.pdf, "application/pdf")
            elif path == "/redirect":
                self.redirect("/article", 301)
            elif path.startswith("/chain/"):
                n = int(path.rsplit("/", 1)[1])
                self.redirect(f"/chain/{n - 1}" if n else "/article", 307)
            elif path == "/loop-a":
                self.redirect(f"{site.base}/loop-b")
            elif path == "/loop-b":
                self.redirect("/loop-a", 308)
            elif path.startswith("/to?"):
                self.redirect(path.split("?", 1)[1], 303)
            elif path == "/missing":
                self.reply(404, b"<h1>Not Found</h1>")
            elif path in ("/busy", "/broken"):
                self.reply(429 if path == "/busy" else 503, b"try later", "text/plain")
            elif path == "/image.png":
                self.reply(200, b"\x89PNG\r\n\x1a\n" + bytes(100), "image/png")
            elif path == "/echo":
                lines = [f"{k}: {v}" for k, v in self.headers.items()]
                self.reply(200, "\n".join(lines).encode(), "text/plain")
            elif path == "/latin":
                self.reply(
                    200, "Caf\xe9 au lait".encode("latin-1"), "text/plain; charset=ISO-8859-1"
                )
            elif path == "/bad-utf8":
                self.reply(200, b"caf\xe9 au lait", "text/markdown")
            elif path == "/declared-big":
                self.send_response(200)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(LIMIT * 100))
                self.end_headers()
                self.wfile.write(b"only a little")
            elif path.startswith("/coded/"):
                coding, body = {
                    "gzip-twice": ("gzip, gzip", gzipped(gzip_bomb())),  # ~500 bytes sent
                    "gzip-bomb": ("gzip", gzip_bomb()),
                    "gzip": ("gzip", gzipped(b"Caf\xc3\xa9 au lait")),
                    "deflate": ("deflate", gzipped(b"zlib-wrapped deflate", 15)),
                    "raw-deflate": ("deflate", gzipped(b"raw deflate", -15)),
                    "zstd": ("zstd", b"(zstd bytes)"),
                    "broken": ("gzip", b"\x1f\x8b not really gzip"),
                }[path.removeprefix("/coded/")]
                if path.endswith("bomb"):  # no Content-Length to refuse it by: read until closed
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain")
                    self.send_header("Content-Encoding", coding)
                    self.end_headers()
                    with contextlib.suppress(OSError):  # the client hangs up early
                        self.wfile.write(body)
                else:
                    self.reply(200, body, "text/plain", {"Content-Encoding": coding})
            elif path == "/stream-big":
                self.stream()
            elif path == "/slow":
                site.release.wait(10)
                with contextlib.suppress(OSError):  # the client gave up long ago
                    self.reply(200, b"too late", "text/plain")
            else:
                self.reply(404, b"no such route", "text/plain")

        def stream(self) -> None:
            """64 MB without a Content-Length: only a client that reads it all lets it end."""
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            try:
                for _ in range(1024):
                    self.wfile.write(b"a" * 65536)
                site.stream_completed = True
            except OSError:
                pass
            finally:
                site.stream_done.set()

    return Handler


@pytest.fixture
def site(chapter_pdf: bytes) -> Iterator[Site]:
    state = Site(chapter_pdf)
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    state.port = server.server_address[1]
    state.base = f"http://127.0.0.1:{state.port}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        yield state
    finally:
        state.release.set()
        server.shutdown()
        server.server_close()  # joins the handler threads
        thread.join(timeout=10)
        assert not thread.is_alive()


ALLOWED = UrlSettings(allow_hosts=["127.0.0.1"], max_bytes=LIMIT, timeout=5, connect_timeout=2)


def resolver(
    table: dict[str, list[str]], calls: list[str] | None = None
) -> Callable[[str, int], list[str]]:
    def resolve(host: str, port: int) -> list[str]:
        if calls is not None:
            calls.append(host)
        if host not in table:
            raise AssertionError(f"unexpected lookup of {host}")
        return table[host]

    return resolve


# -- URLs: what comes back --------------------------------------------------------------------


def test_article_page_gives_the_article_only(site: Site) -> None:
    fetched = fetch_url(f"{site.base}/article", ALLOWED)
    assert isinstance(fetched, Fetched)
    assert fetched.content_type == "text/html"
    assert fetched.final_url == f"{site.base}/article"
    for heading in ARTICLE_HEADINGS:
        assert heading in fetched.text.splitlines()
    assert "last in, first out" in fetched.text
    assert not [m for m in MARKERS if m in fetched.text]


def test_redirect_is_followed_and_checked(site: Site) -> None:
    fetched = fetch_url(f"{site.base}/redirect", ALLOWED)
    assert fetched.final_url == f"{site.base}/article"
    assert "# Understanding Ownership" in fetched.text
    assert site.paths == ["/redirect", "/article"]


def test_pdf_over_http_keeps_the_chapters_headings(site: Site) -> None:
    fetched = fetch_url(f"{site.base}/chapter.pdf", ALLOWED.model_copy(update={"max_bytes": 10**7}))
    assert fetched.content_type == "application/pdf"
    chunks = chunk_structure(fetched.text)
    for _, title in headings_of(chapter()):
        assert any(plain(title) in c.headings for c in chunks), title


def test_plain_text_charset_from_the_header(site: Site) -> None:
    assert fetch_url(f"{site.base}/latin", ALLOWED).text == "Café au lait"


def test_honest_user_agent_and_pinned_address(site: Site) -> None:
    """The name is resolved once, by kidx; the request goes to that address, with the
    original Host header (httpx could not resolve kidx.test itself)."""
    calls: list[str] = []
    resolve = resolver({"kidx.test": ["127.0.0.1"]}, calls)
    fetched = fetch_url(f"http://kidx.test:{site.port}/echo", ALLOWED, resolve=resolve)
    sent = site.headers[-1]
    assert sent["User-Agent"] == "kidx/0.1 (+https://github.com/kidx)"
    assert sent["Host"] == f"kidx.test:{site.port}"
    assert fetched.final_url == f"http://kidx.test:{site.port}/echo"
    assert calls == ["kidx.test"]


def test_allowed_by_host_name(site: Site) -> None:
    settings = UrlSettings(allow_hosts=["kidx.test"])
    resolve = resolver({"kidx.test": ["127.0.0.1"]})
    assert (
        "Host:" in fetch_url(f"http://kidx.test:{site.port}/echo", settings, resolve=resolve).text
    )


def test_https_goes_to_the_checked_address_with_sni() -> None:
    """An allowed CIDR range; the request is for the checked IP, with Host and TLS name kept."""
    seen: list[httpx.Request] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, text="hello from inside", headers={"Content-Type": "text/plain"})

    settings = UrlSettings(allow_hosts=["10.0.0.0/8"])
    resolve = resolver({"internal.example": ["10.1.2.3"]})
    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        fetched = fetch_url(
            "https://internal.example/doc", settings, resolve=resolve, client=client
        )
    assert fetched.text == "hello from inside"
    assert fetched.final_url == "https://internal.example/doc"
    (request,) = seen
    assert request.url.host == "10.1.2.3"
    assert request.headers["Host"] == "internal.example"
    assert request.extensions["sni_hostname"] == "internal.example"


# -- URLs: refusals ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:{port}/article",
        "http://[::1]:{port}/article",
        "http://[::ffff:127.0.0.1]:{port}/article",
        "http://0.0.0.0:{port}/article",
    ],
)
def test_loopback_literals_are_refused(site: Site, url: str) -> None:
    message = refused(
        "is not a public address",
        lambda: fetch_url(url.format(port=site.port), UrlSettings()),
    )
    assert "KIDX_URLS__ALLOW_HOSTS" in message
    assert site.paths == []


def test_a_name_that_resolves_to_a_private_address(site: Site) -> None:
    resolve = resolver({"internal.example": ["10.1.2.3"]})
    message = refused(
        "internal.example resolves to 10.1.2.3",
        lambda: fetch_url("http://internal.example/", UrlSettings(), resolve=resolve),
    )
    assert "not a public address" in message


def test_any_private_address_refuses_the_name() -> None:
    resolve = resolver({"mixed.example": ["93.184.215.14", "192.168.1.7"]})
    refused(
        "192.168.1.7", lambda: fetch_url("http://mixed.example/", UrlSettings(), resolve=resolve)
    )


@pytest.mark.parametrize(
    "address",
    [
        "169.254.169.254",
        "100.64.0.1",
        "224.0.0.1",
        "0.0.0.0",
        "240.0.0.1",
        "fe80::1",
        "ff0e::1",
        "fc00::1",
        "::",
        "64:ff9b::7f00:1",
        "64:ff9b::a01:203",
        "2002:7f00:1::1",
        "::ffff:10.0.0.1",
    ],
)
def test_every_kind_of_non_global_address_is_refused(address: str) -> None:
    resolve = resolver({"tricky.example": [address]})
    url = "http://tricky.example/"
    shown = re.escape(str(ipaddress.ip_address(address)))
    refused(
        rf"resolves to {shown}, which is not a public address",
        lambda: fetch_url(url, UrlSettings(), resolve=resolve),
    )


@pytest.mark.parametrize("address", ["93.184.215.14", "2606:2800:21f:cb07:6820:80da:af6b:8b2c"])
def test_a_public_address_is_fetched(address: str) -> None:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, text="public", headers={"Content-Type": "text/plain"})

    resolve = resolver({"public.example": [address]})
    with httpx.Client(transport=httpx.MockTransport(answer)) as client:
        got = fetch_url("http://public.example/", UrlSettings(), resolve=resolve, client=client)
    assert got.text == "public"


@pytest.mark.parametrize(
    ("target", "table", "match"),
    [
        ("http://[::1]:{port}/article", {}, r"::1"),
        (
            "http://internal.example:{port}/article",
            {"internal.example": ["10.0.0.5"]},
            r"10\.0\.0\.5",
        ),
        (
            "http://localhost:{port}/article",
            {"localhost": ["127.0.0.1", "::1"]},
            r"localhost resolves to ::1",
        ),
    ],
)
def test_redirect_from_an_allowed_host_to_a_refused_one(
    site: Site, target: str, table: dict[str, list[str]], match: str
) -> None:
    url = f"{site.base}/to?{target.format(port=site.port)}"
    message = refused(match, lambda: fetch_url(url, ALLOWED, resolve=resolver(table)))
    assert f"{url} redirects to http" in message
    assert site.paths == [url.removeprefix(site.base)]  # the target was never requested


def test_redirect_loop_and_too_many_redirects(site: Site) -> None:
    refused("redirect loop", lambda: fetch_url(f"{site.base}/loop-a", ALLOWED))
    assert site.paths == ["/loop-a", "/loop-b"]
    few = ALLOWED.model_copy(update={"max_redirects": 2})
    refused(r"too many redirects \(more than 2\)", lambda: fetch_url(f"{site.base}/chain/5", few))
    assert len(site.paths) == 2 + 3
    assert "Understanding" in fetch_url(f"{site.base}/chain/1", few).text


def test_http_errors(site: Site) -> None:
    refused("HTTP 404 Not Found", lambda: fetch_url(f"{site.base}/missing", ALLOWED))
    with pytest.raises(SourceUnavailable, match="HTTP 429"):
        fetch_url(f"{site.base}/busy", ALLOWED)
    with pytest.raises(SourceUnavailable, match="HTTP 503"):
        fetch_url(f"{site.base}/broken", ALLOWED)


def test_body_over_the_size_limit_stops_the_download(site: Site) -> None:
    refused(
        f"over the size limit of {LIMIT} bytes",
        lambda: fetch_url(f"{site.base}/stream-big", ALLOWED),
    )
    assert site.stream_done.wait(10)
    assert not site.stream_completed  # the client hung up long before the 64 MB were sent


@pytest.mark.parametrize(
    ("path", "match"),
    [
        ("gzip-twice", r"compressed more than once \(Content-Encoding: gzip, gzip\)"),
        ("gzip-bomb", f"over the size limit of {LIMIT} bytes"),
    ],
)
def test_a_compression_bomb_is_refused_without_unpacking_it(
    site: Site, path: str, match: str
) -> None:
    """A gzip of gzip (500 bytes) or a gzip (200 KB, no length given) of 200 MB: httpx
    inflated every layer of what it read whole before the size check saw a byte (+400 MB
    for the first); now no more than the limit is ever unpacked."""
    gzip_bomb()  # built before measuring
    tracemalloc.start()
    try:
        refused(match, lambda: fetch_url(f"{site.base}/coded/{path}", ALLOWED))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 * 2**20, f"{peak / 2**20:.0f} MB allocated to refuse a {BOMB_MB} MB bomb"


def test_content_codings_read_and_refused(site: Site) -> None:
    def text(path: str) -> str:
        return fetch_url(f"{site.base}/coded/{path}", ALLOWED).text

    assert text("gzip") == "Caf\xe9 au lait"
    assert text("deflate") == "zlib-wrapped deflate"
    assert text("raw-deflate") == "raw deflate"
    refused("content coding 'zstd' is not supported", lambda: text("zstd"))
    refused("the gzip body could not be decoded", lambda: text("broken"))
    assert {h.get("Accept-Encoding") for h in site.headers} == {"gzip, deflate"}


def test_declared_length_over_the_limit_is_refused_before_reading(site: Site) -> None:
    refused(
        r"over the size limit .*declared", lambda: fetch_url(f"{site.base}/declared-big", ALLOWED)
    )


def test_content_type_not_allowed(site: Site) -> None:
    refused(
        "content type image/png is not allowed",
        lambda: fetch_url(f"{site.base}/image.png", ALLOWED),
    )
    only_html = ALLOWED.model_copy(update={"content_types": ["text/html"]})
    refused(
        "content type text/plain is not allowed", lambda: fetch_url(f"{site.base}/echo", only_html)
    )


def test_invalid_utf8_text_is_refused(site: Site) -> None:
    refused(
        r"not UTF-8 text \(byte 0xe9 at offset 3\)",
        lambda: fetch_url(f"{site.base}/bad-utf8", ALLOWED),
    )


def test_slow_page_times_out(site: Site) -> None:
    quick = ALLOWED.model_copy(update={"timeout": 0.5})
    with pytest.raises(SourceUnavailable, match="timed out"):
        fetch_url(f"{site.base}/slow", quick)


def test_connection_refused_is_transient() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(SourceUnavailable):
        fetch_url(f"http://127.0.0.1:{port}/", ALLOWED)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("file:///etc/passwd", "only http and https"),
        ("ftp://example.com/x", "only http and https"),
        ("not a url", "only http and https"),
        ("http:///x", "has no host"),
    ],
)
def test_only_http_and_https(url: str, match: str) -> None:
    refused(match, lambda: fetch_url(url, UrlSettings(), resolve=resolver({})))


def test_the_converters_do_not_load_pythons_sqlite3(chapter_pdf: bytes, tmp_path: Path) -> None:
    """apsw is the project's SQLite; a second SQLite library in the process crashed it."""
    (tmp_path / "c.pdf").write_bytes(chapter_pdf)
    script = f"""
import sys
from pathlib import Path
from worker.sources import files, pdf, urls
assert files.html_to_markdown({ARTICLE!r})
assert pdf.pdf_text(Path({str(tmp_path / "c.pdf")!r}).read_bytes(), "c.pdf", limit=10**6)
print(sorted(m for m in sys.modules if m.split(".")[0] == "sqlite3"))
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_a_docx_of_a_huge_zip_directory_is_refused_before_zipfile_reads_it(root: Path) -> None:
    """zipfile makes an object of every entry of the central directory before anything can be
    looked at: 500,000 empty entries (43 MB) took 14 s and 600 MB, then the file was read."""
    from worker.sources.docx import DIRECTORY_MAX, _directory_size

    normal = make_docx(1)
    assert 0 < _directory_size(normal) < 10_000
    out = io.BytesIO()
    source = zipfile.ZipFile(io.BytesIO(normal))
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for info in source.infolist():
            archive.writestr(info.filename, source.read(info.filename))
        for n in range(40_000):
            archive.writestr(f"customXml/item{n:06d}.bin", b"")
    (root / "many.docx").write_bytes(out.getvalue())
    assert _directory_size(out.getvalue()) > DIRECTORY_MAX
    # zipfile takes a zip64 record it finds before the classic end record whatever that one
    # says: one that lies (a directory of 1,000 bytes) does not hide the zip64 record's size.
    data = out.getvalue()
    end = data.rindex(b"PK\x05\x06")
    size = struct.unpack("<I", data[end + 12 : end + 16])[0]
    offset = struct.unpack("<I", data[end + 16 : end + 20])[0]
    record = struct.pack(
        "<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, 40_011, 40_011, size, offset
    )
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, end, 1)
    lying = data[:end] + record + locator + data[end : end + 12] + struct.pack("<I", 1_000)
    lying += data[end + 16 :]
    assert zipfile.ZipFile(io.BytesIO(lying)).infolist()[-1].filename.endswith("39999.bin")
    assert _directory_size(lying) == size
    (root / "lying.docx").write_bytes(lying)
    refused(
        r"lying\.docx: its zip directory takes \d+ bytes",
        lambda: read_file(root / "lying.docx", FilesSettings(roots=[root])),
    )
    refused(
        r"many\.docx: its zip directory takes \d+ bytes, over 2000000",
        lambda: read_file(root / "many.docx", FilesSettings(roots=[root])),
    )
