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

# Anchored on "\n" and a look-ahead at the next character rather than on "^" with re.M: the
# engine then skips ahead in C, which makes the scan about four times as fast (bench/chunking.py).
# Blank lines (most of the matches) are found by a second expression, without a Python loop.
_BLOCK_LINE = re.compile(
    r"\n(?=[ \t#`~=-])(?:(?P<fence>[ \t]*(?:`{3,}|~{3,}))(?P<info>[^\n]*)"
    r"|(?P<atx> {0,3}#{1,6})(?P<title>[ \t][^\n]*)?(?=\n|\Z)"
    r"|(?P<setext> {0,3}(?:=+|-+)[ \t]*\r?)(?=\n|\Z))"
)
_BLANK_RUN = re.compile(
    r"\n(?=[ \t\r\n])(?:[ \t]*\r?\n)+"
)  # its end is where the next paragraph starts
_BLANK_LINE = re.compile(r"[ \t]*\r?(?:\n|\Z)")
NOT_SETEXT = re.compile(r"[ \t]*(?:[-*+>|]|\d+[.)])(?:[ \t]|$)")  # list, quote, table


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


def _atx_title(raw: str) -> str:
    title = raw.strip()
    stripped = title.rstrip("#")
    if stripped != title and (not stripped or stripped[-1] in " \t"):
        title = stripped.rstrip()
    return title


def _block_lines(text: str) -> Iterator[tuple[int, int, re.Match[str]]]:
    """(line start, line end, match) of each heading, fence or underline line. The first line is
    matched with a "\n" put before it alone: a "\n" before the whole text would copy it (80 MB
    for a 20 MB note with one emoji in it, which Python then keeps in four bytes a character)."""
    first = text.find("\n")
    if m := _BLOCK_LINE.match("\n" + (text if first < 0 else text[:first])):
        yield 0, m.end() - 1, m
    for m in _BLOCK_LINE.finditer(text):
        yield m.start() + 1, m.end(), m  # the match starts at the "\n" before the line


def scan(text: str) -> Layout:
    """Headings, paragraph breaks and fenced blocks, outside fenced blocks."""
    n = len(text)
    blank_ends = [m.end() for m in _BLANK_RUN.finditer(text)]
    if blank_ends and blank_ends[-1] >= n:
        blank_ends.pop()
    heading_pos: list[int] = []
    heading_level: list[int] = []
    heading_title: list[str] = []
    edges: list[int] = []  # fence starts, and the line after each fence
    fences: list[Fence] = []
    fence_start = -1
    fence_char = ""
    fence_len = 0
    open_line = ""
    prev_end = -2  # end of the last heading or fence line

    for start, end, m in _block_lines(text):
        kind = m.lastgroup
        if fence_start >= 0:
            if kind == "info":
                marker = m.group("fence").lstrip(" \t")
                if marker[0] == fence_char and len(marker) >= fence_len and not m["info"].strip():
                    fences.append(Fence(fence_start, end, open_line, fence_char * fence_len, True))
                    fence_start = -1
                    prev_end = end
                    if end + 1 < n and not _BLANK_LINE.match(text, end + 1):
                        edges.append(end + 1)
            continue
        if kind == "info":
            marker = m.group("fence").lstrip(" \t")
            if marker[0] == "`" and "`" in m["info"]:
                continue  # ```inline code``` on a line of its own, not a fence
            fence_start, fence_char, fence_len = start, marker[0], len(marker)
            open_line = text[start:end].rstrip("\r")
            edges.append(start)
            prev_end = end
        elif kind == "setext":  # a heading only if it directly follows paragraph text
            k = bisect_right(blank_ends, start) - 1
            para_start = max(blank_ends[k] if k >= 0 else 0, prev_end + 1)
            if (
                prev_end != start - 1
                and (k < 0 or blank_ends[k] != start)
                and start > para_start
                and not NOT_SETEXT.match(text, para_start)
            ):
                heading_pos.append(para_start)
                heading_level.append(1 if text[start:end].lstrip()[0] == "=" else 2)
                heading_title.append(" ".join(text[para_start:start].split()))
                prev_end = end
        else:  # ATX heading (`kind` is "atx" or "title")
            heading_pos.append(start)
            heading_level.append(len(m["atx"].strip()))
            heading_title.append(_atx_title(m["title"] or ""))
            prev_end = end
    if fence_start >= 0:
        fences.append(Fence(fence_start, n, open_line, fence_char * fence_len, False))
    return Layout(
        heading_pos, heading_level, heading_title, _outside(blank_ends, edges, fences), fences
    )


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
    """Each heading's path: the titles of the headings it sits under, and its own."""
    paths: list[tuple[str, ...]] = []
    stack: list[tuple[int, str]] = []
    for lv, title in zip(lay.heading_level, lay.heading_title):
        while stack and stack[-1][0] >= lv:
            stack.pop()
        stack.append((lv, title))
        paths.append(tuple(t for _, t in stack if t))
    return paths
