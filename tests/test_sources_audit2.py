"""Sources, second audit: compressed bodies cut short, empty answers, text DOCX hides in its
structures, AES PDFs, line ends, separator lines, legacy charset labels, wrapped PDF headings,
UTF-16 source files. Real files under tmp_path, a real HTTP server on 127.0.0.1."""

from __future__ import annotations

import gzip
import io
import subprocess
import sys
import threading
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import docx
import pypdf
import pytest
from fpdf import FPDF

from worker.chunking import chunk_structure
from worker.errors import InvalidInput, SourceUnavailable
from worker.providers.http import JSONClient, RetryLater, _Inflater
from worker.settings import FilesSettings, HTTPProviderSettings, UrlSettings
from worker.sources.code import list_code_files, read_code
from worker.sources.decoding import decode_html, decode_text, escape_markdown_lookalikes
from worker.sources.files import html_text, read_file
from worker.sources.pdf import pdf_text
from worker.sources.urls import fetch_url

ALLOWED = UrlSettings(
    allow_hosts=["127.0.0.1"],
    timeout=10,
    connect_timeout=5,
    content_types=[
        "text/html",
        "application/xhtml+xml",
        "text/plain",
        "text/markdown",
        "application/json",
        "application/rss+xml",
    ],
)

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


# -- 4. lone CR line ends -----------------------------------------------------------------------

SECTIONS = "".join(
    f"# Section {i}\n\nThe text of section {i}, in a few words.\n\n" for i in range(1, 5)
)


@pytest.fixture
def files(tmp_path: Path) -> FilesSettings:
    return FilesSettings(roots=[tmp_path])


@pytest.mark.parametrize("newline", ["\r", "\r\n"])
@pytest.mark.parametrize("suffix", [".md", ".txt", ".notes"])
def test_files_with_cr_line_ends_read_as_lines(
    tmp_path: Path, files: FilesSettings, newline: str, suffix: str
) -> None:
    """Lone CRs (old Mac files, some exporters) made the whole file one line: one heading
    whose title was the whole document, and no sections."""
    path = tmp_path / f"mac{suffix}"
    path.write_bytes(SECTIONS.replace("\n", newline).encode())
    text = read_file(path, files)
    assert text == SECTIONS


def test_a_utf16_file_with_cr_line_ends_reads_as_lines(
    tmp_path: Path, files: FilesSettings
) -> None:
    (tmp_path / "w.txt").write_bytes(
        "\ufeff".encode("utf-16-le") + SECTIONS.replace("\n", "\r").encode("utf-16-le")
    )
    assert read_file(tmp_path / "w.txt", files) == SECTIONS


@pytest.mark.parametrize("media", ["text/markdown", "text/plain", "application/json"])
def test_pages_with_cr_line_ends_read_as_lines(server: Server, media: str) -> None:
    server.routes["/mac"] = [(200, {"Content-Type": media}, SECTIONS.replace("\n", "\r").encode())]
    assert fetch_url(f"{server.url}/mac", ALLOWED).text == SECTIONS


# -- 5. separator lines in extracted text --------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "escaped"),
    [
        ("---", "\\---"),
        ("-", "\\-"),
        ("=====  ", "\\=====  "),
        ("   ----------", "   \\----------"),
        ("\t===", "\t\\==="),
        ("# not a heading", "\\# not a heading"),
        ("```", "\\```"),
        ("   ~~~ text", "   \\~~~ text"),
        ("      ```", "      \\```"),  # indented: harmless to escape, whatever reads it
    ],
)
def test_separator_and_fence_lines_are_escaped(line: str, escaped: str) -> None:
    text = f"Some body text above.\n{line}\nSome below."
    assert escape_markdown_lookalikes(text) == f"Some body text above.\n{escaped}\nSome below."
    assert chunk_structure(escape_markdown_lookalikes(text))[0].headings == ()


