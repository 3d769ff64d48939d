"""What the reconcile sweep finds after a host's plain SQL, and what it leaves to a backoff (an
audit of the scheduler: each case below was found stale for good, or sent on every sweep).

A real SQLite file with sqlite-vec; the host is a bare apsw connection with no kidx code and
foreign keys off; the provider is the stand-in over HTTP."""

from __future__ import annotations

import apsw

from conftest import AFTER_THE_RUN, AS_A_RUN, FakeEmbedder, corpus_text, mirror_problems
from worker.bulk import index_item
from worker.indexers import IndexOptions
from worker.reconcile import Backoff, reconcile
from worker.retrieval import search_chunks
from worker.settings import FilesSettings
from worker.sources import Reader
from worker.store.db import Database
from worker.store.items import add_item, get_state

# As the retry sweep waits: 60 s, then doubling; five attempts.
BACKOFF = Backoff(max_attempts=5, backoff=60.0, backoff_max=6 * 3600.0)


def to_index(db: Database) -> list[int]:
    return reconcile(db, model="standin-embed", max_items=100, backoff=BACKOFF).to_index


def set_state(host: apsw.Connection, item: int, status: str, attempts: int, age_s: float) -> None:
    """As a run left it `age_s` ago, of the item's text as it is (so no edit to send)."""
    host.execute(
        "UPDATE item_index_state SET status = ?, attempts = ?, updated_at = "
        "strftime('%Y-%m-%dT%H:%M:%fZ', 'now', ?), indexed_hash = "
        "(SELECT content_hash FROM knowledge_items WHERE id = item_id) WHERE item_id = ?",
        (status, attempts, f"-{age_s} seconds", item),
    )


def test_a_failed_note_a_host_fixes_is_pending_again_with_its_attempts_back_to_0(db, host):
    """The retry sweep gives up after the last attempt, and the reconcile sweep leaves failed
    items to it: a host's fix of the text was never indexed (the error even said what to fix)."""
    item = add_item(db, kind="note", title="Broken", content="The text as it was.")
    set_state(host, item, "failed", 5, 0)
    assert to_index(db) == []
    host.execute("UPDATE knowledge_items SET content = 'The text, fixed.' WHERE id = ?", (item,))
    state = get_state(db, item)
    assert (state["status"], db.scalar("SELECT attempts FROM item_index_state")) == ("pending", 0)
    assert to_index(db) == [item]


def test_an_item_a_host_replaces_loses_the_old_index_and_is_indexed_anew(db, embedder, host):
    """`INSERT OR REPLACE` deletes the old row without its delete trigger: the old chunks stayed,
    `indexed`, searchable under the new item, and no sweep ever sent it."""
    item = add_item(db, kind="note", title="Zebras", content="Zebra migration across the plains.")
    assert index_item(db, item, embedder=embedder).status == "indexed"
    host.execute(
        "INSERT OR REPLACE INTO knowledge_items(id, kind, title, content) "
        "VALUES (?, 'note', 'Volcanoes', 'Lava flows from the volcano.')",
        (item,),
    )
    assert db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (item,)) == 0
    assert get_state(db, item) is None or get_state(db, item)["status"] == "pending"
    assert search_chunks(db, "zebra migration", embedder, k=5).hits == []
    drift = reconcile(db, model=embedder.model_id, max_items=100, backoff=BACKOFF)
    assert drift.to_index == [item]
    assert index_item(db, item, embedder=embedder).status == "indexed"
    assert mirror_problems(db) == []
    hits = search_chunks(db, "lava volcano", embedder, k=5).hits
    assert [(h.item_id, h.title) for h in hits] == [(item, "Volcanoes")]


