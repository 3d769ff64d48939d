"""The text of a file, as Markdown where the format has structure, so that the structural
chunker (which cuts at `#` headings) sees sections (PDF: `pdf.py`, DOCX: `docx.py`, HTML here;
`urls.py` shares them).

Files are read only under `FilesSettings.roots`, checked on the fully resolved path and then
read from that path, so that neither `..` nor a symlink leads outside. Every refusal is an
`InvalidInput` whose one-line message names the file: retrying cannot help.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any

from worker.errors import InvalidInput
from worker.settings import HTML_BYTES, HTML_ELEMENTS, FilesSettings
from worker.sources.decoding import decode_html, decode_text, decode_xml
from worker.sources.docx import docx_to_markdown
from worker.sources.limits import check_text_size, refuse
from worker.sources.pdf import pdf_text

TEXT_SUFFIXES = frozenset({".md", ".markdown", ".txt", ".text", ".rst"})
HTML_SUFFIXES = frozenset({".html", ".htm", ".xhtml"})
XML_SUFFIXES = frozenset({".xhtml", ".xml"})  # their charset is in their XML declaration
_BINARY = """.doc .xls .xlsx .ppt .pptx .odt .ods .odp .epub .zip .gz .tgz .bz2 .xz .zst .tar .7z
.rar .png .jpg .jpeg .gif .webp .bmp .tif .tiff .ico .heic .mp3 .mp4 .m4a .wav .flac .ogg .avi
.mov .mkv .webm .exe .dll .so .dylib .bin .o .a .class .jar .pyc .whl .sqlite .db .woff .woff2
.ttf .otf .iso .dmg"""
BINARY_SUFFIXES = frozenset(_BINARY.split())
# A start tag: what trafilatura's time grows with (`html_text`).
_START_TAG = re.compile(r"<[A-Za-z]")


# -- HTML -----------------------------------------------------------------------------


def parse_html(html: str, name: object = "the page") -> Any:
    """The page's lxml tree, parsed as trafilatura parses it but with `huge_tree`: without it,
    libxml2 stops at elements nested 256 deep (a template that never closes its `<div>`s) or
    at a text node of 10 MB, and trafilatura found the main text of what came before: part of
    a page indexed as the whole. Refused when the parser stopped all the same (nested past
    even the huge limits): what follows would be lost."""
    from lxml import etree
    from lxml import html as lxml_html
    from trafilatura.utils import repair_faulty_html

    parser = lxml_html.HTMLParser(
        collect_ids=False,
        default_doctype=False,
        encoding="utf-8",
        remove_comments=True,
        remove_pis=True,
        huge_tree=True,
    )
    data = repair_faulty_html(html, html[:50].lower()).encode("utf-8", "surrogatepass")
    try:
        tree = lxml_html.fromstring(data, parser=parser)
    except etree.ParserError:  # "Document is empty": nothing to read
        return None
    stopped = [e for e in parser.error_log if e.level == etree.ErrorLevels.FATAL]
    if stopped:
        raise refuse(
            name,
            f"the HTML parser stopped before its end ({stopped[0].message.split(', use')[0]}), so "
            "the rest of its text would be lost",
        )
    return tree


def html_to_markdown(html: str, name: object = "the page") -> str | None:
    """The page's main text as Markdown with headings (no navigation, scripts or footers), or
    None when trafilatura finds none."""
    import trafilatura  # slow to import; only the workers that read HTML pay for it

    tree = parse_html(html, name)
    if tree is None:
        return None
    text = trafilatura.extract(
        tree,
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
    xml: bool = False,
) -> str | None:
    """An HTML document's main text as Markdown (`html_to_markdown`), refused past `max_bytes`
    bytes or `max_elements` start tags, before trafilatura sees it. Its time grows faster
    than the element count, not the bytes: 20 MB in 200 paragraphs took 0.6 s, 0.9 MB in
    80,000 tiny paragraphs 13 s, a real 8.5 MB source listing of 154,000 tags 128 s and 730
    MB resident (the whole Rust reference, 89,000 tags: 3 s). Every file and URL goes here.
    `xml`: XHTML, whose XML declaration names its charset (`decode_html`)."""
    if len(data) > max_bytes:
        raise refuse(
            name, f"{len(data)} bytes of HTML is over the limit of {max_bytes} bytes for HTML"
        )
    html = decode_html(data, name, charset, xml=xml)
    for tags, _ in enumerate(_START_TAG.finditer(html), 1):
        if tags > max_elements:
            raise refuse(
                name,
                f"the HTML has over {max_elements} elements, the limit for HTML (finding the "
                "main text of more takes minutes)",
            )
    return html_to_markdown(html, name)


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
        raise refuse(path, "reading files is off: set KIDX_FILES__ROOTS to the folders allowed")
    try:
        resolved = path.expanduser().resolve(strict=True)
    except FileNotFoundError:
        raise refuse(path, "no such file") from None
    except (OSError, RuntimeError) as e:  # a symlink loop, a permission denied
        raise refuse(path, f"cannot be resolved ({e})") from None
    except ValueError:  # a host's source with a NUL in it
        raise refuse(path, "the path holds a NUL character") from None
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
        raise refuse(shown, f"cannot be read ({e.strerror or e})") from None
    if not stat.S_ISREG(mode):
        raise refuse(
            shown, f"is {_KINDS.get(stat.S_IFMT(mode), 'not a regular file')}, not a regular file"
        )
    try:
        fd = _open_beneath(resolved, settings)
    except OSError as e:
        raise refuse(shown, f"cannot be opened ({e.strerror or e})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise refuse(shown, "is not a regular file")
        if st.st_size == 0:
            raise refuse(shown, "the file is empty")
        if st.st_size > limit:
            raise refuse(shown, f"{st.st_size} bytes is over the size limit of {limit} bytes")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise refuse(shown, f"is over the size limit of {limit} bytes")
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
        raise refuse(shown, "the file is empty")
    suffix = resolved.suffix.lower()
    limit = settings.max_bytes
    if suffix == ".pdf" or (suffix not in TEXT_SUFFIXES | HTML_SUFFIXES and data[:5] == b"%PDF-"):
        text = pdf_text(data, shown, limit=limit, max_content=settings.max_pdf_content_bytes)
    elif suffix == ".docx":
        text = docx_to_markdown(data, shown, limit=limit, max_xml=settings.max_xml_bytes)
    elif suffix in BINARY_SUFFIXES:
        raise refuse(shown, f"binary or unsupported file type ({suffix})")
    elif suffix in HTML_SUFFIXES:
        markdown = html_text(
            data,
            shown,
            max_bytes=settings.max_html_bytes,
            max_elements=settings.max_html_elements,
            xml=suffix in XML_SUFFIXES,
        )
        if markdown is None:
            raise refuse(shown, "no main text could be extracted from the HTML")
        text = markdown
    elif suffix in XML_SUFFIXES:
        text = decode_xml(data, shown)
    else:
        text = decode_text(data, shown)
    if not text.strip():
        raise refuse(shown, "contains only white space; nothing to index")
    return check_text_size(text, shown, limit)
