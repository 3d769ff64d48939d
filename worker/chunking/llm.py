"""LLM chunking that can never lose or invent text: the model chooses boundaries, not content.

A model asked to rewrite the text as chunks can invent text; one shown only the first 12,000
characters loses the rest; one whose answer does not parse must not leave an item without an
index. Here:

* The text is cut into numbered units that tile it, every character in exactly one
  (paragraphs; sentences inside long ones; a fenced block one unit, or, when it alone exceeds
  the maximum, the structural chunker's parts of it), from one scan of the whole text, and
  shown in windows of whole units that cover all of it. Windows are cut by the structural
  chunker at a larger size, so they are content-defined: an edit changes only its window.
* The model answers, per window, which units each chunk spans and a summary of each. Content is
  always sliced from the source by the units chosen, so chunks carry exact offsets; a chunk
  that starts or ends inside a block over the maximum is re-fenced for the embedder, as the
  structural chunker's parts are.
* Every answer is validated (shape, ids in range, ascending, covering the window without gaps or
  overlaps, no rewritten text); an invalid one is asked for once more with the reason; then, or on
  a refusal, a timeout or an HTTP error, `ChunkingFailed` says why and the caller falls back to
  structural chunking. So it does once the text's `deadline` has passed (the call in flight is
  cut at it): a slow model costs an item some seconds, never its soft time limit.
* Answers are cached by (model, hash of the window's units): unchanged text never calls the model
  again, and its chunks do not reshuffle. A cached answer is validated as a fresh one is: a
  row that does not fit (junk a host or an older version wrote) is a miss, not an error.
"""

from __future__ import annotations

import itertools
import re
import time
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from worker.chunking.base import MAX_CHUNK_SIZE, Chunk, ChunkMethod, text_hash
from worker.chunking.markdown import Fence, Layout, heading_paths, scan
from worker.chunking.structure import (
    SENTENCE_END,
    _fence_like_lines,
    chunk_structure,
    fence_context,
    safe_cut,
)
from worker.errors import (
    BadAnswer,
    Cancelled,
    KidxError,
    OutOfTime,
    ProviderDown,
    ProviderError,
)
from worker.store.text import without_lone_surrogates

PROMPT_VERSION = "1"
UNIT_MAX = 700  # a paragraph longer than this is shown as its sentences
MERGE_UNDER = 150  # a chunk this short is merged into a neighbour
SINGLE_CHUNK_UNDER = 500  # a text this short may be one chunk: nothing to split
SUMMARY_MAX = 200
# Where a unit still over UNIT_MAX after its sentences is cut: line ends, then spaces (each
# cut after the white space), then hard (minified JSON, CJK without stops, a log paragraph were
# one unit, and one prompt, of up to the whole text).
_UNIT_BREAKS = (re.compile(r"(?:\r\n?|\n)\s*"), re.compile(r"\s+"))
_BLANKS = re.compile(r"[ \t]*")  # what `_FENCE_START` skips before its marker

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "chunks": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "start": {"type": "integer"},
                    "end": {"type": "integer"},
                    "summary": {"type": "string"},
                },
                "required": ["start", "end", "summary"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["chunks"],
    "additionalProperties": False,
}

SYSTEM = (
    "You split documents into chunks for semantic search. You never rewrite, shorten or add "
    "text: you only say which numbered units each chunk spans, and summarise each chunk."
)
INSTRUCTIONS = """The text below is cut into {n} numbered units, each starting with [[number]].
Group consecutive units into chunks:
- the chunks cover every unit from 1 to {n} exactly once, in order, without gaps or overlaps;
- aim for 300 to 1500 characters per chunk; a text under 500 characters may be one chunk;
- keep a heading with the text it introduces, and code with the sentence that explains it;
- give each chunk "start" and "end" (unit numbers, inclusive) and a "summary" of at most 200
  characters that says what the chunk is about.
Answer with JSON only, like {{"chunks": [{{"start": 1, "end": 3, "summary": "..."}}]}}."""


