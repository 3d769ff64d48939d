"""What a host's plain SQL could still do unseen to chunks, vectors and items (schema migration
16; an audit reproduced each on the code before it): a chunk row inserted or replaced, chunk ids
swapped, a chunk moved through a negative index, a vector replaced, an item's id taken over by
`UPDATE OR REPLACE`, a failed note fixed together with its hash, and a hash that is not UTF-8.
kidx writes chunks and vectors only while its run holds the item `indexing`: what else is
written there is the host's, and the item is indexed again from its text."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from conftest import FakeEmbedder, corpus_text, mirror_problems
from worker.bulk import index_item
from worker.reconcile import Backoff, reconcile
from worker.retrieval import search_chunks
from worker.store.fts import fts_counts
from worker.store.items import add_item, get_state

BACKOFF = Backoff(max_attempts=5, backoff=60.0, backoff_max=3600.0)
TEXT = corpus_text("ch01-01-installation.md")


def sent(db, model: str) -> list[int]:
    return reconcile(db, model=model, max_items=100, backoff=BACKOFF).to_index


def indexed_note(db, title: str = "Install", text: str = TEXT) -> tuple[int, FakeEmbedder]:
    fake = FakeEmbedder()
    item = add_item(db, kind="note", title=title, content=text)
    assert index_item(db, item, embedder=fake).status == "indexed"
    return item, fake


def vectors_by_text(db, item: int) -> dict[str, bytes]:
    """Each chunk's text -> its vector."""
    return dict(
        db.all(
            "SELECT c.content, e.vector FROM note_chunks c "
            "JOIN note_chunk_embeddings e ON e.chunk_id = c.id WHERE c.item_id = ?",
            (item,),
        )
    )


def kept_true(db, item: int, before: dict[str, bytes], embedded: int) -> bool:
    """Every chunk whose text had a vector before has that vector, and only the others were
    embedded (a region the host's row changed may be cut again)."""
    after = vectors_by_text(db, item)
    new = [t for t in after if t not in before]
    return len(new) == embedded and all(after[t] == before[t] for t in after if t in before)


def chunk_id(db, item: int, index: int) -> int:
    return db.scalar(
        "SELECT id FROM note_chunks WHERE item_id = ? AND chunk_index = ?", (item, index)
    )


def exact_slices(db, item: int, text: str) -> bool:
    rows = db.all(
        "SELECT chunk_index, content, start_offset, end_offset FROM note_chunks "
        "WHERE item_id = ? ORDER BY chunk_index",
        (item,),
    )
    return [r[0] for r in rows] == list(range(len(rows))) and all(
        content == text[a:b] for _, content, a, b in rows
    )


def test_chunk_ids_a_host_swaps_never_pair_a_text_with_another_s_vector(db, host):
    """Vectors are kept under their chunk's id: swapped ids put each text beside the other's
    vector, which the item's next run even reused (by the chunk's hash, found under that id)."""
    item, fake = indexed_note(db)
    before = vectors_by_text(db, item)
    a, b = chunk_id(db, item, 0), chunk_id(db, item, 5)
    for old, new in ((a, -a), (b, a), (-a, b)):
        host.execute("UPDATE note_chunks SET id = ? WHERE id = ?", (new, old))
    assert get_state(db, item)["status"] == "pending"
    assert (
        db.scalar("SELECT count(*) FROM note_chunk_embeddings WHERE chunk_id IN (?, ?)", (a, b))
        == 0
    )
    assert sent(db, fake.model_id) == [item]
    fake.calls.clear()
    assert index_item(db, item, embedder=fake).embedded == 2
    assert vectors_by_text(db, item) == before
    assert mirror_problems(db) == [] and sent(db, fake.model_id) == []


