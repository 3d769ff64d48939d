"""Code chunking: one chunk per definition, so that a hit names the function it is in.

Why it looks the way it does:

* Python is cut where `ast` says its top-level definitions are: a function or class with its
  decorators and the comment lines directly above it is one chunk, its name the chunk's symbol.
  Module-level statements between definitions (imports, constants) are grouped up to
  `TARGET_SIZE`; two definitions are never merged, so each chunk answers "which function".
* A definition over the maximum is split: a class by its members (header, then one chunk per
  method, `Class.method`), anything else by whole lines, preferring a blank line; a line is cut
  only when it alone exceeds the maximum, and then between words where it can.
* Other languages, and Python that does not parse, are cut before each line that starts at
  column 0 after a blank line (where top-level declarations start in almost every language),
  packed up to `TARGET_SIZE`.
* Every chunk is an exact slice `text[start:end]`; chunks never overlap (code is looked up by
  line, and a duplicated line would be a second hit) and only white space between them is
  dropped. Lines are counted by `\\n` only; Python containing `\\r` (which `ast` also counts as
  a line break) goes to the fallback, and `read_code` normalises line endings beforehand.
"""

from __future__ import annotations

import ast
import itertools
import re
import unicodedata
import warnings
import zlib
from bisect import bisect_right
from typing import NamedTuple

from worker.chunking.base import CONTEXT_CHARS, MAX_CHUNK_SIZE, clip

TARGET_SIZE = 1000
"""Small neighbouring pieces are packed up to this size (never past the maximum)."""

PYTHON_SUFFIXES = (".py", ".pyi")

_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_BLOCK_START = re.compile(r"\n[^\S\n]*\n(?=\S)")
_BLANK_LINE = re.compile(r"\n[^\S\n]*(?=\n)")
_NON_BLANK = re.compile(r"\S")

Span = tuple[int, int]


class CodeChunk(NamedTuple):
    """`text[start:end]`, lines `start_line`..`end_line` (1-based, inclusive), and the
    definition it belongs to (`f`, `Class`, `Class.method`), if any."""

    index: int
    start: int
    end: int
    start_line: int
    end_line: int
    content: str
    symbol: str | None = None

    def embedding_input(self, path: str, context: int = CONTEXT_CHARS) -> str:
        """Where the chunk is and what it defines, then the code: the path and the symbol are
        often what a question names (each cut to `context` characters)."""
        where = f"{clip(path, context, keep_end=True)}:{self.start_line}-{self.end_line}"
        if self.symbol:
            where += f" {clip(self.symbol, context)}"
        return f"{where}\n\n{self.content}"


class _Piece(NamedTuple):
    start: int
    end: int
    symbol: str | None
    mergeable: bool  # a module-level statement group, which may be packed with its neighbours


def _trim(text: str, s: int, e: int) -> Span:
    """Drop the white space at both ends, keeping the indentation of the first line."""
    kept = text[s:e].rstrip()
    if not kept:
        return s, s
    first = s + len(kept) - len(kept.lstrip())
    line_start = text.rfind("\n", s, first)
    return (s if line_start < 0 else line_start + 1), s + len(kept)


class _Blanks:
    """Where the rest of `text[s:e]` starts once `_trim` would have dropped its leading white
    space (its end is already trimmed); `e` when only white space is left. Not `_trim` itself:
    it copies the whole rest, once per cut, which made a long block quadratic. The next
    non-blank character and the last line end before it are found once per run of white
    space, for every cut inside it: a run of 2M spaces, cut every 1,500 characters, was
    searched to its end at each cut (5 s)."""

    def __init__(self, text: str, e: int) -> None:
        self.text, self.e = text, e
        self.lo = self.first = self.line_end = -1
        self.found = False

    def skip(self, s: int) -> int:
        if not self.lo <= s <= self.first:
            m = _NON_BLANK.search(self.text, s, self.e)
            self.lo, self.first, self.found = s, (m.start() if m else self.e), m is not None
            self.line_end = self.text.rfind("\n", s, self.first)
        if not self.found:
            return self.e
        return self.line_end + 1 if self.line_end >= s else s