@pytest.mark.parametrize(
    ("line", "escaped"),
    [
        ("<!-- a comment", "\\<!-- a comment"),
        ("<pre>", "\\<pre>"),
        ("  <SCRIPT src=x>", "  \\<SCRIPT src=x>"),
        ("<?php echo 1;", "\\<?php echo 1;"),
        ("<![CDATA[ x", "\\<![CDATA[ x"),
        ("<!DOCTYPE html", "\\<!DOCTYPE html"),  # its `>` on a later line
        ("<textarea", "\\<textarea"),
    ],
)
def test_an_html_block_opener_in_extracted_text_is_escaped(line: str, escaped: str) -> None:
    """The chunker reads such a line as a literal HTML block that runs to its end marker (none
    here): the headings a PDF's or a DOCX's reader writes after it (`# ...` from the font or
    the style) were its text, and every chunk after it lost its heading path."""
    body = f"Intro.\n{line}\n" + "More of the first section. " * 20
    assert escape_markdown_lookalikes(body) == body.replace(line, escaped)
    later = "\n\n# Later\n\n" + "Body under the later heading. " * 20
    assert chunk_structure(body + later)[-1].headings == ()  # unescaped: lost
    assert chunk_structure(escape_markdown_lookalikes(body) + later)[-1].headings == ("Later",)


@pytest.mark.parametrize(
    "line",
    [
        "<prefix> x",
        "<p>",
        "a <pre>",
        "<",
        "- - -",
        "-- x",
        "a ---",
        "=x=",
        "    ----",
        "#hashtag",
        "``inline``",
        "* * *",
    ],
)
def test_lines_the_chunker_takes_for_nothing_are_left_alone(line: str) -> None:
    text = f"Some body text above.\n{line}\nSome below."
    assert escape_markdown_lookalikes(text) == text


@pytest.mark.parametrize("separator", ["-" * 60, "=" * 40])
def test_a_separator_line_in_a_pdf_makes_no_heading(separator: str) -> None:
    """PDF text has no blank lines within a page: a line of dashes under 25 lines of body
    made them one heading, the heading path of every chunk after it."""
    pdf = FPDF()
    pdf.add_page()
    pdf.set_font("Helvetica", size=11)
    for i in range(25):
        pdf.cell(0, 6, f"Line {i} of the terms and conditions.", new_x="LMARGIN", new_y="NEXT")
    pdf.cell(0, 6, separator, new_x="LMARGIN", new_y="NEXT")
    for i in range(40):
        pdf.cell(0, 6, f"Signature block line {i}.", new_x="LMARGIN", new_y="NEXT")
    text = pdf_text(bytes(pdf.output()), "t.pdf", limit=10**6)
    assert "\\" + separator in text
    assert all(c.headings == () for c in chunk_structure(text))


def test_a_separator_line_in_a_docx_paragraph_makes_no_heading(
    tmp_path: Path, files: FilesSettings
) -> None:
    document = docx.Document()
    run = document.add_paragraph().add_run("Terms above the line.")
    run.add_break()
    run.add_text("=" * 20)
    document.add_paragraph("Below.")
    document.save(tmp_path / "sep.docx")
    text = read_file(tmp_path / "sep.docx", files)
    assert text == "Terms above the line.\n\\" + "=" * 20 + "\n\nBelow."
    assert all(c.headings == () for c in chunk_structure(text))


# -- 6. charset labels as browsers read them, XML declarations --------------------------------

LEGACY = [
    # label, what the page is really in, text with a character only the superset has
    ("gb2312", "gbk", "中国总理朱镕基。"),
    ("GB_2312-80", "gbk", "朱镕基"),
    ("euc-kr", "cp949", "한국어 똠방각하"),
    ("ks_c_5601-1987", "cp949", "똠방각하"),
    ("shift_jis", "cp932", "日本語 ①②③"),
    ("x-sjis", "cp932", "①②③"),
    ("iso-8859-9", "cp1254", "“Türkçe” metin"),
    ("tis-620", "cp874", "“ภาษาไทย”"),
    ("iso-8859-11", "cp874", "“ภาษาไทย”"),
    ("big5", "big5hkscs", "香港增補字符集 𥚃"),
    ("x-mac-roman", "mac_roman", "Café ™"),
]


@pytest.mark.parametrize(("label", "real", "text"), LEGACY)
def test_legacy_labels_decode_as_browsers_do(label: str, real: str, text: str) -> None:
    html = f'<html><head><meta charset="{label}"></head><body><p>{text}</p></body></html>'
    assert text in decode_html(html.encode(real), "page")
    assert decode_text(text.encode(real), "page", label.upper()) == text


@pytest.mark.parametrize(("label", "real", "text"), LEGACY[:3])
def test_a_legacy_label_in_the_header_decodes_the_page(
    server: Server, label: str, real: str, text: str
) -> None:
    kind = {"Content-Type": f"text/plain; charset={label}"}
    server.routes["/legacy"] = [(200, kind, text.encode(real))]
    assert fetch_url(f"{server.url}/legacy", ALLOWED).text == text


