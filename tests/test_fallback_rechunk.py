"""Items that fell back to structure are asked of the chunk model again (worker.reconcile).

A fallback keeps the index (the seed), but before this an outage of the chunk model left every
item indexed meanwhile structurally chunked for good. The chunk model is a real HTTP stand-in;
the sweep's findings are the engine's (`reconcile`), the runs are `index_item`'s.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from conftest import corpus_text
from worker.bulk import index_item
from worker.chunking import FELL_BACK
from worker.indexers import IndexOptions
from worker.providers.chat import ChatModel
from worker.reconcile import Backoff, reconcile
from worker.settings import ChunkSettings
from worker.store.items import add_item, summary
from worker.store.jobs import record_queued

TEXT = corpus_text("ch04-03-slices.md")
NOW = Backoff(max_attempts=3, backoff=0.0, backoff_max=0.0)  # every wait has passed


@pytest.fixture
def chat(standin) -> Iterator[ChatModel]:
    model = ChatModel(
        ChunkSettings(
            model="standin-chat", base_url=standin.base_url, max_retries=0, timeout=2, down_after=2
        )
    )
    yield model
    model.close()


def get_state(db, item: int) -> dict:
    return db.dicts("SELECT * FROM item_index_state WHERE item_id = ?", (item,))[0]


def run(db, embedder, chat, item: int, **options: object):
    return index_item(db, item, embedder=embedder, options=IndexOptions(chat=chat, **options))


def fell_back(db, *, rechunk: int = 100, backoff: Backoff | None = NOW) -> list[int]:
    drift = reconcile(db, model="standin-embed", max_items=100, backoff=backoff, rechunk=rechunk)
    assert set(drift.found["fell_back"]) <= set(drift.to_index)
    return drift.found["fell_back"]


def failing_item(db, embedder, chat, standin, title: str = "Slices") -> int:
    standin.chat.fail_status = 503
    item = add_item(db, kind="note", title=title, content=TEXT)
    result = run(db, embedder, chat, item)
    standin.chat.fail_status = None
    assert result.chunk_method == "structure" and "HTTP 503" in result.fallback
    return item


def test_an_item_that_fell_back_is_chunked_by_the_model_once_it_answers(
    db, embedder, chat, standin
):
    item = failing_item(db, embedder, chat, standin)
    state = get_state(db, item)
    assert state["status"] == "indexed" and state["last_error"].startswith(FELL_BACK)
    assert state["attempts"] == 1  # a fallback the model was asked for is an attempt

    assert fell_back(db) == [item]
    asked = standin.chat.requests
    result = run(db, embedder, chat, item)  # the run the sweep sends
    assert result.chunk_method == "llm" and result.fallback is None
    assert standin.chat.requests > asked
    state = get_state(db, item)
    assert (state["chunk_method"], state["last_error"], state["attempts"]) == ("llm", None, 0)
    assert fell_back(db) == []  # done: not sent again
    methods = db.all("SELECT DISTINCT method FROM note_chunks WHERE item_id = ?", (item,))
    assert methods == [("llm",)]


def test_without_a_chunk_model_or_a_backoff_nothing_is_sent_for_it(db, embedder, chat, standin):
    item = failing_item(db, embedder, chat, standin)
    assert fell_back(db, rechunk=0) == []  # no chunk model configured now
    assert fell_back(db, backoff=None) == []  # as a partial item: never without a backoff
    assert fell_back(db) == [item]


def test_each_fallback_waits_its_backoff_and_the_attempts_run_out(db, embedder, chat, standin):
    item = failing_item(db, embedder, chat, standin)
    assert fell_back(db, backoff=Backoff(3, backoff=3600.0, backoff_max=7200.0)) == []
    standin.chat.fail_status = 503
    for attempts in (2, 3):
        assert fell_back(db) == [item]
        chat.streak.ok()  # (not taken for down: asked each time)
        run(db, embedder, chat, item)
        assert get_state(db, item)["attempts"] == attempts
    assert fell_back(db) == []  # three fallbacks in a row: left as it is (an admin reindexes)


def test_while_the_model_is_taken_for_down_one_item_goes_as_a_probe(db, embedder, chat, standin):
    first = failing_item(db, embedder, chat, standin, "One")
    second = failing_item(db, embedder, chat, standin, "Two")
    assert chat.taken_for_down()  # two failed calls in a row (down_after = 2)
    assert fell_back(db, rechunk=1) == [first]  # the oldest
    # a run queued for the first: the probe is the next one, not none
    record_queued(db, "t-1", "kidx.index_item", first, None, "reconcile")
    assert fell_back(db, rechunk=1) == [second]


def test_failed_runs_before_a_fallback_are_not_the_model_s_attempts(
    db, host, embedder, chat, standin
):
    """Attempts an item spent failing (the embedder's) counted on into its fallbacks: one
    failed twice, then indexed while the chunk model was down, was asked of it once, or not
    at all, before `max_attempts` left it structurally chunked for good."""
    item = failing_item(db, embedder, chat, standin)
    host.execute(
        "UPDATE item_index_state SET status = 'failed', attempts = 2, last_error = 'HTTP 500' "
        "WHERE item_id = ?",
        (item,),
    )
    chat.streak.ok()
    standin.chat.fail_status = 503
    run(db, embedder, chat, item)  # indexed again, the chunk model failing it
    assert get_state(db, item)["attempts"] == 1  # its first fallback, not a third attempt
    assert fell_back(db) == [item]


def test_a_fallback_the_model_was_not_asked_for_is_no_attempt(db, embedder, chat, standin):
    failing_item(db, embedder, chat, standin, "One")
    failing_item(db, embedder, chat, standin, "Two")
    asked = standin.chat.requests
    third = add_item(db, kind="note", title="Three", content=TEXT)
    result = run(db, embedder, chat, third)  # taken for down: not asked
    assert result.chunk_method == "structure" and "taken for down" in result.fallback
    assert standin.chat.requests == asked
    state = get_state(db, third)
    assert state["last_error"].startswith(FELL_BACK) and state["attempts"] == 0
    assert third in fell_back(db)  # still asked again: it never was


def test_a_deadline_gone_before_any_call_is_no_attempt(db, embedder, chat, standin):
    item = add_item(db, kind="note", title="T", content=TEXT)
    result = run(db, embedder, chat, item, chunk_deadline=1e-9)
    assert result.chunk_method == "structure" and standin.chat.requests == 0
    assert get_state(db, item)["attempts"] == 0
    assert fell_back(db) == [item]


def test_structure_by_choice_is_never_sent_for_the_model(db, embedder, chat, standin):
    by_settings = add_item(db, kind="note", title="No model", content=TEXT)
    run(db, embedder, None, by_settings)
    by_task = add_item(db, kind="note", title="Structure only", content=TEXT)
    run(db, embedder, chat, by_task, structure_only=True)
    assert standin.chat.requests == 0
    failed = failing_item(db, embedder, chat, standin)
    assert fell_back(db) == [failed]


def test_a_host_s_values_in_the_state_row_are_read_not_a_crash(db, host, embedder, chat, standin):
    item = failing_item(db, embedder, chat, standin)
    other = failing_item(db, embedder, chat, standin, "Other")
    host.execute(
        "UPDATE item_index_state SET attempts = X'01', last_error = CAST(last_error AS BLOB) "
        "WHERE item_id = ?",
        (item,),
    )
    host.execute("UPDATE item_index_state SET updated_at = 'soon' WHERE item_id = ?", (other,))
    # bytes for attempts: resting, as a failed item's; no time: the wait has passed
    assert fell_back(db) == [other]


def test_kidx_status_counts_the_items_that_fell_back_apart(db, embedder, chat, standin):
    failing_item(db, embedder, chat, standin)
    run(db, embedder, None, add_item(db, kind="note", title="No model", content=TEXT))
    run(db, embedder, chat, add_item(db, kind="note", title="Asked", content=TEXT))
    assert summary(db)["by_chunk_method"] == {"llm": 1, "structure": 1, "structure (fell back)": 1}


def test_a_fallback_after_the_model_s_chunks_cuts_by_structure_not_at_the_model_s_cuts(
    db, embedder, chat, standin
):
    """An item the chunk model cut, edited, then run while the model is down: the structural
    chunker was given the model's chunks as the previous version's and kept their cuts (2
    chunks across 4 headings came back as 2): it cuts as structure does now."""
    from worker.chunking import chunk_structure
    from worker.store.items import update_content

    item = add_item(db, kind="note", title="Slices", content=TEXT)
    assert run(db, embedder, chat, item).chunk_method == "llm"
    by_model = db.all(
        "SELECT start_offset, end_offset FROM note_chunks WHERE item_id = ? ORDER BY chunk_index",
        (item,),
    )
    edited = TEXT.replace("\n\n", "\n\nAn edit. ", 1)
    update_content(db, item, edited)
    standin.chat.fail_status = 503
    result = run(db, embedder, chat, item)
    assert result.chunk_method == "structure" and "HTTP 503" in result.fallback
    spans = db.all(
        "SELECT start_offset, end_offset FROM note_chunks WHERE item_id = ? ORDER BY chunk_index",
        (item,),
    )
    assert spans == [(c.start, c.end) for c in chunk_structure(edited)]
    assert spans != by_model
