"""Bytes to text: byte-order marks, declared charsets (a header's, an HTML page's `<meta>`, an
XML declaration) read as browsers read their labels (the WHATWG Encoding Standard), refused
with the byte and offset when they do not decode, line ends made `\\n`; and plain text made
safe for the structural chunker (`escape_markdown_lookalikes`)."""

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
# `<?xml version="1.0" encoding="..."?>`, which can only open a document (after a BOM).
_XML_DECLARATION = re.compile(
    rb"""<\?xml\s+version\s*=\s*["'][^"']*["']"""
    rb"""\s+encoding\s*=\s*["']([A-Za-z][A-Za-z0-9._:-]*)["']"""
)
# The WHATWG Encoding Standard's labels (what browsers do), by the Python codec that decodes
# what browsers decode: a page labelled with a legacy charset is decoded with the superset
# its authors' tools wrote (gb2312: GBK, euc-kr: windows-949, shift_jis: windows-31J,
# latin-1 and ascii: windows-1252, ...), else it is refused for a character the old charset
# lacks. Labels not listed fall back to Python's own (latin-1, cp437, utf-32, ...).
_WHATWG = """
utf-8: unicode-1-1-utf-8 unicode11utf8 unicode20utf8 utf-8 utf8 x-unicode20utf8
cp866: 866 cp866 csibm866 ibm866
iso8859-2: csisolatin2 iso-8859-2 iso-ir-101 iso8859-2 iso88592 iso_8859-2 iso_8859-2:1987 l2
  latin2
iso8859-3: csisolatin3 iso-8859-3 iso-ir-109 iso8859-3 iso88593 iso_8859-3 iso_8859-3:1988 l3
  latin3
iso8859-4: csisolatin4 iso-8859-4 iso-ir-110 iso8859-4 iso88594 iso_8859-4 iso_8859-4:1988 l4
  latin4
iso8859-5: csisolatincyrillic cyrillic iso-8859-5 iso-ir-144 iso8859-5 iso88595 iso_8859-5
  iso_8859-5:1988
iso8859-6: arabic asmo-708 csiso88596e csiso88596i csisolatinarabic ecma-114 iso-8859-6
  iso-8859-6-e iso-8859-6-i iso-ir-127 iso8859-6 iso88596 iso_8859-6 iso_8859-6:1987
iso8859-7: csisolatingreek ecma-118 elot_928 greek greek8 iso-8859-7 iso-ir-126 iso8859-7
  iso88597 iso_8859-7 iso_8859-7:1987 sun_eu_greek
iso8859-8: csiso88598e csisolatinhebrew hebrew iso-8859-8 iso-8859-8-e iso-ir-138 iso8859-8
  iso88598 iso_8859-8 iso_8859-8:1988 visual csiso88598i iso-8859-8-i logical
iso8859-10: csisolatin6 iso-8859-10 iso-ir-157 iso8859-10 iso885910 l6 latin6
iso8859-13: iso-8859-13 iso8859-13 iso885913
iso8859-14: iso-8859-14 iso8859-14 iso885914
iso8859-15: csisolatin9 iso-8859-15 iso8859-15 iso885915 iso_8859-15 l9
iso8859-16: iso-8859-16
koi8-r: cskoi8r koi koi8 koi8-r koi8_r
koi8-u: koi8-ru koi8-u
mac-roman: csmacintosh mac macintosh x-mac-roman
mac-cyrillic: x-mac-cyrillic x-mac-ukrainian
cp874: dos-874 iso-8859-11 iso8859-11 iso885911 tis-620 windows-874
cp1250: cp1250 windows-1250 x-cp1250
cp1251: cp1251 windows-1251 x-cp1251
cp1252: ansi_x3.4-1968 ascii cp1252 cp819 csisolatin1 ibm819 iso-8859-1 iso-ir-100 iso8859-1
  iso88591 iso_8859-1 iso_8859-1:1987 l1 latin1 us-ascii windows-1252 x-cp1252 latin-1
cp1253: cp1253 windows-1253 x-cp1253
cp1254: cp1254 csisolatin5 iso-8859-9 iso-ir-148 iso8859-9 iso88599 iso_8859-9
  iso_8859-9:1989 l5 latin5 windows-1254 x-cp1254
cp1255: cp1255 windows-1255 x-cp1255
cp1256: cp1256 windows-1256 x-cp1256
cp1257: cp1257 windows-1257 x-cp1257
cp1258: cp1258 windows-1258 x-cp1258
gb18030: chinese csgb2312 csiso58gb231280 gb2312 gb_2312 gb_2312-80 gbk iso-ir-58 x-gbk gb18030
big5hkscs: big5 big5-hkscs cn-big5 csbig5 x-x-big5
euc_jp: cseucpkdfmtjapanese euc-jp x-euc-jp
iso2022_jp: csiso2022jp iso-2022-jp
cp932: csshiftjis ms932 ms_kanji shift-jis shift_jis sjis windows-31j x-sjis
cp949: cseuckr csksc56011987 euc-kr iso-ir-149 korean ks_c_5601-1987 ks_c_5601-1989 ksc5601
  ksc_5601 windows-949
utf-16-be: unicodefffe utf-16be
utf-16-le: csunicode iso-10646-ucs-2 ucs-2 unicode unicodefeff utf-16 utf-16le
"""
_LABELS = {
    label: codec
    for line in re.sub(r"\n +", " ", _WHATWG).strip().splitlines()
    for codec, _, labels in [line.partition(":")]
    for label in labels.split()
}
# Lines of plain text that the chunker would take for a heading (ATX, or a Setext underline of
# `=` or `-` below a line) or a code fence (indented any amount: harmless where it is not one).
# An HTML block opener (`<!--`, `<pre`, ...: CommonMark's types 1 to 5) too: the chunker takes
# everything from it to its end marker, or to the text's end, as one literal block, and a PDF
# about HTML would lose every heading and paragraph break after its first `<pre>` line.
_MARKDOWN_LOOKALIKE = re.compile(
    r"^[ \t]{0,3}(?=#{1,6}(?:[ \t]|$)|(?:=+|-+)[ \t]*$"
    r"|<(?:!--|\?|!\[CDATA\[|![A-Za-z]|(?i:pre|script|style|textarea)(?:[ \t>]|$)))"
    r"|^[ \t]*(?=`{3}|~{3})",
    re.M,
)


