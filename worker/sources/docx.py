"""A DOCX's text as Markdown (headings, lists, tables), refused before python-docx inflates a
zip that unpacks to too much."""

from __future__ import annotations

import io
import re
import zipfile
from collections.abc import Iterator
from typing import Any

from worker.errors import InvalidInput, input_failure
from worker.sources.decoding import bom, escape_markdown_lookalikes
from worker.sources.limits import TextBudget, check_text_size, refuse

# A zipped document (DOCX) may unpack to at most this many times the size limit in all (its
# images and other blobs, held in memory); its XML has a limit of its own (`max_xml_bytes`).
UNPACK_RATIO = 4
# Whose exceptions a damaged DOCX raises (`worker.errors.input_failure`); any other is an
# interruption (Celery's soft time limit), which must stop the run, not refuse the file.
_DOCX_PACKAGES = ("docx", "zipfile", "zlib", "lxml", "xml")


_W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
_MC = "{http://schemas.openxmlformats.org/markup-compatibility/2006}"
_P, _TBL, _TR, _TC = _W + "p", _W + "tbl", _W + "tr", _W + "tc"
_RUN_TEXT = frozenset(_W + tag for tag in ("br", "cr", "noBreakHyphen", "ptab", "t", "tab"))
# What a paragraph holds that is not its text: properties (a tab stop is a w:tab too), a tracked
# deletion or the old place of a move (w:delText is never text), a field's code, a ruby's
# pronunciation guide, and the fallback of an mc:AlternateContent (a text box is written twice:
# for Word 2010 and later, and again in VML for older readers).
_NOT_TEXT = frozenset(
    [_W + tag for tag in ("pPr", "rPr", "sdtPr", "sdtEndPr", "del", "moveFrom", "instrText")]
    + [_W + "delText", _W + "rt", _MC + "Fallback"]
)


def _inner(parent: Any, tag: str) -> Iterator[Any]:
    """The children of `parent` with `tag`, also those wrapped in content controls (w:sdt, as
    forms and templates have) and custom XML: python-docx's lists skip them and their text."""
    for child in parent:
        if child.tag == tag:
            yield child
        elif child.tag == _W + "sdt":
            content = child.find(_W + "sdtContent")
            if content is not None:
                yield from _inner(content, tag)
        elif child.tag == _W + "customXml":
            yield from _inner(child, tag)


def _blocks(parent: Any) -> Iterator[Any]:
    """The paragraphs and tables of the body or a cell, in order, content controls opened."""
    for child in parent:
        if child.tag in (_P, _TBL):
            yield child
        elif child.tag == _W + "sdt":
            content = child.find(_W + "sdtContent")
            if content is not None:
                yield from _blocks(content)
        elif child.tag == _W + "customXml":
            yield from _blocks(child)


def _paragraph_text(p: Any) -> str:
    """A paragraph's text as Word shows it: every run within it, however wrapped (hyperlinks,
    tracked insertions, fields, smart tags, content controls, direction, text boxes, whose
    paragraphs each take a line), but not what `_NOT_TEXT` names. A walk of the elements,
    not python-docx's XPath queries, compiled on every call (13 µs a paragraph: a minute for
    a document of a few million empty ones)."""
    parts: list[str] = []
    stack: list[Any] = list(reversed(p))
    while stack:
        e = stack.pop()
        if isinstance(e, str):
            parts.append(e)
            continue
        tag = e.tag
        if tag in _RUN_TEXT:
            parts.append(str(e))
        elif tag not in _NOT_TEXT and isinstance(tag, str) and len(e):  # not a comment or PI
            if tag == _P:  # a paragraph within (a text box's): a line of its own
                if parts and not parts[-1].endswith("\n"):
                    parts.append("\n")
                stack.append("\n")
            stack.extend(reversed(e))
    return "".join(parts)