def test_failed_items_are_left_to_the_retry_sweep(db, host):
    """A failed item with a chunk without a vector was sent by every reconcile sweep, past
    the retry sweep's backoff and past its last attempt."""
    item = add_item(db, kind="note", title="Failed", content="Text.")
    host.execute(
        "INSERT INTO note_chunks(item_id, chunk_index, content, method, start_offset, "
        "end_offset, embed_hash) VALUES (?, 0, 'Text.', 'structure', 0, 5, 'h')",
        (item,),
    )
    for attempts, age in ((1, 3600.0), (5, 86400.0)):  # due for the retry sweep; exhausted
        set_state(host, item, "failed", attempts, age)
        drift = reconcile(db, model="standin-embed", max_items=100, backoff=BACKOFF)
        assert item not in drift.to_index and item not in drift.found["without_vectors"]


def test_a_partial_item_is_sent_again_with_the_retry_backoff_and_after_new_items(db, host):
    """A partial item was re-sent on every sweep with no attempt counted, and, first by id,
    took every slot of a sweep with a small `max_items` from items never indexed."""
    partial = add_item(db, kind="note", title="Partial", content="Some text.")
    fresh = [add_item(db, kind="note", title=f"New {n}", content="New.") for n in range(2)]
    for item in fresh:
        host.execute("DELETE FROM item_index_state WHERE item_id = ?", (item,))
    set_state(host, partial, "partial", 1, 10)  # 10 s after its first partial run
    assert to_index(db) == fresh
    set_state(host, partial, "partial", 1, 61)  # its first wait (60 s) has passed
    assert to_index(db) == [*fresh, partial]
    one = reconcile(db, model="standin-embed", max_items=1, backoff=BACKOFF).to_index
    assert one == [fresh[0]]
    set_state(host, partial, "partial", 2, 61)  # the second wait is 120 s
    assert partial not in to_index(db)
    set_state(host, partial, "partial", 5, 86400)  # its attempts are spent
    assert partial not in to_index(db)
    # A host's garbage in the columns the backoff reads: left alone, never a crash.
    host.execute(
        "UPDATE item_index_state SET attempts = 'many', updated_at = x'ff' WHERE item_id = ?",
        (partial,),
    )
    assert partial not in to_index(db)


