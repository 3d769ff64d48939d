"""The store against a fourth review: a keyword table a host made again in its own shape was
searched as kidx's; a migration run again wound the item id sequence back; a vec table a host
made at another dimension stayed until a write; the chunk list and state read any id."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import FakeEmbedder
from worker.bulk import index_items
from worker.retrieval import search_chunks
from worker.store.items import add_item


def test_a_keyword_table_a_host_made_in_its_own_shape_is_not_searched(db, host):
    """`fts5(content)` with the host's own rows: its rowids came back as chunks that hold
    none of the query's words, `via=fts`, no reason given."""
    fake = FakeEmbedder()
    ids = [
        add_item(db, kind="note", title=f"T{i}", content=f"zeta{i} omega. " * 40) for i in range(3)
    ]
    index_items(db, ids, embedder=fake)
    host.execute("DROP TABLE note_chunks_fts")
    host.execute("CREATE VIRTUAL TABLE note_chunks_fts USING fts5(content)")
    first = db.scalar("SELECT min(id) FROM note_chunks")
    host.execute("INSERT INTO note_chunks_fts(rowid, content) VALUES (?, 'platypus')", (first,))
    keyword = search_chunks(db, "platypus", embedder=fake, k=3, mode="keyword")
    assert keyword.hits == []
    assert "note_chunks_fts is not kidx's (the sweep rebuilds it)" in " ".join(keyword.notes)
    hybrid = search_chunks(db, "platypus", embedder=fake, k=3, mode="hybrid")
    assert hybrid.via == "vec" and all("platypus" not in h.content for h in hybrid.hits)


@pytest.mark.parametrize("bad", [True, "1", 1.0, 2**70, [1], None])
def test_the_chunk_list_and_state_take_an_item_id_or_say_what_it_is_not(db, bad):
    """Bound as it came: True, "1" and 1.0 meant item 1, 2**70 raised OverflowError, [1] a
    TypeError; a numpy integer was bound as bytes and item 1 was "not found"."""
    import numpy as np

    from worker.errors import InvalidInput
    from worker.store.items import get_state, list_chunks

    item = add_item(db, kind="note", title="T", content="One short note.")
    index_items(db, [item], embedder=FakeEmbedder())
    assert list_chunks(db, np.int64(item)) == list_chunks(db, item)
    assert get_state(db, np.int32(item))["status"] == "indexed"
    for read in (list_chunks, get_state):
        with pytest.raises(InvalidInput, match="must be a 64-bit integer"):
            read(db, bad)


def test_a_migration_run_again_keeps_the_ids_deleted_items_had(db_path, emb_settings):
    """Migration 5 rebuilt knowledge_items and set its sequence from the ids left: run again
    (schema_version set back, a restored copy), the sequence a deleted item had counted was
    lost with the old table, and its id was given to the next item."""
    import apsw

    from worker.store import connect
    from worker.store.removal import delete_items

    db = connect(db_path, embedding=emb_settings)
    ids = [add_item(db, kind="note", title=f"T{i}", content=f"Note {i}.") for i in range(4)]
    delete_items(db, [ids[-1]])
    db.close()
    host = apsw.Connection(str(db_path))
    host.execute("UPDATE index_meta SET value = '4' WHERE key = 'schema_version'")
    host.close()
    db = connect(db_path, embedding=emb_settings)
    try:
        assert add_item(db, kind="note", title="new", content="A new note.") == ids[-1] + 1
        assert db.all("SELECT name FROM sqlite_sequence WHERE name = 'kidx_items_before'") == []
    finally:
        db.close()


def test_a_vec_table_a_host_made_at_another_dimension_is_rebuilt_by_the_sweep(db):
    """At 32 dimensions where the index and every other table are at this model's: the sweep
    rebuilt only missing tables, and search stayed on the exact fallback until a write."""
    import apsw

    from worker.reconcile import reconcile
    from worker.store import db as store_db

    fake = FakeEmbedder()
    ids = [
        add_item(db, kind="note", title=f"T{i}", content=f"zeta{i} omega. " * 40) for i in range(3)
    ]
    index_items(db, ids, embedder=fake)
    host = apsw.Connection(str(db.path))
    host.enable_load_extension(True)
    host.load_extension(store_db.vec_library_path())
    host.execute("DROP TABLE vec_chunk_embeddings")
    host.execute(
        "CREATE VIRTUAL TABLE vec_chunk_embeddings USING vec0(chunk_id INTEGER PRIMARY KEY, "
        "embedding float[32] distance_metric=cosine)"
    )
    host.close()
    assert search_chunks(db, "zeta1 omega", fake, k=3, mode="vector").via == "fallback"
    drift = reconcile(db, model=fake.model_id, max_items=100)
    assert drift.repaired["tables_rebuilt"] == {"vec_chunk_embeddings": 3}
    found = search_chunks(db, "zeta1 omega", fake, k=3, mode="vector")
    assert found.via == "vec" and found.hits