@pytest.mark.parametrize("label", ["utf-16", "UTF-16LE", "utf-16be", "unicode", "utf-32"])
def test_a_meta_charset_of_utf16_on_a_page_read_in_ascii_means_utf8(label: str) -> None:
    page = f'<html><head><meta charset="{label}"><title>T</title></head><body><article>'
    page += "<h1>Hello</h1><p>" + "This page is plain text, café, and readable. " * 20
    page += "</p></article></body></html>"
    data = page.encode() + b" " * (len(page.encode()) % 2)
    assert decode_html(data, "page").startswith(f'<html><head><meta charset="{label}">')
    assert "This page is plain text, café" in (html_text(data, "page") or "")


XHTML = (
    "<?xml version='1.0' encoding='{label}'?>\n<html xmlns='http://www.w3.org/1999/xhtml'>"
    "<head><title>Menu</title>{meta}</head><body><article><h1>Menu</h1><p>"
    + "Café au lait, crème brûlée and a slice of tarte. " * 10
    + "</p></article></body></html>"
)


def test_xhtml_is_decoded_by_its_xml_declaration(
    tmp_path: Path, files: FilesSettings, server: Server
) -> None:
    data = XHTML.format(label="iso-8859-1", meta="").encode("cp1252")
    (tmp_path / "menu.xhtml").write_bytes(data)
    assert "Café au lait, crème brûlée" in read_file(tmp_path / "menu.xhtml", files)
    server.routes["/menu"] = [(200, {"Content-Type": "application/xhtml+xml"}, data)]
    assert "Café au lait, crème brûlée" in fetch_url(f"{server.url}/menu", ALLOWED).text


def test_in_xhtml_the_xml_declaration_wins_over_a_meta(
    tmp_path: Path, files: FilesSettings
) -> None:
    meta = '<meta http-equiv="Content-Type" content="text/html; charset=utf-8"/>'
    data = XHTML.format(label="windows-1252", meta=meta).encode("cp1252")
    (tmp_path / "menu.xhtml").write_bytes(data)
    assert "Café au lait, crème brûlée" in read_file(tmp_path / "menu.xhtml", files)


def test_xml_is_decoded_by_its_declaration(
    tmp_path: Path, files: FilesSettings, server: Server
) -> None:
    feed = '<?xml version="1.0" encoding="ISO-8859-15"?>\n<rss><item>Prix : 5 €, crème</item></rss>'
    data = feed.encode("iso-8859-15")
    (tmp_path / "feed.xml").write_bytes(data)
    assert read_file(tmp_path / "feed.xml", files) == feed
    server.routes["/feed"] = [(200, {"Content-Type": "application/rss+xml"}, data)]
    assert fetch_url(f"{server.url}/feed", ALLOWED).text == feed
    utf16 = '<?xml version="1.0" encoding="UTF-16"?>\n<rss><item>crème</item></rss>'
    (tmp_path / "feed16.xml").write_bytes(utf16.encode("utf-16-le"))  # no BOM: XML detects it
    assert read_file(tmp_path / "feed16.xml", files) == utf16


# -- 3. AES-encrypted PDFs that open without a password -----------------------------------------


def encrypted_pdf(text: str, algorithm: str) -> bytes:
    """A PDF anyone may open (an empty user password, an owner password restricting printing
    and copying: the common 'protected' brochure), written by pypdf itself."""
    pdf = FPDF()
    pdf.add_page()
    pdf.set_font("Helvetica", size=12)
    pdf.multi_cell(0, 8, text)
    writer = pypdf.PdfWriter(clone_from=io.BytesIO(bytes(pdf.output())))
    writer.encrypt(user_password="", owner_password="owner", algorithm=algorithm)
    out = io.BytesIO()
    writer.write(out)
    return out.getvalue()


BROCHURE = "This brochure opens without a password; only printing is restricted."


@pytest.mark.parametrize("algorithm", ["AES-128", "AES-256", "RC4-128"])
def test_an_encrypted_pdf_that_opens_without_a_password_is_read(
    tmp_path: Path, files: FilesSettings, algorithm: str
) -> None:
    """AES needs `cryptography`, which kidx did not depend on: the file was refused as an
    "unreadable PDF"."""
    data = encrypted_pdf(BROCHURE, algorithm)
    assert pypdf.PdfReader(io.BytesIO(data)).is_encrypted
    (tmp_path / "brochure.pdf").write_bytes(data)
    assert read_file(tmp_path / "brochure.pdf", files).strip() == BROCHURE


