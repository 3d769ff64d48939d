"""Structural chunking: headings first, then paragraphs, sentences, lines, words, characters.

Why it looks the way it does:

* Every chunk is an exact slice `text[start:end]` (a splitter that drops the white space it
  matched glues words together). Offsets are the truth, content is derived from them.
* Boundaries are chosen by content, not by position, so that an edit moves only the chunks around
  it (greedy packing re-cuts everything after an insertion). A candidate boundary is a heading, a
  paragraph break or the edge of a fenced block; each has a strength derived from the text at that
  point (headings beat paragraphs, shallower headings beat deeper ones, ties by a hash of the text).
  A candidate becomes a cut when it is the strongest within `window` characters on either side: a
  property of the text near it only. A section that fits into the target size is never cut
  inside.
* The chunker aims at a target size (`TARGET_CHUNK_SIZE`), below the maximum: small chunks
  retrieve better (bench/retrieval.py: a large chunk carries passages that do not answer the
  question, and its one vector matches none of them well). The window scales with the target.
* A region between two cuts that is longer than the target is split into parts of about the
  target, each at the strongest candidate near where an even split would put it, else at the
  nearest sentence end, line end or space, else anywhere within bounds, or (last resort) hard.
  Nothing is ever longer than `max_size`.
* Parts of an oversized section overlap: each part ends with up to `overlap` characters (whole
  words) of the next one. The overlap is taken from the *start* of the next part, so appending to a
  paragraph at the end of a part does not change its neighbour.
* Headings and fences are recognised outside fenced code only (`# comment` in a shell block is not
  a section). A fenced block is split only when it alone exceeds the maximum; its parts are
  re-fenced in the text given to the embedder (`Chunk.fence_open` / `fence_close`).

* Given the previous version's chunks, their cuts are kept wherever the text around them is
  unchanged and the bounds still hold: only the chunks the edit touched are cut anew. Without
  this, an inserted paragraph becomes a cut of its own about one time in five (a fresh candidate
  beating its neighbours), and re-cuts two chunks instead of one (bench/chunking.py measures
  both).

The scanner (`worker/chunking/markdown.py`) is one regular expression over the whole text, so
the per-line work happens in C.
"""

from __future__ import annotations

import itertools
import math
import re
import unicodedata
import zlib
from bisect import bisect_left, bisect_right
from collections.abc import Collection, Sequence

from worker.chunking.base import (
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    OVERLAP_SIZE,
    TARGET_CHUNK_SIZE,
    Chunk,
    ChunkMethod,
)
from worker.chunking.markdown import Fence, heading_paths, scan, section_ends

WINDOW_SHARE = 1 / 5
"""A paragraph break becomes a cut only if no stronger candidate lies within this share of the
target on either side (the window was 500 for chunks of up to 1500 before there was a target).
A third of the target left long regions that are split by position, so one inserted paragraph
moved six chunks of a Rust book chapter (tests/test_chunking_structure.py); a fifth moves two,
and retrieves as well (bench/retrieval.py, target 700: 75.7 / 6.27 against 76.2 / 6.15)."""
SLACK_SHARE = 1 / 3
"""A region over the target is cut at the strongest candidate within this share of the target
of where an even split would cut: paragraph breaks first, sizes near the target second."""