@pytest.mark.parametrize("how", ["replace", "delete and insert"])
def test_a_chunk_row_a_host_replaces_is_written_again_from_the_item_s_text(db, host, how):
    """`INSERT OR REPLACE` under a chunk's id fires no UPDATE trigger: the forged text stayed
    beside the old text's vector, and the sweep even wrote it into the keyword index."""
    item, fake = indexed_note(db)
    before = vectors_by_text(db, item)
    target = chunk_id(db, item, 2)
    if how == "delete and insert":
        host.execute("DELETE FROM note_chunks WHERE id = ?", (target,))
    host.execute(
        "INSERT OR REPLACE INTO note_chunks(id, item_id, chunk_index, content, method, "
        "start_offset, end_offset, embed_hash) SELECT ?, item_id, 2, 'zanzibar quokka', method, "
        "start_offset, end_offset, embed_hash FROM note_chunks WHERE item_id = ? LIMIT 1",
        (target, item),
    )
    assert get_state(db, item)["status"] == "pending"
    assert (
        db.scalar("SELECT count(*) FROM note_chunk_embeddings WHERE chunk_id = ?", (target,)) == 0
    )
    assert sent(db, fake.model_id) == [item]
    result = index_item(db, item, embedder=fake)
    assert result.status == "indexed" and result.embedded <= 2
    assert exact_slices(db, item, TEXT) and kept_true(db, item, before, result.embedded)
    assert mirror_problems(db) == [] and fts_counts(db)["note_chunks_fts"]["stale"] == 0
    assert search_chunks(db, "zanzibar quokka", fake, k=5, mode="keyword").hits == []


def test_a_code_chunk_row_a_host_inserts_sends_its_item(db, host, tmp_path):
    from worker.indexers import IndexOptions
    from worker.settings import FilesSettings
    from worker.sources import Reader

    path = tmp_path / "m.py"
    path.write_text("\n\n".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(6)))
    item = add_item(db, kind="code", title="m.py", content="", source=str(path))
    options = IndexOptions(reader=Reader(FilesSettings(roots=[tmp_path])))
    fake = FakeEmbedder()
    assert index_item(db, item, embedder=fake, options=options).status == "indexed"
    host.execute(
        "INSERT OR REPLACE INTO code_chunks(id, item_id, chunk_index, path, start_line, "
        "end_line, content, embed_hash) SELECT id, item_id, chunk_index, path, start_line, "
        "end_line, 'def forged(): pass', embed_hash FROM code_chunks "
        "WHERE item_id = ? AND chunk_index = 1",
        (item,),
    )
    assert get_state(db, item)["status"] == "pending"
    assert sent(db, fake.model_id) == [item]
    again = index_item(db, item, embedder=fake, options=options)
    assert (again.status, again.chunks, again.embedded) == ("indexed", 6, 1)
    assert db.scalar("SELECT count(*) FROM code_chunks WHERE content LIKE '%forged%'") == 0


def test_a_chunk_a_host_moves_below_zero_is_put_back(db, host):
    """kidx's own moves go below zero and back inside one transaction, its item `indexing`;
    a host's move there went unseen, and the chunk stayed at -7 with another's offsets."""
    item, fake = indexed_note(db)
    host.execute(
        "UPDATE note_chunks SET chunk_index = -7, start_offset = 0, end_offset = 1 "
        "WHERE item_id = ? AND chunk_index = 4",
        (item,),
    )
    assert get_state(db, item)["status"] == "pending"
    assert sent(db, fake.model_id) == [item]
    assert index_item(db, item, embedder=fake).status == "indexed"
    assert exact_slices(db, item, TEXT)


