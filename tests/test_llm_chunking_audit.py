"""LLM chunking defects an audit found: text in no unit (so in no chunk) after a sentence's
closing quote; a fenced block over the window cut at its blank lines and sent unfenced; a chunk
model that never answers paid for again by every item; a 64 MB cap on a chat answer.

End to end against the stand-in over real HTTP with a real SQLite file; properties over
`units_of` and over `chunk_llm` with a model that answers arbitrary valid boundaries."""

from __future__ import annotations

import itertools
import random
import re
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from conftest import chat_model
from testkit.standin_chat import ChatReply
from worker.bulk import index_item
from worker.chunking import chunk_structure
from worker.chunking.base import MAX_CHUNK_SIZE
from worker.chunking.llm import LLMChunker, chunk_llm, units_of, windows_of
from worker.chunking.markdown import scan
from worker.indexers import IndexOptions
from worker.providers.chat import ChatDown, ChatModel, max_answer_bytes
from worker.settings import ChunkSettings, Settings
from worker.store.items import add_item

QUOTED = 'The officer said "stop the car now, please, and step out of it slowly." '
CODE = "\n".join(f"def f{i}(x):\n    # step {i}: add one\n    return x + {i}\n" for i in range(260))
BIG_FENCE = "# Listing\n\nThe code:\n\n```python\n" + CODE + "```\n\nAfter the code, prose again."


def lost(text: str, spans: list[tuple[int, int]]) -> str:
    """The non-space characters of `text` in none of `spans`."""
    covered = bytearray(len(text))
    for a, b in spans:
        covered[a:b] = b"\x01" * (b - a)
    return "".join(ch for i, ch in enumerate(text) if not covered[i] and not ch.isspace())


def stored(db, item_id: int) -> list[tuple[int, int, str]]:
    return db.all(
        "SELECT start_offset, end_offset, content FROM note_chunks WHERE item_id = ? "
        "ORDER BY chunk_index",
        (item_id,),
    )


def closed(text: str) -> bool:
    """Every code fence the text opens is closed."""
    return all(f.closed for f in scan(text).fences)


def reads_as_code(text: str) -> bool:
    """The text has a code fence, and it is closed: what the embedder is given of a block."""
    return bool(scan(text).fences) and closed(text)


def in_place(text: str, c):
    """The chunk with its first line's indentation put back, as it reads in its text: a chunk
    starts at a non-space character, so a ``` line indented 4 spaces (indented code, no fence)
    would otherwise open a fence at its start."""
    line_start = max(text.rfind("\n", 0, c.start), text.rfind("\r", 0, c.start)) + 1
    lead = text[line_start : c.start]
    return c._replace(content=lead + c.content) if not lead.strip(" \t") else c


# -- 1. no text lost after a sentence's closing quote ---------------------------------------


def test_closing_quotes_after_sentence_ends_are_in_a_stored_chunk(db, embedder, chat, standin):
    text = "# Traffic stop\n\n" + (QUOTED * 12).strip()
    text += "\n\nSee the **appendix.** It has the rest (all of it.) The end is here.\n\n"
    text += ("A second long paragraph that ends with emphasis, *like this one.* " * 12).strip()
    standin.chat.target = 100  # a model that likes small chunks: a chunk ends after a quote
    item = add_item(db, kind="note", title="T", content=text)
    result = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert result.status == "indexed" and result.chunk_method == "llm" and result.fallback is None
    rows = stored(db, item)
    assert all(content == text[a:b] for a, b, content in rows)
    assert lost(text, [(a, b) for a, b, _ in rows]) == ""