class ChunkingFailed(KidxError):
    """LLM chunking could not be used for this text; the message says why."""

    # Whether this run asked the model anything (False: it was taken for down, or the deadline
    # had passed, before any request): a fallback the model was not asked for is not one of the
    # item's attempts at LLM chunking (worker.reconcile asks it again).
    asked: bool = True


class ChatModelLike(Protocol):
    model_id: str

    def complete_json(
        self,
        messages: list[dict[str, str]],
        *,
        schema: dict[str, Any],
        name: str,
        until: float | None = None,
    ) -> Any: ...


class BoundaryCache(Protocol):
    def get(self, model: str, key: str) -> list[tuple[int, int, str | None]] | None: ...

    def put(self, model: str, key: str, value: list[tuple[int, int, str | None]]) -> None: ...


@dataclass(frozen=True)
class Unit:
    start: int
    end: int


@dataclass(frozen=True)
class Window:
    units: list[Unit]
    key: str  # hash of the units' texts and the prompt version


def _trimmed(text: str, a: int, b: int) -> tuple[int, int]:
    while a < b and text[a].isspace():
        a += 1
    while b > a and text[b - 1].isspace():
        b -= 1
    return a, b


def unit_cuts(text: str, lay: Layout | None = None) -> list[int]:
    """Where units may start, from the whole text's layout: paragraph breaks, headings and fence
    edges, and the structural chunker's parts of each fenced block that alone exceeds the
    maximum (a block within it is one unit: its blank lines are code, not breaks)."""
    lay = lay or scan(text)
    cuts = {*lay.breaks, *lay.heading_pos}
    for f in _big_fences(lay):
        parts = chunk_structure(text[f.start : f.end], overlap=0)
        cuts.update(f.start + c.start for c in parts[1:])
    return sorted(cuts)


def _big_fences(lay: Layout) -> list[Fence]:
    return [f for f in lay.fences if f.end - f.start > MAX_CHUNK_SIZE]


def units_of(
    text: str,
    a: int,
    b: int,
    *,
    lay: Layout | None = None,
    cuts: Sequence[int] | None = None,
) -> list[Unit]:
    """Units that tile text[a:b]: every character in exactly one, in order (a unit's trailing
    white space is its own). Paragraphs, headings and fenced blocks as the whole text's layout
    has them (`unit_cuts`), long paragraphs outside fences as their sentences, and a sentence
    still over `UNIT_MAX` as its lines, words or (last) pieces of `UNIT_MAX` (`_split_long`).
    A unit that skipped the closing quote or bracket after a sentence's end lost it from every
    chunk. A unit is never cut off where either half would start a line like a fence's
    opening (`_FenceLines`): the chunk holding it would read as an unclosed code block."""
    lay = lay or scan(text)
    cuts = unit_cuts(text, lay) if cuts is None else cuts
    inner = cuts[bisect_right(cuts, a) : bisect_left(cuts, b)]
    fences = lay.fences
    fence_lines = _FenceLines(text)
    starts: list[int] = []
    for s, e in itertools.pairwise([a, *inner, b]):
        ts, te = _trimmed(text, s, e)
        if ts >= te:
            continue  # white space only: the unit before it keeps it
        starts.append(s if starts else a)
        if te - ts <= UNIT_MAX or any(f.start <= ts < f.end for f in fences):
            continue
        start = ts
        for m in SENTENCE_END.finditer(text, ts, te):
            p = m.end()
            if p - start >= 80 and p < te and not fence_lines.splits(p):
                _split_long(text, start, p, starts, fence_lines)
                starts.append(p)  # after the closing quote and the white space
                start = p
        _split_long(text, start, te, starts, fence_lines)
    return [Unit(u, v) for u, v in itertools.pairwise([*starts, b])] if starts else []