def test_each_partial_outcome_counts_an_attempt_and_a_whole_index_resets_them(
    db, embedder, standin
):
    text = corpus_text("ch04-03-slices.md")
    middle = text.index(" ", len(text) // 2)
    item = add_item(
        db, kind="note", title="Poisoned", content=f"{text[:middle]} POISON{text[middle:]}"
    )
    standin.poison = "POISON"  # one chunk of many refused
    for n in (1, 2):
        assert index_item(db, item, embedder=embedder).status == "partial"
        assert db.scalar("SELECT attempts FROM item_index_state WHERE item_id = ?", (item,)) == n
    standin.poison = None
    assert index_item(db, item, embedder=embedder).status == "indexed"
    assert db.scalar("SELECT attempts FROM item_index_state WHERE item_id = ?", (item,)) == 0


def test_after_a_model_switch_a_failed_item_is_the_retry_sweeps_and_a_partial_one_goes(db, host):
    """Vectors of another model send an item whatever its backoff (a switch is no retry), but
    not a failed one: a document that keeps failing under the new model, its old index intact,
    was sent by every sweep."""
    items = {}
    for status in ("failed", "partial"):
        item = add_item(db, kind="note", title=status, content="Text.")
        # as the old model's run wrote them (a host's rows would go: schema migration 16)
        host.execute(AS_A_RUN)
        host.execute(
            "INSERT INTO note_chunks(item_id, chunk_index, content, method, start_offset, "
            "end_offset, embed_hash) VALUES (?, 0, 'Text.', 'structure', 0, 5, 'h')",
            (item,),
        )
        host.execute(
            "INSERT INTO note_chunk_embeddings(chunk_id, model, dimensions, vector) "
            "VALUES (last_insert_rowid(), 'the-old-model', ?, zeroblob(?))",
            (db.dimensions, 4 * db.dimensions),
        )
        host.execute(AFTER_THE_RUN)
        set_state(host, item, status, 1, 5)  # its backoff not yet passed
        items[status] = item
    drift = reconcile(db, model="standin-embed", max_items=100, backoff=BACKOFF)
    assert drift.found["other_model"] == [items["partial"]]
    assert drift.to_index == [items["partial"]]


def test_chunks_a_host_deletes_or_adds_send_their_item_to_be_indexed_again(db, embedder, host):
    """A plain DELETE of an indexed item's chunks (some or all): the sweep deleted their vec
    rows as orphans and found nothing to send, so the item stayed `indexed` and its text was
    never found again. A chunk row a host adds under an item is the same drift."""
    text = corpus_text("ch01-01-installation.md")
    items = {
        name: add_item(db, kind="note", title=name.title(), content=f"{name}\n\n{text}")
        for name in ("whole", "one", "all", "added", "untouched")
    }
    for item in items.values():
        assert index_item(db, item, embedder=embedder).status == "indexed"
    assert (
        db.scalar("SELECT chunk_count FROM item_index_state WHERE item_id = ?", (items["one"],))
        >= 3
    )
    host.execute("DELETE FROM note_chunks WHERE item_id = ? AND chunk_index = 1", (items["one"],))
    host.execute("DELETE FROM note_chunks WHERE item_id = ?", (items["all"],))
    host.execute(
        "INSERT INTO note_chunks(item_id, chunk_index, content, method, start_offset, "
        "end_offset, embed_hash) VALUES (?, 999, 'a stray row', 'structure', 0, 5, 'x')",
        (items["added"],),
    )
    # the added row made its item `pending` at once (schema migration 16)
    assert get_state(db, items["added"])["status"] == "pending"
    drift = reconcile(db, model=embedder.model_id, max_items=100, backoff=BACKOFF)
    lost = sorted(items[n] for n in ("one", "all", "added"))
    assert drift.found["chunks_lost"] == sorted(items[n] for n in ("one", "all"))
    assert drift.found["pending"] == [items["added"]]
    assert sorted(drift.to_index) == lost
    for item in lost:
        assert index_item(db, item, embedder=embedder).status == "indexed"
    rows = dict(db.all("SELECT item_id, count(*) FROM note_chunks GROUP BY item_id"))
    states = dict(db.all("SELECT item_id, chunk_count FROM item_index_state"))
    assert all(rows.get(item, 0) == states[item] > 0 for item in items.values())
    assert db.scalar("SELECT count(*) FROM note_chunks WHERE chunk_index = 999") == 0
    assert mirror_problems(db) == []
    again = reconcile(db, model=embedder.model_id, max_items=100, backoff=BACKOFF)
    assert again.found["chunks_lost"] == [] and again.to_index == []  # sent once, not forever
    hits = search_chunks(db, text[:300], embedder, k=10).hits
    assert items["all"] in {h.item_id for h in hits}


def test_code_chunks_a_host_deletes_send_their_item_and_only_they_are_embedded(db, tmp_path):
    """The same for a code item, whose chunks are in `code_chunks`: the lost function is cut
    and embedded again, the others keep their vectors."""
    path = tmp_path / "m.py"
    path.write_text("\n\n".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(6)))
    item = add_item(db, kind="code", title="m.py", content="", source=str(path))
    options = IndexOptions(reader=Reader(FilesSettings(roots=[tmp_path])))
    fake = FakeEmbedder()
    assert index_item(db, item, embedder=fake, options=options).chunks == 6
    db.execute("PRAGMA foreign_keys = OFF")  # as a host's connection: the vectors stay
    db.execute("DELETE FROM code_chunks WHERE item_id = ? AND chunk_index = 3", (item,))
    db.execute("PRAGMA foreign_keys = ON")
    drift = reconcile(db, model=fake.model_id, max_items=100, backoff=BACKOFF)
    assert drift.found["chunks_lost"] == [item] and drift.to_index == [item]
    again = index_item(db, item, embedder=fake, options=options)
    assert (again.status, again.chunks, again.embedded) == ("indexed", 6, 1)
    assert reconcile(db, model=fake.model_id, max_items=100, backoff=BACKOFF).to_index == []


