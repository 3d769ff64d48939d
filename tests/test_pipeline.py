"""The per-item pipeline against a real SQLite file with sqlite-vec and the HTTP stand-in."""

from __future__ import annotations

import threading
from collections import Counter

import apsw
import numpy as np
import pytest

from conftest import (
    DIMS,
    FakeEmbedder,
    corpus_text,
    keyword_rows_problems,
    mirror_problems,
    standin_settings,
)
from worker.bulk import index_item, index_items
from worker.chunking import chunk_structure, text_hash
from worker.errors import Cancelled, IndexAborted, StoreError
from worker.indexers import IndexOptions
from worker.reconcile import reconcile
from worker.retrieval import Filters, search_chunks
from worker.sources import Reader
from worker.store import connect
from worker.store.items import add_item, get_state, list_chunks, update_content

CHAPTER = "ch10-02-traits.md"  # 20 chunks or more


def embedding_inputs(text: str, previous=None) -> list[str]:
    """What the pipeline embeds for each chunk: no title (a rename would re-embed them all)."""
    return [c.embedding_input("") for c in chunk_structure(text, previous=previous)]


def snapshot(db, item_id: int) -> dict[str, object]:
    """Everything the index holds for an item, to compare before and after."""
    ids = [r[0] for r in db.all("SELECT id FROM note_chunks WHERE item_id = ?", (item_id,))]
    marks = ",".join("?" * len(ids)) or "NULL"
    return {
        "chunks": db.all(
            "SELECT id, chunk_index, content, embed_hash FROM note_chunks WHERE item_id = ? "
            "ORDER BY chunk_index",
            (item_id,),
        ),
        "vectors": db.all(
            "SELECT chunk_id, model, vector FROM note_chunk_embeddings "
            f"WHERE chunk_id IN ({marks}) ORDER BY chunk_id",
            ids,
        ),
        "vec": db.all(
            f"SELECT chunk_id FROM vec_chunk_embeddings WHERE chunk_id IN ({marks}) "
            "ORDER BY chunk_id",
            ids,
        ),
        "whole": db.all("SELECT item_id FROM vec_note_embeddings WHERE item_id = ?", (item_id,)),
    }


def test_no_provider_writes_nothing_and_skips(db):
    item = add_item(db, kind="note", title="T", content="Some text to index.")
    result = index_item(db, item, embedder=None)
    assert result.status == "skipped"
    assert get_state(db, item)["status"] == "skipped"
    assert "no embedding provider" in get_state(db, item)["last_error"]
    assert db.scalar("SELECT count(*) FROM note_chunks") == 0
    assert db.scalar("SELECT count(*) FROM note_chunk_embeddings") == 0
    assert db.scalar("SELECT count(*) FROM vec_chunk_embeddings") == 0


def test_first_run_embeds_every_chunk_and_mirrors_it(db, embedder, standin):
    text = corpus_text(CHAPTER)
    item = add_item(db, kind="note", title="Traits", content=text)
    result = index_item(db, item, embedder=embedder)
    expected = embedding_inputs(text)
    assert result.status == "indexed" and result.chunks == len(expected) >= 20
    assert sorted(standin.texts) == sorted(expected)
    assert db.scalar("SELECT count(*) FROM vec_chunk_embeddings") == len(expected)
    rows = db.all(
        "SELECT content, start_offset, end_offset FROM note_chunks WHERE item_id = ?", (item,)
    )
    assert all(content == text[s:e] for content, s, e in rows)
    # Vectors are the provider's, stored as float32 in both places.
    blob = db.scalar("SELECT vector FROM note_chunk_embeddings LIMIT 1")
    assert len(blob) == 4 * DIMS


