"""kidx's tables dropped by a host application (plain SQL, a bare apsw connection).

A dropped derived table made every later connection, sweep and task fail on `no such table`:
it now comes back, empty, at the next connection, and the reconcile sweep refills it. A
dropped source table (the items, the memories) cannot be made again: the database is refused
with what to do, and what was derived from it is kept for a restore. A real SQLite file with
sqlite-vec; the provider is the stand-in over HTTP."""

from __future__ import annotations

from pathlib import Path

import apsw
import pytest

from conftest import corpus_text, mirror_problems
from worker.bulk import index_item
from worker.errors import StoreError
from worker.reconcile import reconcile
from worker.retrieval import search_chunks
from worker.settings import EmbeddingSettings
from worker.store import connect
from worker.store.db import Database
from worker.store.items import add_item
from worker.store.schema import SCHEMA_VERSION, SOURCE_TABLES

DERIVED = (
    "chunk_boundaries",
    "chunk_windows",
    "code_chunk_embeddings",
    "code_chunks",
    "index_batches",
    "index_jobs",
    "item_index_state",
    "kidx_writer",
    "memory_embeddings",
    "memory_refusals",
    "note_chunk_embeddings",
    "note_chunks",
    "note_embeddings",
)


def as_host(path: Path, *statements: str) -> None:
    conn = apsw.Connection(str(path))  # foreign keys off, as SQLite's default
    try:
        for sql in statements:
            conn.execute(sql)
    finally:
        conn.close()


def indexed(db: Database, embedder) -> dict[str, int]:
    items = {
        "short": add_item(
            db, kind="note", title="Zebras", content="Zebra migration on the plains."
        ),
        "long": add_item(
            db, kind="note", title="Install", content=corpus_text("ch01-01-installation.md")
        ),
    }
    for item in items.values():
        assert index_item(db, item, embedder=embedder).status == "indexed"
    db.execute("INSERT INTO memories(content) VALUES ('The user prefers tea.')")
    return items


def indexed_file(db_path: Path, emb_settings: EmbeddingSettings, embedder) -> dict[str, int]:
    """`indexed` in a database of its own, closed again before the host's SQL."""
    db = connect(db_path, embedding=emb_settings)
    try:
        return indexed(db, embedder)
    finally:
        db.close()


def swept(db: Database, embedder) -> None:
    """A reconcile sweep, then a run of every item it sends."""
    for item in reconcile(db, model=embedder.model_id, max_items=100).to_index:
        assert index_item(db, item, embedder=embedder).status == "indexed"


def test_every_kidx_table_is_derived_or_a_source() -> None:
    """The two lists below cover kidx's tables: a new table must be put in one of them."""
    ref = Database(":memory:")
    try:
        from worker.store.schema import migrate

        migrate(ref)
        tables = {
            r[0]
            for r in ref.all(
                "SELECT name FROM sqlite_schema WHERE type = 'table' AND sql NOT LIKE "
                "'CREATE VIRTUAL%' AND name NOT LIKE 'sqlite_%' AND name NOT LIKE '%_fts_%'"
            )
        }
    finally:
        ref.close()
    assert tables == set(DERIVED) | set(SOURCE_TABLES)


@pytest.mark.parametrize("table", DERIVED)
def test_a_dropped_derived_table_comes_back_and_the_sweep_refills_it(
    table: str, db_path: Path, emb_settings: EmbeddingSettings, embedder
) -> None:
    items = indexed_file(db_path, emb_settings, embedder)
    as_host(db_path, f"DROP TABLE {table}")
    db = connect(db_path, embedding=emb_settings)
    try:
        assert db.table_exists(table)
        swept(db, embedder)
        states = dict(db.all("SELECT item_id, status FROM item_index_state"))
        assert states == {items["short"]: "indexed", items["long"]: "indexed"}
        chunks = dict(db.all("SELECT item_id, count(*) FROM note_chunks GROUP BY item_id"))
        counts = dict(db.all("SELECT item_id, chunk_count FROM item_index_state"))
        assert chunks == counts and chunks[items["short"]] == 1
        assert db.scalar("SELECT item_id FROM note_embeddings") == items["short"]
        assert mirror_problems(db) == []
        assert reconcile(db, model=embedder.model_id, max_items=100).to_index == []
        hits = search_chunks(db, "Zebra migration on the plains.", embedder, k=3).hits
        assert hits[0].item_id == items["short"]
    finally:
        db.close()