def _cell_text(tc: Any) -> str:
    """A cell's paragraphs and the text of the tables nested in it, a line each."""
    lines: list[str] = []
    for block in _blocks(tc):
        if block.tag == _P:
            lines.append(_paragraph_text(block))
        else:
            lines.extend(
                _cell_text(cell) for row in _inner(block, _TR) for cell in _inner(row, _TC)
            )
    return "\n".join(lines)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _table_markdown(tbl: Any, budget: TextBudget) -> str:
    """A table as Markdown rows, a cell spanning n grid columns repeated n times (as python-docx's
    `row.cells` gives it) and a vertically merged one repeating the cell above; a table nested
    in a cell gives the cell its text. Each cell's text is found once, a span counts at most
    the table's grid columns, and every row is taken from the text budget before it is built:
    a `gridSpan` of a million (a 36 KB file) made python-docx yield the cell, and its text be
    found, a million times per row, and the limit was checked only after the whole table
    (106 s)."""
    grid = tbl.tblGrid
    columns = max(1, len(grid.gridCol_lst) if grid is not None else 0)
    rows: list[str] = []
    above: dict[int, str] = {}  # grid offset -> the text of the row above's cell there
    for tr in _inner(tbl, _TR):
        offset = tr.grid_before
        cells: list[tuple[str, int]] = []  # (Markdown of the cell, how many times)
        here: dict[int, str] = {}
        for tc in _inner(tr, _TC):
            span = min(tc.grid_span, columns)
            merged = tc.vMerge == "continue"
            text = above.get(offset, "") if merged else _cell(_cell_text(tc))
            here[offset] = text
            if span > 0:
                cells.append((text, span))
                offset += span
        above = here
        count = sum(n for _, n in cells)
        # "| " + cells joined by " | " + " |", and a line end
        budget.take(sum(len(t) * n for t, n in cells) + 3 * max(count - 1, 0) + 5)
        rows.append("| " + " | ".join(t for t, n in cells for _ in range(n)) + " |")
    if not rows:
        return ""
    width = rows[0].count(" | ") + 1
    budget.take(1 + 6 * width)
    rows.insert(1, "|" + " --- |" * width)
    return "\n".join(rows)


def _is_markup(head: bytes) -> bool:
    """Whether an entry beginning with `head` may be XML, which python-docx would parse
    (taking some 40 times its size in memory), rather than a blob (an image) it only holds.
    White space may come before XML's `<` (NULs too, in UTF-16): a head of nothing else may
    be XML yet."""
    rest = head.lstrip(b" \t\r\n\0")
    return not rest or rest.startswith(b"<") or bom(head) is not None


# The central directory zipfile reads (in Python, an object an entry) before anything can be
# looked at: a 43 MB DOCX of 500,000 empty entries took 14 s and 600 MB, then was read. A
# document's directory is a few KB (an entry of about a hundred bytes, rarely a thousand).
DIRECTORY_MAX = 2_000_000  # bytes
_EOCD, _ZIP64_LOCATOR, _ZIP64_RECORD = b"PK\x05\x06", b"PK\x06\x07", b"PK\x06\x06"


def _directory_size(data: bytes) -> int:
    """The size its end record gives the zip's central directory (zip64's when it says so),
    which is what zipfile reads, whatever count of entries it states; 0 if none is found
    (zipfile then says what is wrong)."""
    at = data.rfind(_EOCD, max(0, len(data) - 65_557))
    if at < 0 or at + 22 > len(data):
        return 0
    size = int.from_bytes(data[at + 12 : at + 16], "little")
    # zipfile takes the zip64 record just before a zip64 locator whenever there is one,
    # whatever the classic record says: the larger of the two is what it may read.
    if (
        at >= 76
        and data[at - 20 : at - 16] == _ZIP64_LOCATOR
        and data[at - 76 : at - 72] == (_ZIP64_RECORD)
    ):
        size = max(size, int.from_bytes(data[at - 36 : at - 28], "little"))
    return size