@pytest.mark.parametrize("edit", ["sentence", "insert_near_top"])
def test_an_edit_sends_only_changed_chunks(db, embedder, standin, edit):
    text = corpus_text(CHAPTER)
    item = add_item(db, kind="note", title="Traits", content=text)
    index_item(db, item, embedder=embedder)
    if edit == "sentence":
        at = text.index(".\n\n", len(text) // 2) + 1  # the end of a prose paragraph
        edited = text[:at] + " One more sentence, added by the test." + text[at:]
    else:
        at = text.index(".\n\n", 300) + 1
        edited = text[:at] + "\n\nA paragraph inserted near the top by the test." + text[at:]
    update_content(db, item, edited)
    previous = db.all(
        "SELECT start_offset, content FROM note_chunks WHERE item_id = ? ORDER BY chunk_index",
        (item,),
    )
    standin.texts.clear()
    result = index_item(db, item, embedder=embedder)
    before = Counter(embedding_inputs(text))
    after = Counter(embedding_inputs(edited, previous))
    changed = sorted((after - before).elements())
    assert 1 <= len(changed) <= 3
    assert sorted(standin.texts) == changed  # exactly the new chunks, nothing else
    assert result.embedded == len(changed) and result.reused == result.chunks - len(changed)
    assert db.scalar("SELECT count(*) FROM vec_chunk_embeddings") == result.chunks


def test_content_changed_directly_in_the_database_is_seen(db, embedder, standin):
    item = add_item(db, kind="note", title="T", content="First version of the note.")
    index_item(db, item, embedder=embedder)
    db.execute(
        "UPDATE knowledge_items SET content = 'Second version, written by a host app.' "
        "WHERE id = ?",
        (item,),
    )
    standin.texts.clear()
    index_item(db, item, embedder=embedder)
    assert standin.texts == ["Second version, written by a host app."]
    assert db.scalar("SELECT content FROM note_chunks WHERE item_id = ?", (item,)).startswith(
        "Second"
    )
    state = db.one("SELECT indexed_hash FROM item_index_state WHERE item_id = ?", (item,))
    assert state[0] == text_hash("Second version, written by a host app.")


class EditsMidRun(FakeEmbedder):
    """Runs `edit` (a host's or `kidx update`'s change) at its first request: while the run
    that read the item is embedding it."""

    def __init__(self, edit) -> None:
        super().__init__()
        self.edit = edit

    def embed_batch(self, texts: list[str]) -> np.ndarray:
        if not self.calls:
            self.edit()
        return super().embed_batch(texts)


@pytest.mark.parametrize("how", ["host SQL", "kidx update", "host SQL with its hash"])
def test_an_edit_during_the_run_is_never_recorded_as_indexed(db, emb_settings, tmp_path, how):
    """The run indexed the text it read; the row holds another now. Its hash must still say so
    (NULL from the trigger, or the editor's), for the sweep: the run does not write the hash
    of the text it read over it."""
    item = add_item(db, kind="note", title="t", content="Old text about apples. " * 3)
    new = "New text about oranges."
    other = connect(db.path, embedding=emb_settings)

    def edit() -> None:
        if how == "kidx update":
            update_content(other, item, new)
        elif how == "host SQL":
            other.execute("UPDATE knowledge_items SET content = ? WHERE id = ?", (new, item))
        else:
            other.execute(
                "UPDATE knowledge_items SET content = ?, content_hash = ? WHERE id = ?",
                (new, text_hash(new), item),
            )

    try:
        index_item(db, item, embedder=EditsMidRun(edit))
    finally:
        other.close()
    assert db.scalar("SELECT content FROM note_chunks WHERE item_id = ?", (item,)).startswith("Old")
    stored = db.scalar("SELECT content_hash FROM knowledge_items WHERE id = ?", (item,))
    assert stored in (None, text_hash(new))
    assert reconcile(db, model="fake", max_items=10).to_index == [item]
    index_item(db, item, embedder=FakeEmbedder())  # the sweep's run: the new text, its hash
    assert db.scalar("SELECT content FROM note_chunks WHERE item_id = ?", (item,)) == new
    assert db.scalar("SELECT content_hash FROM knowledge_items WHERE id = ?", (item,)) == (
        text_hash(new)
    )


def test_a_wrong_hash_a_host_wrote_is_mended_by_a_run_of_the_same_text(db):
    item = add_item(db, kind="note", title="t", content="The text as it is.")
    db.execute("UPDATE knowledge_items SET content_hash = 'junk' WHERE id = ?", (item,))
    index_item(db, item, embedder=FakeEmbedder())
    assert db.scalar("SELECT content_hash FROM knowledge_items WHERE id = ?", (item,)) == (
        text_hash("The text as it is.")
    )
    assert reconcile(db, model="fake", max_items=10).to_index == []


@pytest.mark.parametrize("column", ["title", "source"])
def test_a_rename_during_the_run_leaves_the_item_pending_for_the_sweep(db, emb_settings, column):
    """The run read the old title (its keyword rows hold it): the item is `pending`, not
    `indexed` (a title of bytes that are not UTF-8 is compared as the bytes it is, or it
    would never be indexed). Or, when the rename came before the run's `indexing` mark (the
    mark and the request are on two threads), the run saw its state change and read the item
    again: `indexed` then, from a second request made after the rename."""
    item = add_item(db, kind="note", title="Old title", content="Body text of the note.")
    db.execute("UPDATE knowledge_items SET title = x'ff4f6c64' WHERE id = ?", (item,))
    index_item(db, item, embedder=FakeEmbedder())
    assert get_state(db, item)["status"] == "indexed"  # bytes as they were: unchanged
    other = connect(db.path, embedding=emb_settings)
    edit = f"UPDATE knowledge_items SET {column} = 'New' WHERE id = ?"
    embedder = EditsMidRun(lambda: other.execute(edit, (item,)))
    try:
        db.execute("UPDATE knowledge_items SET content = 'Body, edited.' WHERE id = ?", (item,))
        index_item(db, item, embedder=embedder)
    finally:
        other.close()
    status = get_state(db, item)["status"]
    assert (status, len(embedder.calls)) in {("pending", 1), ("indexed", 2)}
    if status == "indexed":  # read again after the rename: its keyword rows say so
        titles = db.all(
            "SELECT DISTINCT CAST(f.title AS BLOB) FROM note_chunks_fts f "
            "JOIN note_chunks c ON c.id = f.rowid WHERE c.item_id = ?",
            (item,),
        )
        assert column == "source" or titles == [(b"New",)]
        assert reconcile(db, model="fake", max_items=10).to_index == []
    else:
        assert reconcile(db, model="fake", max_items=10).to_index == [item]


def test_no_statement_binds_a_value_per_chunk_or_item(db):
    """SQLite binds 32,766 values at most: a 12 MB note (40k chunks) whose chunks all change,
    a run of many items, or a search filtered by many items must not bind one value each in
    one statement. The limit is lowered to 64 here to see it with three chapters."""
    db.conn.limit(apsw.SQLITE_LIMIT_VARIABLE_NUMBER, 64)
    text = "\n\n".join(corpus_text(n) for n in (CHAPTER, *GROUP))
    item = add_item(db, kind="note", title="Traits", content=text)
    assert index_item(db, item, embedder=FakeEmbedder()).chunks > 64
    db.execute("UPDATE knowledge_items SET title = 'Traits, renamed' WHERE id = ?", (item,))
    assert index_item(db, item, embedder=FakeEmbedder()).status == "indexed"  # every chunk anew
    many = [add_item(db, kind="note", title=f"n{k}", content=f"Note {k}.") for k in range(80)]
    results = index_items(db, many, embedder=FakeEmbedder())
    assert {r.status for r in results.values()} == {"indexed"}
    hits = search_chunks(
        db, "Note 3.", FakeEmbedder(), filters=Filters(item_ids=tuple(many[1:])), k=100
    ).hits
    assert {h.item_id for h in hits} == set(many[1:])


def test_missing_vec_rows_are_restored_and_orphans_deleted_without_a_provider_call(
    db, embedder, standin
):
    item = add_item(db, kind="note", title="Traits", content=corpus_text(CHAPTER))
    n = index_item(db, item, embedder=embedder).chunks
    assert n >= 20
    ids = [r[0] for r in db.all("SELECT id FROM note_chunks WHERE item_id = ? LIMIT 4", (item,))]
    for cid in ids:
        db.execute("DELETE FROM vec_chunk_embeddings WHERE chunk_id = ?", (cid,))
    orphan = np.ones(DIMS, dtype="<f4").tobytes()
    db.execute(
        "INSERT INTO vec_chunk_embeddings(chunk_id, embedding) VALUES (987654, ?)", (orphan,)
    )
    assert db.scalar("SELECT count(*) FROM vec_chunk_embeddings") == n - 4 + 1
    requests = standin.requests
    result = index_item(db, item, embedder=embedder)
    assert standin.requests == requests  # no provider call at all
    assert result.repaired == 5
    assert db.scalar("SELECT count(*) FROM vec_chunk_embeddings") == n
    assert db.scalar("SELECT count(*) FROM vec_chunk_embeddings WHERE chunk_id = 987654") == 0


def test_three_consecutive_failures_abort_with_previous_index_intact(db, embedder, standin):
    text = corpus_text(CHAPTER)
    item = add_item(db, kind="note", title="Traits", content=text)
    index_item(db, item, embedder=embedder)
    before = snapshot(db, item)
    # Every chunk of the new version is refused (400): three in a row abort the run.
    update_content(db, item, text.replace("trait", "POISON trait"))
    standin.poison = "POISON"
    first_run = standin.requests
    with pytest.raises(IndexAborted) as caught:
        index_item(db, item, embedder=embedder)
    assert "3 consecutive vector failures" in str(caught.value)
    assert "HTTP 400" in str(caught.value)
    assert snapshot(db, item) == before
    state = get_state(db, item)
    assert state["status"] == "failed" and "HTTP 400" in state["last_error"]
    # The first batch fails, its texts are tried alone until three fail in a row: the run
    # stops there, and never sends the later batches.
    assert 1 + 3 <= standin.requests - first_run <= 1 + 8


def test_a_dead_provider_aborts_naming_the_cause(db, embedder, standin):
    item = add_item(db, kind="note", title="Traits", content=corpus_text(CHAPTER))
    standin.fail_status = 503
    with pytest.raises(IndexAborted) as caught:
        index_item(db, item, embedder=embedder)
    assert "HTTP 503" in str(caught.value) and "after 2 attempts" in str(caught.value)
    assert db.scalar("SELECT count(*) FROM note_chunks") == 0
    assert get_state(db, item)["status"] == "failed"


def test_one_isolated_failure_leaves_the_item_partial(db, embedder, standin):
    text = corpus_text(CHAPTER)
    chunks = chunk_structure(text)
    target = chunks[5]
    marker = "ISOLATED-FAILURE"
    # Poison one chunk only: the marker goes into a word that only chunk 5 contains.
    pos = target.start + target.content.index(" ", 200 if target.content.find(" ", 200) > 0 else 0)
    edited = text[:pos] + " " + marker + text[pos:]
    item = add_item(db, kind="note", title="Traits", content=edited)
    standin.poison = marker
    result = index_item(db, item, embedder=embedder)
    assert result.status == "partial" and result.failed >= 1
    rows = list_chunks(db, item)
    without = [r for r in rows if not r["has_embedding"]]
    assert 1 <= len(without) <= 2  # the chunk (and its overlapping neighbour, if it shares it)
    assert all(
        marker
        in db.scalar(
            "SELECT content FROM note_chunks WHERE item_id = ? AND chunk_index = ?",
            (item, r["chunk_index"]),
        )
        for r in without
    )
    assert "have no vector" in get_state(db, item)["last_error"]
    # The next run embeds only what is missing, once the provider takes it.
    standin.poison = None
    standin.texts.clear()
    again = index_item(db, item, embedder=embedder)
    assert again.status == "indexed" and len(standin.texts) == len(without)


def test_single_chunk_note_has_a_whole_item_vector_until_it_grows(db, embedder):
    item = add_item(db, kind="note", title="Short", content="A short note about borrowing.")
    index_item(db, item, embedder=embedder)
    assert db.scalar("SELECT count(*) FROM vec_note_embeddings WHERE item_id = ?", (item,)) == 1
    assert db.scalar("SELECT count(*) FROM note_embeddings WHERE item_id = ?", (item,)) == 1
    update_content(db, item, corpus_text(CHAPTER))
    index_item(db, item, embedder=embedder)
    assert db.scalar("SELECT count(*) FROM vec_note_embeddings WHERE item_id = ?", (item,)) == 0
    assert db.scalar("SELECT count(*) FROM note_embeddings WHERE item_id = ?", (item,)) == 0


def test_cancellation_rolls_back_and_is_not_a_failure(db, embedder, standin):
    text = corpus_text(CHAPTER)
    item = add_item(db, kind="note", title="Traits", content=text)
    index_item(db, item, embedder=embedder)
    before = snapshot(db, item)
    update_content(db, item, text.replace("trait", "feature"))
    calls = iter([False, False, True])  # cancelled after the first batch

    with pytest.raises(Cancelled):
        index_item(
            db, item, embedder=embedder, options=IndexOptions(cancel=lambda: next(calls, True))
        )
    assert snapshot(db, item) == before
    state = get_state(db, item)
    assert state["status"] == "cancelled" and state["last_error"] is None
    assert index_item(db, item, embedder=embedder).status == "indexed"


def test_wrong_dimension_from_the_provider_is_never_written(db, embedder, standin):
    item = add_item(db, kind="note", title="T", content="Text for the wrong dimension test.")
    standin.dimensions = DIMS * 2
    with pytest.raises(IndexAborted) as caught:
        index_item(db, item, embedder=embedder)
    assert f"{DIMS * 2} dimensions" in str(caught.value)
    assert standin.requests == 1  # no per-text retries: every text would fail the same way
    assert db.scalar("SELECT count(*) FROM note_chunk_embeddings") == 0


# -- several items at once (bulk runs): shared batches, one outcome each --------------------

GROUP = (
    "ch04-01-what-is-ownership.md",
    "ch10-02-traits.md",
    "appendix-00.md",
    "ch08-03-hash-maps.md",
)


def test_items_indexed_together_fill_each_request_and_equal_one_by_one(
    db, embedder, standin, tmp_path
):
    texts = {name: corpus_text(name) for name in GROUP}
    ids = [add_item(db, kind="note", title=name, content=t) for name, t in texts.items()]
    results = index_items(db, ids, embedder=embedder)
    assert [results[i].status for i in ids] == ["indexed"] * len(ids)
    total = sum(len(embedding_inputs(t)) for t in texts.values())
    sizes = [len(b["input"]) for b in standin.bodies]
    # Requests are filled across items: all full but the last (one per item would not be).
    assert sum(sizes) == total and sizes[:-1] == [embedder.batch_size] * (len(sizes) - 1)
    assert len(sizes) == -(-total // embedder.batch_size) < len(ids) + total // 8
    # The same index as item by item, in a second store.
    other = connect(tmp_path / "other.db", embedding=standin_settings(standin))
    try:
        alone = [add_item(other, kind="note", title=n, content=t) for n, t in texts.items()]
        for i in alone:
            index_item(other, i, embedder=embedder)
        for a, b in zip(ids, alone, strict=True):
            assert [r[1:] for r in snapshot(db, a)["chunks"]] == [
                r[1:] for r in snapshot(other, b)["chunks"]
            ]
            assert [r[1:] for r in snapshot(db, a)["vectors"]] == [
                r[1:] for r in snapshot(other, b)["vectors"]
            ]
            hashes = [
                d.scalar("SELECT indexed_hash FROM item_index_state WHERE item_id = ?", (i,))
                for d, i in ((db, a), (other, b))
            ]
            assert hashes[0] == hashes[1] == text_hash(texts[GROUP[ids.index(a)]])
    finally:
        other.close()


def test_items_together_each_get_their_own_outcome(db, embedder, standin):
    good = add_item(
        db, kind="note", title="Good", content=corpus_text("ch04-01-what-is-ownership.md")
    )
    blank = add_item(db, kind="file", title="Missing", content="", source="/nonexistent/kidx.md")
    poisoned = add_item(db, kind="note", title="Poisoned", content="POISON " * 40)
    standin.poison = "POISON"
    results = index_items(db, [good, blank, poisoned], embedder=embedder)
    assert results[good].status == "indexed"
    assert isinstance(results[blank], Exception) and get_state(db, blank)["status"] == "failed"
    # Not one vector for the poisoned note: it keeps no index, and the good one is untouched.
    assert isinstance(results[poisoned], IndexAborted)
    assert "no chunk could be embedded" in str(results[poisoned])
    assert get_state(db, poisoned)["status"] == "failed"
    assert db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (poisoned,)) == 0


def test_items_together_a_provider_failing_three_times_in_a_row_stops_them_all(
    db, embedder, standin
):
    first = add_item(
        db, kind="note", title="First", content=corpus_text("ch04-01-what-is-ownership.md")
    )
    index_items(db, [first], embedder=embedder)
    before = snapshot(db, first)
    update_content(db, first, corpus_text("ch04-01-what-is-ownership.md") + "\n\nOne more line.\n")
    second = add_item(db, kind="note", title="Second", content=corpus_text(CHAPTER))
    standin.fail_status = 503
    sent = standin.requests
    results = index_items(db, [first, second], embedder=embedder)
    for item in (first, second):
        assert isinstance(results[item], IndexAborted), results[item]
        assert "3 consecutive failures of the provider's requests" in str(results[item])
        assert results[item].transient and results[item].provider_down
        assert get_state(db, item)["status"] == "failed"
    assert snapshot(db, first) == before  # the previous index is intact
    assert db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (second,)) == 0
    # Three failed requests (two attempts each): the batch, then its first two texts alone.
    assert standin.requests - sent == 2 * 3