def test_a_dropped_index_and_trigger_come_back(db_path, emb_settings, embedder) -> None:
    """Without `knowledge_items_content_changed`, a host's edit left the item `indexed` with
    the old text for good."""
    items = indexed_file(db_path, emb_settings, embedder)
    as_host(
        db_path,
        "DROP TRIGGER knowledge_items_content_changed",
        "DROP INDEX note_chunks_embed_hash",
    )
    db = connect(db_path, embedding=emb_settings)
    try:
        names = {r[0] for r in db.all("SELECT name FROM sqlite_schema")}
        assert {"knowledge_items_content_changed", "note_chunks_embed_hash"} <= names
        db.execute(
            "UPDATE knowledge_items SET content = 'Lava flows.' WHERE id = ?", (items["short"],)
        )
        assert reconcile(db, model=embedder.model_id, max_items=100).to_index == [items["short"]]
    finally:
        db.close()


@pytest.mark.parametrize("table", ["knowledge_items", "memories"])
def test_a_dropped_source_table_refuses_the_database_and_keeps_what_was_derived(
    table: str, db_path: Path, emb_settings: EmbeddingSettings, embedder
) -> None:
    db = connect(db_path, embedding=emb_settings)
    try:
        indexed(db, embedder)
        chunks = db.scalar("SELECT count(*) FROM note_chunks")
    finally:
        db.close()
    as_host(db_path, f"DROP TABLE {table}")
    for _ in range(2):  # and again: the refusal wrote nothing
        with pytest.raises(StoreError, match=f"not {table} \\(dropped outside kidx\\?\\).*backup"):
            connect(db_path, embedding=emb_settings)
    conn = apsw.Connection(str(db_path))
    try:
        assert conn.execute("SELECT count(*) FROM note_chunks").fetchone()[0] == chunks
        assert not conn.execute("SELECT 1 FROM sqlite_schema WHERE name = ?", (table,)).fetchall()
    finally:
        conn.close()


def test_a_name_a_host_took_for_something_else_is_refused_with_its_name(
    db_path, emb_settings, embedder
) -> None:
    db = connect(db_path, embedding=emb_settings)
    db.close()
    as_host(db_path, "DROP TABLE note_chunks", "CREATE VIEW note_chunks AS SELECT 1 AS id")
    with pytest.raises(StoreError, match="note_chunks is not what kidx made"):
        connect(db_path, embedding=emb_settings)


@pytest.mark.parametrize(
    ("statement", "says"),
    [
        ("DROP TABLE index_meta", "its index_meta table was dropped"),
        (
            "DELETE FROM index_meta WHERE key = 'schema_version'",
            "the schema_version row of its index_meta was deleted",
        ),
    ],
    ids=["table", "row"],
)
def test_a_lost_schema_version_says_so_beside_another_application(
    statement: str, says: str, db_path, emb_settings
) -> None:
    db = connect(db_path, embedding=emb_settings)
    db.close()
    as_host(db_path, statement)
    with pytest.raises(StoreError, match=f"another application.*or it is kidx's and {says}"):
        connect(db_path, embedding=emb_settings)


def test_two_processes_finding_the_table_dropped_at_once_both_open_the_file(
    db_path, emb_settings, monkeypatch
) -> None:
    """The other one made the table while this one waited for the write lock: it is looked
    for again under the lock, not created twice (`table note_chunks already exists`)."""
    import threading

    db = connect(db_path, embedding=emb_settings)
    sql = db.scalar("SELECT sql FROM sqlite_schema WHERE name = 'note_chunks'")
    db.close()
    as_host(db_path, "DROP TABLE note_chunks")
    waiting = threading.Event()
    busy = Database._busy

    def noticed(self: Database, prior_calls: int) -> bool:
        waiting.set()
        return busy(self, prior_calls)

    monkeypatch.setattr(Database, "_busy", noticed)
    other = apsw.Connection(str(db_path))  # the other process, first to the lock
    other.execute("BEGIN IMMEDIATE")
    other.execute(sql)
    opened: list[object] = []
    thread = threading.Thread(target=lambda: opened.append(_connect(db_path, emb_settings)))
    thread.start()
    try:
        assert waiting.wait(30), "the connection never waited for the write lock"
    finally:
        other.execute("COMMIT")
        other.close()
        thread.join(30)
    assert len(opened) == 1 and not isinstance(opened[0], Exception), opened