# Texts of paragraphs whose sentences end in closing quotes, brackets and emphasis, headings,
# and fenced blocks (with blank lines inside) both under and over the maximum.
_word = st.sampled_from(["the", "car", "stop", "now", "a", "slowly", "it", "x1", "(aside"])
_sentence = st.builds(
    lambda words, end, closers: " ".join(words) + end + closers,
    st.lists(_word, min_size=1, max_size=30),
    st.sampled_from([".", "!", "?", ""]),
    st.text(alphabet="\"')]*_`", max_size=3),
)
_paragraph = st.lists(_sentence, min_size=1, max_size=40).map(" ".join)
_code_line = st.sampled_from(["x = 1", "", "    return x  # done.", "# comment", "print('a.')"])
_fence = st.builds(
    lambda indent, lines, times, after: f"{indent}```py\n" + "\n".join(lines * times) + after,
    st.sampled_from(["", "  "]),
    st.lists(_code_line, min_size=1, max_size=8),
    st.sampled_from([1, 3, 40, 120]),
    st.sampled_from(["\n```", "\n```  "]),
)
_block = st.one_of(_paragraph, _paragraph, _fence, st.sampled_from(["# Title", "## Part"]))
_texts = st.builds(
    lambda blocks, seps, lead: lead + "".join(b + s for b, s in zip(blocks, seps)),
    st.lists(_block, min_size=1, max_size=12),
    st.lists(st.sampled_from(["\n\n", "\n", " ", "\n\n\n", ""]), min_size=12, max_size=12),
    st.sampled_from(["", "\n", "  "]),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_texts)
def test_units_tile_the_text_and_keep_small_fences_whole(text: str) -> None:
    units = units_of(text, 0, len(text))
    if not text.strip():
        assert units == []
        return
    assert units[0].start == 0 and units[-1].end == len(text)
    assert all(u.end == v.start for u, v in itertools.pairwise(units))  # no gap, no overlap
    assert all(text[u.start : u.end].strip() for u in units)
    starts = {u.start for u in units}
    for f in scan(text).fences:
        if f.end - f.start <= MAX_CHUNK_SIZE:  # never cut inside, blank lines included
            assert not any(f.start < p < f.end for p in starts), text[f.start : f.end][:80]
    for w in windows_of(text, 1000):  # a window's units tile its part of the text
        assert all(u.end == v.start for u, v in zip(w.units, w.units[1:]))


class AnyBoundaries:
    """A chunk model that answers valid but arbitrary boundaries (its own random choice)."""

    model_id = "any"

    def __init__(self, seed: int) -> None:
        self.rand = random.Random(seed)

    def complete_json(
        self, messages: list[dict[str, str]], *, schema: Any, name: str, until: Any = None
    ) -> Any:
        n = int(re.search(r"cut into (\d+) numbered units", messages[-1]["content"])[1])
        ends = sorted({*self.rand.sample(range(1, n), self.rand.randint(0, n - 1)), n})
        starts = [1, *(e + 1 for e in ends[:-1])]
        return {"chunks": [{"start": s, "end": e, "summary": "s"} for s, e in zip(starts, ends)]}


def test_a_unit_over_the_maximum_is_cut_without_overlap():
    """Found by the property below: a paragraph of 2,170 characters (a fence opened mid-line is
    no fence) was cut by the structural chunker with its 100-character overlap, so two LLM
    chunks shared 99 characters."""
    text = "```py\nx = 1\n```\n\n" + "the.\n\n" * 5 + "the. ```py\n"
    text += "\n".join(["x = 1"] * 360) + "\n```\n\n"
    chunks = chunk_llm(text, LLMChunker(AnyBoundaries(0), window=1000))
    assert all(a.end <= b.start for a, b in itertools.pairwise(chunks))
    assert all(c.content == text[c.start : c.end] for c in chunks)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_texts, st.integers(0, 2**32))