def test_items_together_cancelled_leave_every_unwritten_item_cancelled(db, embedder, standin):
    ids = [add_item(db, kind="note", title=n, content=corpus_text(n)) for n in GROUP]
    read: list[int] = []

    class Counting(Reader):
        def text(self, item, cancel=None):
            read.append(item.id)
            return super().text(item, cancel)

    def cancel() -> bool:  # once two items have been read and a request has gone (any thread)
        return len(read) >= 2 and standin.requests > 0

    with pytest.raises(Cancelled):
        index_items(
            db, ids, embedder=embedder, options=IndexOptions(cancel=cancel, reader=Counting())
        )
    states = [get_state(db, i)["status"] for i in ids]
    assert states[: len(read)] == ["cancelled"] * len(read)  # read, never written
    assert set(states[len(read) :]) <= {"pending"}  # never read: untouched
    assert db.scalar("SELECT count(*) FROM note_chunks") == 0


def test_ctrl_c_during_an_inline_run_leaves_what_was_read_cancelled_not_failed(db):
    """Ctrl-C (KeyboardInterrupt, in the main thread) is the user cancelling the run: the items
    read and not written are `cancelled`, as after a revoke, not `failed` (which the retry
    sweep counts, and doctor reports)."""
    ids = [add_item(db, kind="note", title=n, content=corpus_text(n)) for n in GROUP]
    read: list[int] = []

    class Interrupted(Reader):
        def text(self, item, cancel=None):
            if len(read) == 2:
                raise KeyboardInterrupt
            read.append(item.id)
            return super().text(item, cancel)

    embedder = FakeEmbedder()
    embedder.batch_size = 1000  # nothing is written before the third item is read
    with pytest.raises(KeyboardInterrupt):
        index_items(db, ids, embedder=embedder, options=IndexOptions(reader=Interrupted()))
    states = [get_state(db, i)["status"] for i in ids]
    assert states[:2] == ["cancelled", "cancelled"] and set(states[2:]) == {"pending"}
    assert db.scalar("SELECT count(*) FROM item_index_state WHERE attempts > 0") == 0