def test_a_vector_a_host_replaces_goes_and_is_embedded_again(db, host):
    """`INSERT OR REPLACE` of a vector fires no UPDATE trigger (migration 15): search ranked
    its chunk by the host's vector for good."""
    item, fake = indexed_note(db)
    before = vectors_by_text(db, item)
    target = chunk_id(db, item, 3)
    host.execute(
        "INSERT OR REPLACE INTO note_chunk_embeddings(chunk_id, model, dimensions, vector) "
        "VALUES (?, ?, ?, ?)",
        (target, fake.model_id, db.dimensions, np.ones(db.dimensions, "<f4").tobytes()),
    )
    assert (
        db.scalar("SELECT count(*) FROM note_chunk_embeddings WHERE chunk_id = ?", (target,)) == 0
    )
    drift = reconcile(db, model=fake.model_id, max_items=100, backoff=BACKOFF)
    assert drift.found["without_vectors"] == [item] and drift.to_index == [item]
    fake.calls.clear()
    assert index_item(db, item, embedder=fake).embedded == 1
    assert vectors_by_text(db, item) == before and mirror_problems(db) == []


def test_an_item_id_a_host_takes_over_keeps_nothing_of_the_replaced_item(db, host, tmp_path):
    """`UPDATE OR REPLACE knowledge_items SET id = 2 WHERE id = 1` deletes item 2 without its
    delete trigger: item 2 (now item 1's file) stayed `indexed` with item 2's chunks, and a
    file's text is no hash the sweep could compare."""
    from worker.indexers import IndexOptions
    from worker.settings import FilesSettings
    from worker.sources import Reader

    options = IndexOptions(reader=Reader(FilesSettings(roots=[tmp_path])))
    fake = FakeEmbedder()
    ids = []
    for name, text in (("apples", "Apples are red and crisp."), ("bananas", "Bananas bend.")):
        (tmp_path / f"{name}.md").write_text(f"# {name.title()}\n\n{text}\n")
        ids.append(
            add_item(db, kind="file", title=name, content="", source=str(tmp_path / f"{name}.md"))
        )
        assert index_item(db, ids[-1], embedder=fake, options=options).status == "indexed"
    apples, bananas = ids
    host.execute("UPDATE OR REPLACE knowledge_items SET id = ? WHERE id = ?", (bananas, apples))
    assert db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (bananas,)) == 0
    assert get_state(db, bananas) is None or get_state(db, bananas)["status"] == "pending"
    assert sent(db, fake.model_id) == [bananas]
    assert index_item(db, bananas, embedder=fake, options=options).status == "indexed"
    texts = [r[0] for r in db.all("SELECT content FROM note_chunks")]
    assert len(texts) == 1 and "Apples" in texts[0]
    assert mirror_problems(db) == []


@pytest.mark.parametrize(
    "new_hash", [None, hashlib.sha256(b"Fixed text.").hexdigest()], ids=["cleared", "the new one"]
)
def test_a_failed_note_a_host_fixes_with_its_hash_is_pending_again(db, host, new_hash):
    """Only a fix that kept `content_hash` as it was made a failed item `pending` again: one
    that cleared it, or wrote the new text's, left it failed for good."""
    item = add_item(db, kind="note", title="Doc", content="Broken.")
    host.execute(
        "UPDATE item_index_state SET status = 'failed', attempts = 5 WHERE item_id = ?", (item,)
    )
    assert get_state(db, item)["status"] == "failed"
    host.execute(
        "UPDATE knowledge_items SET content = 'Fixed text.', content_hash = ? WHERE id = ?",
        (new_hash, item),
    )
    assert get_state(db, item)["status"] == "pending"
    assert db.scalar("SELECT attempts FROM item_index_state WHERE item_id = ?", (item,)) == 0
    assert sent(db, "fake") == [item]


def test_a_chunk_hash_that_is_not_utf8_is_embedded_again_not_a_failure_for_good(db, host):
    """apsw cannot read TEXT that is not UTF-8: every run of the item failed before it could
    write the row again, even after an edit."""
    item, fake = indexed_note(db)
    host.execute(
        "UPDATE note_chunks SET embed_hash = CAST(X'C328' AS TEXT) "
        "WHERE item_id = ? AND chunk_index = 1",
        (item,),
    )
    assert sent(db, fake.model_id) == [item]
    fake.calls.clear()
    result = index_item(db, item, embedder=fake)
    assert (result.status, result.embedded) == ("indexed", 1)
    assert sent(db, fake.model_id) == []


