"""Bytes to text: byte-order marks, declared charsets (a header's, an HTML page's `<meta>`),
refused with the byte and offset when they do not decode; and plain text made safe for the
structural chunker (`escape_markdown_lookalikes`)."""

from __future__ import annotations

import codecs
import re

from worker.sources.limits import refuse

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
# Lines of plain text that the chunker would take for a heading or a code fence.
_MARKDOWN_LOOKALIKE = re.compile(r"^([ \t]{0,3})(#{1,6}(?:[ \t]|$)|`{3}|~{3})", re.M)


def bom(data: bytes) -> tuple[str, int] | None:
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
        raise refuse(
            name,
            f"is not {label} text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
            "convert it to UTF-8",
        ) from None
    except (UnicodeError, LookupError) as e:  # a text codec that fails otherwise (idna)
        raise refuse(name, f"is not {label} text ({e}); convert it to UTF-8") from None


def decode_text(data: bytes, name: object, charset: str | None = None) -> str:
    """Text from bytes: a BOM wins, then `charset` (an HTTP header's), else strict UTF-8, since
    guessing an encoding silently indexes mojibake. NUL bytes mean binary, not text."""
    mark = bom(data)
    if mark:
        return _decode(data[mark[1] :], mark[0], name)
    encoding = _codec(charset) or "utf-8"
    if not encoding.startswith(("utf_16", "utf_32", "utf-16", "utf-32")) and b"\0" in data[:_SNIFF]:
        raise refuse(name, "binary or unsupported file type")
    return _decode(data, encoding, name)


def decode_html(data: bytes, name: object, charset: str | None = None) -> str:
    """HTML's charset: the BOM, then the transport's, then `<meta charset>`, else UTF-8."""
    if bom(data) or _codec(charset):
        return decode_text(data, name, charset)
    m = _META_CHARSET.search(data[:4096])
    return decode_text(data, name, m.group(1).decode("ascii") if m else None)


def escape_markdown_lookalikes(text: str) -> str:
    """Escape lines of extracted plain text that would read as a heading or a code fence."""
    return _MARKDOWN_LOOKALIKE.sub(lambda m: m.group(1) + "\\" + m.group(2), text)
