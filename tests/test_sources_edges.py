"""Files and URLs at their edges (audit): charsets that name codecs which are not text
encodings, DOCX tables whose cells span absurdly many columns."""

from __future__ import annotations

import io
from pathlib import Path

import docx
import pytest
from docx.oxml import parse_xml

from conftest import Pages
from worker.errors import InvalidInput
from worker.settings import FilesSettings, UrlSettings
from worker.sources.decoding import decode_text
from worker.sources.docx import _cell, docx_to_markdown
from worker.sources.files import read_file
from worker.sources.urls import fetch_url

W = "http://schemas.openxmlformats.org/wordprocessingml/2006/main"
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
    # "undefined" is a text codec that raises a bare UnicodeError, which nothing caught. As a
    # charset it is none (NOT_CHARSETS): the text is read as UTF-8.
    from worker.sources.decoding import _decode

    with pytest.raises(InvalidInput, match=r"^page: is not undefined text .*convert it to UTF-8"):
        _decode(b"abc", "undefined", "page")
    assert decode_text(b"abc", "page", "undefined") == "abc"


@pytest.mark.parametrize("charset", NON_TEXT_CODECS)
def test_a_content_type_charset_naming_a_non_text_codec_is_read_as_utf8(
    pages: Pages, charset: str
) -> None:
    pages.routes = {
        "/plain": (200, f"text/plain; charset={charset}", "Café au lait".encode()),
        "/html": (200, f"text/html; charset={charset}", PAGE.format(charset="utf-8").encode()),
        "/meta": (200, "text/html", PAGE.format(charset=charset).encode()),
    }
    settings = UrlSettings(allow_hosts=["127.0.0.1"], timeout=5)
    assert fetch_url(f"{pages.url}/plain", settings).text == "Café au lait"
    for path in ("/html", "/meta"):
        text = fetch_url(f"{pages.url}{path}", settings).text
        assert "Café" in text and "third approach" in text


# -- DOCX tables -----------------------------------------------------------------------------


def _span(table, row: int, col: int, n: int) -> None:
    """Cell `col` of row `row` (as in the XML: no spans counted) spans `n` grid columns."""
    tc = table.rows[row]._tr.tc_lst[col]
    tc.get_or_add_tcPr().append(parse_xml(f'<w:gridSpan xmlns:w="{W}" w:val="{n}"/>'))


def _saved(document) -> bytes:
    buf = io.BytesIO()
    document.save(buf)
    return buf.getvalue()


def _markdown(data: bytes, limit: int = 50_000_000) -> str:
    return docx_to_markdown(data, "t.docx", limit=limit, max_xml=20_000_000)


def test_a_huge_grid_span_counts_at_most_the_tables_columns() -> None:
    # python-docx gives a cell once per column it spans: a gridSpan of a million made a
    # million copies of the cell per row (a 36 KB file held a worker for 106 s).
    document = docx.Document()
    document.add_paragraph("Intro paragraph.")
    table = document.add_table(rows=3, cols=3)
    for r, row in enumerate(table.rows):
        for c, cell in enumerate(row.cells):
            cell.text = f"r{r}c{c}"
    _span(table, 0, 0, 20_000)
    _span(table, 2, 1, 5_000)
    text = _markdown(_saved(document))
    assert text.splitlines()[2:] == [
        "| r0c0 | r0c0 | r0c0 | r0c1 | r0c2 |",
        "| --- | --- | --- | --- | --- |",
        "| r1c0 | r1c1 | r1c2 |",
        "| r2c0 | r2c1 | r2c1 | r2c1 | r2c2 |",
    ]


def test_a_table_row_over_the_text_limit_is_refused_as_it_is_read() -> None:
    document = docx.Document()
    table = document.add_table(rows=2, cols=40)
    table.cell(0, 0).text = "word " * 2_000
    _span(table, 0, 0, 5_000)  # capped at 40 columns: some 400 000 characters
    with pytest.raises(InvalidInput, match=r"t\.docx: the text extracted is over the size limit"):
        _markdown(_saved(document), limit=300_000)
    assert _markdown(_saved(document), limit=500_000).count("word") == 40 * 2_000


def test_merged_cells_give_the_markdown_python_docx_rows_give() -> None:
    document = docx.Document()
    table = document.add_table(rows=4, cols=4)
    for r, row in enumerate(table.rows):
        for c, cell in enumerate(row.cells):
            cell.text = f"v{r}{c} | x"
    table.cell(0, 0).merge(table.cell(0, 2))  # a horizontal span
    table.cell(1, 1).merge(table.cell(3, 1))  # a vertical one
    table.cell(2, 2).merge(table.cell(3, 3))  # both
    data = _saved(document)
    loaded = docx.Document(io.BytesIO(data)).tables[0]
    rows = ["| " + " | ".join(_cell(c.text) for c in r.cells) + " |" for r in loaded.rows]
    rows.insert(1, "|" + " --- |" * (rows[0].count(" | ") + 1))
    assert _markdown(data) == "\n".join(rows)
    assert "| v00 \\| x v01 \\| x v02 \\| x | v00 \\| x v01 \\| x v02 \\| x |" in _markdown(data)
