"""The text of a file, as Markdown where the format has structure, so that the structural
chunker (which cuts at `#` headings) sees sections; also the converters `urls.py` shares.

Files are read only under `FilesSettings.roots`, checked on the fully resolved path and then
read from that path, so that neither `..` nor a symlink leads outside. Every refusal is an
`InvalidInput` whose one-line message names the file: retrying cannot help.
"""

from __future__ import annotations

import codecs
import contextlib
import io
import math
import os
import re
import stat
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

from worker.errors import InvalidInput
from worker.settings import HTML_BYTES, HTML_ELEMENTS, PDF_CONTENT_BYTES, FilesSettings

TEXT_SUFFIXES = frozenset({".md", ".markdown", ".txt", ".text", ".rst"})
HTML_SUFFIXES = frozenset({".html", ".htm", ".xhtml"})
_BINARY = """.doc .xls .xlsx .ppt .pptx .odt .ods .odp .epub .zip .gz .tgz .bz2 .xz .zst .tar .7z
.rar .png .jpg .jpeg .gif .webp .bmp .tif .tiff .ico .heic .mp3 .mp4 .m4a .wav .flac .ogg .avi
.mov .mkv .webm .exe .dll .so .dylib .bin .o .a .class .jar .pyc .whl .sqlite .db .woff .woff2
.ttf .otf .iso .dmg"""
BINARY_SUFFIXES = frozenset(_BINARY.split())
# Longest first: the UTF-32 LE mark begins with the UTF-16 LE one.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
_SNIFF = 8192
_META_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([A-Za-z0-9._:-]+)""", re.I)
# Per WHATWG, pages labelled Latin-1 or ASCII are really windows-1252.
_LABEL_ALIASES = {
    "iso-8859-1": "cp1252",
    "latin1": "cp1252",
    "latin-1": "cp1252",
    "ascii": "cp1252",
    "us-ascii": "cp1252",
}
# A zipped document (DOCX) may unpack to at most this many times the size limit in all (its
# images and other blobs, held in memory); its XML has a limit of its own (`max_xml_bytes`).
UNPACK_RATIO = 4
# A start tag: what trafilatura's time grows with (`html_text`).
_START_TAG = re.compile(r"<[A-Za-z]")
# Lines of plain text that the chunker would take for a heading or a code fence.
_MARKDOWN_LOOKALIKE = re.compile(r"^([ \t]{0,3})(#{1,6}(?:[ \t]|$)|`{3}|~{3})", re.M)


def _refuse(name: object, reason: str) -> InvalidInput:
    return InvalidInput(f"{name}: {reason}")


# -- decoding -------------------------------------------------------------------------------


def _bom(data: bytes) -> tuple[str, int] | None:
    for mark, encoding in _BOMS:
        if data.startswith(mark):
            return encoding, len(mark)
    return None


def _codec(label: str | None) -> str | None:
    """A Python text codec for a charset label, or None when Python does not know it as one:
    `base64`, `hex`, `rot13` and the like are codecs too, but bytes.decode refuses them
    (LookupError), so a page naming one is read as one naming an unknown charset."""
    if not label:
        return None
    label = _LABEL_ALIASES.get(label.strip().lower(), label.strip())
    try:
        info = codecs.lookup(label)
    except LookupError:
        return None
    return info.name if getattr(info, "_is_text_encoding", True) else None


def _decode(data: bytes, encoding: str, name: object) -> str:
    label = "UTF-8" if encoding in ("utf-8", "utf_8") else encoding
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as e:
        raise _refuse(
            name,
            f"is not {label} text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
            "convert it to UTF-8",
        ) from None
    except (UnicodeError, LookupError) as e:  # a text codec that fails otherwise (idna)
        raise _refuse(name, f"is not {label} text ({e}); convert it to UTF-8") from None


def decode_text(data: bytes, name: object, charset: str | None = None) -> str:
    """Text from bytes: a BOM wins, then `charset` (an HTTP header's), else strict UTF-8, since
    guessing an encoding silently indexes mojibake. NUL bytes mean binary, not text."""
    bom = _bom(data)
    if bom:
        return _decode(data[bom[1] :], bom[0], name)
    encoding = _codec(charset) or "utf-8"
    if not encoding.startswith(("utf_16", "utf_32", "utf-16", "utf-32")) and b"\0" in data[:_SNIFF]:
        raise _refuse(name, "binary or unsupported file type")
    return _decode(data, encoding, name)


def decode_html(data: bytes, name: object, charset: str | None = None) -> str:
    """HTML's charset: the BOM, then the transport's, then `<meta charset>`, else UTF-8."""
    if _bom(data) or _codec(charset):
        return decode_text(data, name, charset)
    m = _META_CHARSET.search(data[:4096])
    return decode_text(data, name, m.group(1).decode("ascii") if m else None)


def escape_markdown_lookalikes(text: str) -> str:
    """Escape lines of extracted plain text that would read as a heading or a code fence."""
    return _MARKDOWN_LOOKALIKE.sub(lambda m: m.group(1) + "\\" + m.group(2), text)


# -- converters -----------------------------------------------------------------------------


def html_to_markdown(html: str) -> str | None:
    """The page's main text as Markdown with headings (no navigation, scripts or footers), or
    None when trafilatura finds none."""
    import trafilatura  # slow to import; only the workers that read HTML pay for it

    text = trafilatura.extract(
        html,
        output_format="markdown",
        include_comments=False,
        include_tables=True,
        favor_recall=True,
    )
    return text if text and text.strip() else None


def html_text(
    data: bytes,
    name: object,
    charset: str | None = None,
    *,
    max_bytes: int = HTML_BYTES,
    max_elements: int = HTML_ELEMENTS,
) -> str | None:
    """An HTML document's main text as Markdown (`html_to_markdown`), refused past `max_bytes`
    bytes or `max_elements` start tags, before trafilatura sees it. Its time grows faster
    than the element count, not the bytes: 20 MB in 200 paragraphs took 0.6 s, 0.9 MB in
    80,000 tiny paragraphs 13 s, a real 8.5 MB source listing of 154,000 tags 128 s and 730
    MB resident (the whole Rust reference, 89,000 tags: 3 s). Every file and URL goes here."""
    if len(data) > max_bytes:
        raise _refuse(
            name, f"{len(data)} bytes of HTML is over the limit of {max_bytes} bytes for HTML"
        )
    html = decode_html(data, name, charset)
    for tags, _ in enumerate(_START_TAG.finditer(html), 1):
        if tags > max_elements:
            raise _refuse(
                name,
                f"the HTML has over {max_elements} elements, the limit for HTML (finding the "
                "main text of more takes minutes)",
            )
    return html_to_markdown(html)


class _TextBudget:
    """The characters extracted so far, refused as soon as they pass the limit: a small
    compressed file (deflated XML, a PDF's compressed streams) can hold a huge text, which
    would hold a worker for minutes and make a hundred thousand chunks. Refused rather than
    cut short, as an oversized file is: an index of part of a document would pass for whole."""

    def __init__(self, name: object, limit: int) -> None:
        self.name = name
        self.limit = limit
        self.used = 0

    def take(self, chars: int) -> None:
        self.used += chars
        if self.used > self.limit:
            raise text_over_limit(self.name, self.limit)


def text_over_limit(name: object, limit: int) -> InvalidInput:
    return _refuse(name, f"the text extracted is over the size limit of {limit} characters")


def check_text_size(text: str, name: object, limit: int) -> str:
    """`text`, refused when longer than `limit` characters (the source's size limit): no
    file or page gives more text than the largest plain text file allowed."""
    if len(text) > limit:
        raise text_over_limit(name, limit)
    return text


def _font_size(tm: Any, cm: Any, size: float) -> float:
    """The rendered height: the font size scaled by the text and current matrices."""
    c = tm[2] * cm[0] + tm[3] * cm[2]
    d = tm[2] * cm[1] + tm[3] * cm[3]
    return round(size * (math.hypot(c, d) or 1.0), 1)


# What reading a page or a form costs besides its content, in bytes of content read in the
# same time: pypdf sets up its reading (0.3 ms) and each of its fonts (0.05 ms) again each
# time it reads the page or draws the form.
READ_COST = 250
FONT_COST = 50


def _resolved(obj: Any) -> Any:
    return obj.get_object() if hasattr(obj, "get_object") else obj


class _PdfWork:
    """The work reading a PDF's text takes, refused once past `limit`, before the part that
    would pass it is read. pypdf bounds each stream (75 MB unpacked, 2 million tokens), but
    reads a page's content streams again for each page that draws them, a form's at each use
    (up to 5,000 a page), and sets up their fonts each time: a PDF of a few KB can take an
    hour (a stream of 1.6 million operators, 7 s to read, drawn by 500 pages). Counted in
    bytes of content unpacked, each time it is read, with `READ_COST` a read and `FONT_COST`
    a font: the time pypdf takes is about proportional (1.1 to 1.7 µs a byte, whatever the
    operators).

    The refusal is raised again at every operator after it: pypdf logs and skips an error in
    a form and goes on with the page."""

    def __init__(self, name: object, limit: int) -> None:
        self.name, self.limit = name, limit
        self.used = 0
        self.refusal: InvalidInput | None = None
        self.resources: list[Any] = []  # the resources of the page, then of each form drawn

    def charge(self, cost: int) -> None:
        self.check()
        self.used += cost
        if self.used > self.limit:
            self.refusal = _refuse(
                self.name,
                f"reading its text means reading over {self.limit} bytes of page content "
                "(unpacked, each time a page or form draws it, fonts included); refused (a "
                "decompression bomb?)",
            )
            raise self.refusal

    def check(self) -> None:
        if self.refusal is not None:
            raise self.refusal

    def page(self, page: Any) -> None:
        """Charge the page's contents and fonts, before pypdf reads them."""
        try:
            contents = _resolved(page.get("/Contents"))
            resources = _resolved(page.get_inherited("/Resources", None))
        except Exception:  # damaged: pypdf says so when it reads it
            contents = resources = None
        streams = contents if isinstance(contents, list) else [contents]
        self.resources = [resources]
        self.charge(READ_COST + sum(self._size(s) for s in streams) + self._fonts(resources))

    def before(self, operator: bytes, operands: Any, _cm: Any, _tm: Any) -> None:
        """Before each operator: a form drawn (`Do`) is charged, its resources pushed."""
        self.check()
        if operator != b"Do":
            return
        form, resources = None, None
        try:  # as pypdf finds it: anything but an image is read as a form
            xobjects = _resolved(self.resources[-1].get("/XObject"))
            form = _resolved(xobjects[operands[0]])
            if form.get("/Subtype") not in (None, "/Image"):
                resources = _resolved(form.get_inherited("/Resources", None))
        except Exception:  # no such form: pypdf skips it too
            form = None
        if resources is not None:
            self.charge(READ_COST + self._size(form) + self._fonts(resources))
        self.resources.append(resources if resources is not None else {})

    def after(self, operator: bytes, _operands: Any, _cm: Any, _tm: Any) -> None:
        if operator == b"Do" and len(self.resources) > 1:
            self.resources.pop()

    @staticmethod
    def _size(stream: Any) -> int:
        """A content stream's bytes unpacked (pypdf keeps them: it does not unpack again)."""
        try:
            return len(_resolved(stream).get_data())
        except Exception:  # not a stream, or damaged: pypdf says so when it reads it
            return 0

    def _fonts(self, resources: Any) -> int:
        try:
            fonts = _resolved(resources.get("/Font"))
            entries = [_resolved(font) for font in fonts.values()]
        except Exception:
            return 0
        cost = 0
        for font in entries:
            cost += FONT_COST
            with contextlib.suppress(Exception):
                cost += self._size(font.get("/ToUnicode"))
        return cost


def _page_runs(
    page: Any, budget: _TextBudget, work: _PdfWork
) -> tuple[str, list[tuple[float, str]]]:
    """A page's text, and its runs of text in one font size, in order. A run's pieces are
    joined once at the end: added to a string each time, they took time quadratic in their
    number (400,000 one-letter `Tj`: 2.6 s, against 0.03 s)."""
    runs: list[tuple[float, list[str]]] = []

    def visit(text: str, cm: Any, tm: Any, _font: Any, size: float) -> None:
        if not text:
            return
        budget.take(len(text))
        height = _font_size(tm, cm, size)
        if runs and (abs(runs[-1][0] - height) < 0.5 or not text.strip()):
            runs[-1][1].append(text)
        else:
            runs.append((height, [text]))

    work.page(page)
    text = page.extract_text(
        visitor_text=visit, visitor_operand_before=work.before, visitor_operand_after=work.after
    )
    work.check()  # a refusal pypdf swallowed (it goes on past an error in a form)
    return text or "", [(height, "".join(pieces)) for height, pieces in runs]


def _mark_headings(text: str, headings: dict[str, int]) -> str:
    """Lines whose whole text was set larger than the body become `#` headings; a heading
    wrapped over several lines becomes one."""
    out: list[str] = []
    previous = 0
    for line in escape_markdown_lookalikes(text).splitlines():
        level = headings.get(line.strip(), 0)
        if level and level == previous:
            out[-1] += " " + line.strip()
        elif level:
            out.extend(["", "#" * level + " " + line.strip(), ""])
        else:
            out.append(line)
        previous = level
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip()


def pdf_text(data: bytes, name: object, *, limit: int, max_content: int = PDF_CONTENT_BYTES) -> str:
    """A PDF's text, page by page with a blank line between; lines set in a font larger than
    the body's become Markdown headings, ranked by size. Refused once the text passes `limit`
    characters (the size limit), counted as it is extracted, or once reading it passes
    `max_content` bytes of page content (`_PdfWork`)."""
    import pypdf

    budget = _TextBudget(name, limit)
    work = _PdfWork(name, max_content)
    try:
        reader = pypdf.PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not reader.decrypt(""):
            raise _refuse(name, "the PDF is encrypted; give kidx a copy without a password")
        pages = [_page_runs(page, budget, work) for page in reader.pages]
    except InvalidInput:
        raise
    except Exception as e:  # pypdf raises many kinds on damaged files
        raise _refuse(name, f"unreadable PDF ({type(e).__name__}: {e})".strip()) from None
    chars: Counter[float] = Counter()
    for _, runs in pages:
        for size, text in runs:
            chars[size] += len(text.strip())
    body = chars.most_common(1)[0][0] if chars else 0.0
    big = [
        {
            line.strip(): size
            for size, text in runs
            if size >= body * 1.15
            for line in text.splitlines()
            if 0 < len(line.strip()) <= 200
        }
        for _, runs in pages
    ]
    sizes = sorted({size for page in big for size in page.values()}, reverse=True)
    ranks = {size: min(i + 1, 6) for i, size in enumerate(sizes)}
    texts = [
        _mark_headings(text, {line: ranks[size] for line, size in lines.items()})
        for (text, _), lines in zip(pages, big)
    ]
    result = "\n\n".join(t for t in texts if t)
    if not result.strip():
        raise _refuse(name, "the PDF has no text layer (scanned?); nothing to index")
    return check_text_size(result, name, limit)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _table_markdown(table: Any, budget: _TextBudget) -> str:
    """A table as Markdown rows, a cell spanning n grid columns repeated n times (as python-docx's
    `row.cells` gives it) and a vertically merged one repeating the cell above. Each cell's
    text is found once, a span counts at most the table's grid columns, and every row is taken
    from the text budget before it is built: a `gridSpan` of a million (a 36 KB file) made
    python-docx yield the cell, and its text be found, a million times per row, and the limit
    was checked only after the whole table (106 s)."""
    from docx.table import _Cell

    grid = table._tbl.tblGrid
    columns = max(1, len(grid.gridCol_lst) if grid is not None else 0)
    rows: list[str] = []
    above: dict[int, str] = {}  # grid offset -> the text of the row above's cell there
    for tr in table._tbl.tr_lst:
        offset = tr.grid_before
        cells: list[tuple[str, int]] = []  # (Markdown of the cell, how many times)
        here: dict[int, str] = {}
        for tc in tr.tc_lst:
            span = min(tc.grid_span, columns)
            if tc.vMerge == "continue":
                text = above.get(offset, "")
            else:
                text = _cell(_Cell(tc, table).text)
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


_W = "{http://schemas.openxmlformats.org/wordprocessingml/2006/main}"
_RUN_TEXT = frozenset(_W + tag for tag in ("br", "cr", "noBreakHyphen", "ptab", "t", "tab"))


def _run_text(run: Any) -> str:
    return "".join(str(e) for e in run if e.tag in _RUN_TEXT)


def _paragraph_text(p: Any) -> str:
    """`Paragraph.text` without its XPath queries, which python-docx compiles on every call
    (13 µs a paragraph: a minute for a document of a few million empty ones)."""
    parts: list[str] = []
    for child in p:
        if child.tag == _W + "r":
            parts.append(_run_text(child))
        elif child.tag == _W + "hyperlink":
            parts.extend(_run_text(run) for run in child if run.tag == _W + "r")
    return "".join(parts)


def _is_markup(head: bytes) -> bool:
    """Whether an entry beginning with `head` may be XML, which python-docx would parse
    (taking some 40 times its size in memory), rather than a blob (an image) it only holds.
    White space may come before XML's `<` (NULs too, in UTF-16): a head of nothing else may
    be XML yet."""
    rest = head.lstrip(b" \t\r\n\0")
    return not rest or rest.startswith(b"<") or _bom(head) is not None


def _check_unpacked(data: bytes, name: object, *, max_xml: int, max_total: int) -> None:
    """Refuse a zip whose XML unpacks to more than `max_xml` bytes, or everything to more than
    `max_total`, before python-docx inflates and parses it. The sizes are those its directory
    declares; a lie cannot get past them, since zipfile never inflates an entry past its
    declared size (what is cut off fails the CRC check; tests/test_sources.py checks it)."""
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
        raise _refuse(name, f"unreadable DOCX ({type(e).__name__}: {e})") from None


def _head(archive: zipfile.ZipFile, entry: zipfile.ZipInfo) -> bytes:
    with archive.open(entry) as member:
        return member.read(64)


def _unpacks_over(name: object, what: str, size: int, limit: int) -> InvalidInput:
    return _refuse(
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
    from docx.table import Table

    _check_unpacked(data, name, max_xml=max_xml, max_total=UNPACK_RATIO * limit)
    budget = _TextBudget(name, limit)
    try:
        document = docx.Document(io.BytesIO(data))
        # A paragraph's style is found by a scan of every style when it has none of its own:
        # looked up once per style, not once per paragraph.
        styles: dict[str | None, str] = {}
        blocks: list[tuple[str, str]] = []  # (kind, markdown)
        for block in document.iter_inner_content():
            if isinstance(block, Table):
                table = _table_markdown(block, budget)
                if table:
                    blocks.append(("table", table))
                continue
            text = _paragraph_text(block._p).strip()
            if not text:
                continue
            budget.take(len(text))
            style_id = block._p.style
            if style_id not in styles:
                found = block.style
                styles[style_id] = (found.name if found is not None else "") or ""
            style = styles[style_id]
            heading = re.fullmatch(r"heading\s*(\d)", style.strip(), re.I)
            ppr = block._p.pPr
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
        raise _refuse(name, f"unreadable DOCX ({type(e).__name__}: {e})") from None
    parts: list[str] = []
    for i, (kind, md) in enumerate(blocks):
        if i:
            parts.append("\n" if kind == "item" and blocks[i - 1][0] == "item" else "\n\n")
        parts.append(md)
    out = "".join(parts)
    if not out.strip():
        raise _refuse(name, "the document has no text")
    return check_text_size(out, name, limit)


# -- files ----------------------------------------------------------------------------------


# Pseudo file systems: their "regular files" report a size of 0 and read without end
# (/dev/zero) or give away the process (/proc/self/environ holds the API key).
SPECIAL_ROOTS = tuple(Path(p) for p in ("/proc", "/sys", "/dev"))
_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}


def resolve_under_roots(path: str | Path, settings: FilesSettings) -> Path:
    """The path fully resolved (symlinks included), refused unless it lies under one of
    `settings.roots` and outside the pseudo file systems. The one guard for every kind of
    item read from a path (files, code)."""
    path = Path(path)
    if not settings.roots:
        raise _refuse(path, "reading files is off: set KIDX_FILES__ROOTS to the folders allowed")
    try:
        resolved = path.expanduser().resolve(strict=True)
    except FileNotFoundError:
        raise _refuse(path, "no such file") from None
    except (OSError, RuntimeError) as e:  # a symlink loop, a permission denied
        raise _refuse(path, f"cannot be resolved ({e})") from None
    shown = str(path) if resolved == path else f"{path} (resolves to {resolved})"
    if any(resolved == r or resolved.is_relative_to(r) for r in SPECIAL_ROOTS):
        raise InvalidInput(f"{shown}: a special file system is never read")
    roots = [r.expanduser().resolve() for r in settings.roots]
    if not any(resolved.is_relative_to(root) for root in roots):
        allowed = ", ".join(str(r) for r in roots)
        raise InvalidInput(f"{shown}: outside the allowed folders (KIDX_FILES__ROOTS: {allowed})")
    return resolved


def read_under_roots(path: str | Path, settings: FilesSettings) -> tuple[Path, bytes]:
    """The bytes of a regular file under the allowed roots, and its resolved path.

    Refused before it is opened: anything outside the roots (resolved), a FIFO, a device, a
    socket or a folder (opening a FIFO blocks; a device reads without end). Then opened
    without following a symlink swapped in since the check, at any depth (`_open_beneath`),
    and without blocking, checked
    again on the open file, and read up to the size limit, which holds while reading too.
    A file that says it is empty is not read (the pseudo files of /proc say so too)."""
    shown = Path(path)
    resolved = resolve_under_roots(shown, settings)
    limit = settings.max_bytes
    try:
        mode = os.stat(resolved, follow_symlinks=False).st_mode
    except OSError as e:
        raise _refuse(shown, f"cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        raise _refuse(
            shown, f"is {_KINDS.get(stat.S_IFMT(mode), 'not a regular file')}, not a regular file"
        )
    try:
        fd = _open_beneath(resolved, settings)
    except OSError as e:
        raise _refuse(shown, f"cannot be opened ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise _refuse(shown, "is not a regular file")
        if st.st_size == 0:
            raise _refuse(shown, "the file is empty")
        if st.st_size > limit:
            raise _refuse(shown, f"{st.st_size} bytes is over the size limit of {limit} bytes")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise _refuse(shown, f"is over the size limit of {limit} bytes")
    return resolved, data


def _open_beneath(resolved: Path, settings: FilesSettings) -> int:
    """Open the resolved path one name at a time from its root, following no symlink: a
    folder on the way swapped for a symlink after the check (by anyone who may write under
    the roots) fails the open (ELOOP, ENOTDIR), where opening the whole path would follow it
    out of the roots. Without `dir_fd` (not Linux), the last name only is not followed."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    roots = [r.expanduser().resolve() for r in settings.roots]
    root = next((r for r in roots if resolved.is_relative_to(r) and resolved != r), None)
    if root is None or os.open not in os.supports_dir_fd:
        return os.open(resolved, flags)
    *folders, name = resolved.relative_to(root).parts
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for folder in folders:
            inner = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            os.close(fd)
            fd = inner
        return os.open(name, flags, dir_fd=fd)
    finally:
        os.close(fd)


def read_file(path: str | Path, settings: FilesSettings) -> str:
    """The text to index from a file under the allowed roots, Markdown where structure exists.

    Raises `InvalidInput` (naming the file) for anything it will not or cannot read, including
    a file whose text is longer than `max_bytes` characters, whatever its size on disk.
    """
    shown = Path(path)
    resolved, data = read_under_roots(shown, settings)
    if not data:
        raise _refuse(shown, "the file is empty")
    suffix = resolved.suffix.lower()
    limit = settings.max_bytes
    if suffix == ".pdf" or (suffix not in TEXT_SUFFIXES | HTML_SUFFIXES and data[:5] == b"%PDF-"):
        text = pdf_text(data, shown, limit=limit, max_content=settings.max_pdf_content_bytes)
    elif suffix == ".docx":
        text = docx_to_markdown(data, shown, limit=limit, max_xml=settings.max_xml_bytes)
    elif suffix in BINARY_SUFFIXES:
        raise _refuse(shown, f"binary or unsupported file type ({suffix})")
    elif suffix in HTML_SUFFIXES:
        markdown = html_text(
            data,
            shown,
            max_bytes=settings.max_html_bytes,
            max_elements=settings.max_html_elements,
        )
        if markdown is None:
            raise _refuse(shown, "no main text could be extracted from the HTML")
        text = markdown
    else:
        text = decode_text(data, shown)
    if not text.strip():
        raise _refuse(shown, "contains only white space; nothing to index")
    return check_text_size(text, shown, limit)