def test_a_chunk_is_never_found_twice_when_a_host_emptied_a_vec_rowids_row(db, host):
    """vec0 finds a key through its `_rowids` table: after a host's DELETE there, the next
    write of that chunk's vector went beside the old one, and sqlite-vec gave the chunk twice
    (hybrid search counted it twice in its fusion). As for memories: the exact path serves,
    with the reason, until the sweep rebuilds the table."""
    fake = FakeEmbedder()
    items = [
        add_item(db, kind="note", title=f"n{n}", content=f"alpha text number {n} here")
        for n in range(12)
    ]
    for item in items:
        index_item(db, item, embedder=fake)
    query = "alpha text number 3 here"
    top = search_chunks(db, query, fake, k=1, mode="vector").hits[0]
    host.execute("DELETE FROM vec_chunk_embeddings_rowids WHERE rowid = ?", (top.chunk_id,))
    host.execute("UPDATE item_index_state SET status = 'pending' WHERE item_id = ?", (top.item_id,))
    assert index_item(db, top.item_id, embedder=fake).status == "indexed"
    for mode in ("vector", "hybrid"):
        found = search_chunks(db, query, fake, k=3, mode=mode)
        chunks = [h.chunk_id for h in found.hits]
        assert len(set(chunks)) == 3, mode
        assert found.via.endswith("fallback") and "twice" in (found.reason or ""), mode
    exact = [h.chunk_id for h in search_chunks(db, query, fake, k=3, mode="vector").hits]
    assert exact[0] == top.chunk_id
    reconcile(db, model=fake.model_id, max_items=100, backoff=BACKOFF)
    again = search_chunks(db, query, fake, k=3, mode="vector")
    assert again.via == "vec" and [h.chunk_id for h in again.hits] == exact


def test_code_search_gives_k_hits_past_a_row_it_cannot_show(db, host, tmp_path):
    """A chunk whose line a host made TEXT cannot be shown (until its item's run writes it
    again): code search skipped it and gave k - 1 hits once k passed its candidate depth,
    where prose search refills."""
    from worker.indexers import IndexOptions
    from worker.indexers.code import search_code
    from worker.settings import FilesSettings
    from worker.sources import Reader

    path = tmp_path / "shapes.py"
    path.write_text(
        "\n\n".join(
            f"def area_{j}(r):\n    x = {j}\n    return 3.14 * r * r * x\n"
            + "\n".join(f"    # line {m}" for m in range(30))
            for j in range(80)
        )
    )
    item = add_item(db, kind="code", title=path.name, content="", source=str(path))
    options = IndexOptions(reader=Reader(FilesSettings(roots=[tmp_path])))
    fake = FakeEmbedder()
    index_item(db, item, embedder=fake, options=options)
    chunks = db.scalar("SELECT count(*) FROM code_chunks")
    assert chunks > 60
    top = search_code(db, "zzqq", fake, k=50)[0][0]
    host.execute(
        "UPDATE code_chunks SET start_line = 'ten' WHERE item_id = ? AND start_line = ?",
        (item, top.start_line),
    )
    for k in (50, chunks - 1):
        hits = search_code(db, "zzqq", fake, k=k)[0]
        assert len(hits) == k and top.start_line not in {h.start_line for h in hits}, k


class RenamedMeanwhile(FakeEmbedder):
    """Renames the item (a host's plain SQL) while its run embeds its second batch: by then
    the run has marked the item `indexing` (its first write, after it sent the first batch).
    A rename before that mark makes the run read the item again (`coalesced` fence)."""

    def __init__(self, host, item: int) -> None:
        super().__init__()
        self.host, self.item = host, item

    def embed_batch(self, texts):  # type: ignore[no-untyped-def]
        if len(self.calls) == 1:
            self.host.execute(
                "UPDATE knowledge_items SET source = 'moved.md' WHERE id = ?", (self.item,)
            )
        return super().embed_batch(texts)