def _check_unpacked(data: bytes, name: object, *, max_xml: int, max_total: int) -> None:
    """Refuse a zip whose XML unpacks to more than `max_xml` bytes, or everything to more than
    `max_total`, before python-docx inflates and parses it. The sizes are those its directory
    declares; a lie cannot get past them, since zipfile never inflates an entry past its
    declared size (what is cut off fails the CRC check; tests/test_sources.py checks it)."""
    if (directory := _directory_size(data)) > DIRECTORY_MAX:
        raise refuse(
            name,
            f"its zip directory takes {directory} bytes, over {DIRECTORY_MAX} (hundreds of "
            "thousands of entries: no document has them); refused",
        )
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            entries = archive.infolist()
            declared = sum(entry.file_size for entry in entries)
            if declared > max_total:
                raise _unpacks_over(name, "content", declared, max_total)
            if declared > max_xml:
                xml = sum(e.file_size for e in entries if _is_markup(_head(archive, e)))
                if xml > max_xml:
                    raise _unpacks_over(name, "XML", xml, max_xml)
    except InvalidInput:
        raise
    except Exception as e:  # zipfile raises several kinds on damaged archives
        if not input_failure(e, *_DOCX_PACKAGES):
            raise  # an interruption (Celery's soft time limit), not a damaged file
        raise refuse(name, f"unreadable DOCX ({type(e).__name__}: {e})") from None


def _head(archive: zipfile.ZipFile, entry: zipfile.ZipInfo) -> bytes:
    with archive.open(entry) as member:
        return member.read(64)


def _unpacks_over(name: object, what: str, size: int, limit: int) -> InvalidInput:
    return refuse(
        name,
        f"the document's {what} unpacks to {size} bytes, over the limit of {limit} bytes "
        "(a decompression bomb?)",
    )


def docx_to_markdown(data: bytes, name: object, *, limit: int, max_xml: int) -> str:
    """A DOCX as Markdown: Title/Heading N → `#`×N, list paragraphs → `- ` items, tables →
    Markdown table rows. Refused when its XML unpacks to more than `max_xml` bytes, the whole
    to more than `UNPACK_RATIO` × `limit` (the size limit), or its text passes `limit`
    characters, counted as it is extracted."""
    import docx
    from docx.enum.style import WD_STYLE_TYPE

    _check_unpacked(data, name, max_xml=max_xml, max_total=UNPACK_RATIO * limit)
    budget = TextBudget(name, limit)
    try:
        document = docx.Document(io.BytesIO(data))
        # A paragraph's style is found by a scan of every style when it has none of its own:
        # looked up once per style, not once per paragraph.
        styles: dict[str | None, str] = {}
        blocks: list[tuple[str, str]] = []  # (kind, markdown)
        for block in _blocks(document.element.body):
            if block.tag == _TBL:
                table = _table_markdown(block, budget)
                if table:
                    blocks.append(("table", table))
                continue
            text = _paragraph_text(block).strip()
            if not text:
                continue
            budget.take(len(text))
            style_id = block.style
            if style_id not in styles:
                found = document.part.get_style(style_id, WD_STYLE_TYPE.PARAGRAPH)
                styles[style_id] = (found.name if found is not None else "") or ""
            style = styles[style_id]
            heading = re.fullmatch(r"heading\s*(\d)", style.strip(), re.I)
            ppr = block.pPr
            numbered = ppr is not None and ppr.numPr is not None
            if style == "Title" or heading:
                level = min(int(heading.group(1)), 6) if heading else 1
                blocks.append(("heading", "#" * max(level, 1) + " " + " ".join(text.split())))
            elif style.startswith("List") or numbered:
                depth = re.search(r"(\d)$", style)
                indent = "  " * (int(depth.group(1)) - 1 if depth else 0)
                blocks.append(("item", indent + "- " + escape_markdown_lookalikes(text)))
            else:
                blocks.append(("para", escape_markdown_lookalikes(text)))
    except InvalidInput:
        raise
    except Exception as e:  # python-docx, zipfile and lxml all raise on damaged files
        if not input_failure(e, *_DOCX_PACKAGES):
            raise  # an interruption (Celery's soft time limit), not a damaged file
        raise refuse(name, f"unreadable DOCX ({type(e).__name__}: {e})") from None
    parts: list[str] = []
    for i, (kind, md) in enumerate(blocks):
        if i:
            parts.append("\n" if kind == "item" and blocks[i - 1][0] == "item" else "\n\n")
        parts.append(md)
    out = "".join(parts)
    if not out.strip():
        raise refuse(name, "the document has no text")
    return check_text_size(out, name, limit)