def _glued(ch: str) -> bool:
    """Part of a word: a letter, a digit, `_` (what `\\w` matches), or a combining mark."""
    return ch.isalnum() or ch == "_" or unicodedata.category(ch)[0] == "M"


def _word_cut(text: str, lo: int, limit: int) -> int:
    """Where a line is cut hard before `limit`: there, unless that is inside a word, then
    after the last character of `text[lo:limit]` that is not part of one (a keyword search
    finds an identifier cut in two in neither chunk); `limit` when every one is."""
    if not (_glued(text[limit - 1]) and _glued(text[limit])):
        return limit
    for i in range(limit - 1, lo - 1, -1):
        if not _glued(text[i]):
            return i + 1
    return limit


def _split(text: str, s: int, e: int, max_size: int) -> list[Span]:
    """Whole lines packed up to `max_size`, cut at a blank line when one lies in the second half
    of the window; a line longer than `max_size` is cut hard, between words if it can."""
    parts: list[Span] = []
    s, e = _trim(text, s, e)
    blanks = _Blanks(text, e)
    while s < e:
        if e - s <= max_size:
            parts.append((s, e))
            break
        limit = s + max_size
        cut = -1
        for m in _BLANK_LINE.finditer(text, s + max_size // 2, limit):
            cut = m.start()
        if cut <= s:
            cut = text.rfind("\n", s + 1, limit + 1)
        if cut <= s:
            cut = _word_cut(text, s + max_size // 2, limit)
        a, b = _trim(text, s, cut)
        if a < b:
            parts.append((a, b))
        s = blanks.skip(cut)
    return parts


def _pieces(
    text: str, s: int, e: int, symbol: str | None, max_size: int, merge: bool
) -> list[_Piece]:
    """The span as one piece, or split by lines when it is too long; nothing if it is blank."""
    s, e = _trim(text, s, e)
    spans = [(s, e)] if e - s <= max_size else _split(text, s, e, max_size)
    return [_Piece(a, b, symbol, merge) for a, b in spans if a < b]


# One mergeable piece in this many, chosen by its text, starts a chunk of its own (`_pack`):
# on a Go file of 300 small functions, 15 % more chunks, and 1.5 embedded again after a
# function added at the top where 14 were (23 to 51 of 51 for some files).
ANCHOR_EVERY = 16


def _anchor(text: str, p: _Piece) -> bool:
    """Whether `p` starts a chunk whatever came before it: by its own text (crc32), as a
    content-defined chunker chooses its cuts."""
    return zlib.crc32(text[p.start : p.end].encode("utf-8", "surrogatepass")) % ANCHOR_EVERY == 0


def _pack(text: str, pieces: list[_Piece], target: int) -> list[_Piece]:
    """Merge neighbouring mergeable pieces while the union stays within `target`, but never
    into an anchor (`_anchor`). Packed greedily from the top alone, one function added near
    the start of a Go file shifted every later group: 51 of 51 chunks embedded again (the
    LESSONS trap); the anchors bring the groups back in step within a few pieces."""
    out: list[_Piece] = []
    for p in pieces:
        last = out[-1] if out else None
        if (
            last
            and last.mergeable
            and p.mergeable
            and p.end - last.start <= target
            and not _anchor(text, p)
        ):
            out[-1] = last._replace(end=p.end)
        else:
            out.append(p)
    return out


class _Python:
    """Pieces of a module that `ast` parsed: definitions whole or split, statements between."""

    def __init__(self, text: str, max_size: int):
        self.text = text
        self.max_size = max_size
        self.starts = [0, *(m.end() for m in re.finditer("\n", text))]

    def offset(self, line: int) -> int:
        """Offset of the start of a 1-based line; one past the last line is the text's end."""
        return self.starts[line - 1] if line <= len(self.starts) else len(self.text)

    def span(self, first: int, last: int, symbol: str | None, merge: bool) -> list[_Piece]:
        if first > last:
            return []
        return _pieces(
            self.text, self.offset(first), self.offset(last + 1), symbol, self.max_size, merge
        )

    def line(self, n: int) -> str:
        return self.text[self.offset(n) : self.offset(n + 1)]

    def first_line(self, node: ast.stmt, floor: int) -> int:
        """A definition starts at its first decorator, or at the comment lines right above; when
        only comments lie between it and the previous statement (a section comment such as
        `# -- parsing --`), at those: alone they would be a chunk of their own."""
        first = node.lineno
        if isinstance(node, _DEFS):
            first = min([first, *(d.lineno for d in node.decorator_list)])
            while first - 1 >= floor and self.line(first - 1).lstrip().startswith("#"):
                first -= 1
            gap = (self.line(n).lstrip() for n in range(floor, first))
            if all(not g or g.startswith("#") for g in gap):
                first = floor
        return max(first, floor)

    def module(self, tree: ast.Module) -> list[_Piece]:
        pieces: list[_Piece] = []
        cursor = 1  # the first line no piece has taken yet
        for node in tree.body:
            first, last = self.first_line(node, cursor), min(node.end_lineno or 0, len(self.starts))
            if last < first:  # on a line a previous statement already took (`a = 1; b = 2`)
                continue
            pieces += self.span(cursor, first - 1, None, True)
            if isinstance(node, _DEFS):
                pieces += self.definition(node, first, last)
            else:
                pieces += self.span(first, last, None, True)
            cursor = last + 1
        pieces += self.span(cursor, len(self.starts), None, True)
        return pieces

    def definition(
        self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef, first: int, last: int
    ) -> list[_Piece]:
        """The definition whole; a class over the maximum by members; else split by lines."""
        s, e = _trim(self.text, self.offset(first), self.offset(last + 1))
        members = [m for m in node.body if isinstance(m, _DEFS)]
        if e - s <= self.max_size or not isinstance(node, ast.ClassDef) or not members:
            return self.span(first, last, node.name, False)
        pieces: list[_Piece] = []
        cursor = first  # the first line of the class no piece has taken yet
        taken = node.lineno  # the last line of the class body's statements so far
        for m in node.body:
            m_last = min(m.end_lineno or 0, last)
            if isinstance(m, _DEFS):
                m_first = self.first_line(m, max(cursor, taken + 1))
                pieces += self.span(cursor, m_first - 1, node.name, False)
                pieces += self.span(m_first, m_last, f"{node.name}.{m.name}", False)
                cursor = max(cursor, m_last + 1)
            taken = max(taken, m_last)
        pieces += self.span(cursor, last, node.name, False)
        return pieces


# Python's tree of a module takes some 400 times its text (8 MB of `x = 1` lines: 3.4 GB, and
# the code files' limit is 50 MB); a longer module is cut as other code is, by blocks.
_PARSE_MAX = 500_000


def _parse(text: str) -> ast.Module | None:
    if "\r" in text or len(text) > _PARSE_MAX:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # invalid escape sequences and the like
            return ast.parse(text)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _fallback(text: str, max_size: int) -> list[_Piece]:
    """Blocks starting at column 0 after a blank line, each split by lines if too long."""
    bounds = [0, *(m.end() for m in _BLOCK_START.finditer(text)), len(text)]
    pieces: list[_Piece] = []
    for a, b in itertools.pairwise(bounds):
        pieces += _pieces(text, a, b, None, max_size, True)
    return pieces


def chunk_code(text: str, path: str, *, max_size: int = MAX_CHUNK_SIZE) -> list[CodeChunk]:
    """Split source code into chunks of at most `max_size` characters (see the module
    docstring); `path` picks the language by its suffix."""
    if max_size < 1:
        raise ValueError("max_size must be positive")
    if not text.strip():
        return []
    tree = _parse(text) if path.lower().endswith(PYTHON_SUFFIXES) else None
    pieces = _fallback(text, max_size) if tree is None else _Python(text, max_size).module(tree)
    pieces = _pack(text, pieces, min(TARGET_SIZE, max_size))
    starts = [0, *(m.end() for m in re.finditer("\n", text))]
    return [
        CodeChunk(
            i,
            p.start,
            p.end,
            bisect_right(starts, p.start),
            bisect_right(starts, p.end - 1),
            text[p.start : p.end],
            p.symbol,
        )
        for i, p in enumerate(pieces)
    ]
