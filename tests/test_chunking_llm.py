"""LLM chunking through the pipeline: a real SQLite file, the stand-in for both the embedding and
the chat API over real HTTP (scripted answers, faults), and the structural fallback."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import pytest
import structlog

from conftest import CORPUS, corpus_text
from testkit.standin_chat import ChatReply, automatic_chunks
from worker.bulk import index_item, index_items
from worker.chunking.llm import SUMMARY_MAX, units_of, windows_of
from worker.indexers import IndexOptions
from worker.providers.chat import ChatModel
from worker.settings import ChunkSettings
from worker.store.boundaries import SqliteBoundaryCache
from worker.store.items import add_item, get_state, update_content

CHAPTER = "ch04-01-what-is-ownership.md"  # 25 KB: several windows


def rows(db, item_id: int) -> list[dict]:
    return db.dicts(
        "SELECT c.chunk_index, c.content, c.summary, c.method, c.start_offset, c.end_offset, "
        "e.chunk_id IS NOT NULL AS has_vector FROM note_chunks c "
        "LEFT JOIN note_chunk_embeddings e ON e.chunk_id = c.id WHERE c.item_id = ? "
        "ORDER BY c.chunk_index",
        (item_id,),
    )


def assert_exact_and_covering(text: str, chunks: list[dict]) -> None:
    assert all(c["content"] == text[c["start_offset"] : c["end_offset"]] for c in chunks)
    covered = {i for c in chunks for i in range(c["start_offset"], c["end_offset"])}
    assert all(i in covered for i, ch in enumerate(text) if not ch.isspace())
    assert all(len(c["content"]) <= 1500 for c in chunks)


def test_a_good_answer_gives_llm_chunks_with_summaries(db, embedder, chat, standin):
    text = corpus_text(CHAPTER)
    item = add_item(db, kind="note", title="Ownership", content=text)
    result = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert result.status == "indexed" and result.chunk_method == "llm" and result.fallback is None
    chunks = rows(db, item)
    assert {c["method"] for c in chunks} == {"llm"} and all(c["has_vector"] for c in chunks)
    assert all(c["summary"] and len(c["summary"]) <= SUMMARY_MAX for c in chunks)
    assert_exact_and_covering(text, chunks)
    assert standin.chat.requests == len(windows_of(text, 6000)) >= 3
    # The summary goes into what is embedded, before the content.
    first = chunks[0]
    assert any(
        first["summary"] in t and t.index(first["summary"]) < t.index(first["content"])
        for t in standin.texts
        if first["content"] in t
    )
    state = get_state(db, item)
    assert state["chunk_method"] == "llm" and state["last_error"] is None


BAD_ANSWERS = {
    "not JSON": "Here are your chunks: 1-3, 4-9.",
    "wrong shape": {"boundaries": [1, 4, 9]},
    "ids out of range": lambda units: {
        "chunks": [{"start": 1, "end": len(units) + 5, "summary": "x"}]
    },
    "overlapping": lambda units: {
        "chunks": [
            {"start": 1, "end": 2, "summary": "a"},
            {"start": 2, "end": len(units), "summary": "b"},
        ]
    },
    "gapped": lambda units: {
        "chunks": [
            {"start": 1, "end": 1, "summary": "a"},
            {"start": 3, "end": len(units), "summary": "b"},
        ]
    },
    "empty list": {"chunks": []},
    "rewrites the text": lambda units: {
        "chunks": [{"start": 1, "end": len(units), "summary": "s", "text": "An invented text."}]
    },
    "HTTP 500": ChatReply(status=500, content="upstream exploded"),
    "timeout": ChatReply(delay=3.0, content="{}"),
    "refusal": ChatReply(refusal="I cannot help with chunking."),
    "cut off": ChatReply(content='{"chunks": [', finish_reason="length"),
}
REASONS = {
    "not JSON": "not JSON",
    "wrong shape": '"chunks" list',
    "ids out of range": "outside",
    "overlapping": "overlaps",
    "gapped": "gap",
    "empty list": "no chunks",
    "rewrites the text": "rewrites the text",
    "HTTP 500": "HTTP 500",
    "timeout": "timed out",
    "refusal": "refused",
    "cut off": "cut off",
}


@pytest.mark.parametrize("case", list(BAD_ANSWERS))
def test_each_bad_answer_falls_back_to_structure_and_says_why(db, embedder, chat, standin, case):
    text = corpus_text("ch04-03-slices.md")
    item = add_item(db, kind="note", title="Slices", content=text)
    standin.chat.script = [BAD_ANSWERS[case]] * 2  # asked once more, answers the same
    with structlog.testing.capture_logs() as logs:
        result = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert result.status == "indexed" and result.chunk_method == "structure"
    assert REASONS[case] in result.fallback
    chunks = rows(db, item)
    assert chunks and {c["method"] for c in chunks} == {"structure"}
    assert_exact_and_covering(text, chunks)
    state = get_state(db, item)
    assert state["chunk_method"] == "structure" and "fell back to structure" in state["last_error"]
    assert REASONS[case] in state["last_error"]
    fell_back = [e for e in logs if e["event"] == "[Chunk] LLM chunking fell back to structure"]
    assert fell_back and REASONS[case] in fell_back[0]["reason"]
    retried = case not in {"HTTP 500", "timeout"}  # an HTTP failure is final, a bad answer not
    assert standin.chat.requests == (2 if retried else 1)


def test_a_bad_answer_then_a_good_one_is_llm(db, embedder, chat, standin):
    text = "First paragraph of a short note.\n\nSecond paragraph, a little longer than that."
    item = add_item(db, kind="note", title="T", content=text)
    standin.chat.script = ["not json at all"]  # then the automatic model answers
    result = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert result.chunk_method == "llm" and standin.chat.requests == 2
    second = standin.chat.bodies[1]["messages"]
    assert "could not be used" in second[-1]["content"] and "not JSON" in second[-1]["content"]


def test_a_server_that_refuses_json_schema_is_asked_with_json_object(db, embedder, chat, standin):
    item = add_item(db, kind="note", title="T", content=corpus_text("ch04-03-slices.md"))
    standin.chat.reject_json_schema = True
    assert (
        index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat)).chunk_method
        == "llm"
    )
    kinds = [b["response_format"]["type"] for b in standin.chat.bodies]
    assert kinds[0] == "json_schema" and set(kinds[1:]) == {"json_object"}
    before = standin.chat.requests
    other = add_item(
        db, kind="note", title="U", content=corpus_text("ch04-02-references-and-borrowing.md")
    )
    index_item(db, other, embedder=embedder, options=IndexOptions(chat=chat))
    assert all(
        b["response_format"]["type"] == "json_object" for b in standin.chat.bodies[before:]
    )  # remembered


def test_a_60000_character_document_is_covered_end_to_end(db, embedder, chat, standin):
    parts, size = [], 0
    for path in sorted(CORPUS.glob("ch1[0-5]-*.md")):
        parts.append(path.read_text(encoding="utf-8"))
        size += len(parts[-1])
        if size > 60_000:
            break
    text = "\n\n".join(parts)[:61_000]
    text = text[: text.rindex("\n\n")] + "\n\nThe very last paragraph of the long document."
    item = add_item(db, kind="note", title="Long", content=text)
    result = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert result.chunk_method == "llm" and standin.chat.requests >= 10
    chunks = rows(db, item)
    assert_exact_and_covering(text, chunks)
    assert "The very last paragraph of the long document." in chunks[-1]["content"]


def test_text_under_500_characters_may_be_one_chunk(db, embedder, chat, standin):
    text = "A short note.\n\nWith two paragraphs, both brief.\n\nAnd a third."
    item = add_item(db, kind="note", title="T", content=text)
    standin.chat.script = [
        lambda units: {"chunks": [{"start": 1, "end": len(units), "summary": "A short note."}]}
    ]
    index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    chunks = rows(db, item)
    assert len(chunks) == 1 and chunks[0]["content"] == text and chunks[0]["method"] == "llm"
    assert db.scalar("SELECT count(*) FROM vec_note_embeddings WHERE item_id = ?", (item,)) == 1


def test_unchanged_text_calls_nothing_and_an_edit_re_asks_only_its_window(
    db, embedder, chat, standin
):
    text = corpus_text(CHAPTER)
    item = add_item(db, kind="note", title="Ownership", content=text)
    index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    first = [(c["start_offset"], c["content"], c["summary"]) for c in rows(db, item)]
    chats, embeds = standin.chat.requests, standin.requests
    again = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert standin.chat.requests == chats and standin.requests == embeds
    assert again.embedded == 0 and again.reused == len(first)
    assert [(c["start_offset"], c["content"], c["summary"]) for c in rows(db, item)] == first
    at = text.index(".\n\n", len(text) // 2) + 1
    update_content(db, item, text[:at] + " A sentence added by the test." + text[at:])
    standin.texts.clear()
    edited = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert 1 <= standin.chat.requests - chats <= 2  # the window that changed (and a neighbour)
    assert edited.embedded <= 4 and edited.reused >= len(first) - 4
    assert len(standin.texts) == edited.embedded


def test_no_chunk_model_means_structure_and_no_chat_call(db, embedder, standin):
    item = add_item(db, kind="note", title="T", content=corpus_text("ch04-03-slices.md"))
    result = index_item(db, item, embedder=embedder, options=IndexOptions(chat=None))
    assert result.chunk_method == "structure" and result.fallback is None
    assert standin.chat.requests == 0
    assert get_state(db, item)["last_error"] is None


def test_structure_only_skips_the_model_for_one_run(db, embedder, chat, standin):
    item = add_item(db, kind="note", title="T", content=corpus_text("ch04-03-slices.md"))
    result = index_item(
        db, item, embedder=embedder, options=IndexOptions(chat=chat, structure_only=True)
    )
    assert result.chunk_method == "structure" and standin.chat.requests == 0


def test_summaries_are_trimmed_or_dropped_and_sizes_repaired(db, embedder, chat, standin):
    text = corpus_text(CHAPTER)
    item = add_item(db, kind="note", title="T", content=text)

    def answer(units: list[str]) -> dict:
        # One huge chunk (split structurally), then tiny ones (merged), odd summaries.
        chunks = [{"start": 1, "end": len(units) // 2, "summary": "word " * 100}]
        chunks += [
            {"start": i, "end": i, "summary": ""}
            for i in range(len(units) // 2 + 1, len(units) + 1)
        ]
        return {"chunks": chunks}

    standin.chat.script = [answer] * 10
    index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    chunks = rows(db, item)
    assert_exact_and_covering(text, chunks)
    assert all(c["summary"] is None or len(c["summary"]) <= SUMMARY_MAX for c in chunks)
    assert any(c["summary"] is None for c in chunks)  # empty summaries dropped
    small = [c for c in chunks if len(c["content"]) < 150]
    assert len(small) <= 2  # tiny chunks were merged into neighbours


def test_a_lone_surrogate_in_a_summary_is_replaced_not_a_failed_item(db, embedder, chat, standin):
    # The model's JSON escapes a lone surrogate ("\\ud800"): it parses, but it cannot be
    # encoded as UTF-8, so storing or embedding the chunk failed the item, and the cached
    # answer failed every later run too.
    text = corpus_text("ch04-03-slices.md")
    windows = windows_of(text, 6000)
    standin.chat.script = [
        lambda units: {"chunks": [{"start": 1, "end": len(units), "summary": "about \ud800 it"}]}
    ] * len(windows)
    item = add_item(db, kind="note", title="Slices", content=text)
    result = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert result.status == "indexed" and result.chunk_method == "llm" and result.fallback is None
    chunks = rows(db, item)
    assert_exact_and_covering(text, chunks)
    assert all(c["has_vector"] for c in chunks)
    assert {c["summary"] for c in chunks} == {"about \ufffd it"}
    cached = SqliteBoundaryCache(db).get(chat.model_id, windows[0].key)
    assert cached is not None and cached[0][2] == "about \ufffd it"
    assert standin.chat.requests == len(windows)
    again = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert again.status == "indexed" and again.chunk_method == "llm"
    assert standin.chat.requests == len(windows)  # the cached answer is used as it is


def test_units_cover_the_text_and_keep_fences_whole():
    text = corpus_text(CHAPTER)
    units = units_of(text, 0, len(text))
    covered = {i for u in units for i in range(u.start, u.end)}
    assert all(i in covered for i, ch in enumerate(text) if not ch.isspace())
    for u in units:
        piece = text[u.start : u.end]
        assert piece.count("```") % 2 == 0, piece[:80]
    windows = windows_of(text, 6000)
    assert all(sum(u.end - u.start for u in w.units) <= 6000 for w in windows)
    assert json.dumps([w.key for w in windows]) == json.dumps(
        [w.key for w in windows_of(text, 6000)]
    )


# A cached row of chunk_boundaries as a host or an older version may have left it, for a window
# of n units: each must be a cache miss (asked again, then structure), never a failed item.
JUNK_ROWS: dict[str, Callable[[int], str | bytes]] = {
    "out of range": lambda n: f"[[1, {n + 50}, null]]",
    "not JSON": lambda n: "chunks 1-3, then 4-9",
    "nested too deep": lambda n: "[" * 100_000,
    "not UTF-8": lambda n: b'[[1, 2, "\xff"]]',
    "not a list": lambda n: json.dumps({"chunks": [[1, n, None]]}),
    "objects": lambda n: json.dumps([{"start": 1, "end": n, "summary": "s"}]),
    "a string end": lambda n: json.dumps([[1, str(n), None]]),
    "a bool start": lambda n: json.dumps([[True, n, None]]),
    "a number summary": lambda n: json.dumps([[1, n, 5]]),
    "decreasing": lambda n: json.dumps([[2, n, "b"], [1, 1, "a"]]),
    "a gap": lambda n: json.dumps([[1, 1, "a"], [3, n, "b"]]),
    "huge list": lambda n: json.dumps([[i, i, None] for i in range(1, 100_001)]),
    # An older version cached a summary with a lone surrogate: JSON escapes it, but it cannot
    # be stored or embedded, so the row stays a miss (the model is asked again).
    "a lone surrogate summary": lambda n: json.dumps([[1, n, "about \ud800 things"]]),
}


@pytest.mark.parametrize("case", list(JUNK_ROWS))
def test_a_junk_cached_boundary_row_is_a_miss_not_a_failed_item(db, embedder, chat, standin, case):
    text = corpus_text("ch04-03-slices.md")
    windows = windows_of(text, 6000)
    first = windows[0]
    assert len(first.units) >= 3
    junk = JUNK_ROWS[case](len(first.units))
    db.execute(  # as TEXT, as a host writes it (bytes that are not UTF-8 included)
        "INSERT INTO chunk_boundaries(model, window_hash, boundaries) "
        "VALUES (?, ?, CAST(? AS TEXT))",
        (chat.model_id, first.key, junk),
    )
    item = add_item(db, kind="note", title="Slices", content=text)
    result = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert result.status == "indexed" and result.chunk_method == "llm" and result.fallback is None
    assert standin.chat.requests == len(windows)  # the junk window was asked again
    assert_exact_and_covering(text, rows(db, item))
    fresh = SqliteBoundaryCache(db).get(chat.model_id, first.key)  # the answer replaced it
    assert fresh is not None and fresh[0][0] == 1 and fresh[-1][1] == len(first.units)


def test_a_junk_cached_row_and_a_failing_chunk_model_fall_back_to_structure(
    db, embedder, chat, standin
):
    text = corpus_text("ch04-03-slices.md")
    key = windows_of(text, 6000)[0].key
    db.execute(
        "INSERT INTO chunk_boundaries(model, window_hash, boundaries) VALUES (?, ?, ?)",
        (chat.model_id, key, "[[1, 99999, null]]"),
    )
    standin.chat.script = [ChatReply(status=500, content="upstream exploded")] * 2
    item = add_item(db, kind="note", title="Slices", content=text)
    result = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert result.status == "indexed" and result.chunk_method == "structure"
    assert "HTTP 500" in result.fallback
    assert_exact_and_covering(text, rows(db, item))


# -- the deadline of LLM chunking (KIDX_CHUNK__DEADLINE) --------------------------------------


@pytest.fixture
def patient_chat(standin) -> Iterator[ChatModel]:
    """A chunk model that would wait a minute for an answer: only the deadline cuts sooner."""
    model = ChatModel(
        ChunkSettings(
            model="standin-chat",
            base_url=standin.base_url,
            timeout=60,
            max_retries=2,
            backoff=30,
            backoff_max=30,
        ),
        rand=lambda: 1.0,  # every backoff its whole 30 s
    )
    yield model
    model.close()


def test_llm_chunking_past_its_deadline_falls_back_and_keeps_the_answers_it_had(
    db, embedder, patient_chat, standin
):
    """The second window's answer is held far past the deadline: the call in flight is cut
    at it, the item is chunked structurally (indexed, the reason kept), the call counts as
    one the model failed, and the next run asks only the windows not answered yet."""
    text = corpus_text(CHAPTER)
    windows = len(windows_of(text, 6000))
    item = add_item(db, kind="note", title="Ownership", content=text)
    standin.chat.script = [automatic_chunks, ChatReply(delay=30, content="{}")]
    options = IndexOptions(chat=patient_chat, chunk_deadline=1.0)
    started = time.monotonic()
    result = index_item(db, item, embedder=embedder, options=options)
    assert time.monotonic() - started < 10  # not the held answer's 30 s, nor the timeout
    assert result.status == "indexed" and result.chunk_method == "structure"
    assert f"1 of {windows} windows answered" in result.fallback
    assert "KIDX_CHUNK__DEADLINE" in get_state(db, item)["last_error"]
    assert {c["method"] for c in rows(db, item)} == {"structure"}
    assert standin.chat.requests == 2
    assert patient_chat.streak.current()[0] == 1  # it had the request and did not answer
    # Not one of the item's attempts: the run got a window further (a text of more windows
    # than KIDX_TASKS__RETRY_MAX_ATTEMPTS stayed structural for good).
    assert db.scalar("SELECT attempts FROM item_index_state WHERE item_id = ?", (item,)) == 0
    standin.chat.script = []  # the automatic model answers at once
    again = index_item(db, item, embedder=embedder, options=options)
    assert again.chunk_method == "llm" and again.fallback is None
    assert standin.chat.requests == 2 + windows - 1  # the first window's answer was kept


def test_a_retry_that_would_wait_past_the_deadline_is_not_waited_for(
    db, embedder, patient_chat, standin
):
    item = add_item(db, kind="note", title="T", content=corpus_text("ch04-03-slices.md"))
    standin.chat.fail_status, standin.chat.fail_times = 503, 1  # then it would answer
    started = time.monotonic()
    result = index_item(
        db, item, embedder=embedder, options=IndexOptions(chat=patient_chat, chunk_deadline=2.0)
    )
    assert time.monotonic() - started < 10  # the 30 s backoff was not slept
    assert result.chunk_method == "structure" and "KIDX_CHUNK__DEADLINE" in result.fallback
    assert standin.chat.requests == 1


def test_without_a_deadline_a_slow_answer_is_waited_for(db, embedder, patient_chat, standin):
    text = "First paragraph of a short note.\n\nSecond paragraph, a little longer than that."
    item = add_item(db, kind="note", title="T", content=text)
    standin.chat.delay = 1.5
    result = index_item(
        db, item, embedder=embedder, options=IndexOptions(chat=patient_chat, chunk_deadline=30)
    )
    assert result.chunk_method == "llm" and standin.chat.requests == 1


def test_a_model_that_never_answers_within_the_deadline_is_taken_for_down(db, embedder, standin):
    """Every call cut unanswered counts: after `down_after` of them the model is not asked
    (each item would otherwise wait the whole deadline)."""
    chat = ChatModel(
        ChunkSettings(model="standin-chat", base_url=standin.base_url, timeout=60, down_after=2)
    )
    standin.chat.delay = 30
    options = IndexOptions(chat=chat, chunk_deadline=0.5)
    try:
        results = [
            index_item(
                db,
                add_item(db, kind="note", title=f"T{i}", content=corpus_text("ch04-03-slices.md")),
                embedder=embedder,
                options=options,
            )
            for i in range(3)
        ]
    finally:
        chat.close()
    assert [r.chunk_method for r in results] == ["structure"] * 3
    assert "KIDX_CHUNK__DEADLINE" in results[1].fallback
    assert "taken for down" in results[2].fallback
    assert standin.chat.requests == 2  # the third item asked nothing


def test_a_deadline_passed_before_any_call_is_not_the_model_s_failure(db, embedder, standin):
    chat = ChatModel(ChunkSettings(model="standin-chat", base_url=standin.base_url))
    item = add_item(db, kind="note", title="T", content=corpus_text("ch04-03-slices.md"))
    try:
        result = index_item(
            db, item, embedder=embedder, options=IndexOptions(chat=chat, chunk_deadline=1e-9)
        )
        assert chat.streak.current()[0] == 0
    finally:
        chat.close()
    assert result.chunk_method == "structure" and "0 of" in result.fallback
    assert standin.chat.requests == 0


def test_the_prompt_asks_for_the_seed_s_sizes(db, embedder, chat, standin):
    """The seed: the prompt asks for 300-1500 characters per chunk; text under 500 characters
    may return a single chunk. What the server received, in its system and user messages."""
    item = add_item(db, kind="note", title="Slices", content=corpus_text("ch04-03-slices.md"))
    index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    body = standin.chat.bodies[0]
    asked = " ".join(str(m["content"]) for m in body["messages"])
    assert "300 to 1500 characters per chunk" in asked
    assert "a text under 500 characters may be one chunk" in asked
    assert body["temperature"] == 0 and body["response_format"]["type"] == "json_schema"


def test_a_line_that_starts_like_a_unit_marker_is_shown_escaped(db, embedder, chat, standin):
    """A wiki link at a line's start (`[[2]] is ...`) read as unit 2 of a one-unit window:
    the answer naming it was refused twice and the item fell back, at every sweep."""
    text = (
        "Meeting notes, see the linked page below for the plan.\n"
        "[[2]] is the page id of the plan in our wiki, kept for reference.\n"
    )
    item = add_item(db, kind="note", title="Wiki", content=text)
    result = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert result.chunk_method == "llm" and result.fallback is None
    asked = standin.chat.bodies[0]["messages"][-1]["content"]
    assert "\n\\[[2]] is the page id" in asked and standin.chat.requests == 1
    assert_exact_and_covering(text, rows(db, item))


def _links(db, item: int) -> int:
    return int(db.scalar("SELECT count(*) FROM chunk_windows WHERE item_id = ?", (item,)))


def _unlinked(db) -> int:
    """Cached windows no item's text holds."""
    return int(
        db.scalar(
            "SELECT count(*) FROM chunk_boundaries b WHERE NOT EXISTS (SELECT 1 FROM "
            "chunk_windows w WHERE w.model = b.model AND w.window_hash = b.window_hash)"
        )
    )