def test_a_database_path_under_a_file_says_which_file_is_in_the_way(tmp_path):
    """`kidx init --db notes.txt/x.db` said "File exists: notes.txt" (and add "Not a
    directory"), for a path that names no existing file."""
    from worker.errors import StoreError
    from worker.store import connect

    (tmp_path / "notes.txt").write_text("a note")
    for path in (tmp_path / "notes.txt" / "x.db", tmp_path / "notes.txt" / "sub" / "x.db"):
        with pytest.raises(StoreError, match=r"notes\.txt is a file, not a folder"):
            connect(path)


def test_the_chunk_list_tells_the_index_s_vectors_whatever_model_the_reader_has(
    db_path, emb_settings
):
    """`kidx chunks` in a shell without the workers' .env (another model, or none) said 0 of
    8 chunks embedded where `kidx status` said the item indexed: judged by the reader's
    settings, not by the model the index is kept for."""
    from worker.store import connect
    from worker.store.items import list_chunks

    writer = connect(db_path, embedding=emb_settings)
    item = add_item(writer, kind="note", title="T", content="zeta omega. " * 400)
    index_items(writer, [item], embedder=FakeEmbedder(model_id=emb_settings.model))
    count = len(list_chunks(writer, item))
    writer.close()
    other = emb_settings.model_copy(update={"model": "not-the-index-s"})
    for settings in (other, None):
        reader = connect(db_path, embedding=settings, read_only=True, claim=False)
        try:
            assert [c["has_embedding"] for c in list_chunks(reader, item)] == [True] * count
        finally:
            reader.close()


def test_a_sweep_record_nested_past_what_kidx_writes_is_left_out(db, host):
    """json read 500 levels, and what shows the summary walked it recursively: `kidx status
    --summary --json` ended in a RecursionError, "a bug in kidx"."""
    import json

    from worker.reconcile import last_sweeps, record_sweep

    record_sweep(db, "retry", {"sent": 1, "found": {"failed": 1}})
    deep: object = 1
    for _ in range(500):
        deep = {"a": deep}
    host.execute(
        "INSERT OR REPLACE INTO index_meta(key, value) VALUES ('last_reconcile', ?)",
        (json.dumps({"at": "now", "deep": deep}),),
    )
    sweeps = last_sweeps(db)
    assert set(sweeps) == {"retry"} and sweeps["retry"]["found"] == {"failed": 1}


@pytest.mark.parametrize("items", [1, 3])
def test_no_write_transaction_of_a_run_counts_whole_tables(db, items):
    """The orphan check counted every vec table and its source (twice the chunk vectors)
    inside each item's write transaction, or the group's: 0.5 s under the write lock at
    200,000 chunks, for an item of two. Counted now in a read snapshot, outside it."""
    ids = [
        add_item(db, kind="note", title=f"T{i}", content=f"zeta{i} omega. " * 40)
        for i in range(items)
    ]
    statements: list[str] = []
    db.conn.exec_trace = lambda cursor, sql, bindings: statements.append(sql) or True
    try:
        index_items(db, ids, embedder=FakeEmbedder())
    finally:
        db.conn.exec_trace = None
    inside, held = [], False
    for sql in statements:
        word = sql.lstrip().split(None, 1)[0].upper() if sql.strip() else ""
        if sql.lstrip().upper().startswith("BEGIN IMMEDIATE"):
            held = True
        elif word in ("COMMIT", "ROLLBACK", "END"):
            held = False
        elif held:
            inside.append(sql)
    assert inside and not [s for s in inside if "count(*) FROM vec_" in s]
    assert any("count(*) FROM vec_" in s for s in statements)  # the check is made, outside