def test_llm_chunks_cover_every_character_and_fence_their_code(text: str, seed: int) -> None:
    chunks = chunk_llm(text, LLMChunker(AnyBoundaries(seed), window=1000))
    assert all(c.content == text[c.start : c.end] for c in chunks)
    assert all(a.end <= b.start for a, b in itertools.pairwise(chunks))
    assert all(0 < len(c.content) <= MAX_CHUNK_SIZE for c in chunks)
    assert lost(text, [(c.start, c.end) for c in chunks]) == ""
    for f in scan(text).fences:
        if f.end - f.start <= MAX_CHUNK_SIZE:  # its code, white space at its ends aside
            code = text[f.start : f.end]
            a, b = f.start + len(code) - len(code.lstrip()), f.start + len(code.rstrip())
            assert not any(a < p < b for c in chunks for p in (c.start, c.end))
    if not closed(text):
        return  # a block the text never closes is not closed in its chunks either
    for f in scan(text).fences:
        code = text[f.start : f.end]
        a, b = f.start + len(code) - len(code.lstrip()), f.start + len(code.rstrip())
        for c in chunks:  # a chunk with code of the block in it has it fenced
            if c.start < b and c.end > a and text[max(a, c.start) : min(b, c.end)].strip():
                assert reads_as_code(in_place(text, c).embedding_input("T")), (text, c)
    assert all(closed(in_place(text, c).embedding_input("T")) for c in chunks), text


# -- 2. a fenced block over the window ------------------------------------------------------


@pytest.mark.parametrize("indent, after", [("", "```  "), ("  ", "```")])
def test_parts_of_a_big_fence_get_one_opening_and_one_closing_line(indent: str, after: str):
    # The re-fencing both chunkers share: a part that starts at an indented opening line, or
    # ends at a closing line with spaces after it, has its own; a second made it unbalanced.
    text = f"{indent}```py\n" + "x = 1\n" * 300 + after
    for chunks in (chunk_structure(text), chunk_llm(text, LLMChunker(AnyBoundaries(1)))):
        assert len(chunks) > 1
        for c in chunks:
            body = c.embedding_input("T")
            assert reads_as_code(body) and len(re.findall(r"(?m)^ *```", body)) == 2, body[:80]


def test_a_fenced_block_longer_than_the_window_reaches_the_embedder_fenced(
    db, embedder, chat, standin
):
    item = add_item(db, kind="note", title="Listing", content=BIG_FENCE)
    result = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert result.status == "indexed" and result.chunk_method == "llm" and result.fallback is None
    assert standin.chat.requests >= 3  # 14.5 KB of code: several windows
    rows = stored(db, item)
    assert lost(BIG_FENCE, [(a, b) for a, b, _ in rows]) == ""
    fs, fe = BIG_FENCE.index("```python"), BIG_FENCE.rindex("```") + 3
    inside = [(a, b) for a, b, _ in rows if a < fe and b > fs]
    # Cut into about as many parts as the structural chunker makes, not at every blank line.
    assert len(inside) <= 2 * len([c for c in chunk_structure(BIG_FENCE) if c.start < fe])
    code = [t for t in standin.texts if "return x + " in t]
    assert len(code) == len(inside) and all(reads_as_code(t) for t in code)


# -- 3. a chunk model that does not answer --------------------------------------------------


def test_a_chunk_model_that_times_out_is_taken_for_down_and_items_fall_back_at_once(
    db, embedder, standin
):
    standin.chat.delay = 30  # never within the timeout (the stand-in wakes on stop)
    chat = chat_model(standin, timeout=0.3)
    try:
        items = [
            add_item(db, kind="note", title=f"N{i}", content=f"Note number {i}. " * 40)
            for i in range(5)
        ]
        results = [
            index_item(db, i, embedder=embedder, options=IndexOptions(chat=chat)) for i in items
        ]
    finally:
        chat.close()
    assert [r.chunk_method for r in results] == ["structure"] * 5
    assert all(r.status == "indexed" for r in results)
    assert standin.chat.requests == 3  # three timeouts in a row, then not asked again
    assert "timed out" in results[0].fallback
    assert "taken for down" in results[3].fallback and "timed out" in results[3].fallback