class _FenceLines:
    """Whether a cut inside a line leaves either half starting like a fence's opening (as the
    structural chunker's `_cuttable`); the lines that open like one are found once, lazily."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines: tuple[list[int], list[int]] | None = None
        self.blanks = (-1, -1)  # a run of spaces and tabs, the last one looked past

    def splits(self, p: int) -> bool:
        if self.text[p - 1] in "\r\n":
            return False  # a cut between lines: each half has the line whole
        if self._fence_after_blanks(p):
            return True
        if self.lines is None:
            self.lines = _fence_like_lines(self.text)
        starts, ends = self.lines
        k = bisect_right(starts, p) - 1
        return k >= 0 and p <= ends[k]

    def _fence_after_blanks(self, p: int) -> bool:
        """`_FENCE_START.match(text, p)`, with the run of blanks it skips found once for all
        the cuts inside it: a match at each cut of a run of 1M spaces scanned it to its end
        (13.6 s), before the chunk model's deadline was looked at."""
        lo, end = self.blanks
        if not lo <= p <= end:
            end = _BLANKS.match(self.text, p).end()
            self.blanks = (p, end)
        return self.text.startswith(("```", "~~~"), end)


def _split_long(text: str, a: int, b: int, starts: list[int], fence_lines: _FenceLines) -> None:
    """Append to `starts` the unit starts that cut text[a:b] (a sentence, starting at a
    non-space character) into pieces of at most `UNIT_MAX`: at the last line end within
    reach, else the last space, else hard at a grapheme boundary. Not where either half would
    start a line like a fence's opening (its chunk would read as an unclosed block) while a
    break up to the chunk maximum, or leaving a piece within it whole, avoids it."""
    while b - a > UNIT_MAX:
        p = -1
        for pattern in _UNIT_BREAKS:
            for m in pattern.finditer(text, a + 1, a + UNIT_MAX):
                if m.end() < b and not fence_lines.splits(m.end()):
                    p = m.end()
            if p > a:
                break
        if p <= a:  # the first acceptable break past UNIT_MAX, within the chunk maximum
            p = next(
                (
                    m.end()
                    for pattern in _UNIT_BREAKS
                    for m in pattern.finditer(text, a + UNIT_MAX, min(b, a + MAX_CHUNK_SIZE))
                    if m.end() < b and not fence_lines.splits(m.end())
                ),
                -1,
            )
        if p <= a:
            p = safe_cut(text, a + UNIT_MAX, a)
            if b - a <= MAX_CHUNK_SIZE and fence_lines.splits(p):
                return  # whole rather than cut inside a fence-like line, as a chunk may be
        starts.append(p)
        a = p


def windows_of(text: str, size: int, lay: Layout | None = None) -> list[Window]:
    """Windows of about `size` characters, cut where the structure says (content-defined), at
    unit starts: the units are the whole text's, so that a window never starts inside a fenced
    block that stays whole, nor reads code as prose. A window holds the units whose text starts
    in its region; one running past the region's end makes it longer by that much."""
    lay = lay or scan(text)
    units = units_of(text, 0, len(text), lay=lay)
    firsts = [_trimmed(text, u.start, u.end)[0] for u in units]
    regions = chunk_structure(
        text, max_size=size, min_size=size // 10, overlap=0, target=size, window=size // 3
    )
    bounds = [0, *(bisect_left(firsts, r.start) for r in regions[1:]), len(units)]
    result = []
    for i, j in itertools.pairwise(bounds):
        if i >= j:
            continue
        joined = "\x1f".join(_shown(text, u) for u in units[i:j])
        result.append(Window(units[i:j], text_hash(f"{PROMPT_VERSION}\x1e{joined}")))
    return result


def _shown(text: str, unit: Unit) -> str:
    """A unit's text as the model sees it (and its window's key): without the white space at
    its ends."""
    return text[unit.start : unit.end].strip()


# A line of a unit's text that starts as a marker does (`[[2]] is the wiki page...`): shown
# escaped, or the model (and the stand-in) read a unit that is not there, and the answer that
# named it was refused.
_LIKE_A_MARKER = re.compile(r"^([ \t]*)\[\[", re.MULTILINE)
_ESCAPED = r"\1\\[["