def test_a_lock_held_past_the_busy_timeout_is_waited_out_once_a_run_not_once_an_item(
    db_path, emb_settings
):
    """A host's transaction held the write lock: the run's write waited the busy timeout and
    failed, then recording each item's outcome waited the whole timeout again ((N+1) x 30 s
    for a group of N: past the soft time limit). Once locked out, the rest waits a moment."""
    import threading

    import apsw

    from worker.store import connect

    db = connect(db_path, embedding=emb_settings, busy_timeout_ms=300)
    ids = [add_item(db, kind="note", title=f"T{i}", content=f"Note {i}. " * 30) for i in range(6)]
    full_waits: list[int] = []

    def spy(prior_calls: int) -> bool:
        go_on = db._busy(prior_calls)
        if not go_on and db.busy_timeout_ms == 300:
            full_waits.append(prior_calls)
        return go_on

    db.conn.set_busy_handler(spy)
    host = apsw.Connection(str(db_path))
    host.execute("PRAGMA busy_timeout = 10000")  # (past the run's own short writes)
    held = threading.Event()

    class LocksOut(FakeEmbedder):  # the host takes the lock while the run embeds
        def embed_batch(self, texts: list[str]) -> Any:
            if not held.is_set():
                host.execute("BEGIN IMMEDIATE")
                held.set()
            return super().embed_batch(texts)

    try:
        out = index_items(db, ids, embedder=LocksOut())
    finally:
        if held.is_set():
            host.execute("COMMIT")
        host.close()
    assert all(type(out[i]).__name__ == "IndexAborted" for i in ids)
    assert len(full_waits) == 1 and db.busy_timeout_ms == 300  # given back after the run
    db.close()


def test_a_host_s_memory_of_unicode_white_space_is_left_alone_as_an_empty_one(db, host):
    """add_memory refuses "\\u3000\\xa0" as empty (Python's strip); the backfill trimmed ASCII
    white space only, embedded a host's such row, and memory search returned it."""
    from worker.indexers.memories import embed_memories

    host.execute(
        "INSERT INTO memories(id, content) VALUES (1, ?), (2, ?), (3, ?)",
        ("\u3000\xa0\u2028", " \t\n", "Likes green tea."),
    )
    report = embed_memories(db, FakeEmbedder())
    assert report.embedded == 1 and report.left == 0
    assert db.all("SELECT memory_id FROM memory_embeddings") == [(3,)]


def test_a_savepoint_whose_release_fails_is_rolled_back_not_committed_with_its_parent(db):
    """RELEASE outside the undo: a savepoint left open when it failed was committed with the
    transaction around it (a run's claim marks stayed `indexing`, its items reported failed)."""
    import apsw

    def refuse_release(cursor, sql, bindings):
        return not sql.startswith("RELEASE sp1")

    with db.atomic():
        db.execute("INSERT INTO index_meta(key, value) VALUES ('outer', '1')")
        with pytest.raises(apsw.ExecTraceAbort), db.atomic():
            db.execute("INSERT INTO index_meta(key, value) VALUES ('inner', '1')")
            db.conn.exec_trace = refuse_release
        db.conn.exec_trace = None
    keys = {k for (k,) in db.all("SELECT key FROM index_meta WHERE key IN ('outer', 'inner')")}
    assert keys == {"outer"} and db.conn.get_autocommit()


def test_a_run_without_a_provider_leaves_alone_an_item_another_run_has_taken(db_path, emb_settings):
    """A process with no provider marked the item `skipped` over the `indexing` mark of a run
    that took it since this one read it (that run then ended coalesced, nothing written)."""
    import time

    from worker.indexers import IndexOptions
    from worker.log import get_logger
    from worker.pipeline import prepare_item
    from worker.store import connect
    from worker.store.items import claim_items, get_item, get_state, read_claim

    db = connect(db_path, embedding=emb_settings)
    item = add_item(db, kind="note", title="T", content="A note to index.")
    claim = read_claim(db, item)  # what the provider-less run read
    other = connect(db_path, embedding=emb_settings)
    with other.atomic():  # another run takes the item meanwhile
        assert item in claim_items(other, [(item, read_claim(other, item))], "other-task")
    other.close()
    result = prepare_item(
        db,
        get_item(db, item, content=False),
        None,
        IndexOptions(),
        time.monotonic(),
        get_logger("test"),
        claim=claim,
    )
    assert result.status == "skipped"
    assert get_state(db, item)["status"] == "indexing"  # the other run's, as it was
    db.close()
