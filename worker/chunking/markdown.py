"""A line scanner for the Markdown structure chunking needs: ATX and Setext headings, paragraph
breaks and fenced blocks, all outside fenced blocks (`# comment` in a shell block is not a
heading). CommonMark's rules for these, nothing more: one regular expression finds the lines,
so the per-line work happens in C (markdown-it-py's full parse runs at about 5 MB/s here, too
slow for a chunker that must match semantic-text-splitter's Rust speed; bench/chunking.py).
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

# Anchored on a line end and a look-ahead at the next character rather than on "^" with re.M:
# the engine then skips ahead in C, which makes the scan about four times as fast
# (bench/chunking.py). A line ends at "\r\n", "\r" or "\n" (old Mac text has lone CRs, and a
# note's offsets must stay those of its text: it is never rewritten); at "\r\n" the match at
# the "\r" fails its look-ahead and the one at the "\n" is taken, so a line always starts one
# past the match's start. Headings and underlines are indented at most 3 spaces (CommonMark: 4,
# or a tab, is an indented code block). A fence may also open inside list items and block
# quotes, after their markers (`- ```sh`, `1. ~~~`, `> ````) and at any depth of indentation
# (a nested item's fence is indented 4 or more): unseen, the item's closing line, indented,
# was read as a fence that never closed, and every heading after it as code. (An indented
# code block whose text holds a fence line is taken for one: rarer by far.) Blank lines (most
# of the matches) are found by a second expression, without a Python loop.
_BLOCK = (
    r"(?=[ \t#`~=<>*+0-9-])"
    r"(?:(?P<fence>(?:[ \t]*(?:>|(?:[-*+]|[0-9]{1,9}[.)])[ \t]))*[ \t]*(?P<marker>`{3,}|~{3,}))"
    r"(?P<info>[^\r\n]*)"
    r"|(?P<atx> {0,3}#{1,6})(?P<title>[ \t][^\r\n]*)?(?=[\r\n]|\Z)"
    r"|(?P<setext> {0,3}(?:=+|-+)[ \t]*)(?=[\r\n]|\Z)"
    r"|(?P<html> {0,3}<(?:!--|\?|!\[CDATA\[|![A-Za-z]"
    r"|(?i:pre|script|style|textarea)(?=[ \t>\r\n]|\Z))))"
)
_EOL = r"(?:\r\n|\r(?!\n)|\n)"  # a "\r\n" is one line end, never a "\r" and a "\n"
# Text without a "\r" (nearly all) is scanned with the expressions anchored on a literal "\n",
# which the engine searches for fastest (twice as fast as a class of two, bench/chunking.py).
_BLOCK_LINE = re.compile(r"[\r\n]" + _BLOCK)
_BLOCK_LINE_LF = re.compile(r"\n" + _BLOCK)
_BLANK_RUN = re.compile(
    rf"{_EOL}(?=[ \t\r\n])(?:[ \t]*{_EOL})+"
)  # its end is where the next paragraph starts
_BLANK_RUN_LF = re.compile(r"\n(?=[ \t\n])(?:[ \t]*\n)+")
_BLANK_LINE = re.compile(r"[ \t]*(?:[\r\n]|\Z)")
_LINE_BREAK = re.compile(r"[\r\n]")
NOT_SETEXT = re.compile(r"[ \t]*(?:[-*+>|]|\d+[.)])(?:[ \t\r\n]|$)")  # list, quote, table
# Where each kind of literal HTML block ends (CommonMark's types 1 to 5): on the line holding
# this, or at the text's end. Headings and fences inside one are its text.
_HTML_END = (
    ("<!--", re.compile("-->")),
    ("<?", re.compile(r"\?>")),
    ("<![", re.compile(r"\]\]>")),
    ("<!", re.compile(">")),
    ("<", re.compile(r"(?i)</(?:pre|script|style|textarea)>")),
)
# YAML front matter (Jekyll, Hugo, Obsidian, pandoc): a `---` line at the very start, a first
# line that is a YAML key (a thematic break opening a document, then prose, is not front
# matter), closed by `---` or `...` within FRONT_MATTER_MAX characters (metadata, not a
# document: an unbounded search would let one `---` line far below swallow every heading).
_FRONT_MATTER_OPEN = re.compile(r"\ufeff?---[ \t]*(?:\r\n|\r|\n)[A-Za-z_][\w .-]*:(?=[ \t\r\n]|\Z)")
_FRONT_MATTER_CLOSE = re.compile(r"[\r\n](?:---|\.\.\.)[ \t]*(?=[\r\n]|\Z)")
FRONT_MATTER_MAX = 32_768
# A heading's title is metadata that every chunk of its section carries (note_chunks.headings,
# the keyword index, the embedder's input): a 200 KB line starting with "# " put 60 M
# characters of headings on 300 chunks. Titles are cut to TITLE_MAX, and a chunk's whole path
# to PATH_MAX (two or three full titles): the text itself is never cut, only this copy of it.
TITLE_MAX = 200
PATH_MAX = 600
# A setext underline makes a heading of the paragraph above only when that is short: a title
# is one line, or a few when hard-wrapped (CommonMark allows any number). A longer paragraph
# over `---` is prose followed by a thematic break, its usual meaning in notes; read as a
# heading, the whole paragraph became every chunk's title.
SETEXT_MAX_LINES = 3
SETEXT_MAX_CHARS = 300


class Fence(NamedTuple):
    start: int  # start of the opening line
    end: int  # end of the closing line (or of the text, when never closed)
    open_line: str
    close_marker: str
    closed: bool


@dataclass(slots=True)
class Layout:
    heading_pos: list[int]
    heading_level: list[int]
    heading_title: list[str]
    breaks: list[int]  # paragraph starts and fence edges, ascending
    fences: list[Fence]


def clip_title(title: str, limit: int = TITLE_MAX) -> str:
    """`title` cut to at most `limit` characters: at a word boundary when one lies in the last
    quarter, an ellipsis where it was cut."""
    if len(title) <= limit:
        return title
    head = title[: limit - 1]
    cut = head.rfind(" ")
    if cut >= limit * 3 // 4:
        head = head[:cut]
    return head.rstrip() + "…"


def _atx_title(raw: str) -> str:
    title = raw.strip()
    stripped = title.rstrip("#")
    if stripped != title and (not stripped or stripped[-1] in " \t"):
        title = stripped.rstrip()
    return clip_title(title)


_THEMATIC_BREAK = re.compile(r" {0,3}([*_])[ \t]*(?:\1[ \t]*){2,}")
_EOL_SPLIT = re.compile(_EOL)


def _setext_heading(text: str, para_start: int, start: int) -> tuple[int, str] | None:
    """Where the heading a setext underline at `start` makes of the paragraph text above it
    (from `para_start`) starts, and its title; None when that text is no title: too long
    (`SETEXT_MAX_CHARS`, `SETEXT_MAX_LINES`: looked at without copying it, as a text of many
    underlines under one long paragraph asks again and again), or holding a line that is a
    list item, a quote or a table row (a paragraph ends there: `Intro:` over `- one` is no
    title), or indented as code. A thematic break (`***`) ends the paragraph above it."""
    end = start
    while end > para_start and text[end - 1].isspace():  # (the last line's own end only)
        end -= 1
    if end - para_start > SETEXT_MAX_CHARS:
        return None
    para = text[para_start:end]
    lines = _EOL_SPLIT.split(para) if "\n" in para or "\r" in para else [para]
    for k in range(len(lines) - 1, -1, -1):
        if _THEMATIC_BREAK.fullmatch(lines[k]):
            if k == len(lines) - 1:
                return None  # a thematic break, then another: no text to be a title
            after = [m.end() for m in _EOL_SPLIT.finditer(para)][k]
            para_start, para, lines = para_start + after, para[after:], lines[k + 1 :]
            break
    if not lines or len(lines) > SETEXT_MAX_LINES:
        return None
    first = lines[0].expandtabs(4)
    if any(NOT_SETEXT.match(line) for line in lines) or len(first) - len(first.lstrip(" ")) > 3:
        return None
    title = " ".join(para.lstrip("\ufeff").split())  # (a byte order mark is no text)
    return (para_start, clip_title(title)) if title else None


def _next_line(text: str, end: int) -> int:
    """The start of the line after the one that ends at `end` (its "\r\n", "\r" or "\n")."""
    if text.startswith("\r\n", end):
        return end + 2
    return min(end + 1, len(text))


def _front_matter_end(text: str) -> int:
    """Where YAML front matter at the very start of `text` ends (its closing line's end), or 0."""
    if not _FRONT_MATTER_OPEN.match(text):
        return 0
    m = _FRONT_MATTER_CLOSE.search(text, 3, FRONT_MATTER_MAX)
    return m.end() if m else 0


def _html_block_end(text: str, opener: str, after: int) -> int:
    """The end of the line on which the literal HTML block opened by `opener` ends (the text's
    end when it never does). Looked for from the opening line's start (`after`): `<!-->` ends
    on its own line (no opener holds its end marker)."""
    end_mark = next(pattern for prefix, pattern in _HTML_END if opener.startswith(prefix))
    m = end_mark.search(text, after)
    if not m:
        return len(text)
    eol = _LINE_BREAK.search(text, m.end())
    return eol.start() if eol else len(text)


def _block_lines(text: str) -> Iterator[tuple[int, int, re.Match[str]]]:
    """(line start, line end, match) of each heading, fence, underline or HTML block opening
    line. The first line is matched with a line end put before it alone: one before the whole
    text would copy it (80 MB for a 20 MB note with one emoji in it, which Python then keeps in
    four bytes a character). A leading byte order mark is not part of that line's Markdown: it
    is replaced by that line end, so that the match's offsets are the text's own."""
    eol = _LINE_BREAK.search(text)
    first = text[: eol.start() if eol else len(text)]
    if first.startswith("\ufeff"):
        if m := _BLOCK_LINE.match("\n" + first[1:]):
            yield 0, m.end(), m
    elif m := _BLOCK_LINE.match("\n" + first):
        yield 0, m.end() - 1, m
    for m in (_BLOCK_LINE if "\r" in text else _BLOCK_LINE_LF).finditer(text):
        yield m.start() + 1, m.end(), m  # the match starts at the line end before the line


def scan(text: str) -> Layout:
    """Headings, paragraph breaks and fenced blocks, outside fenced blocks, literal HTML blocks
    and front matter."""
    n = len(text)
    blank_ends = [m.end() for m in (_BLANK_RUN if "\r" in text else _BLANK_RUN_LF).finditer(text)]
    if blank_ends and blank_ends[-1] >= n:
        blank_ends.pop()
    heading_pos: list[int] = []
    heading_level: list[int] = []
    heading_title: list[str] = []
    edges: list[int] = []  # fence starts, and the line after each fence
    fences: list[Fence] = []
    fence_start = -1
    opener: re.Match[str] | None = None  # the open fence's line
    open_line = ""
    prev_next = -1  # start of the line after the last heading, fence, HTML block or front matter
    skip_to = _front_matter_end(text)  # no Markdown before this: front matter, an HTML block
    if skip_to:
        prev_next = _next_line(text, skip_to)
        if prev_next < n and not _BLANK_LINE.match(text, prev_next):
            edges.append(prev_next)

    lines = list(_block_lines(text))
    ahead: _Ahead | None = None
    starts: list[int] | None = None  # every line's start, for `_in_list_item`
    for i, (start, end, m) in enumerate(lines):
        if start < skip_to:
            continue
        kind = m.lastgroup
        if fence_start >= 0:
            if kind == "info" and opener is not None and _closes(opener, m):
                fences.append(Fence(fence_start, end, open_line, opener["marker"], True))
                fence_start = -1
                prev_next = _next_line(text, end)
                if prev_next < n and not _BLANK_LINE.match(text, prev_next):
                    edges.append(prev_next)
            continue
        if kind == "info":
            marker = m["marker"]
            if marker[0] == "`" and "`" in m["info"]:
                continue  # ```inline code``` on a line of its own, not a fence
            lead = _lead(m)
            # An indented code block's line, an item's line that only says ```, or an item's
            # fence indented under it, which the item's end closes (one left open under
            # `- run:` hid every heading after it).
            width = _width(lead)
            if width and not lead.strip() and starts is None:
                starts = _line_starts(text)  # (once, for the first indented fence line)
            if (
                lead.strip()
                or width > 3
                or (width and _in_list_item(text, starts, m.start("fence"), width))
            ) and not _closed_ahead(lines, i, ahead := ahead or _Ahead(lines)):
                continue
            fence_start, opener = start, m
            open_line = text[start:end]
            edges.append(start)
            prev_next = _next_line(text, end)
        elif kind == "html":  # literal HTML: text up to the line its end marker is on
            skip_to = _html_block_end(text, m["html"].lstrip(" "), start)
            prev_next = _next_line(text, skip_to)
        elif kind == "setext":  # a heading only if it directly follows paragraph text
            k = bisect_right(blank_ends, start) - 1
            para_start = max(blank_ends[k] if k >= 0 else 0, prev_next)
            dashes = text[start:end].lstrip()[0] == "-"
            if (
                prev_next != start
                and (k < 0 or blank_ends[k] != start)
                and start > para_start
                and (found := _setext_heading(text, para_start, start)) is not None
            ):
                heading_pos.append(found[0])
                heading_level.append(2 if dashes else 1)
                heading_title.append(found[1])
                prev_next = _next_line(text, end)
            elif dashes:  # no underline: a thematic break, which ends the paragraph above
                prev_next = _next_line(text, end)
        else:  # ATX heading (`kind` is "atx" or "title")
            heading_pos.append(start)
            heading_level.append(len(m["atx"].strip()))
            heading_title.append(_atx_title(m["title"] or ""))
            prev_next = _next_line(text, end)
    if fence_start >= 0 and opener is not None:
        fences.append(Fence(fence_start, n, open_line, opener["marker"], False))
    return Layout(
        heading_pos, heading_level, heading_title, _outside(blank_ends, edges, fences), fences
    )


# A list item's marker at a line's start: `-`, `*`, `+`, or up to 9 digits and `.` or `)`,
# and the blanks after it (its content starts past them).
_ITEM = re.compile(r"([ \t]*)([-*+]|\d{1,9}[.)])([ \t]+|$)")
# How far back `_in_list_item` looks for the item (lines): bounded, or text of many indented
# fence lines would be quadratic.
LOOK_BACK = 64
_LINE_END = re.compile(r"\r\n|\r|\n")


def _line_starts(text: str) -> list[int]:
    """Where every line of `text` starts (line ends as the scanner's: CR LF, CR, LF)."""
    return [0, *(m.end() for m in _LINE_END.finditer(text))]


def _in_list_item(text: str, starts: list[int], line_start: int, width: int) -> bool:
    """Whether the line at `line_start`, indented `width` columns (1 to 3), goes on a list
    item: going back over blank and indented lines (the item's text), a list item's marker
    comes before a line that is not indented, and the line is indented to the item's content
    (`- ` then 2 columns: a fence at 1 is not the item's). A top-level fence may be indented
    as much (its text is code whatever its indentation); an item's ends with the item."""
    k = bisect_right(starts, line_start) - 1
    for j in range(k - 1, max(k - 1 - LOOK_BACK, -1), -1):
        line = text[starts[j] : starts[j + 1]].rstrip("\r\n").expandtabs(4)
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent < width and (m := _ITEM.match(line)):
            content = len(m[1]) + len(m[2]) + (len(m[3]) if 0 < len(m[3]) <= 4 else 1)
            return width >= content
        if not indent:
            return False
    return False


def _lead(m: re.Match[str]) -> str:
    """What comes before a fence line's marker: indentation, list items' and quotes' markers."""
    return m.group("fence")[: -len(m["marker"])]


def _width(lead: str) -> int:
    return len(lead.expandtabs(4))


def _closes(opener: re.Match[str], m: re.Match[str]) -> bool:
    """Whether the fence line `m` closes the fence `opener` opened: its character, at least as
    long, no info string; no marker before it but the opening line's block quotes (a list
    marker starts an item: `1. ```` inside a block is its text); within 3 columns of the
    opening marker, or at most 3 when that one had neither markers nor 4 columns before it
    (CommonMark: 4 is an indented code line)."""
    marker, opened = m["marker"], opener["marker"]
    if marker[0] != opened[0] or len(marker) < len(opened) or m["info"].strip():
        return False
    lead, open_lead = _lead(m), _lead(opener)
    if "".join(lead.split()) != ">" * open_lead.count(">"):
        return False
    if open_lead.strip() or _width(open_lead) > 3:
        return abs(_width(lead) - _width(open_lead)) <= 3
    return _width(lead) <= 3


# Lines that look like a fence's close `_closed_ahead` tries, at most, for an indented fence.
LOOK_AHEAD = 16


class _Ahead:
    """Where `_closed_ahead` looks, found once for all of a text's block lines (made on the
    first fence line that needs it): for each line, the next line that may close a fence of
    each character (the marker alone, after nothing but indentation and quotes' markers), and
    the next heading (or underline, or HTML) indented less than 1, 2, 3 or 4+ columns."""

    def __init__(self, lines: list[tuple[int, int, re.Match[str]]]) -> None:
        n = len(lines)
        self.closer = {"`": [n] * n, "~": [n] * n}
        self.stop = [[n] * n for _ in range(5)]  # by the fence's column, 1 to 4 (4: 4 or more)
        for k in range(n - 2, -1, -1):
            m = lines[k + 1][2]
            for nxt in self.closer.values():
                nxt[k] = nxt[k + 1]
            for nxt in self.stop:
                nxt[k] = nxt[k + 1]
            if m.lastgroup == "info":
                if not m["info"].strip() and not _lead(m).replace(">", "").strip():
                    self.closer[m["marker"][0]][k] = k + 1
                continue
            line = m.group(0).lstrip("\r\n").expandtabs(4)
            for col in range(len(line) - len(line.lstrip()) + 1, 5):
                self.stop[col][k] = k + 1


def _closed_ahead(lines: list[tuple[int, int, re.Match[str]]], i: int, ahead: _Ahead) -> bool:
    """Whether the fence line `lines[i]`, one indented (a list item's fence, or an indented
    code block's text) or after a list item's or a quote's marker, has its
    closing line before the next line less indented that is not a fence (a heading: the item
    ended there). Else it opens nothing: a lone indented ``` line, as a text on Markdown shows
    one, or an item's line that only mentions ```, never hides every heading after it. Lines
    of the same character that cannot close it (an info string, a list marker: skipped by
    `_Ahead`; a shorter marker: a fence inside the fence) are passed over, at most
    `LOOK_AHEAD` of them: from each of many such lines, a search on to the text's end would
    be quadratic."""
    opener = lines[i][2]
    stop = ahead.stop[min(_width(_lead(opener)), 4)][i]
    closer = ahead.closer[opener["marker"][0]]
    k = closer[i]
    for _ in range(LOOK_AHEAD):
        if k >= stop:
            return False
        if _closes(opener, lines[k][2]):
            return True
        k = closer[k]
    return False


def _outside(blank_ends: list[int], edges: list[int], fences: list[Fence]) -> list[int]:
    """Paragraph breaks and fence edges, minus the blank lines inside fenced blocks."""
    if not fences:
        return blank_ends
    kept: list[int] = []
    i = 0
    for f in fences:
        j = bisect_right(blank_ends, f.start, i)
        kept.extend(blank_ends[i:j])
        i = bisect_left(blank_ends, f.end, j)
    kept.extend(blank_ends[i:])
    kept.extend(edges)
    kept.sort()
    return [p for k, p in enumerate(kept) if k == 0 or kept[k - 1] != p]


def section_ends(pos: list[int], level: list[int], n: int) -> list[int]:
    """Where each heading's section (with its subsections) ends."""
    ends = [n] * len(pos)
    stack: list[int] = []
    for i, lv in enumerate(level):
        while stack and level[stack[-1]] >= lv:
            ends[stack.pop()] = pos[i]
        stack.append(i)
    return ends


def heading_paths(lay: Layout) -> list[tuple[str, ...]]:
    """Each heading's path: the titles of the headings it sits under, and its own; at most
    `PATH_MAX` characters joined with " > " (`bounded_path`)."""
    paths: list[tuple[str, ...]] = []
    stack: list[tuple[int, str]] = []
    for lv, title in zip(lay.heading_level, lay.heading_title):
        while stack and stack[-1][0] >= lv:
            stack.pop()
        stack.append((lv, title))
        paths.append(bounded_path(tuple(t for _, t in stack if t)))
    return paths


def bounded_path(path: tuple[str, ...], limit: int = PATH_MAX) -> tuple[str, ...]:
    """`path` with its titles cut, the shallowest first, so that joined with " > " it takes at
    most `limit` characters: the deepest titles are the most specific. A title left no room
    becomes "…" (the path keeps its depth: at most six levels, always room for them)."""
    total = sum(map(len, path)) + 3 * max(0, len(path) - 1)
    if total <= limit:
        return path
    room = limit - 3 * (len(path) - 1)
    out: list[str] = []
    for i in reversed(range(len(path))):  # i: the titles above, each left at least "…"
        avail = room - i
        title = path[i]
        keep = title if len(title) <= avail else clip_title(title, avail) if avail >= 2 else "…"
        out.append(keep)
        room -= len(keep)
    return tuple(reversed(out))