def test_the_boundary_cache_keeps_the_windows_items_hold_and_goes_with_them(
    db, embedder, chat, standin, host
):
    """Each edit left the old windows' rows (model summaries of text no item holds), and a
    deleted note's stayed in the file for good, by `kidx delete` or by a host's DELETE. A
    window two notes hold (a copy) stays while either does: unchanged text never asks the
    model again."""
    text = corpus_text(CHAPTER)
    item = add_item(db, kind="note", title="Ownership", content=text)
    copy = add_item(db, kind="note", title="Copy", content=text)
    other = add_item(db, kind="note", title="Slices", content=corpus_text("ch04-03-slices.md"))
    options = IndexOptions(chat=chat)
    for each in (item, copy, other):
        assert index_item(db, each, embedder=embedder, options=options).chunk_method == "llm"
    windows = len(windows_of(text, 6000))
    asked = standin.chat.requests
    assert _links(db, item) == _links(db, copy) == windows and _unlinked(db) == 0
    for n in range(3):  # the last paragraph edited each time: its window alone is new
        update_content(db, item, text + f"\n\nAn edit, number {n}, at the end.\n")
        assert index_item(db, item, embedder=embedder, options=options).chunk_method == "llm"
    assert _links(db, item) == windows and _unlinked(db) == 0  # no edit's window left over
    assert standin.chat.requests == asked + 3  # one window a time
    asked = standin.chat.requests
    assert index_item(db, copy, embedder=embedder, options=options).chunk_method == "llm"
    assert standin.chat.requests == asked  # the copy's windows stayed for it
    host.execute("DELETE FROM knowledge_items WHERE id = ?", (item,))  # a host's, plain SQL
    assert _links(db, item) == 0 and _unlinked(db) == 0
    assert index_item(db, copy, embedder=embedder, options=options).chunk_method == "llm"
    assert standin.chat.requests == asked  # what the copy holds is still there
    total = int(db.scalar("SELECT count(*) FROM chunk_boundaries"))
    host.execute("DELETE FROM knowledge_items WHERE id = ?", (copy,))
    assert int(db.scalar("SELECT count(*) FROM chunk_boundaries")) == total - windows
    assert _links(db, other) > 0 and _unlinked(db) == 0