def test_the_chunk_model_is_asked_again_after_the_cool_down(standin):
    now = [0.0]
    standin.chat.fail_status = 503
    chat = ChatModel(
        ChunkSettings(model="standin-chat", base_url=standin.base_url, max_retries=0, cool_down=60),
        clock=lambda: now[0],
    )
    ask = [{"role": "user", "content": "[[1]] text"}]
    try:
        for _ in range(3):
            with pytest.raises(Exception, match="HTTP 503"):
                chat.complete_json(ask, schema={}, name="n")
        with pytest.raises(ChatDown, match=r"3 failed calls in a row, last: .*HTTP 503"):
            chat.complete_json(ask, schema={}, name="n")
        assert standin.chat.requests == 3
        now[0] = 61.0  # the cool-down is over: one call tries again
        standin.chat.fail_status = None
        standin.chat.script = [{"chunks": [{"start": 1, "end": 1, "summary": "s"}]}]
        assert chat.complete_json(ask, schema={}, name="n")["chunks"][0]["end"] == 1
        standin.chat.fail_status = 503  # up again: it takes three failures anew
        for _ in range(2):
            with pytest.raises(Exception, match="HTTP 503"):
                chat.complete_json(ask, schema={}, name="n")
        assert standin.chat.requests == 6
    finally:
        chat.close()


def test_the_breaker_is_set_from_the_environment(standin, monkeypatch):
    monkeypatch.setenv("KIDX_CHUNK__DOWN_AFTER", "1")
    monkeypatch.setenv("KIDX_CHUNK__COOL_DOWN", "5")
    monkeypatch.setenv("KIDX_CHUNK__MODEL", "standin-chat")
    monkeypatch.setenv("KIDX_CHUNK__BASE_URL", standin.base_url)
    monkeypatch.setenv("KIDX_CHUNK__MAX_RETRIES", "0")
    settings = Settings().chunk
    assert (settings.down_after, settings.cool_down) == (1, 5.0)
    now = [0.0]
    standin.chat.fail_status = 503
    chat = ChatModel(settings, clock=lambda: now[0])
    ask = [{"role": "user", "content": "[[1]] text"}]
    try:
        with pytest.raises(Exception, match="HTTP 503"):
            chat.complete_json(ask, schema={}, name="n")
        with pytest.raises(ChatDown, match="1 failed calls in a row"):  # down after one
            chat.complete_json(ask, schema={}, name="n")
        now[0] = 5.5  # over after five seconds
        with pytest.raises(Exception, match="HTTP 503"):
            chat.complete_json(ask, schema={}, name="n")
        assert standin.chat.requests == 2
    finally:
        chat.close()


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        ("DOWN_AFTER", "0", "greater than or equal to 1"),
        ("DOWN_AFTER", "x", "valid integer"),
        ("COOL_DOWN", "-1", "greater than or equal to 0"),
        ("COOL_DOWN", "inf", "finite number"),
    ],
)
def test_a_bad_breaker_setting_is_refused_when_built(monkeypatch, name, value, said):
    monkeypatch.setenv(f"KIDX_CHUNK__{name}", value)
    with pytest.raises(ValidationError, match=f"(?s)chunk.{name.lower()}.*{said}"):
        Settings()


def test_an_answer_that_is_refused_resets_the_count(standin):
    standin.chat.script = [
        ChatReply(status=503),
        ChatReply(status=503),
        "not JSON at all",  # it answered: up
        ChatReply(status=503),
        ChatReply(status=503),
    ]
    chat = chat_model(standin)
    ask = [{"role": "user", "content": "[[1]] text"}]
    try:
        for _ in range(5):
            with pytest.raises(Exception, match=r"503|not JSON"):
                chat.complete_json(ask, schema={}, name="n")
        assert chat.streak.current()[0] == 2  # not three: the bad answer showed the model is up
    finally:
        chat.close()


def test_a_chat_answer_over_its_own_cap_is_refused(standin, chat):
    assert max_answer_bytes(6000) == 1024 * 1024
    assert chat.http.max_answer_bytes == 1024 * 1024
    huge = {"chunks": [{"start": 1, "end": 1, "summary": "s" * 200}] * 6000}  # about 1.3 MB
    standin.chat.script = [huge]
    with pytest.raises(Exception, match="over the size limit"):
        chat.complete_json([{"role": "user", "content": "[[1]] text"}], schema={}, name="n")