def test_items_together_are_read_and_written_while_a_request_is_in_flight(db):
    """One request in flight while the caller works: the first request cannot end before the
    caller has read the next item, nor the second before the first request's items are
    written (a caller that waited on each request would time out here)."""
    ids = [
        add_item(db, kind="note", title=f"N{n}", content=f"Note {n}, one chunk.") for n in "ABCD"
    ]
    third_read, first_written = threading.Event(), threading.Event()
    seen: list[bool] = []

    class Watching(Reader):
        def text(self, item, cancel=None):
            if item.id == ids[2]:
                third_read.set()
            return super().text(item, cancel)

    class Waiting(FakeEmbedder):
        def embed_batch(self, texts: list[str]) -> np.ndarray:
            seen.append((first_written if self.calls else third_read).wait(5))
            return super().embed_batch(texts)

    model = Waiting()
    model.batch_size = 2
    results = index_items(
        db,
        ids,
        embedder=model,
        on_done=lambda i, r: i == ids[0] and first_written.set(),
        options=IndexOptions(reader=Watching()),
    )
    assert [results[i].status for i in ids] == ["indexed"] * 4
    assert [len(c) for c in model.calls] == [2, 2]  # A and B, then C and D
    assert seen == [True, True]


def fail_vec_writes_at(db, keys: list[int]) -> None:
    """Fault injection: stray rows in vec0's own `_rowids` table under chunk ids the next
    chunks get (plain SQL, as a host may write): vec0 refuses a row under such a key and
    cannot delete it, so exactly those chunks' vec writes fail."""
    db.executemany(
        "INSERT INTO vec_chunk_embeddings_rowids(rowid) VALUES (?)", [(k,) for k in keys]
    )