def test_windows_an_older_kidx_cached_are_linked_by_the_item_that_uses_them(db, embedder, chat):
    """Rows cached before windows were linked to items are linked when an item's whole text
    is chunked from them, and go with its windows from then on; those no item uses stay."""
    text = corpus_text("ch04-03-slices.md")
    item = add_item(db, kind="note", title="Slices", content=text)
    index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    db.execute("DELETE FROM chunk_windows")  # as the earlier schema left them
    db.execute(
        "INSERT INTO chunk_boundaries(model, window_hash, boundaries) VALUES (?, 'old', '[]')",
        (chat.model_id,),
    )
    index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert _links(db, item) == len(windows_of(text, 6000)) and _unlinked(db) == 1  # 'old'
    update_content(db, item, "A short note now, of one window.")
    index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert _links(db, item) == 1 and _unlinked(db) == 1
    assert int(db.scalar("SELECT count(*) FROM chunk_boundaries")) == 2


def test_windows_cached_by_a_run_that_fell_back_go_with_the_item(db, embedder, chat, standin, host):
    """A run that cached some windows and then fell back to structure wrote no link: the
    rows stayed for good, a deleted note's model summaries with them."""
    text = corpus_text(CHAPTER)
    item = add_item(db, kind="note", title="Ownership", content=text)
    standin.chat.script = [automatic_chunks] + [ChatReply(status=400, content="no")] * 4
    result = index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat))
    assert result.chunk_method == "structure"
    assert db.scalar("SELECT count(*) FROM chunk_boundaries") == 1 and _links(db, item) == 1
    host.execute("DELETE FROM knowledge_items WHERE id = ?", (item,))
    assert db.scalar("SELECT count(*) FROM chunk_boundaries") == 0


