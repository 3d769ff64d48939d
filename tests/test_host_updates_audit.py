"""Chunk rows and vectors a host's plain SQL UPDATEs (schema migrations 14 and 15).

Before, an UPDATE of an indexed item's chunk row (its text, its hash, its item) went unseen:
search showed the host's text beside the vector and keyword row of the old one, for good. Now
the item is `pending`, and its run writes the chunks again from the item's text.

A vector a host changed (its bytes, or moved under another chunk, item or memory) was kept for
good, the sweep's repair even mirroring it into the vec table. Now the row goes, and what has
no vector is embedded again.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import FakeEmbedder, corpus_text, mirror_problems
from worker.bulk import index_item
from worker.indexers import IndexOptions
from worker.indexers.memories import add_memory, embed_memories, memories_missing
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


def indexed_note(db) -> tuple[int, FakeEmbedder]:
    """The installation chapter as a note, indexed: (its id, the model)."""
    fake = FakeEmbedder()
    item = add_item(db, kind="note", title="Install", content=TEXT)
    assert index_item(db, item, embedder=fake).status == "indexed"
    return item, fake


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
    item, fake = indexed_note(db)
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


def indexed_code(
    db, folder, name: str = "m.py", fake: FakeEmbedder | None = None
) -> tuple[int, IndexOptions, FakeEmbedder]:
    """A code item of four functions, indexed: (its id, the options that read it, the model)."""
    path = folder / name
    path.write_text("\n\n".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(4)))
    item = add_item(db, kind="code", title=name, content="", source=str(path))
    options = IndexOptions(reader=Reader(FilesSettings(roots=[folder])))
    fake = fake or FakeEmbedder()
    assert index_item(db, item, embedder=fake, options=options).embedded == 4
    return item, options, fake


def test_a_code_chunk_a_host_rewrites_is_written_again(db, host, tmp_path):
    item, options, fake = indexed_code(db, tmp_path)
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


@pytest.mark.parametrize("status", ["failed", "cancelled"])
def test_a_resting_item_s_chunk_a_host_rewrites_sends_it(db, host, status):
    """A failed item keeps its last index, a cancelled one the one before the run: neither
    sweep sent them again for a host's change of their chunks (a failed one out of attempts,
    or a cancelled one whose text did not change, for good)."""
    item, fake = indexed_note(db)
    host.execute(
        "UPDATE item_index_state SET status = ?, attempts = 9, "
        "updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE item_id = ?",
        (status, item),
    )
    host.execute("UPDATE note_chunks SET content = 'x' WHERE item_id = ?", (item,))
    assert get_state(db, item)["status"] == "pending"
    assert sent(db, fake.model_id) == [item]


def test_a_chunk_a_host_moves_within_its_item_is_put_back(db, host):
    """Its offsets and place, which search shows: the run writes them again."""
    item, fake = indexed_note(db)
    host.execute(
        "UPDATE note_chunks SET start_offset = 0, end_offset = 5, chunk_index = 99 "
        "WHERE item_id = ? AND chunk_index = 4",
        (item,),
    )
    assert sent(db, fake.model_id) == [item]
    assert index_item(db, item, embedder=fake).embedded <= 2
    rows = db.all(
        "SELECT chunk_index, content, start_offset, end_offset FROM note_chunks "
        "WHERE item_id = ? ORDER BY chunk_index",
        (item,),
    )
    assert [r[0] for r in rows] == list(range(len(rows)))
    assert all(content == TEXT[a:b] for _, content, a, b in rows)


def vector_of(db, table: str, key: str, value: int) -> bytes | None:
    return db.scalar(f"SELECT vector FROM {table} WHERE {key} = ?", (value,))


def third_chunk(db, item: int) -> int:
    return db.scalar("SELECT id FROM note_chunks WHERE item_id = ? AND chunk_index = 3", (item,))


def test_a_chunk_vector_a_host_rewrites_is_embedded_again(db, host):
    item, fake = indexed_note(db)
    chunk_id = db.scalar(
        "SELECT id FROM note_chunks WHERE item_id = ? AND chunk_index = 3", (item,)
    )
    original = vector_of(db, "note_chunk_embeddings", "chunk_id", chunk_id)
    forged = np.ones(64, dtype=np.float32).tobytes()
    host.execute(
        "UPDATE note_chunk_embeddings SET vector = ? WHERE chunk_id = ?", (forged, chunk_id)
    )
    assert vector_of(db, "note_chunk_embeddings", "chunk_id", chunk_id) is None
    drift = reconcile(db, model=fake.model_id, max_items=100, backoff=BACKOFF)
    assert drift.found["without_vectors"] == [item] and drift.to_index == [item]
    fake.calls.clear()
    assert index_item(db, item, embedder=fake).embedded == 1
    assert vector_of(db, "note_chunk_embeddings", "chunk_id", third_chunk(db, item)) == original
    assert mirror_problems(db) == []


def test_a_vector_a_host_moves_to_another_chunk_is_embedded_again_for_both(db, host):
    item, fake = indexed_note(db)
    a, b = (
        r[0]
        for r in db.all(
            "SELECT id FROM note_chunks WHERE item_id = ? AND chunk_index IN (1, 2) "
            "ORDER BY chunk_index",
            (item,),
        )
    )
    host.execute("DELETE FROM note_chunk_embeddings WHERE chunk_id = ?", (b,))
    host.execute("UPDATE note_chunk_embeddings SET chunk_id = ? WHERE chunk_id = ?", (b, a))
    assert (
        db.scalar("SELECT count(*) FROM note_chunk_embeddings WHERE chunk_id IN (?, ?)", (a, b))
        == 0
    )
    assert sent(db, fake.model_id) == [item]
    assert index_item(db, item, embedder=fake).embedded == 2
    assert mirror_problems(db) == []


def test_a_whole_item_vector_a_host_rewrites_is_written_again_without_a_request(db, host):
    fake = FakeEmbedder()
    item = add_item(db, kind="note", title="Zebras", content="Zebra migration on the plains.")
    index_item(db, item, embedder=fake)
    original = vector_of(db, "note_embeddings", "item_id", item)
    host.execute(
        "UPDATE note_embeddings SET vector = ? WHERE item_id = ?",
        (np.ones(64, dtype=np.float32).tobytes(), item),
    )
    assert sent(db, fake.model_id) == [item]
    fake.calls.clear()
    assert index_item(db, item, embedder=fake).embedded == 0 and fake.calls == []
    assert vector_of(db, "note_embeddings", "item_id", item) == original


def test_a_code_chunk_vector_a_host_rewrites_is_embedded_again(db, host, tmp_path):
    item, options, fake = indexed_code(db, tmp_path)
    host.execute(
        "UPDATE code_chunk_embeddings SET vector = zeroblob(256) WHERE chunk_id = "
        "(SELECT id FROM code_chunks WHERE item_id = ? AND chunk_index = 1)",
        (item,),
    )
    assert sent(db, fake.model_id) == [item]
    fake.calls.clear()
    assert index_item(db, item, embedder=fake, options=options).embedded == 1


def test_a_memory_vector_a_host_moves_to_another_memory_is_embedded_again(db, host):
    fake = FakeEmbedder()
    texts = ("The user likes tea.", "The user lives in Oslo.")
    tea, oslo = (add_memory(db, t, fake) for t in texts)
    host.execute("DELETE FROM memory_embeddings WHERE memory_id = ?", (oslo,))
    host.execute("UPDATE memory_embeddings SET memory_id = ? WHERE memory_id = ?", (oslo, tea))
    assert memories_missing(db, fake.model_id) == 2
    fake.calls.clear()
    assert embed_memories(db, fake).embedded == 2
    assert sorted(fake.calls[0]) == list(texts)
    assert mirror_problems(db) == []


def test_kidx_s_own_writes_over_a_stray_vector_keep_their_vectors(db, host):
    """kidx writes vectors with INSERT OR REPLACE: an UPSERT's UPDATE of a stray row (a vector
    a host left under the id a new chunk takes) fired the trigger, which dropped the vector
    kidx had just written."""
    _, fake = indexed_note(db)
    host.execute(  # foreign keys off: a vector under the id the next new chunk gets
        "INSERT INTO note_chunk_embeddings(chunk_id, model, dimensions, vector) "
        "SELECT max(id) + 1, 'fake', 64, zeroblob(256) FROM note_chunks"
    )
    second = add_item(db, kind="note", title="Again", content=TEXT)
    result = index_item(db, second, embedder=fake)
    assert (result.status, result.embedded) == ("indexed", 17)
    drift = reconcile(db, model=fake.model_id, max_items=100, backoff=BACKOFF)
    assert drift.found["without_vectors"] == [] and drift.to_index == []
    assert mirror_problems(db) == []
    memory = add_memory(db, "The user likes tea.", fake)
    assert embed_memories(db, Negated(model_id="other")).embedded == 1  # over its old vector
    assert vector_of(db, "memory_embeddings", "memory_id", memory) is not None
    assert memories_missing(db, "other") == 0


def test_a_code_item_s_vectors_over_a_stray_one_are_kept(db, host, tmp_path):
    _, _, fake = indexed_code(db, tmp_path)
    host.execute(  # foreign keys off: a vector under the id the next code chunk gets
        "INSERT INTO code_chunk_embeddings(chunk_id, model, dimensions, vector) "
        "SELECT max(id) + 1, 'fake', 64, zeroblob(256) FROM code_chunks"
    )
    second, _, _ = indexed_code(db, tmp_path, "n.py", fake)
    assert (
        db.scalar(
            "SELECT count(*) FROM code_chunk_embeddings e JOIN code_chunks c ON c.id = e.chunk_id "
            "WHERE c.item_id = ?",
            (second,),
        )
        == 4
    )
    assert sent(db, fake.model_id) == []
    assert mirror_problems(db) == []


class Negated(FakeEmbedder):
    """Another model: other vectors for the same texts."""

    def embed_batch(self, texts: list[str]) -> np.ndarray:
        return -super().embed_batch(texts)