def test_a_rename_during_a_run_keeps_the_vectors_the_run_wrote(db, host):
    """A rename makes the item `pending` while its run embeds, and the run writes all the
    same (it records `pending`): told from a host's by the item's state, the run's new
    vectors were deleted as it wrote them, and the item could not be found until it ran
    again, its text embedded twice. kidx's writes are told by their own mark now."""
    item = add_item(db, kind="note", title="Install", content=TEXT)
    embedder = RenamedMeanwhile(host, item)
    result = index_item(db, item, embedder=embedder)
    assert len(embedder.calls) >= 3  # (the rename came during the run)
    assert result.status == "indexed" and get_state(db, item)["status"] == "pending"
    chunks = db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (item,))
    assert len(vectors_by_text(db, item)) == chunks > 1
    assert mirror_problems(db) == []
    fake = FakeEmbedder()
    again = index_item(db, item, embedder=fake)
    assert (again.status, again.embedded, fake.calls) == ("indexed", 0, [])
    assert db.scalar("SELECT count(*) FROM kidx_writer") == 0


def test_a_memory_vector_a_host_replaces_goes_and_is_embedded_again(db, host):
    """`INSERT OR REPLACE` of a memory's vector fires no UPDATE trigger (migration 15): the
    memory was found by the host's vector for good."""
    from worker.indexers.memories import add_memory, embed_memories, search_memories

    fake = FakeEmbedder()
    ids = [add_memory(db, text, fake) for text in ("Likes tea.", "Lives in Oslo.", "Has a cat.")]
    before = db.scalar("SELECT vector FROM memory_embeddings WHERE memory_id = ?", (ids[0],))
    host.execute(
        "INSERT OR REPLACE INTO memory_embeddings(memory_id, model, dimensions, vector) "
        "VALUES (?, ?, ?, ?)",
        (ids[0], fake.model_id, db.dimensions, np.ones(db.dimensions, "<f4").tobytes()),
    )
    assert db.scalar("SELECT count(*) FROM memory_embeddings WHERE memory_id = ?", (ids[0],)) == 0
    fake.calls.clear()
    assert embed_memories(db, fake).embedded == 1 and fake.calls == [["Likes tea."]]
    assert db.scalar("SELECT vector FROM memory_embeddings WHERE memory_id = ?", (ids[0],)) == (
        before
    )
    hits, _, _ = search_memories(db, "Likes tea.", fake, k=1)
    assert hits[0].memory_id == ids[0] and hits[0].score > 0.99


@pytest.mark.parametrize("index", [-1, -3, "x", 2.5, b"\x00", 2**62])
def test_a_chunk_index_a_host_writes_anywhere_is_put_back(db, host, index):
    """A run moved an item's chunks to `-1 - chunk_index` before putting the kept ones in
    place: a host's -1 (0 then), -3 or 'x' (-1 either way) collided with another chunk, and
    the item failed at every run with UNIQUE(item_id, chunk_index)."""
    # sections that are a chunk each: the moved chunk is cut again the same, and kept
    text = "# Doc\n\n" + "\n\n".join(
        f"## Part {k}\n\nPart {k} says " + "alpha beta gamma. " * 25 for k in range(12)
    )
    item, fake = indexed_note(db, "Parts", text)
    assert db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (item,)) == 12
    before = vectors_by_text(db, item)
    host.execute(
        "UPDATE note_chunks SET chunk_index = ? WHERE item_id = ? AND chunk_index = 4",
        (index, item),
    )
    assert get_state(db, item)["status"] == "pending"
    result = index_item(db, item, embedder=fake)
    assert result.status == "indexed", result
    assert exact_slices(db, item, text) and kept_true(db, item, before, result.embedded)