def bom(data: bytes) -> tuple[str, int] | None:
    for mark, encoding in _BOMS:
        if data.startswith(mark):
            return encoding, len(mark)
    return None


# Text codecs that are no character set a page or a file may name: they turn bytes into
# lone surrogates (UTF-7's `+2AA-`, `\\ud800`), which UTF-8 cannot store or send (the item's
# bulk run failed with it), or decode in time that grows with the square of the text
# (punycode, idna: a 425-byte gzipped page took 30 s, past every timeout); and in code,
# `unicode-escape` would read a `\\n` as a line end.
NOT_CHARSETS = frozenset(
    ("unicode-escape", "raw-unicode-escape", "undefined", "idna", "punycode", "utf-7")
)
_SURROGATE = re.compile("[\ud800-\udfff]")


def _codec(label: str | None) -> str | None:
    """A Python text codec for a charset label, or None when Python does not know it as one:
    `base64`, `hex`, `rot13` and the like are codecs too, but bytes.decode refuses them
    (LookupError), so a page naming one is read as one naming an unknown charset."""
    if not label:
        return None
    label = _LABELS.get(label.strip().lower(), label.strip())
    try:
        info = codecs.lookup(label)
    except LookupError:
        return None
    if not getattr(info, "_is_text_encoding", True) or info.name in NOT_CHARSETS:
        return None
    return info.name