_FENCE_START = re.compile(r"[ \t]*(?:`{3}|~{3})")
# Lines end at "\r\n", "\r" or "\n", as for the scanner: "^" with re.M knows only "\n". The
# look-behind makes the search try every position (a third slower on the Rust book), so text
# without a "\r" is searched with "^" alone.
_FENCE_LIKE_LINE = re.compile(r"(?:^|(?<=\r))[ \t]*(?:`{3}|~{3})[^\r\n]*", re.M)
_FENCE_LIKE_LINE_LF = re.compile(r"^[ \t]*(?:`{3}|~{3})[^\n]*", re.M)
# A sentence ends at [.!?] and white space, or at a CJK full stop, exclamation or question mark
# (also fullwidth), which takes no space after it: Chinese and Japanese prose was cut
# mid-sentence at a character count.
SENTENCE_END = re.compile(r"[.!?][\"')\]*_`]*\s+|[。！？．][」』）】〕〉》\"')\]*_`]*\s*")
_CJK_PAUSE = "。！？．、，；"  # where an overlap may start in text without spaces
_LINE_END = re.compile(r"\r\n?|\n")
_SPACE = re.compile(r"\s+")
_FENCE_OR_HEADING_LINE = re.compile(
    r"(?:^|(?<=\r))(?:[ \t]*(?:`{3,}|~{3,})| {0,3}#{1,6}(?:[ \t\r]|$))", re.M
)
_FENCE_OR_HEADING_LINE_LF = re.compile(r"^(?:[ \t]*(?:`{3,}|~{3,})| {0,3}#{1,6}(?:[ \t]|$))", re.M)
_STRONG_BLOCK = re.compile(r"[ \t]*(?:`{3}|~{3}|<|\||>|[-*+][ \t]|\d+[.)][ \t])")
_STRONG_FIRST = frozenset(" \t`~<|>-*+0123456789")
_HEADING = 10.0  # strength of a heading candidate is above this; paragraph breaks are in [0, 1)


def _joins_previous(ch: str) -> bool:
    """A character that belongs to the grapheme before it: a combining mark (Mn, Mc, Me), a zero
    width joiner, a variation selector, an emoji skin tone or a tag character."""
    if ch < "\u0300":
        return False
    return (
        unicodedata.category(ch) in ("Mn", "Mc", "Me")
        or ch == "\u200d"
        or "\ufe00" <= ch <= "\ufe0f"
        or "\U0001f3fb" <= ch <= "\U0001f3ff"
        or "\U000e0020" <= ch <= "\U000e007f"
        or "\U000e0100" <= ch <= "\U000e01ef"
    )


# How far back a cut inside a run of regional indicators counts them to find the flags'
# pairs: to the run's start, every cut into a text of flags alone cost the run's length (1 MB
# of them took 338 s to chunk at target 200). Past this, the pairs are counted from here (an
# even number): a run of more than 32 flags may be cut inside one.
FLAG_RUN_MAX = 64


def _jamo(ch: str) -> str:
    """A Hangul character's part in a syllable (UAX #29): L leading, V vowel, T trailing, S a
    precomposed syllable, "" none."""
    if "\u1100" <= ch <= "\u115f" or "\ua960" <= ch <= "\ua97f":
        return "L"
    if "\u1160" <= ch <= "\u11a7" or "\ud7b0" <= ch <= "\ud7c6":
        return "V"
    if "\u11a8" <= ch <= "\u11ff" or "\ud7cb" <= ch <= "\ud7fb":
        return "T"
    return "S" if "\uac00" <= ch <= "\ud7a3" else ""


def _one_syllable(prev: str, ch: str) -> bool:
    """Whether `prev` and `ch` are parts of one Hangul syllable written as conjoining jamo
    (text in NFD): a leading consonant before another part, a vowel or trailing consonant
    after a part (loosely: a cut there is never made, one that would be allowed is rare)."""
    if ch < "\u1100" or prev < "\u1100":
        return False
    before, part = _jamo(prev), _jamo(ch)
    return bool(before) and ((before == "L" and part in ("L", "V", "S")) or part in ("V", "T"))


def grapheme_safe(text: str, p: int) -> bool:
    """Whether a cut at `p` leaves every user-perceived character whole: not before a mark that
    joins the character before it, not after a zero width joiner, not inside a "\r\n", not
    between the two regional indicators of a flag."""
    if p <= 0 or p >= len(text):
        return True
    ch, prev = text[p], text[p - 1]
    if prev < "\u0300" and ch < "\u0300":
        return not (prev == "\r" and ch == "\n")
    if prev == "\u200d" or _joins_previous(ch) or _one_syllable(prev, ch):
        return False
    if "\U0001f1e6" <= ch <= "\U0001f1ff" and "\U0001f1e6" <= prev <= "\U0001f1ff":
        k = p  # a flag is a pair: count the indicators before `p`, at most FLAG_RUN_MAX
        stop = max(0, p - FLAG_RUN_MAX)
        while k > stop and "\U0001f1e6" <= text[k - 1] <= "\U0001f1ff":
            k -= 1
        return (p - k) % 2 == 0
    return True