def test_a_copy_indexed_with_the_original_s_edit_keeps_the_windows_it_holds(
    db, embedder, chat, standin
):
    """One run of an edited note and its earlier copy: the original's write unlinked the old
    windows before the copy's write linked them (its chunking had read them from the cache),
    and they went: the copy's next edit asked the model for every window."""
    text = corpus_text(CHAPTER)
    item = add_item(db, kind="note", title="Ownership", content=text)
    options = IndexOptions(chat=chat)
    index_item(db, item, embedder=embedder, options=options)
    copy = add_item(db, kind="note", title="Copy", content=text)
    update_content(db, item, "A short note now, of one window.")
    index_items(db, [item, copy], embedder=embedder, options=options)
    windows = len(windows_of(text, 6000))
    assert _links(db, copy) == windows and _unlinked(db) == 0
    held = db.scalar(
        "SELECT count(*) FROM chunk_boundaries b JOIN chunk_windows w ON w.model = b.model "
        "AND w.window_hash = b.window_hash WHERE w.item_id = ?",
        (copy,),
    )
    assert held == windows
    asked = standin.chat.requests
    update_content(db, copy, text + "\n\nAn edit at the end.\n")
    index_item(db, copy, embedder=embedder, options=options)
    assert standin.chat.requests == asked + 1  # its last window alone


def test_an_item_a_host_renumbers_keeps_its_windows(db, embedder, chat, standin, host):
    text = corpus_text("ch04-03-slices.md")
    item = add_item(db, kind="note", title="Slices", content=text)
    options = IndexOptions(chat=chat)
    index_item(db, item, embedder=embedder, options=options)
    cached = db.scalar("SELECT count(*) FROM chunk_boundaries")
    host.execute("UPDATE knowledge_items SET id = 500 WHERE id = ?", (item,))
    assert db.scalar("SELECT count(*) FROM chunk_boundaries") == cached
    assert _links(db, 500) == cached and _links(db, item) == 0