def _decode(data: bytes, encoding: str, name: object) -> str:
    label = "UTF-8" if encoding in ("utf-8", "utf_8") else encoding
    try:
        text = data.decode(encoding)
    except UnicodeDecodeError as e:
        raise refuse(
            name,
            f"is not {label} text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
            "convert it to UTF-8",
        ) from None
    except (UnicodeError, LookupError) as e:  # a text codec that fails otherwise (idna)
        raise refuse(name, f"is not {label} text ({e}); convert it to UTF-8") from None
    if (lone := _SURROGATE.search(text)) is not None:  # (a codec that slipped NOT_CHARSETS)
        raise refuse(
            name,
            f"decodes as {label} to a lone surrogate U+{ord(lone.group()):04X} (at character "
            f"{lone.start()}), which no UTF-8 text holds; convert it to UTF-8",
        )
    return text


def normalize_newlines(text: str) -> str:
    """`\\r\\n` and a lone `\\r` (old Mac files, some exporters) as `\\n`, the only line end
    the chunker knows: without it a text of lone CRs is one line, one "heading" long."""
    return text.replace("\r\n", "\n").replace("\r", "\n") if "\r" in text else text


def decode_text(data: bytes, name: object, charset: str | None = None) -> str:
    """Text from bytes: a BOM wins, then `charset` (an HTTP header's), else strict UTF-8, since
    guessing an encoding silently indexes mojibake. NUL bytes mean binary, not text. Line ends
    become `\\n`."""
    mark = bom(data)
    if mark:
        return normalize_newlines(_decode(data[mark[1] :], mark[0], name))
    encoding = _codec(charset) or "utf-8"
    if not encoding.startswith(("utf_16", "utf_32", "utf-16", "utf-32")) and b"\0" in data[:_SNIFF]:
        raise refuse(name, "binary or unsupported file type")
    return normalize_newlines(_decode(data, encoding, name))


def _in_document(label: str | None) -> str | None:
    """The codec for a charset a document declares in itself, in ASCII (a `<meta>`, an XML
    declaration): one of UTF-16 or UTF-32 contradicts that, and means UTF-8 (WHATWG)."""
    codec = _codec(label)
    if codec and codec.replace("_", "-").startswith(("utf-16", "utf-32")):
        return "utf-8"
    return codec


def _xml_encoding(data: bytes) -> str | None:
    """The encoding an XML document declares, or UTF-16 when it begins `<?xml` in UTF-16
    without a BOM (XML's own detection)."""
    if data.startswith(b"<\0?\0x\0m\0l\0"):
        return "utf-16-le"
    if data.startswith(b"\0<\0?\0x\0m\0l"):
        return "utf-16-be"
    m = _XML_DECLARATION.match(data)
    return _in_document(m.group(1).decode("ascii")) if m else None


def _meta_encoding(data: bytes) -> str | None:
    m = _META_CHARSET.search(data[:4096])
    return _in_document(m.group(1).decode("ascii")) if m else None


def decode_html(data: bytes, name: object, charset: str | None = None, *, xml: bool = False) -> str:
    """HTML's charset: the BOM, then the transport's, then `<meta charset>`, then an XML
    declaration, else UTF-8. XHTML (`xml`: an XML media type) is read as XML is: its XML
    declaration comes before a `<meta>`."""
    if bom(data) or _codec(charset):
        return decode_text(data, name, charset)
    first, second = (_xml_encoding, _meta_encoding) if xml else (_meta_encoding, _xml_encoding)
    return decode_text(data, name, first(data) or second(data))


def decode_xml(data: bytes, name: object, charset: str | None = None) -> str:
    """XML's charset: the BOM, then the transport's, then its XML declaration, else UTF-8."""
    if bom(data) or _codec(charset):
        return decode_text(data, name, charset)
    return decode_text(data, name, _xml_encoding(data))


def escape_markdown_lookalikes(text: str) -> str:
    """Escape lines of extracted plain text that would read as a heading, a Setext underline or
    a code fence, with a backslash, as Markdown does: the text reads the same."""
    return _MARKDOWN_LOOKALIKE.sub(lambda m: m.group(0) + "\\", normalize_newlines(text))