def safe_cut(text: str, p: int, lo: int) -> int:
    """`p`, or the nearest position before it and after `lo` where a cut leaves every grapheme
    whole (`p` itself when there is none: a run of marks longer than a part)."""
    q = p
    while q > lo and not grapheme_safe(text, q):
        q -= 1
    return q if q > lo else p


def _hash01(text: str) -> float:
    """A hash of `text` in [0, 1), stable across processes (unlike `hash()`)."""
    return zlib.crc32(text.encode("utf-8", "surrogatepass")) / 4294967296.0


def _break_strengths(text: str, breaks: list[int]) -> dict[int, float]:
    """A break before a code block, list, table, quote or HTML block beats one between two
    prose paragraphs: an inserted prose paragraph then rarely becomes a cut of its own. The
    hash is of the text after the break, so appending to the paragraph before it changes
    nothing. (One comprehension: this runs for every paragraph of every text.)"""
    crc, strong, scale = zlib.crc32, _STRONG_BLOCK.match, 0.5 / 4294967296.0
    try:
        return {
            p: crc(text[p : p + 48].encode()) * scale
            + (0.5 if text[p] in _STRONG_FIRST and strong(text, p) else 0.0)
            for p in breaks
        }
    except UnicodeEncodeError:  # a lone surrogate somewhere: the slower, lenient encoding
        return {
            p: crc(text[p : p + 48].encode("utf-8", "surrogatepass")) * scale
            + (0.5 if text[p] in _STRONG_FIRST and strong(text, p) else 0.0)
            for p in breaks
        }


def _fence_like_lines(text: str) -> tuple[list[int], list[int]]:
    """Start and end (the `\n` or the text's end) of every line that opens like a fence."""
    starts: list[int] = []
    ends: list[int] = []
    for m in (_FENCE_LIKE_LINE if "\r" in text else _FENCE_LIKE_LINE_LF).finditer(text):
        starts.append(m.start())
        ends.append(m.end())
    return starts, ends


