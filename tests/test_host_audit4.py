"""The engine against rows a host wrote with plain SQL (tests/host.py: its own process, foreign
keys off), from a fourth review: text that is not UTF-8 where an integer or a hash belongs
(apsw raised UnicodeDecodeError reading it, every sweep or every run), two vec rows in one slot
(each sweep rewrote one, for good), and schema-4 databases that migration 5 could not upgrade
without loss or without a clear error. A real SQLite file with sqlite-vec; the provider is the
stand-in over HTTP."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import mirror_problems
from host import host
from tasks.run import changed
from worker.bulk import index_item
from worker.errors import StoreError
from worker.reconcile import Backoff, reconcile
from worker.store import connect
from worker.store.db import Database, set_meta
from worker.store.fts import FTS_TABLES, fts_counts, fts_present
from worker.store.items import add_item, get_state
from worker.store.schema import MIGRATIONS, SCHEMA_VERSION, _statements, schema_version

BACKOFF = Backoff(max_attempts=5, backoff=60.0, backoff_max=3600.0)
NOT_UTF8 = "CAST(x'ff32' AS TEXT)"


def _indexed(db: Database, embedder, n: int = 2) -> list[int]:
    items = [add_item(db, kind="note", title=f"N{i}", content=f"Note {i} text.") for i in range(n)]
    for item in items:
        index_item(db, item, embedder=embedder)
    return items


def test_a_failed_items_attempts_that_are_not_utf8_rest_and_the_sweep_runs(db, embedder):
    a, b = _indexed(db, embedder)
    host(
        db.path,
        (
            f"UPDATE item_index_state SET status = 'failed', attempts = {NOT_UTF8} "
            "WHERE item_id = ?",
            [b],
        ),
        ("UPDATE knowledge_items SET content = 'Edited by the host.' WHERE id = ?", [a]),
    )
    drift = reconcile(db, model="standin-embed", max_items=10, backoff=BACKOFF)
    assert drift.to_index == [a]  # the edit is sent; the failed item rests


def test_a_fell_back_items_attempts_that_are_not_utf8_rest_and_the_sweep_runs(db, embedder):
    from worker.reconcile import FELL_BACK

    a, b = _indexed(db, embedder)
    host(
        db.path,
        (
            f"UPDATE item_index_state SET attempts = {NOT_UTF8}, chunk_method = 'structure', "
            "last_error = ? WHERE item_id = ?",
            [FELL_BACK, b],
        ),
    )
    drift = reconcile(db, model="standin-embed", max_items=10, backoff=BACKOFF, rechunk=5)
    assert b not in drift.to_index and a not in drift.to_index


def test_a_keyword_config_that_is_not_utf8_is_rebuilt_by_the_sweep(db, embedder):
    _indexed(db, embedder)
    table = FTS_TABLES[0].name
    host(db.path, (f"UPDATE {table}_config SET v = {NOT_UTF8} WHERE k = 'version'", []))
    # (the connection's FTS5 may hold the config cached: its hourly check passes once)
    rebuilt = [
        f"{table} rebuilt"
        in reconcile(db, model="standin-embed", max_items=10).repaired["keyword_rows"]
        for _ in range(2)
    ]
    assert any(rebuilt), rebuilt
    assert fts_counts(db)[table] == {"stale": 0, "missing": 0} and fts_present(db, FTS_TABLES[0])
    host(db.path, (f"UPDATE {table}_config SET v = {NOT_UTF8} WHERE k = 'version'", []))
    fresh = connect(db.path)  # a process's open: FTS5 refused the table, every command failed
    try:
        assert fts_counts(fresh)[table] == {"stale": 0, "missing": 0}
        assert fts_present(fresh, FTS_TABLES[0])
    finally:
        fresh.close()


def test_a_chunk_target_that_is_not_utf8_lets_the_item_be_indexed_again(db, embedder):
    (item,) = _indexed(db, embedder, 1)
    host(
        db.path,
        (f"UPDATE item_index_state SET chunk_target = {NOT_UTF8} WHERE item_id = ?", [item]),
        ("UPDATE knowledge_items SET content = 'A new text, edited.' WHERE id = ?", [item]),
    )
    assert index_item(db, item, embedder=embedder).status == "indexed"
    assert get_state(db, item)["status"] == "indexed"


def test_an_indexed_hash_that_is_not_utf8_counts_as_changed(db, embedder):
    (item,) = _indexed(db, embedder, 1)

    class _Runtime:
        pass

    rt = _Runtime()
    rt.db = db  # type: ignore[attr-defined]
    assert changed(rt, item) is False  # type: ignore[arg-type]
    host(
        db.path,
        (f"UPDATE item_index_state SET indexed_hash = {NOT_UTF8} WHERE item_id = ?", [item]),
    )
    assert changed(rt, item) is True  # type: ignore[arg-type]


def test_two_vec_rows_in_one_slot_are_rebuilt_once_and_stay_mended(db, embedder):
    _indexed(db, embedder, 3)
    rows = db.all("SELECT rowid FROM vec_chunk_embeddings_rowids ORDER BY rowid LIMIT 2")
    host(
        db.path,
        ("UPDATE vec_chunk_embeddings_rowids SET chunk_offset = 0 WHERE rowid = ?", [rows[1][0]]),
    )
    first = reconcile(db, model="standin-embed", max_items=10)
    assert "vec_chunk_embeddings" in first.repaired["tables_rebuilt"], first.repaired
    assert mirror_problems(db) == []
    for _ in range(2):  # it flip-flopped: each sweep rewrote one of the two, for good
        again = reconcile(db, model="standin-embed", max_items=10)
        assert not again.repaired["replaced"] and not again.repaired["tables_rebuilt"]


def _schema4(path: Path) -> None:
    old = Database(path)
    for number, sql in MIGRATIONS[:4]:
        with old.atomic():
            for statement in _statements(sql):
                old.execute(statement)
            set_meta(old, "schema_version", str(number))
    old.close()


def test_a_hosts_column_index_or_trigger_on_items_stops_migration_5_with_their_names(tmp_path):
    """Migration 5 rebuilt knowledge_items with kidx's columns only: the host's column, its
    data, its index and its trigger were dropped without a word."""
    path = tmp_path / "old.db"
    _schema4(path)
    host(
        path,
        ("ALTER TABLE knowledge_items ADD COLUMN owner TEXT", []),
        ("CREATE INDEX host_items_owner ON knowledge_items(owner)", []),
        ("INSERT INTO knowledge_items(kind, content, owner) VALUES ('note', 'A.', 'alice')", []),
    )
    with pytest.raises(StoreError, match=r"would drop what a host added to it \(owner, host_"):
        connect(path, vec=False)
    assert host(path, ("SELECT owner = 'alice' FROM knowledge_items", []))[0] == [[1]]
    host(
        path,
        ("DROP INDEX host_items_owner", []),
        ("ALTER TABLE knowledge_items DROP COLUMN owner", []),
    )
    db = connect(path, vec=False)  # moved away: it upgrades
    assert schema_version(db) == SCHEMA_VERSION
    db.close()


def test_migration_5_takes_the_largest_integer_id_and_a_row_it_cannot_keep_is_named(tmp_path):
    path = tmp_path / "old.db"
    _schema4(path)
    host(
        path,
        ("INSERT INTO knowledge_items(id, kind, content) VALUES (2, 'note', 'x')", []),
        # 2**63 is stored as a REAL: the sequence became 9.2e18 and every add failed
        (
            "INSERT INTO index_jobs(task_id, item_id, task_name, state) VALUES "
            "('t1', 9223372036854775808, 'GenerateEmbedding', 'queued')",
            [],
        ),
        (
            "INSERT INTO index_jobs(task_id, item_id, task_name, state) VALUES "
            "('t2', 'abc', 'GenerateEmbedding', 'queued')",
            [],
        ),
    )
    db = connect(path, vec=False)
    assert db.scalar("SELECT seq FROM sqlite_sequence WHERE name = 'knowledge_items'") == 2
    assert add_item(db, kind="note", title="new", content="A new note.") == 3
    db.close()
    bad = tmp_path / "bad.db"
    _schema4(bad)
    host(
        bad,
        ("PRAGMA ignore_check_constraints = ON", []),
        ("INSERT INTO knowledge_items(kind, content) VALUES ('Note', 'x')", []),
    )
    with pytest.raises(StoreError, match="migration 5 cannot keep a row a host wrote"):
        connect(bad, vec=False)