# The chunks with no vector in vec0 (its `_rowids` rows that point into a chunk of vectors;
# the stray ones point nowhere).
UNMIRRORED = (
    "SELECT c.chunk_index FROM note_chunks c WHERE c.id NOT IN "
    "(SELECT rowid FROM vec_chunk_embeddings_rowids WHERE chunk_id IS NOT NULL)"
)


def next_chunk_id(db) -> int:
    return db.scalar("SELECT coalesce(max(id), 0) FROM note_chunks") + 1


def test_a_failed_vec_write_leaves_that_chunk_unmirrored_and_the_item_partial(db, embedder):
    text = corpus_text(CHAPTER)
    chunks = chunk_structure(text)

    def word_of(k: int) -> str | None:
        """A word only chunk k holds (its neighbours' overlaps hold some of its text)."""
        near = chunks[k - 1].content + chunks[k + 1].content
        return next(
            (w for w in chunks[k].content.split() if w.isalpha() and len(w) > 6 and w not in near),
            None,
        )

    at = next(k for k in range(7, len(chunks) - 1) if word_of(k))
    word = word_of(at)
    assert word is not None
    fail_vec_writes_at(db, [next_chunk_id(db) + at])  # the item's chunks get the next ids
    item = add_item(db, kind="note", title="Traits", content=text)
    result = index_item(db, item, embedder=embedder)
    assert result.status == "partial" and result.failed == 1
    assert "vec write" in get_state(db, item)["last_error"]
    assert db.scalar("SELECT count(*) FROM note_chunk_embeddings") == result.chunks  # whole
    assert [r[0] for r in db.all(UNMIRRORED)] == [at]