class _Plan:
    """Candidates, cuts and parts for one text."""

    def __init__(
        self, text: str, max_size: int, min_size: int, overlap: int, window: int, target: int
    ):
        self.text = text
        self.max_size = max_size
        self.target = target
        self.min_size = min_size
        self.overlap = overlap
        self.window = window
        self.layout = lay = scan(text)
        self.first = len(text) - len(text.lstrip())
        self.last = len(text.rstrip())
        self.heading_set = set(lay.heading_pos)
        # Every candidate position with its strength, ascending by position.
        strength = _break_strengths(text, lay.breaks)
        for p, level, title in zip(lay.heading_pos, lay.heading_level, lay.heading_title):
            strength[p] = _HEADING + (7 - level) + _hash01(title) * 0.5
        pos = sorted(strength)
        self.cand_pos = pos[bisect_right(pos, self.first) : bisect_left(pos, self.last)]
        self.cand_strength = [strength[p] for p in self.cand_pos]
        big = max_size  # (a part holding a smaller one gives up its overlap: overlap_end)
        self.big_fences = [f for f in lay.fences if f.end - f.start > big]
        self.small_fences = [(f.start, f.end) for f in lay.fences if f.end - f.start <= big]
        self.fence_starts = [f.start for f in lay.fences]
        self.fitting = self._fitting_sections()
        self._fence_lines: tuple[list[int], list[int]] | None = None

    # -- cuts -------------------------------------------------------------------------------

    def _fitting_sections(self) -> list[tuple[int, int]]:
        """Outermost spans (sections, and the text before the first heading) that fit whole
        into the target: measured as their chunk would be, without the white space at their
        ends (a section of exactly the target followed by a blank line was cut)."""
        lay, limit = self.layout, self.target

        def size(a: int, c: int) -> int:
            a, c = self._trim(a, c)
            return c - a

        spans: list[tuple[int, int]] = []
        if lay.heading_pos and size(self.first, lay.heading_pos[0]) <= limit:
            spans.append((self.first, lay.heading_pos[0]))
        ends = section_ends(lay.heading_pos, lay.heading_level, len(self.text))
        covered = -1
        for pos, end in zip(lay.heading_pos, ends):
            if pos >= covered and size(pos, end) <= limit:
                spans.append((pos, end))
                covered = end
        return spans

    def cuts(self) -> list[int]:
        """Candidates that are the strongest within `window` on both sides, outside fitting
        sections; the text's own start and end count as infinitely strong."""
        pos, strength = self.cand_pos, self.cand_strength
        allowed = [True] * len(pos)
        for s, e in self.fitting:
            for i in range(bisect_right(pos, s), bisect_left(pos, e)):
                allowed[i] = False
        live = [i for i in range(len(pos)) if allowed[i]]
        w, lo_edge, hi_edge = self.window, self.first + self.window, self.last - self.window
        result: list[int] = []
        for k, i in enumerate(live):
            p, s = pos[i], strength[i]
            if p < lo_edge or p > hi_edge:
                continue
            j = k - 1
            ok = True
            while j >= 0 and pos[live[j]] >= p - w:
                if strength[live[j]] >= s:
                    ok = False
                    break
                j -= 1
            if ok:
                j = k + 1
                while j < len(live) and pos[live[j]] <= p + w:
                    if strength[live[j]] > s:
                        ok = False
                        break
                    j += 1
            if ok:
                result.append(p)
        return result

    def keep_previous(
        self,
        previous: Sequence[tuple[int, str]],
        cuts: list[int],
        headings: set[int],
        fresh: Collection[int] = (),
    ) -> tuple[list[int], set[int]]:
        """The previous version's cuts, where they can still be found, plus `headings` (the
        cuts at a heading that the text makes on its own), and the others only where a region
        between them has grown past the maximum; and the cuts kept. `fresh`: where the text's
        own parts start (a previous cut closer than the minimum to the one before is kept
        only there).

        `previous` is the old chunks as (start offset, content). Each old chunk's start is looked
        up by its first characters, at the occurrence nearest to where the shift so far puts it
        (openings such as a code fence's repeat); it is kept unless it now falls inside a fenced
        block that stays whole.
        """
        text, tol = self.text, 4 * self.max_size
        fresh = set(fresh)
        kept: list[int] = []
        shift, last = 0, self.first
        for old_start, content in previous[1:]:
            probe = content[:96]
            expected = old_start + shift
            if len(probe.strip()) < 8:  # too short to search for: only exactly where expected
                if expected <= last or not text.startswith(probe, expected):
                    continue
                p = expected
            else:
                lo = max(last + 1, expected - tol)
                after = text.find(probe, max(lo, expected), expected + tol + len(probe))
                before = text.rfind(probe, lo, expected + len(probe) - 1)
                found = [q for q in (after, before) if q >= 0]
                if not found:
                    continue
                p = min(found, key=lambda q: abs(q - expected))
            cut = self._cut_before(p, last)
            if cut is None:
                continue
            if cut - (kept[-1] if kept else self.first) < self.min_size and cut not in fresh:
                # closer than the minimum to the one before, and not a cut the text makes on
                # its own: a host's rows of 2-character chunks stayed 2 characters for good
                continue
            kept.append(cut)
            shift, last = p - old_start, p
        if not kept:
            return cuts, set()
        # A heading is always a cut where the text as it is now makes one: an edit under a
        # heading (its chunk's opening no longer found) or a heading added or renamed left a
        # kept region running across it, under the heading path of the one before. Only where
        # the text makes one on its own: a small last section merged across its heading there
        # was cut at it here, and an unchanged text changed its chunks.
        result = set(kept) | headings
        bounds = [self.first, *sorted(result), self.last]
        for a, c in itertools.pairwise(bounds):
            s, e = self._trim(a, c)
            # Re-cut only past the maximum itself: a kept region that grew into the room kept
            # for its overlap gives up overlap instead (overlap_end never passes the maximum),
            # so an edit that lengthens a chunk near the maximum makes one new chunk, not two.
            if e - s > self.max_size:
                lo, hi = a + self.min_size, c - self.min_size
                result.update(x for x in cuts if lo <= x <= hi)
        return sorted(result), set(kept)

    # -- parts ------------------------------------------------------------------------------

    def _trim(self, a: int, c: int) -> tuple[int, int]:
        text = self.text  # character loops: the white space at a boundary is a few characters
        while a < c and text[a].isspace():
            a += 1
        while c > a and text[c - 1].isspace():
            c -= 1
        return a, c

    def _limit(self, c: int) -> int:
        """A part that will carry an overlap into the next one must leave room for it; one the
        text's end or a heading follows (after the white space a part is trimmed of) carries
        none (`overlap_end`). Looked at from the trimmed end alone, a section of 1,401 to 1,500
        characters before a heading was taken for too long, and its part was hard-cut inside
        a heading line of the section it held."""
        text, nxt = self.text, c
        while nxt < self.last and text[nxt].isspace():
            nxt += 1
        if nxt >= self.last or nxt in self.heading_set:
            return self.max_size
        return self.max_size - self.overlap

    def _cut_before(self, p: int, floor: int) -> int | None:
        """Where to cut for a chunk found to start at `p`, or None if nowhere: a chunk's
        stored start is past the white space before it, and the cut that made it was in that
        white space (the strongest cuttable candidate there, else `p`). Cut at `p` itself, an
        indented fence (a code block in a list item) split its fence-like line, and the cut
        was lost at every run of the unchanged text. Not back past `floor` (the start found
        before): a host's rows of blank chunks in one long blank run each walked all of it."""
        text, start = self.text, p
        while start > floor + 1 and text[start - 1].isspace():
            start -= 1
        pos = self.cand_pos
        lo, hi = bisect_left(pos, start), bisect_right(pos, p)
        best = None
        for i in range(lo, hi):
            x = pos[i]
            if self._cuttable(x) and (best is None or self.cand_strength[i] >= best[0]):
                best = (self.cand_strength[i], x)
        cut = best[1] if best is not None else p
        if not self.first < cut < self.last or (best is None and not self._cuttable(cut)):
            return None
        return cut

    def _cuttable(self, p: int) -> bool:
        """Not inside a fenced block that stays whole, and, inside a line, not where either
        half would look like a fence's opening on its own."""
        if self._inside_small_fence(p):
            return False
        return self.text[p - 1] in "\r\n" or not self._splits_a_fence_like_line(p)

    def _splits_a_fence_like_line(self, p: int) -> bool:
        """A cut inside a line must not leave either half looking like a fence's opening.

        The lines that open like a fence are found once (`_fence_like_lines`) and looked up by
        bisection: searching back from every candidate for its line's start went to the start
        of the text on text without line ends, quadratic in its length (5 MB of sentences took
        half a minute). Line ends are those of the scanner: `\r\n`, `\r` and `\n`.
        """
        if self._fence_lines is None:
            self._fence_lines = _fence_like_lines(self.text)
        starts, ends = self._fence_lines
        k = bisect_right(starts, p) - 1
        return (k >= 0 and p <= ends[k]) or bool(_FENCE_START.match(self.text, p))

    def _inside_small_fence(self, p: int) -> bool:
        fences = self.small_fences
        k = bisect_right(fences, (p, math.inf)) - 1
        return k >= 0 and fences[k][0] < p < fences[k][1]

    def _inside_fitting(self, p: int) -> bool:
        """Inside a section that fits into the target: a region split around it leaves it
        whole (its own start or end is always a cut within bounds)."""
        spans = self.fitting
        k = bisect_right(spans, (p, math.inf)) - 1
        return k >= 0 and spans[k][0] < p < spans[k][1]

    def _pick_in(self, lo: int, hi: int, ideal: int) -> int:
        """The strongest candidate in [lo, hi]; else the sentence end, line end or space nearest
        to `ideal` that is not inside a fenced block small enough to stay whole; never inside
        a section that fits into the target, nor inside a grapheme; else -1."""
        pos, strength = self.cand_pos, self.cand_strength
        i, j = bisect_left(pos, lo), bisect_right(pos, hi)
        inside = self._inside_fitting
        live = [k for k in range(i, j) if not inside(pos[k])] if self.fitting else range(i, j)
        if live:
            return pos[max(live, key=strength.__getitem__)]
        text = self.text
        for pattern in (SENTENCE_END, _LINE_END, _SPACE):
            best = -1
            for m in pattern.finditer(text, lo, hi):
                p = m.end()
                closer = best < 0 or abs(p - ideal) < abs(best - ideal)
                if (
                    p <= hi
                    and closer
                    and self._cuttable(p)
                    and not inside(p)
                    and grapheme_safe(text, p)
                ):
                    best = p
            if best >= 0:
                return best
        return -1

    def _pick(self, a: int, c: int) -> int:
        """Where the first part of the region [a, c), longer than the target, ends: near where
        an even split into parts of at most the target would cut, else anywhere within
        bounds."""
        limit = self.max_size - self.overlap
        size = min(self.target, limit)
        # Parts of at most the target, but no more parts than the minimum size allows, and
        # never fewer than the maximum needs.
        n = c - a
        count = max(math.ceil(n / limit), min(math.ceil(n / size), n // max(1, self.min_size)))
        ideal = a + (c - a) // count
        lo = max(a + self.min_size, c - (count - 1) * limit)
        hi = min(a + limit, c - self.min_size)
        ranges = [(lo, hi), (a + 1, min(a + limit, c - 1))]
        if size < limit:  # at the maximum itself, any cut within bounds (as before targets)
            slack = max(1, int(size * SLACK_SHARE))
            ranges.insert(0, (max(lo, ideal - slack), min(hi, ideal + slack)))
        for lo_, hi_ in ranges:
            if lo_ <= hi_:
                p = self._pick_in(lo_, hi_, ideal)
                if p > a:
                    return p
        # A heading: a part that ends at one keeps no room for an overlap, so it may reach the
        # maximum itself (every other position in reach was inside a section that fits, and a
        # hard cut would go through it).
        heads = self.layout.heading_pos
        reach = [
            h
            for h in heads[bisect_right(heads, a) : bisect_left(heads, c)]
            if self._trim(a, h)[1] - a <= self.max_size and not self._inside_fitting(h)
        ]
        if reach:
            return min(reach, key=lambda h: abs(h - ideal))
        # No boundary at all (one enormous word): a hard cut, moved back to where it leaves
        # every grapheme whole (Thai marks, emoji sequences), and out of a small fence.
        p = safe_cut(self.text, min(max(ideal, a + 1), a + limit), a)
        fences = self.small_fences
        k = bisect_right(fences, (p, math.inf)) - 1
        if k >= 0 and fences[k][0] < p < fences[k][1]:
            fs, fe = fences[k]
            p = fs if fs > a else fe
        return p

    def split(self, a: int, c: int, *, kept: bool = False) -> list[tuple[int, int]]:
        """Split the region [a, c) into parts within bounds. `kept`: a region between two cuts
        of the previous version stays whole up to the maximum itself (its overlap shrinks)."""
        parts: list[tuple[int, int]] = []
        a, c = self._trim(a, c)
        if kept and c - a <= self.max_size:
            return [(a, c)] if a < c else []
        while a < c:
            n = c - a  # whole when within the target, or too short for two parts of the minimum
            if n <= self._limit(c) and (n <= self.target or n < 2 * self.min_size):
                parts.append((a, c))
                break
            p = self._pick(a, c)
            left = self._trim(a, p)
            if left[0] < left[1]:
                parts.append(left)
            a, c = self._trim(p, c)
        return parts

    def merge_small(
        self,
        parts: list[tuple[int, int]],
        kept: Collection[int] = (),
    ) -> list[tuple[int, int]]:
        """Merge parts under the minimum into a neighbour, when the union stays within bounds
        and does not cross a cut kept from the previous version: that version made its parts
        with the same rule, so a part it left small stays so (merging across a kept cut here
        would cut an unchanged text differently from the first time)."""
        out = list(parts)
        marks = sorted(kept)  # (bisected: a scan of every kept cut for each small part was
        # quadratic, 17 s for a host's 20,000 previous rows)

        def crosses(left: tuple[int, int], right: tuple[int, int]) -> bool:
            k = bisect_left(marks, left[1])
            return k < len(marks) and marks[k] <= right[0]

        i = 0
        while i < len(out) and len(out) > 1:
            s, e = out[i]
            if e - s >= self.min_size:
                i += 1
                continue
            options = []
            if i > 0:
                ps = out[i - 1][0]
                if e - ps <= self._limit(e) and not crosses(out[i - 1], out[i]):
                    options.append((e - ps, i - 1))
            if i + 1 < len(out):
                ne = out[i + 1][1]
                if (
                    ne - s <= self._limit(ne)
                    and not crosses(out[i], out[i + 1])
                    and not self._starts_a_sibling(out[i + 1][0], s)
                ):
                    options.append((ne - s, i))
            if not options:
                i += 1
                continue
            _, k = min(options)
            out[k : k + 2] = [(out[k][0], out[k + 1][1])]
            i = max(k, 0)
        return out

    def _starts_a_sibling(self, p: int, s: int) -> bool:
        """Whether `p` is a heading at the level of the section `s` is in, or above it: a part
        merged forward across it would carry that section's path over the next one's text (a
        small `## Notes` took all of `# Uninstall`, which no chunk's path then named)."""
        if p not in self.heading_set:
            return False
        pos, level = self.layout.heading_pos, self.layout.heading_level
        here = bisect_right(pos, s) - 1
        return here >= 0 and level[bisect_left(pos, p)] <= level[here]

    def overlap_end(self, part: tuple[int, int], nxt: tuple[int, int]) -> int:
        """End of a part extended by up to `overlap` characters of whole words of the next part,
        never into a fence line or a heading, never past the maximum size."""
        s, end = part
        if nxt[0] in self.heading_set or self.overlap <= 0:
            return end
        start = nxt[0]
        stop = min(start + self.overlap, nxt[1], s + self.max_size)
        piece = self.text[start:stop]
        if "`" in piece or "~" in piece or "#" in piece:
            lines = _FENCE_OR_HEADING_LINE if "\r" in piece else _FENCE_OR_HEADING_LINE_LF
            m = lines.search(piece)
            if m:
                piece = piece[: m.start()]
            # and a fence after a list item's or a quote's marker (the scanner's): its first
            # lines copied alone were a fence opened and never closed
            k = bisect_left(self.fence_starts, start)
            if k < len(self.fence_starts) and self.fence_starts[k] < start + len(piece):
                piece = piece[: self.fence_starts[k] - start]
        if start + len(piece) < nxt[1] and piece:
            if any(f.start < start < f.end for f in self.big_fences):
                cut = max(piece.rfind("\n"), piece.rfind("\r"))  # inside code: whole lines
            else:
                cut = max(piece.rfind(" "), piece.rfind("\n"), piece.rfind("\r"), piece.rfind("\t"))
                if cut <= 0:  # text without spaces (CJK): whole sentences or clauses
                    cut = max(map(piece.rfind, _CJK_PAUSE)) + 1
                    while 0 < cut < len(piece) and not grapheme_safe(self.text, start + cut):
                        cut += 1  # a closing bracket or a mark after the stop
            piece = piece[:cut] if cut > 0 else ""
        piece = piece.rstrip()
        return start + len(piece) if piece else end

    def fence_context(self, s: int, e: int) -> tuple[str | None, str | None]:
        """The opening line and closing marker a part of an oversized fence needs."""
        return fence_context(self.text, self.big_fences, s, e)


def fence_context(
    text: str, big_fences: Sequence[Fence], s: int, e: int
) -> tuple[str | None, str | None]:
    """The opening line and closing marker the part `[s, e)` needs to read as code: set when it
    starts (ends) inside one of `big_fences`, the blocks cut because they alone exceed the
    maximum. Shared with the LLM chunker, whose chunks cut the same blocks. A part starts at a
    non-space character, so one that starts at an indented opening line, or ends at a closing
    line with spaces after its marker, is not inside (it has its own: no second one)."""
    fence_open = fence_close = None
    for f in big_fences:
        indent = len(f.open_line) - len(f.open_line.lstrip())
        if f.start + indent < s < f.end:
            fence_open = f.open_line
        last = f.end
        while last > f.start and text[last - 1].isspace():  # after the closing marker
            last -= 1
        if f.start < e < last or (not f.closed and f.start < e):
            fence_close = _close_line(f)
    return fence_open, fence_close


def _close_line(f: Fence) -> str:
    """The line that closes `f` where it is: its marker after the opening line's quote markers
    and indentation, a list item's marker made spaces (a bare marker at the start of a line
    would close nothing in a quote, and end a list item's fence only by ending the item)."""
    at = min(i for i in (f.open_line.find("`"), f.open_line.find("~")) if i >= 0)
    lead = "".join(c if c in "> \t" else " " for c in f.open_line[:at])
    return lead + f.close_marker


def _parts(plan: _Plan, cuts: list[int], kept: set[int]) -> list[tuple[int, int]]:
    """The parts between `cuts`: regions split to size, small ones merged (not across a cut
    in `kept`, the previous version's)."""
    bounds = [plan.first, *cuts, plan.last]
    parts = []
    for a, c in itertools.pairwise(bounds):
        parts.extend(plan.split(a, c, kept=a in kept and c in kept))
    return plan.merge_small(parts, kept - {plan.first, plan.last})


def chunk_structure(
    text: str,
    *,
    max_size: int = MAX_CHUNK_SIZE,
    min_size: int = MIN_CHUNK_SIZE,
    overlap: int = OVERLAP_SIZE,
    target: int = TARGET_CHUNK_SIZE,
    window: int | None = None,
    previous: Sequence[tuple[int, str]] | None = None,
) -> list[Chunk]:
    """Split `text` into structural chunks (see the module docstring).

    `target`: the size aimed at (at most `max_size`, which stays the hard cap; a larger target
    means the maximum). `window`: by default `WINDOW_SHARE` of the target.
    `previous`: the chunks of the text's previous version, as (start offset, content) in
    order; their cuts are kept where the text around them did not change.
    """
    if not 0 <= overlap < max_size // 2 or not 0 <= min_size <= max_size // 2:
        raise ValueError("need 0 <= overlap < max_size/2 and 0 <= min_size <= max_size/2")
    target = min(target, max_size)
    if target < max(1, min_size):
        raise ValueError("need min_size <= target")
    if window is None:
        window = max(1, round(target * WINDOW_SHARE))
    if not text.strip():
        return []
    plan = _Plan(text, max_size, min_size, overlap, window, target)
    if plan.last - plan.first <= target:
        regions = [(plan.first, plan.last)]
        parts = regions
    else:
        cuts, kept = plan.cuts(), set()
        if previous:
            starts = {s for s, _ in _parts(plan, cuts, set())}  # what the text makes alone
            headings = {x for x in cuts if x in plan.heading_set and x in starts}
            cuts, kept = plan.keep_previous(previous, cuts, headings, starts)
            kept |= {plan.first, plan.last}
        parts = _parts(plan, cuts, kept)

    heading_pos = plan.layout.heading_pos
    paths = [(), *heading_paths(plan.layout)]
    chunks: list[Chunk] = []
    last = len(parts) - 1
    for k, (s, e) in enumerate(parts):
        end = plan.overlap_end((s, e), parts[k + 1]) if k < last else e
        fence_open, fence_close = plan.fence_context(s, end) if plan.big_fences else (None, None)
        chunks.append(
            Chunk(
                k,
                s,
                end,
                text[s:end],
                paths[bisect_right(heading_pos, s)],
                ChunkMethod.STRUCTURE,
                None,
                fence_open,
                fence_close,
            )
        )
    return chunks