def _connect(db_path: Path, emb_settings: EmbeddingSettings) -> object:
    try:
        connect(db_path, embedding=emb_settings).close()
        return "opened"
    except Exception as e:
        return e


@pytest.mark.parametrize("version", range(SCHEMA_VERSION))
def test_a_schema_version_set_back_runs_the_migrations_again_and_keeps_every_row(
    version: int, db_path, emb_settings, embedder
) -> None:
    """A version older than the tables (a host's write, a file restored beside newer tables)
    runs the migrations again. Those of comment-led ADD COLUMNs (3, 4) were not seen as done
    and failed every connection: `duplicate column name: queued_at`."""
    db = connect(db_path, embedding=emb_settings)
    try:
        indexed(db, embedder)
        counts = {t: db.scalar(f"SELECT count(*) FROM {t}") for t in DERIVED + SOURCE_TABLES}
    finally:
        db.close()
    as_host(db_path, f"UPDATE index_meta SET value = '{version}' WHERE key = 'schema_version'")
    db = connect(db_path, embedding=emb_settings)
    try:
        version = db.scalar("SELECT value FROM index_meta WHERE key = 'schema_version'")
        assert version == str(SCHEMA_VERSION)
        assert {t: db.scalar(f"SELECT count(*) FROM {t}") for t in counts} == counts
        assert mirror_problems(db) == []
        hits = search_chunks(db, "Zebra migration on the plains.", embedder, k=3).hits
        assert hits and hits[0].title == "Zebras"
    finally:
        db.close()


@pytest.mark.parametrize(
    ("table", "column"),
    [
        ("note_chunks", "content"),
        ("note_chunks", "item_id"),  # named by the triggers of knowledge_items
        ("item_index_state", "indexed_hash"),
        ("note_chunk_embeddings", "vector"),
        ("index_jobs", "queued_at"),
    ],
)
def test_a_derived_table_a_host_took_a_column_from_is_made_again(
    table: str, column: str, db_path: Path, emb_settings: EmbeddingSettings, embedder
) -> None:
    """`ALTER TABLE ... RENAME COLUMN` (or DROP COLUMN) on a derived table failed every run
    with `no such column`; a rename also rewrote the triggers that name the column, so they
    failed too once the table had its column again."""
    items = indexed_file(db_path, emb_settings, embedder)
    as_host(db_path, f"ALTER TABLE {table} RENAME COLUMN {column} TO renamed_by_host")
    db = connect(db_path, embedding=emb_settings)
    try:
        columns = {r[1] for r in db.all(f"PRAGMA table_info({table})")}
        assert column in columns and "renamed_by_host" not in columns
        swept(db, embedder)
        counts = dict(db.all("SELECT item_id, chunk_count FROM item_index_state"))
        chunks = dict(db.all("SELECT item_id, count(*) FROM note_chunks GROUP BY item_id"))
        assert chunks == counts and set(chunks) == set(items.values())
        assert mirror_problems(db) == []
        db.execute("DELETE FROM knowledge_items WHERE id = ?", (items["long"],))  # its triggers
        assert (
            db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (items["long"],)) == 0
        )
        hits = search_chunks(db, "Zebra migration on the plains.", embedder, k=3).hits
        assert [h.item_id for h in hits] == [items["short"]]
    finally:
        db.close()


def test_a_source_table_a_host_took_a_column_from_is_refused_naming_it(
    db_path, emb_settings, embedder
) -> None:
    indexed_file(db_path, emb_settings, embedder)
    as_host(db_path, "ALTER TABLE knowledge_items RENAME COLUMN content TO body")
    with pytest.raises(StoreError, match=r"knowledge_items lacks content .*restore a backup"):
        connect(db_path, embedding=emb_settings)
    conn = apsw.Connection(str(db_path))
    try:  # nothing was dropped or rewritten
        assert conn.execute("SELECT count(*) FROM note_chunks").fetchone()[0] > 1
        assert conn.execute("SELECT count(*) FROM knowledge_items").fetchone()[0] == 2
    finally:
        conn.close()