def test_a_missing_crypto_package_is_an_install_problem_not_a_damaged_file(tmp_path: Path) -> None:
    """Without `cryptography` (nor pycryptodome), pypdf raises DependencyError for AES: that
    says how to fix the install, not that the file is unreadable."""
    (tmp_path / "aes.pdf").write_bytes(encrypted_pdf(BROCHURE, "AES-128"))
    script = """
import sys
sys.modules["cryptography"] = sys.modules["Crypto"] = None  # neither can be imported
from worker.errors import ConfigError
from worker.sources.pdf import pdf_text
try:
    pdf_text(open(sys.argv[1], "rb").read(), "aes.pdf", limit=10**6)
except ConfigError as e:
    print("ConfigError:", e)
"""
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "aes.pdf")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout.strip()
    assert out.startswith("ConfigError: aes.pdf: reading this PDF needs a package that is not")
    assert "cryptography" in out and "pip install 'pypdf[crypto]'" in out
    assert "\n" not in out


# -- 7. a PDF heading wrapped over two lines ----------------------------------------------------


def test_a_pdf_heading_wrapped_over_two_lines_stays_one_heading() -> None:
    """The second line was appended to the blank line after the heading: the heading path held
    half the title, and the rest began the body."""
    title = "Understanding Ownership And Borrowing In Rust Programs"
    body = "Ownership is a set of rules that govern how a Rust program manages memory. " * 8
    pdf = FPDF()
    pdf.add_page()
    pdf.set_font("Helvetica", size=24)
    pdf.multi_cell(100, 12, title)  # wraps: two lines of the same large size
    pdf.set_font("Helvetica", size=11)
    pdf.multi_cell(0, 6, body)
    text = pdf_text(bytes(pdf.output()), "t.pdf", limit=10**6)
    assert text.startswith(f"# {title}\n\nOwnership is a set of rules")
    assert chunk_structure(text)[0].headings == (title,)


def test_a_large_line_that_looks_like_markdown_is_still_a_heading() -> None:
    """Headings are looked up as set, before the escaping of Markdown look-alikes."""
    pdf = FPDF()
    pdf.add_page()
    pdf.set_font("Helvetica", size=24)
    pdf.cell(0, 12, "# Setup", new_x="LMARGIN", new_y="NEXT")
    pdf.set_font("Helvetica", size=11)
    pdf.multi_cell(0, 6, "The body text, set in the body's size, explains the setup. " * 6)
    pdf.cell(0, 6, "----------", new_x="LMARGIN", new_y="NEXT")
    text = pdf_text(bytes(pdf.output()), "t.pdf", limit=10**6)
    assert text.startswith("# # Setup\n\nThe body text")
    assert text.endswith("\n\\----------")


# -- 8. source files saved as UTF-16 or UTF-32 with a BOM ---------------------------------------

SCRIPT = 'param([string]$Name)\r\nWrite-Host "Hello $Name, café"\r\n'


@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"])
def test_a_source_file_in_utf16_or_utf32_with_a_bom_is_listed_and_read(
    tmp_path: Path, files: FilesSettings, encoding: str
) -> None:
    """PowerShell ISE, SSMS and Visual Studio save .ps1, .sql and .cs files so: their NUL bytes
    made them "binary", skipped from the tree and refused by name."""
    (tmp_path / "deploy.ps1").write_bytes(("\ufeff" + SCRIPT).encode(encoding))
    skipped: list[tuple[Path, str]] = []
    assert list_code_files(tmp_path, skipped=skipped) == [tmp_path / "deploy.ps1"]
    assert skipped == []
    assert list_code_files(tmp_path / "deploy.ps1") == [tmp_path / "deploy.ps1"]
    assert read_code(tmp_path / "deploy.ps1", files) == SCRIPT.replace("\r\n", "\n")


def test_nul_bytes_without_a_wide_bom_are_still_binary(
    tmp_path: Path, files: FilesSettings
) -> None:
    (tmp_path / "no_bom.ps1").write_bytes(SCRIPT.encode("utf-16-le"))
    (tmp_path / "utf8_bom.py").write_bytes(b"\xef\xbb\xbfx = 1\n\0\0\0")
    skipped: list[tuple[Path, str]] = []
    assert list_code_files(tmp_path, skipped=skipped) == []
    assert sorted(skipped) == [(tmp_path / n, "is binary") for n in ("no_bom.ps1", "utf8_bom.py")]
    for name in ("no_bom.ps1", "utf8_bom.py"):
        with pytest.raises(InvalidInput, match=rf"{name}: binary, not source code"):
            read_code(tmp_path / name, files)