def prompt(text: str, window: Window, correction: str | None = None) -> list[dict[str, str]]:
    """The request for one window; asked again, it says what was wrong with the last answer
    (in the same message as the units: small models lose track of earlier turns)."""
    body = "\n".join(
        f"[[{i}]] {_LIKE_A_MARKER.sub(_ESCAPED, _shown(text, u))}"
        for i, u in enumerate(window.units, 1)
    )
    head = INSTRUCTIONS.format(n=len(window.units))
    if correction:
        head += f"\nYour previous answer could not be used: {correction}. Follow the rules."
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": head + "\n\n" + body},
    ]


def validate(answer: Any, text: str, window: Window) -> list[tuple[int, int, str | None]]:
    """The answer's chunks as (first unit, last unit, summary), 1-based; BadAnswer if unusable."""
    n = len(window.units)
    items = answer.get("chunks") if isinstance(answer, dict) else None
    if not isinstance(items, list):
        raise BadAnswer('the answer is not an object with a "chunks" list')
    if not items:
        raise BadAnswer("the answer has no chunks")
    result: list[tuple[int, int, str | None]] = []
    expected = 1
    for k, item in enumerate(items, 1):
        if not isinstance(item, dict):
            raise BadAnswer(f"chunk {k} is not an object")
        start, end = item.get("start"), item.get("end", None)
        if end is None and k < len(items) and isinstance(items[k], dict):
            nxt = items[k].get("start")
            end = nxt - 1 if isinstance(nxt, int) else None
        elif end is None:
            end = n
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end)):
            raise BadAnswer(f"chunk {k} has no whole-number start and end")
        if not (1 <= start <= n and 1 <= end <= n):
            raise BadAnswer(f"chunk {k} names units {start}-{end}, outside 1-{n}")
        if end < start:
            raise BadAnswer(f"chunk {k} ends (unit {end}) before it starts (unit {start})")
        if start < expected:
            raise BadAnswer(f"chunk {k} overlaps the one before it (starts at unit {start})")
        if start > expected:
            raise BadAnswer(f"units {expected}-{start - 1} are in no chunk (a gap)")
        for field in ("text", "content"):
            claimed = item.get(field)
            if isinstance(claimed, str) and claimed.split() != _words(text, window, start, end):
                raise BadAnswer(f"chunk {k} rewrites the text (its {field!r} is not the source)")
        summary = item.get("summary")
        result.append((start, end, _summary(summary)))
        expected = end + 1
    if expected != n + 1:
        raise BadAnswer(f"units {expected}-{n} are in no chunk (a gap at the end)")
    return result


def _words(text: str, window: Window, start: int, end: int) -> list[str]:
    return text[window.units[start - 1].start : window.units[end - 1].end].split()


