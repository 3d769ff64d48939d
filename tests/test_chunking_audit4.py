"""Code and LLM chunking against a review's inputs: a chunk of white space only that the chunk
model drew (an empty chunk the database refused, and the item failed at every retry, its
answer cached), and work that grew with the square of a run of spaces or of the chunk count.
The costs are counted (characters scanned, calls), never timed."""

from __future__ import annotations

import itertools
import random
import re
from typing import Any

import pytest

from tests.test_chunking_llm import assert_exact_and_covering, rows
from worker.bulk import index_item
from worker.chunking import code, llm
from worker.chunking.llm import MAX_CHUNK_SIZE, units_of
from worker.indexers import IndexOptions
from worker.store.items import add_item, get_state

WORDS = " ".join(f"w{i:03d}" for i in range(300))  # 1,499 characters


def test_a_chunk_of_white_space_only_the_model_draws_is_no_chunk(db, embedder, chat, standin):
    """A paragraph with a long run of spaces (a PDF's layout) gives units of spaces only; a
    model that put one in a chunk of its own made a chunk of 0 characters: the database's CHECK
    refused the item's write, at every run, the answer being cached."""
    text = WORDS + " " * 2000 + WORDS
    blank = [
        n
        for n, u in enumerate(units_of(text, 0, len(text)), 1)
        if not text[u.start : u.end].strip()
    ]
    assert blank, "the text must give a unit of spaces only"

    def answer(units: list[str]) -> dict[str, Any]:
        b, n = blank[0], len(units)
        return {
            "chunks": [
                {"start": 1, "end": b - 1, "summary": "first half"},
                {"start": b, "end": b, "summary": "nothing but spaces"},
                {"start": b + 1, "end": n, "summary": "second half"},
            ]
        }

    standin.chat.script = [answer] * 5
    item = add_item(db, kind="note", title="Report", content=text)
    result = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert result.status == "indexed" and result.chunk_method == "llm", get_state(db, item)
    chunks = rows(db, item)
    assert_exact_and_covering(text, chunks)
    assert all(c["content"].strip() for c in chunks)
    assert "nothing but spaces" not in {c["summary"] for c in chunks}


class _Counting:
    """A compiled pattern whose matches count the characters they scanned."""

    def __init__(self, pattern: re.Pattern[str]) -> None:
        self.pattern, self.scanned = pattern, 0

    def search(self, text: str, pos: int, endpos: int) -> re.Match[str] | None:
        m = self.pattern.search(text, pos, endpos)
        self.scanned += (m.start() if m else endpos) - pos
        return m

    def match(self, text: str, pos: int) -> re.Match[str] | None:
        m = self.pattern.match(text, pos)
        self.scanned += m.end() - pos if m else 0
        return m


@pytest.mark.parametrize("path", ["a.js", "a.py", "a.txt"])
def test_code_cut_in_a_long_run_of_spaces_scans_it_about_once(monkeypatch, path):
    """Each cut (every 1,500 characters) looked for the next non-blank character to the end
    of the run: 2M spaces took 5 s."""
    counting = _Counting(code._NON_BLANK)
    monkeypatch.setattr(code, "_NON_BLANK", counting)
    text = "x = '" + " " * 300_000 + "'\nprint(x)\n"
    chunks = code.chunk_code(text, path)
    assert all(text[c.start : c.end] == c.content for c in chunks)
    assert "".join(c.content for c in chunks).replace(" ", "") == text.replace(" ", "").strip()
    assert counting.scanned < 3 * len(text)  # the run scanned about once, not once a cut


def test_llm_units_of_a_long_run_of_spaces_scan_it_about_once(monkeypatch):
    """Each candidate cut in the run matched a fence's opening past every space after it:
    1M spaces took 13.6 s, before the chunk model's deadline was looked at."""
    counting = _Counting(llm._BLANKS)
    monkeypatch.setattr(llm, "_BLANKS", counting)
    text = "x" + " " * 200_000 + "y\n\n" + "  ```\ncode\n```\n"
    units = units_of(text, 0, len(text))
    assert units[0].start == 0 and units[-1].end == len(text)
    assert all(u.end == v.start for u, v in itertools.pairwise(units))
    assert counting.scanned < 3 * len(text)


def _merge_small_as_specified(spans, total):
    """The rule, as the list-splicing version wrote it (quadratic: 800k chunks took 34 s)."""
    if total < llm.SINGLE_CHUNK_UNDER:
        return spans
    out = list(spans)
    i = 0
    while i < len(out) and len(out) > 1:
        s, e, _ = out[i]
        if e - s >= llm.MERGE_UNDER:
            i += 1
            continue
        left = i - 1 if i > 0 and e - out[i - 1][0] <= MAX_CHUNK_SIZE else None
        right = i + 1 if i + 1 < len(out) and out[i + 1][1] - s <= MAX_CHUNK_SIZE else None
        if left is None and right is None:
            i += 1
            continue
        size = lambda k: out[k][1] - out[k][0]  # noqa: E731
        k = left if right is None or (left is not None and size(left) <= size(right)) else i
        a, b = out[k], out[k + 1]
        keep = a[2] if (a[1] - a[0]) >= (b[1] - b[0]) else b[2]
        out[k : k + 2] = [(a[0], b[1], keep or a[2] or b[2])]
        i = k
    return out


def test_merging_small_chunks_keeps_its_rule_in_one_pass(monkeypatch):
    rng = random.Random(11)
    for _ in range(3000):
        pos, spans = 0, []
        for _ in range(rng.randint(0, 25)):
            pos += rng.choice([0, 1, 5])
            size = rng.choice([1, 10, 100, 299, 300, 700, 1400, 1500])
            spans.append((pos, pos + size, rng.choice([None, "a", "bb", ""])))
            pos += size
        total = rng.choice([0, 10_000])
        assert llm._merge_small(list(spans), total) == _merge_small_as_specified(spans, total)
    calls = 0
    size = llm._size

    def counted(span):
        nonlocal calls
        calls += 1
        return size(span)

    monkeypatch.setattr(llm, "_size", counted)
    tiny = [(3 * n, 3 * n + 2, None) for n in range(50_000)]
    merged = llm._merge_small(tiny, 10**6)
    assert merged[0][0] == 0 and merged[-1][1] == tiny[-1][1]
    assert calls < 10 * len(tiny)  # a bounded number of looks a chunk