def test_a_failed_vec_write_names_its_cause_in_the_state_and_the_result(db, embedder):
    """The log had the cause; the item's state said only "vec write failed", and the result
    (the task's, on the Tasks page) had no error at all."""
    text = "\n\n".join(
        f"## Part {j}\n\n" + " ".join(f"{'VECFAULT' if j == 2 else 'plain'}{k}" for k in range(40))
        for j in range(4)
    )
    fail_vec_writes_at(db, [next_chunk_id(db) + 2])
    item = add_item(db, kind="note", title="Mirror", content=text)
    result = index_item(db, item, embedder=embedder)
    assert (result.status, result.chunks, result.failed) == ("partial", 4, 1)
    assert result.error.startswith("vec write: ") and len(result.error) > len("vec write: ")
    cause = result.error.removeprefix("vec write: ")
    assert get_state(db, item)["last_error"] == f"1 of 4 chunks have no vector: vec write: {cause}"


def test_a_vec_table_that_refuses_the_re_index_leaves_the_previous_index_whole(db, embedder):
    """An edit re-indexes the item; the vec rows of the chunks it keeps are gone (a host's
    DELETE) and cannot be written again (stray `_rowids` rows under their ids, which vec0
    can neither delete nor write over): the write fails, rolled back, and the item's previous
    index stays whole. (Three failed vec rows in a row of new items: test_bulk_vec_failures.)"""
    item = add_item(db, kind="note", title="Traits", content=corpus_text(CHAPTER))
    index_item(db, item, embedder=embedder)
    update_content(db, item, corpus_text(CHAPTER).replace("trait", "VECFAULT trait", 1))
    before = snapshot(db, item)
    kept = [chunk_id for _, chunk_id, *_ in before["chunks"]]
    db.executemany("DELETE FROM vec_chunk_embeddings WHERE chunk_id = ?", [(k,) for k in kept])
    fail_vec_writes_at(db, kept)
    with pytest.raises(StoreError, match=r"refused the write .*Could not fetch vector data"):
        index_item(db, item, embedder=embedder)
    assert snapshot(db, item)["chunks"] == before["chunks"]
    assert get_state(db, item)["status"] == "failed"