def _summary(value: Any) -> str | None:
    """The model's summary, its white space collapsed, cut to `SUMMARY_MAX`; lone surrogates
    (a JSON answer may escape one, `"\\ud800"`) replaced by U+FFFD: they cannot be encoded as
    UTF-8, so the chunk could be neither stored nor embedded."""
    if not isinstance(value, str):
        return None
    value = " ".join(without_lone_surrogates(value).split())
    if len(value) > SUMMARY_MAX:
        cut = value.rfind(" ", 0, SUMMARY_MAX)
        value = value[: cut if cut > SUMMARY_MAX // 2 else SUMMARY_MAX].rstrip(" ,.;:")
    return value or None


@dataclass
class LLMChunker:
    """The chat model, its answer cache, a cancellation check and the seconds one text may
    take in all (`deadline`: the calls in flight are cut at it), for `chunk_llm`."""

    model: ChatModelLike
    cache: BoundaryCache | None = None
    window: int = 6000
    cancel: Callable[[], bool] | None = None
    deadline: float | None = None
    calls: int = 0  # chat calls made (cache hits make none)


def chunk_llm(text: str, llm: LLMChunker) -> list[Chunk]:
    """Chunks chosen by the model; ChunkingFailed when it cannot be used for this text."""
    lay = scan(text)
    spans: list[tuple[int, int, str | None]] = []
    starts: list[int] = []
    windows = windows_of(text, llm.window, lay)
    until = None if llm.deadline is None else time.monotonic() + llm.deadline
    before = llm.calls
    fresh = 0  # windows the model answered in this run (kept in the cache)
    for done, window in enumerate(windows):
        if llm.cancel is not None and llm.cancel():
            raise Cancelled("cancelled")
        calls = llm.calls
        try:
            chunks = _window_chunks(text, window, llm, until)
        except OutOfTime:
            failed = ChunkingFailed(
                f"the chunk model did not finish within {llm.deadline:g} s "
                f"(KIDX_CHUNK__DEADLINE): {done} of {len(windows)} windows answered, "
                "kept for the next run"
            )
            # Not one of the item's attempts if it answered windows in this run: each run
            # gets further, and a text of more windows than the attempts allow got none.
            failed.asked = llm.calls > before and not fresh
            raise failed from None
        except ChunkingFailed as e:
            e.asked = llm.calls > before
            raise
        fresh += llm.calls > calls
        for s, e, summary in chunks:
            a, b = _trimmed(text, window.units[s - 1].start, window.units[e - 1].end)
            if a < b:  # a chunk of white space only (a unit of a long run of spaces): none
                spans.append((a, b, summary))
        starts.extend(u.start for u in window.units)
    return _finish(text, _merge_small(spans, len(text.strip())), lay, starts)


def _window_chunks(
    text: str, window: Window, llm: LLMChunker, until: float | None
) -> list[tuple[int, int, str | None]]:
    """The window's boundaries, cached or asked for before `until` (OutOfTime past it)."""
    model_id = llm.model.model_id
    cached = _cached(text, window, llm)
    if cached is not None:
        return cached
    reason = ""
    for attempt in range(2):
        if until is not None and time.monotonic() >= until:
            raise OutOfTime("no time left to ask the chunk model", unanswered=False)
        llm.calls += 1
        messages = prompt(text, window, reason or None)
        try:
            answer = llm.model.complete_json(
                messages, schema=SCHEMA, name="chunk_boundaries", until=until
            )
            chunks = validate(answer, text, window)
        except OutOfTime as e:
            if not e.unanswered:  # never sent
                llm.calls -= 1
            raise
        except BadAnswer as e:
            reason = _said(e)
            if attempt == 0:  # once more, saying what was wrong
                continue
            raise ChunkingFailed(f"the chunk model's answer was unusable twice: {reason}") from None
        except ProviderError as e:
            if isinstance(e, ProviderDown):
                llm.calls -= 1
            raise ChunkingFailed(f"the chunk model failed: {_said(e)}") from None
        if llm.cache is not None:
            llm.cache.put(model_id, window.key, chunks)
        return chunks
    raise ChunkingFailed(reason)  # pragma: no cover - the loop returns or raises


def _said(error: Exception) -> str:
    """An error's message, its lone surrogates replaced by U+FFFD: it may quote the server (a
    refusal, an error message, JSON-escaped "\\ud800"), and it is sent back to the model as
    the correction and stored as the fallback's reason, neither of which UTF-8 can carry."""
    return without_lone_surrogates(str(error))


def _cached(text: str, window: Window, llm: LLMChunker) -> list[tuple[int, int, str | None]] | None:
    """The window's cached boundaries, checked as a fresh answer is (`validate`): a row that an
    older version or a host wrote may be anything, and one that does not fit this window is a
    miss (the model is asked again, then structure), never an exception out of chunking."""
    if llm.cache is None:
        return None
    value = llm.cache.get(llm.model.model_id, window.key)
    if value is None:
        return None
    try:
        answer = {"chunks": [{"start": s, "end": e, "summary": summary} for s, e, summary in value]}
        if any(
            isinstance(c["summary"], str) and without_lone_surrogates(c["summary"]) != c["summary"]
            for c in answer["chunks"]
        ):
            return None  # an older version cached a summary it could not store: ask again
        return validate(answer, text, window)
    except (BadAnswer, TypeError, ValueError):  # out of range, unordered, not (s, e, summary)
        return None


def _merge_small(
    spans: list[tuple[int, int, str | None]], total: int
) -> list[tuple[int, int, str | None]]:
    """Chunks far under the 300 the prompt asks for join a neighbour, within the maximum: the
    smaller one, the left on a tie; the joined chunk is looked at again. In one pass, the
    chunks before the current one on a stack (a list spliced at each join was quadratic: 800k
    tiny chunks took 34 s)."""
    if total < SINGLE_CHUNK_UNDER:
        return spans
    out: list[tuple[int, int, str | None]] = []
    j, cur = 0, None
    while cur is not None or j < len(spans):
        if cur is None:
            cur, j = spans[j], j + 1
        s, e, _ = cur
        left = bool(out) and e - out[-1][0] <= MAX_CHUNK_SIZE
        right = j < len(spans) and spans[j][1] - s <= MAX_CHUNK_SIZE
        if e - s >= MERGE_UNDER or not (left or right):
            out.append(cur)
            cur = None
            continue
        if left and (not right or _size(out[-1]) <= _size(spans[j])):
            a, b = out.pop(), cur
        else:
            (a, b), j = (cur, spans[j]), j + 1
        keep = a[2] if _size(a) >= _size(b) else b[2]
        cur = (a[0], b[1], keep or a[2] or b[2])
    return out


def _size(span: tuple[int, int, str | None]) -> int:
    return span[1] - span[0]


def _finish(
    text: str, spans: Sequence[tuple[int, int, str | None]], lay: Layout, starts: list[int]
) -> list[Chunk]:
    """Chunk objects: over-long spans cut at unit starts, heading paths, summaries, and the
    fence lines a part of a block over the maximum needs (as the structural chunker gives)."""
    paths = [(), *heading_paths(lay)]
    big = _big_fences(lay)
    chunks: list[Chunk] = []
    for s, e, summary in spans:
        for ps, pe in _within_max(text, s, e, starts):
            fence_open, fence_close = fence_context(text, big, ps, pe) if big else (None, None)
            chunks.append(
                Chunk(
                    len(chunks),
                    ps,
                    pe,
                    text[ps:pe],
                    paths[_heading_index(lay.heading_pos, ps)],
                    ChunkMethod.LLM,
                    summary,
                    fence_open,
                    fence_close,
                )
            )
    return chunks


def _within_max(text: str, s: int, e: int, starts: list[int]) -> list[tuple[int, int]]:
    """The model drew this span: cut it, if it is over the maximum, into as few parts as the
    maximum allows, at unit starts (never inside a fenced block that stays whole). A unit alone
    over it (a sentence without an end; never a fence part) is cut structurally: it lies outside
    fenced blocks, so its slice can be scanned on its own."""
    if e - s <= MAX_CHUNK_SIZE:
        return [(s, e)]
    out: list[tuple[int, int]] = []

    def add(a: int, b: int) -> None:
        a, b = _trimmed(text, a, b)
        if a < b:
            out.append((a, b))

    def size(a: int, b: int) -> int:
        a, b = _trimmed(text, a, b)
        return b - a

    cur, good = s, -1
    for p in [*starts[bisect_right(starts, s) : bisect_left(starts, e)], e]:
        if good > cur and size(cur, p) > MAX_CHUNK_SIZE:
            add(cur, good)
            cur = good
        if size(cur, p) <= MAX_CHUNK_SIZE:
            good = p
            continue
        a, b = _trimmed(text, cur, p)  # one unit over the maximum
        parts = chunk_structure(text[a:b], target=MAX_CHUNK_SIZE, overlap=0)  # LLM chunks tile
        out.extend((a + c.start, a + c.end) for c in parts)
        cur = p
    if good > cur:
        add(cur, good)
    return out


def _heading_index(positions: list[int], at: int) -> int:
    return bisect_right(positions, at)
