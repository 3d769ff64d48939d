"""Chunk rows a host's plain SQL UPDATEs (schema migration 14).

Before, an UPDATE of an indexed item's chunk row (its text, its hash, its item) went unseen:
search showed the host's text beside the vector and keyword row of the old one, for good. Now
the item is `pending`, and its run writes the chunks again from the item's text.
"""

from __future__ import annotations

from conftest import FakeEmbedder, corpus_text, mirror_problems
from worker.bulk import index_item
from worker.indexers import IndexOptions
from worker.reconcile import Backoff, reconcile
from worker.retrieval import search_chunks
from worker.settings import FilesSettings
from worker.sources import Reader
from worker.store.fts import fts_counts
from worker.store.items import add_item, get_state

BACKOFF = Backoff(max_attempts=5, backoff=60.0, backoff_max=3600.0)
TEXT = corpus_text("ch01-01-installation.md")


def sent(db, model: str) -> list[int]:
    return reconcile(db, model=model, max_items=100, backoff=BACKOFF).to_index


def test_a_chunk_text_a_host_rewrites_is_written_again_from_the_item_s_text(db, host):
    fake = FakeEmbedder()
    item = add_item(db, kind="note", title="Install", content=TEXT)
    other = add_item(db, kind="note", title="Other", content="Another note, left alone.")
    for i in (item, other):
        assert index_item(db, i, embedder=fake).status == "indexed"
    host.execute(
        "UPDATE note_chunks SET content = 'zanzibar quokka' WHERE item_id = ? AND chunk_index = 2",
        (item,),
    )
    assert get_state(db, item)["status"] == "pending"
    assert get_state(db, other)["status"] == "indexed"
    assert sent(db, fake.model_id) == [item]
    result = index_item(db, item, embedder=fake)
    # the rewritten row is no hint where to cut: its region is cut again, the rest kept
    assert result.status == "indexed" and result.embedded <= 2 < result.reused
    rows = db.all(
        "SELECT content, start_offset, end_offset FROM note_chunks WHERE item_id = ?", (item,)
    )
    assert all(content == TEXT[a:b] for content, a, b in rows)
    assert not any("zanzibar" in content for content, _, _ in rows)
    assert sent(db, fake.model_id) == []  # once, not forever
    assert mirror_problems(db) == [] and fts_counts(db)["note_chunks_fts"]["stale"] == 0
    assert search_chunks(db, "zanzibar quokka", fake, k=5, mode="keyword").hits == []


def test_a_chunk_hash_a_host_rewrites_is_embedded_again(db, host):
    fake = FakeEmbedder()
    item = add_item(db, kind="note", title="Install", content=TEXT)
    index_item(db, item, embedder=fake)
    host.execute(
        "UPDATE note_chunks SET embed_hash = 'x' WHERE item_id = ? AND chunk_index = 0", (item,)
    )
    assert sent(db, fake.model_id) == [item]
    fake.calls.clear()
    assert index_item(db, item, embedder=fake).embedded == 1
    assert len(fake.calls) == 1 and len(fake.calls[0]) == 1


def test_chunks_a_host_swaps_between_items_send_both(db, host):
    """Each item keeps its count of chunks (`chunks_lost` sees nothing), but not its text."""
    fake = FakeEmbedder()
    one = add_item(db, kind="note", title="One", content=TEXT)
    two = add_item(db, kind="note", title="Two", content="A short note of its own.")
    for i in (one, two):
        index_item(db, i, embedder=fake)
    host.execute(
        "UPDATE note_chunks SET item_id = ?, chunk_index = -5 WHERE item_id = ?", (one, two)
    )
    host.execute(
        "UPDATE note_chunks SET item_id = ? WHERE item_id = ? AND chunk_index = 0", (two, one)
    )
    host.execute("UPDATE note_chunks SET chunk_index = 0 WHERE chunk_index = -5")
    assert sent(db, fake.model_id) == [one, two]
    for i in (one, two):
        assert index_item(db, i, embedder=fake).status == "indexed"
    two_text = db.all("SELECT content FROM note_chunks WHERE item_id = ?", (two,))
    assert two_text == [("A short note of its own.",)]
    one_rows = db.all(
        "SELECT content, start_offset, end_offset FROM note_chunks WHERE item_id = ?", (one,)
    )
    assert all(content == TEXT[a:b] for content, a, b in one_rows)
    assert mirror_problems(db) == []


def test_a_code_chunk_a_host_rewrites_is_written_again(db, host, tmp_path):
    path = tmp_path / "m.py"
    path.write_text("\n\n".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(4)))
    item = add_item(db, kind="code", title="m.py", content="", source=str(path))
    options = IndexOptions(reader=Reader(FilesSettings(roots=[tmp_path])))
    fake = FakeEmbedder()
    index_item(db, item, embedder=fake, options=options)
    original = db.scalar(
        "SELECT content FROM code_chunks WHERE item_id = ? AND chunk_index = 2", (item,)
    )
    host.execute(
        "UPDATE code_chunks SET content = 'def evil(): pass' WHERE item_id = ? AND chunk_index = 2",
        (item,),
    )
    assert sent(db, fake.model_id) == [item]
    fake.calls.clear()
    assert index_item(db, item, embedder=fake, options=options).status == "indexed"
    again = db.scalar(
        "SELECT content FROM code_chunks WHERE item_id = ? AND chunk_index = 2", (item,)
    )
    assert again == original and "evil" not in again


def test_a_failed_item_s_chunks_a_host_rewrites_stay_the_retry_sweep_s(db, host):
    """Its previous index stays while it waits for its backoff: not sent at once."""
    fake = FakeEmbedder()
    item = add_item(db, kind="note", title="Install", content=TEXT)
    index_item(db, item, embedder=fake)
    host.execute(
        "UPDATE item_index_state SET status = 'failed', attempts = 1, "
        "updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE item_id = ?",
        (item,),
    )
    host.execute("UPDATE note_chunks SET content = 'x' WHERE item_id = ?", (item,))
    assert get_state(db, item)["status"] == "failed"
    assert sent(db, fake.model_id) == []