def test_a_whole_item_vector_a_host_deletes_or_adds_is_mended_without_an_embedding(
    db, embedder, host, standin
):
    """A one-chunk note is recalled whole by its row in `note_embeddings` (the seed's extra
    whole-note vector). A host's DELETE of that row: the sweep deleted its vec rows as orphans
    and the note was never recalled whole again. The run writes the chunk's vector again: no
    request. A row a host adds for a note of several chunks goes at once (schema migration
    16): nothing to send."""
    short = add_item(db, kind="note", title="Zebras", content="Zebra migration on the plains.")
    long = add_item(
        db, kind="note", title="Install", content=corpus_text("ch01-01-installation.md")
    )
    for item in (short, long):
        assert index_item(db, item, embedder=embedder).status == "indexed"
    vector = db.scalar("SELECT vector FROM note_embeddings WHERE item_id = ?", (short,))
    host.execute("DELETE FROM note_embeddings WHERE item_id = ?", (short,))
    host.execute(
        "INSERT INTO note_embeddings(item_id, model, dimensions, vector) "
        "SELECT ?, model, dimensions, vector FROM note_chunk_embeddings LIMIT 1",
        (long,),
    )
    assert db.scalar("SELECT count(*) FROM note_embeddings WHERE item_id = ?", (long,)) == 0
    drift = reconcile(db, model=embedder.model_id, max_items=100, backoff=BACKOFF)
    assert drift.found["whole_vector"] == [short] and drift.to_index == [short]
    standin.reset()
    for item in (short, long):
        assert index_item(db, item, embedder=embedder).embedded == 0
    assert standin.requests == 0
    wholes = dict(db.all("SELECT item_id, vector FROM note_embeddings"))
    assert wholes == {short: vector}
    assert mirror_problems(db) == []
    assert reconcile(db, model=embedder.model_id, max_items=100, backoff=BACKOFF).to_index == []


def test_a_sweep_repairs_at_most_a_slice_and_the_next_goes_on(db, db_path, monkeypatch):
    """A host's DELETE of 200k chunks' vectors made one sweep transaction of 1.4 million
    statements (19 s under the write lock, a worker's write waiting on it); a dropped keyword
    table of 200k chunks was refilled at once (21 s, 300 MB of text)."""
    from conftest import FakeEmbedder
    from host import host
    from worker.bulk import index_item
    from worker.reconcile import reconcile
    from worker.store import fts, repair
    from worker.store.items import add_item

    fake = FakeEmbedder()
    for n in range(12):
        index_item(db, add_item(db, kind="note", title=f"n{n}", content=f"note {n}"), embedder=fake)
    monkeypatch.setattr(repair, "REPAIR_SLICE", 5)
    monkeypatch.setattr("worker.reconcile.SWEEP_ROWS", 5)
    host(db_path, ("DELETE FROM note_chunk_embeddings", []), ("DROP TABLE note_chunks_fts", []))
    orphans, refilled = [], []
    for _ in range(3):
        drift = reconcile(db, model=fake.model_id, max_items=100)
        orphans.append(drift.repaired.get("orphans_deleted", {}).get("vec_chunk_embeddings"))
        refilled.append(drift.repaired.get("keyword_rows", {}).get("note_chunks_fts missing"))
    assert orphans == [5, 5, 2] and refilled == [5, 5, 2]
    assert db.scalar("SELECT count(*) FROM vec_chunk_embeddings") == 0
    assert fts.fts_counts(db)["note_chunks_fts"] == {"stale": 0, "missing": 0}