def test_a_utf16_source_file_that_does_not_decode_says_where(
    tmp_path: Path, files: FilesSettings
) -> None:
    (tmp_path / "odd.sql").write_bytes("\ufeffSELECT 1;".encode("utf-16-le") + b"\x00\xd8")
    with pytest.raises(InvalidInput, match=r"odd\.sql: is not UTF-16-LE text \(byte 20\)"):
        read_code(tmp_path / "odd.sql", files)


def test_a_wide_bom_before_nul_characters_is_still_binary(
    tmp_path: Path, files: FilesSettings
) -> None:
    (tmp_path / "blob.cs").write_bytes(b"\xff\xfe" + bytes(64))  # the mark, then U+0000s
    assert list_code_files(tmp_path) == []
    with pytest.raises(InvalidInput, match=r"blob\.cs: binary, not source code"):
        read_code(tmp_path / "blob.cs", files)


# -- 2. text DOCX keeps in its structures -------------------------------------------------------

NAMESPACES = " ".join(
    [
        'xmlns:w="http://schemas.openxmlformats.org/wordprocessingml/2006/main"',
        'xmlns:mc="http://schemas.openxmlformats.org/markup-compatibility/2006"',
        'xmlns:wps="http://schemas.microsoft.com/office/word/2010/wordprocessingShape"',
        'xmlns:v="urn:schemas-microsoft-com:vml"',
    ]
)


def r(text: str) -> str:
    return f'<w:r><w:t xml:space="preserve">{text}</w:t></w:r>'


def p(*inner: str, style: str = "") -> str:
    props = f'<w:pPr><w:pStyle w:val="{style}"/></w:pPr>' if style else ""
    return f"<w:p>{props}{''.join(inner)}</w:p>"


def sdt(*inner: str) -> str:
    props = '<w:sdtPr><w:alias w:val="Client"/></w:sdtPr>'
    return f"<w:sdt>{props}<w:sdtContent>{''.join(inner)}</w:sdtContent></w:sdt>"


def tc(*inner: str) -> str:
    return f"<w:tc>{''.join(inner) or p()}</w:tc>"


def tbl(*rows: str, columns: int = 2) -> str:
    grid = "<w:tblGrid>" + '<w:gridCol w:w="2000"/>' * columns + "</w:tblGrid>"
    return f"<w:tbl>{grid}{''.join(rows)}</w:tbl>"


def docx_with(tmp_path: Path, *blocks: str) -> Path:
    """A document of a first plain paragraph, then `blocks` (raw WordprocessingML)."""
    document = docx.Document()
    document.add_paragraph("First.")
    body = document.element.body
    for block in blocks:
        body[-1].addprevious(docx.oxml.parse_xml(f"<w:body {NAMESPACES}>{block}</w:body>")[0])
    path = tmp_path / "d.docx"
    document.save(path)
    return path


def test_runs_inside_wrappers_are_text_and_deletions_are_not(
    tmp_path: Path, files: FilesSettings
) -> None:
    """Word shows the runs of a tracked insertion, a simple field, a smart tag, a direction
    wrapper or an inline content control: only runs and hyperlinks were read."""
    field = '<w:fldSimple w:instr="DOCPROPERTY Client">' + r("ACME Ltd") + "</w:fldSimple>"
    complex_field = (
        '<w:r><w:fldChar w:fldCharType="begin"/></w:r>'
        '<w:r><w:instrText xml:space="preserve"> PAGE </w:instrText></w:r>'
        '<w:r><w:fldChar w:fldCharType="separate"/></w:r>'
        + r("page 7")
        + '<w:r><w:fldChar w:fldCharType="end"/></w:r>'
    )
    path = docx_with(
        tmp_path,
        p(
            r("Budget is "),
            '<w:ins w:id="1" w:author="a">' + r("5000 EUR") + "</w:ins>",
            '<w:del w:id="2" w:author="a"><w:r><w:delText>4000 EUR</w:delText></w:r></w:del>',
            '<w:moveFrom w:id="3" w:author="a">' + r("MOVED-AWAY") + "</w:moveFrom>",
            '<w:moveTo w:id="4" w:author="a">' + r(", moved here") + "</w:moveTo>",
            r(", for "),
            field,
            '<w:smartTag w:uri="u" w:element="place">' + r(" in Paris") + "</w:smartTag>",
            '<w:dir w:val="rtl">' + r(" שלום") + "</w:dir>",
            '<w:bdo w:val="rtl">' + r(" עולם") + "</w:bdo>",
            '<w:customXml w:element="x">' + r(" custom") + "</w:customXml>",
            sdt(r(" (filled in)")),
            r(", "),
            complex_field,
            '<w:hyperlink w:anchor="a">' + r(", linked") + "</w:hyperlink>",
        ),
        p(
            '<w:pPr><w:tabs><w:tab w:val="left" w:pos="720"/></w:tabs></w:pPr>',
            r("No tab stop as text."),
        ),
    )
    text = read_file(path, files)
    assert text == (
        "First.\n\nBudget is 5000 EUR, moved here, for ACME Ltd in Paris שלום עולם custom"
        " (filled in), page 7, linked\n\nNo tab stop as text."
    )