def index_dump(db) -> dict[str, list]:
    """Every row a write of notes makes, timestamps left out."""
    queries = {
        "chunks": "SELECT id, item_id, chunk_index, content, summary, method, start_offset, "
        "end_offset, headings, embed_hash FROM note_chunks ORDER BY id",
        "vectors": "SELECT chunk_id, model, dimensions, vector FROM note_chunk_embeddings "
        "ORDER BY chunk_id",
        "whole": "SELECT item_id, model, dimensions, vector FROM note_embeddings ORDER BY item_id",
        "vec": "SELECT chunk_id, embedding FROM vec_chunk_embeddings ORDER BY chunk_id",
        "bits": "SELECT chunk_id, embedding FROM vec_chunk_bits ORDER BY chunk_id",
        "vec whole": "SELECT item_id, embedding FROM vec_note_embeddings ORDER BY item_id",
        "bits whole": "SELECT item_id, embedding FROM vec_note_bits ORDER BY item_id",
        "fts": "SELECT rowid, title, headings, content, parts FROM note_chunks_fts ORDER BY rowid",
        "states": "SELECT item_id, status, indexed_hash, chunk_method, chunk_count, model, "
        "dimensions, last_error, attempts FROM item_index_state ORDER BY item_id",
        "items": "SELECT id, content_hash FROM knowledge_items ORDER BY id",
    }
    return {name: db.all(sql) for name, sql in queries.items()}


def test_new_items_written_together_equal_the_same_items_written_one_by_one(
    db, emb_settings, tmp_path
):
    """A run of many writes new items a statement per table for all of them (write_new_items);
    every row equals what a run of one writes for each, whole-item vectors of single-chunk
    notes, bit mirrors and keyword rows included."""
    texts = {name: corpus_text(name) for name in GROUP}
    texts["Tiny HttpServer"] = "One short paragraph about `HashMap<K, V>` and BackgroundTasks."
    embedder = FakeEmbedder()
    other = connect(tmp_path / "other.db", embedding=emb_settings)
    try:
        ids = [add_item(db, kind="note", title=n, content=t) for n, t in texts.items()]
        alone = [add_item(other, kind="note", title=n, content=t) for n, t in texts.items()]
        statements: list[str] = []
        db.conn.exec_trace = lambda _cursor, sql, _bindings: statements.append(sql) or True
        results = index_items(db, ids, embedder=embedder)
        db.conn.exec_trace = None
        assert [results[i].status for i in ids] == ["indexed"] * len(ids)
        for i in alone:
            index_item(other, i, embedder=embedder)
        # Written together: one new-id lookup for the items ready together, not one an item.
        assert statements.count("SELECT max(id) FROM note_chunks") < len(ids)
        assert index_dump(db) == index_dump(other)
        assert index_dump(db)["whole"]  # appendix-00 and Tiny are single chunks
    finally:
        other.close()


def test_new_items_written_together_clear_what_a_host_left_under_their_ids(db):
    """Rows no chunk has under ids above the highest chunk's (a host deleted the newest
    chunks by hand, foreign keys off): the new chunks written together take those ids, and
    their vec, bit and keyword rows are theirs, nothing of the old ones left."""
    first = add_item(db, kind="note", title="first", content=corpus_text(CHAPTER))
    index_item(db, first, embedder=FakeEmbedder())
    top = db.scalar("SELECT max(id) FROM note_chunks")
    db.execute("PRAGMA foreign_keys = OFF")
    doomed = [r[0] for r in db.all("SELECT id FROM note_chunks ORDER BY id DESC LIMIT 3")]
    db.execute(f"DELETE FROM note_chunks WHERE id IN ({','.join('?' * 3)})", doomed)
    db.execute("PRAGMA foreign_keys = ON")
    stray = np.ones(DIMS, dtype=np.float32).tobytes()
    db.execute(  # and one further up, where no chunk ever was
        "INSERT INTO vec_chunk_embeddings(chunk_id, embedding) VALUES (?, ?)", (top + 40, stray)
    )
    db.execute(
        "INSERT INTO note_chunks_fts(rowid, title, headings, content, parts) "
        "VALUES (?, 'x', '', 'stale', '')",
        (top + 41,),
    )
    assert mirror_problems(db) and keyword_rows_problems(db)
    ids = [
        add_item(db, kind="note", title=n, content=corpus_text(n))
        for n in ("ch04-01-what-is-ownership.md", "ch08-03-hash-maps.md")
    ]
    statements: list[str] = []
    db.conn.exec_trace = lambda _cursor, sql, _bindings: statements.append(sql) or True
    results = index_items(db, ids, embedder=FakeEmbedder())
    db.conn.exec_trace = None
    assert [results[i].status for i in ids] == ["indexed", "indexed"]
    # together, not one by one after a failed write together (which would mend them too)
    assert "SELECT id, embed_hash FROM note_chunks WHERE item_id = ?" not in statements
    assert set(doomed) <= {
        r[0] for r in db.all("SELECT id FROM note_chunks WHERE item_id IN (?, ?)", ids)
    }
    assert mirror_problems(db) == [] and keyword_rows_problems(db) == []