def test_text_boxes_are_read_once(tmp_path: Path, files: FilesSettings) -> None:
    """A text box is written twice, for new Word (mc:Choice) and in VML for old readers
    (mc:Fallback): its text is read from the first only. A VML-only box is read too."""
    box = "<w:txbxContent>" + p(r("Box line one.")) + p(r("Box line two.")) + "</w:txbxContent>"
    modern = (
        '<w:r><mc:AlternateContent><mc:Choice Requires="wps"><w:drawing><wps:wsp><wps:txbx>'
        + box
        + "</wps:txbx></wps:wsp></w:drawing></mc:Choice><mc:Fallback><w:pict><v:shape><v:textbox>"
        + box
        + "</v:textbox></v:shape></w:pict></mc:Fallback></mc:AlternateContent></w:r>"
    )
    legacy = "<w:r><w:pict><v:shape><v:textbox>" + box + "</v:textbox></v:shape></w:pict></w:r>"
    path = docx_with(tmp_path, p(r("Before the box."), modern), p(legacy, r("After.")))
    assert read_file(path, files) == (
        "First.\n\nBefore the box.\nBox line one.\nBox line two.\n\n"
        "Box line one.\nBox line two.\nAfter."
    )


def test_paragraphs_and_tables_in_content_controls_are_read(
    tmp_path: Path, files: FilesSettings
) -> None:
    """Forms and templates wrap whole paragraphs, tables, rows and cells in content controls
    (w:sdt): all of it was skipped."""
    path = docx_with(
        tmp_path,
        sdt(p(r("Terms"), style="Heading1"), p(r("The form filled in.")), sdt(p(r("Nested.")))),
        tbl(
            "<w:tr>" + tc(p(r("Name"))) + sdt(tc(p(r("Value")))) + "</w:tr>",
            sdt("<w:tr>" + tc(sdt(p(r("In a cell's control")))) + tc(p(r("b"))) + "</w:tr>"),
        ),
        '<w:customXml w:element="clause">' + p(r("A custom XML clause.")) + "</w:customXml>",
    )
    assert read_file(path, files) == (
        "First.\n\n# Terms\n\nThe form filled in.\n\nNested.\n\n"
        "| Name | Value |\n| --- | --- |\n| In a cell's control | b |\n\n"
        "A custom XML clause."
    )


def test_a_table_nested_in_a_cell_gives_the_cell_its_text(
    tmp_path: Path, files: FilesSettings
) -> None:
    document = docx.Document()
    outer = document.add_table(rows=1, cols=2)
    outer.cell(0, 0).text = "outer cell"
    inner = outer.cell(0, 1).add_table(rows=2, cols=2)
    for (row, col), text in zip([(0, 0), (0, 1), (1, 0), (1, 1)], ["a", "b", "c", "deep"]):
        inner.cell(row, col).text = text
    inner.cell(1, 1).add_table(rows=1, cols=1).cell(0, 0).text = "deeper"
    document.save(tmp_path / "nested.docx")
    assert read_file(tmp_path / "nested.docx", files) == (
        "| outer cell | a b c deep deeper |\n| --- | --- |"
    )


def test_text_in_content_controls_counts_against_the_limit(tmp_path: Path) -> None:
    path = docx_with(tmp_path, *[sdt(p(r("x" * 5000))) for _ in range(100)])
    with pytest.raises(InvalidInput, match="text extracted is over the size limit of 400000"):
        read_file(path, FilesSettings(roots=[tmp_path], max_bytes=400_000))