def test_a_chunk_a_host_wrote_at_the_largest_rowid_leaves_room_for_every_other(db):
    """No id above 2**63 - 1: new chunks take free ids below (as SQLite picks them), where
    max(id) + 1 could not even be bound and every later prose write failed."""
    first = add_item(db, kind="note", title="a", content="Alpha note text.")
    index_item(db, first, embedder=FakeEmbedder())
    db.execute(
        "INSERT INTO note_chunks(id, item_id, chunk_index, content, method, start_offset, "
        "end_offset, embed_hash) VALUES (9223372036854775807, ?, 99, 'x', 'structure', 0, 1, 'h')",
        (first,),
    )
    alone = add_item(db, kind="note", title="b", content=corpus_text(CHAPTER))
    assert index_item(db, alone, embedder=FakeEmbedder()).status == "indexed"
    ids = [add_item(db, kind="note", title=n, content=f"Note {n}.") for n in "cd"]
    results = index_items(db, ids, embedder=FakeEmbedder())
    assert [results[i].status for i in ids] == ["indexed", "indexed"]
    db.execute("DELETE FROM note_chunks WHERE id = 9223372036854775807")
    assert mirror_problems(db) == [] and keyword_rows_problems(db) == []


def test_new_items_written_together_fall_back_to_one_by_one_when_a_write_fails(db):
    """One item's vec write fails inside the shared write: it is rolled back and the items go
    one by one, so that item alone is partial (its chunk unmirrored) and the others whole."""
    names = ["ch04-01-what-is-ownership.md", CHAPTER, "ch08-03-hash-maps.md"]
    texts = [corpus_text(n) for n in names]
    first = next_chunk_id(db) + len(chunk_structure(texts[0]))  # the second item's first chunk
    fail_vec_writes_at(db, [first + 1])
    ids = [add_item(db, kind="note", title=n, content=t) for n, t in zip(names, texts)]
    results = index_items(db, ids, embedder=FakeEmbedder())
    assert [results[i].status for i in ids] == ["indexed", "partial", "indexed"]
    assert results[ids[1]].failed == 1
    unmirrored = db.all(UNMIRRORED.replace("c.chunk_index", "c.item_id"))
    assert [r[0] for r in unmirrored] == [ids[1]]
    for i in ids:  # every chunk has its vector and its keyword row
        assert (
            db.scalar(
                "SELECT count(*) FROM note_chunks c "
                "JOIN note_chunk_embeddings e ON e.chunk_id = c.id "
                "JOIN note_chunks_fts f ON f.rowid = c.id WHERE c.item_id = ?",
                (i,),
            )
            == results[i].chunks
        )


def test_a_rename_re_embeds_nothing_and_its_keyword_rows_take_the_new_title(db):
    """The seed: chunks whose content and summary are unchanged keep their vectors. The title
    went first into every chunk's embedder input, and a rename embedded the whole note again."""
    text = corpus_text("ch04-01-what-is-ownership.md")
    item = add_item(db, kind="note", title="Ownership", content=text)
    fake = FakeEmbedder()
    first = index_item(db, item, embedder=fake)
    assert first.embedded == first.chunks > 10
    db.execute("UPDATE knowledge_items SET title = 'Who owns what' WHERE id = ?", (item,))
    again = index_item(db, item, embedder=fake)
    assert (again.status, again.embedded, again.reused) == ("indexed", 0, first.chunks)
    hits = search_chunks(db, "owns", embedder=fake, mode="keyword", k=3).hits
    assert hits and all(h.item_id == item for h in hits)


def test_vectors_kidx_made_with_the_title_first_are_kept_after_the_upgrade(db):
    """Chunks kidx embedded before, their input led by the title (and keyed on its hash): an
    upgraded worker's next run of the item embeds nothing again."""
    text = corpus_text("ch04-01-what-is-ownership.md")
    item = add_item(db, kind="note", title="Ownership", content=text)
    fake = FakeEmbedder()
    index_item(db, item, embedder=fake)
    before = db.all("SELECT chunk_id, vector FROM note_chunk_embeddings ORDER BY chunk_id")
    rows = db.all("SELECT id FROM note_chunks WHERE item_id = ? ORDER BY chunk_index", (item,))
    chunks = chunk_structure(text)
    assert len(rows) == len(chunks)
    db.executemany(
        "UPDATE note_chunks SET embed_hash = ? WHERE id = ?",
        [(text_hash(c.embedding_input("Ownership")), r[0]) for c, r in zip(chunks, rows)],
    )
    result = index_item(db, item, embedder=fake)
    assert (result.status, result.embedded) == ("indexed", 0)
    assert db.all("SELECT chunk_id, vector FROM note_chunk_embeddings ORDER BY chunk_id") == before
