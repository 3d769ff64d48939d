"""The store: connection settings, migrations, dimension resolution, rebuild, degraded modes."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import apsw
import numpy as np
import pytest

from conftest import (
    DIMS,
    FakeEmbedder,
    as_a_run,
    corpus_text,
    forge_vector,
    mirror_problems,
    standin_settings,
)
from worker.bulk import index_item
from worker.errors import InvalidInput, StoreError
from worker.providers import build_embedder
from worker.reconcile import reconcile
from worker.retrieval import search, search_chunks
from worker.settings import EmbeddingSettings
from worker.store import connect, resolve_dimensions, vec_table_dimensions
from worker.store.db import WAL_SIZE_LIMIT, Database
from worker.store.items import add_item, get_state, update_content
from worker.store.schema import SCHEMA_VERSION, migrate, schema_version
from worker.store.vec import set_meta


def test_a_writer_waits_for_another_writers_lock_up_to_the_busy_timeout(db_path):
    first = Database(db_path, busy_timeout_ms=400)
    second = Database(db_path, busy_timeout_ms=400)
    try:
        first.execute("CREATE TABLE t(x)")
        first.execute("BEGIN IMMEDIATE")
        threading.Timer(0.1, lambda: first.execute("COMMIT")).start()
        started = time.monotonic()
        with second.atomic():  # waits for the lock, then takes it
            second.execute("INSERT INTO t VALUES (1)")
        assert 0.08 < time.monotonic() - started < 0.4
        first.execute("BEGIN IMMEDIATE")
        started = time.monotonic()
        with pytest.raises(apsw.BusyError), second.atomic():
            pass
        assert time.monotonic() - started >= 0.4  # the whole timeout, then the error
        first.execute("COMMIT")
    finally:
        first.close()
        second.close()


def test_what_waits_for_the_commit_all_runs_though_one_of_it_raises(db_path):
    """A group's retries are sent after the COMMIT that reported them: the soft time limit
    during the first send (its exception) lost every other's, whose items then ended failed
    where their retries were due. Each runs; the first error is raised after them."""
    from celery.exceptions import SoftTimeLimitExceeded

    db = Database(db_path)
    ran: list[str] = []

    def limit() -> None:
        ran.append("first")
        raise SoftTimeLimitExceeded()

    try:
        with pytest.raises(SoftTimeLimitExceeded), db.atomic():
            db.on_commit(limit)
            db.on_commit(lambda: ran.append("second"))
            db.on_commit(lambda: ran.append("third"))
        assert ran == ["first", "second", "third"]
    finally:
        db.close()


def test_what_waits_for_the_commit_runs_after_it_and_never_after_a_rollback(db_path):
    """`on_commit` (a retry's message): after the COMMIT, when the lock is free for others;
    dropped with a transaction or a savepoint that rolls back, and with a COMMIT that fails."""
    db, other = Database(db_path), Database(db_path, busy_timeout_ms=100)
    ran: list[str] = []

    def note(name: str) -> None:
        # the lock is free: another connection writes at once, and sees the row
        with other.atomic():
            other.execute("INSERT INTO t VALUES (?)", (name,))
        ran.append(name)

    try:
        db.execute("CREATE TABLE t(x)")
        db.on_commit(lambda: note("outside: at once"))
        with db.atomic():
            db.execute("INSERT INTO t VALUES ('row')")
            db.on_commit(lambda: note("kept"))
            with db.atomic():  # a savepoint kept: what it asked survives a sibling's rollback
                db.on_commit(lambda: note("savepoint kept"))
            with pytest.raises(RuntimeError), db.atomic():  # a savepoint rolled back
                db.on_commit(lambda: note("savepoint rolled back"))
                raise RuntimeError("undone")
            assert ran == ["outside: at once"]
        assert ran == ["outside: at once", "kept", "savepoint kept"]
        with pytest.raises(RuntimeError), db.atomic():
            db.on_commit(lambda: note("transaction rolled back"))
            raise RuntimeError("undone")
        with pytest.raises(StoreError), db.committing():
            db.on_commit(lambda: note("rolled back by SQLite"))
            db.execute("ROLLBACK")
        with pytest.raises(apsw.ConstraintError), db.atomic():  # the COMMIT itself fails
            db.execute("PRAGMA foreign_keys = ON")
            db.execute("CREATE TABLE p(id INTEGER PRIMARY KEY)")
            db.execute("CREATE TABLE c(p REFERENCES p(id) DEFERRABLE INITIALLY DEFERRED)")
            db.execute("INSERT INTO c VALUES (1)")
            db.on_commit(lambda: note("commit failed"))
        with db.atomic():
            pass
        assert ran == ["outside: at once", "kept", "savepoint kept"]
        assert sorted(r[0] for r in db.all("SELECT x FROM t")) == [
            "kept",
            "outside: at once",
            "row",
            "savepoint kept",
        ]
    finally:
        db.close()
        other.close()


def test_connection_is_wal_with_foreign_keys_busy_timeout_and_sqlite_vec(db, db_path):
    assert db.scalar("PRAGMA journal_mode") == "wal"
    assert db.scalar("PRAGMA foreign_keys") == 1
    assert db.busy_timeout_ms == 30_000  # waited out by Database._busy (test below)
    assert db.vec_loaded and db.vec_version.startswith("v0.")
    assert set(vec_table_dimensions(db).values()) == {DIMS}
    for name in (
        "vec_note_embeddings",
        "vec_chunk_embeddings",
        "vec_memories",
        "vec_work_code_chunks",
    ):
        sql = db.scalar("SELECT sql FROM sqlite_master WHERE name = ?", (name,))
        assert "distance_metric=cosine" in sql


def _set_schema_version(path: Path, value: str) -> bytes:
    """The file with `value` as its schema version, closed; its bytes."""
    db = connect(path, vec=False)
    db.execute("UPDATE index_meta SET value = ? WHERE key = 'schema_version'", (value,))
    db.close()
    return path.read_bytes()


def test_a_database_of_a_newer_schema_is_refused_and_left_as_it_is(tmp_path):
    """A newer kidx's tables are unknown to this one: opening and writing them could break the
    newer kidx's data, so connect() refuses, naming both versions and what to do."""
    path = tmp_path / "newer.db"
    before = _set_schema_version(path, str(SCHEMA_VERSION + 1))
    with pytest.raises(StoreError) as refused:
        connect(path, vec=False)
    message = str(refused.value)
    assert f"schema {SCHEMA_VERSION + 1}, this one knows {SCHEMA_VERSION}" in message
    assert "newer kidx" in message and "upgrade kidx" in message and str(path) in message
    assert path.read_bytes() == before


@pytest.mark.parametrize("value", ["nine", "", "9.5"])
def test_a_schema_version_that_is_not_a_number_is_a_clear_store_error(tmp_path, value):
    path = tmp_path / "odd.db"
    _set_schema_version(path, value)
    with pytest.raises(StoreError, match="not a number"):
        connect(path, vec=False)


def test_connect_creates_by_default_and_not_when_told(tmp_path):
    """Library callers (workers, beat, scripts) get a new database as before; create=False
    (the CLI's commands that expect one) makes neither the file nor its folder."""
    missing = tmp_path / "nope" / "b.db"
    with pytest.raises(StoreError, match="no database at"):
        connect(missing, vec=False, create=False)
    assert not missing.parent.exists()
    connect(missing, vec=False).close()
    assert missing.is_file()
    again = connect(missing, vec=False, create=False)
    assert schema_version(again) == SCHEMA_VERSION
    again.close()


def test_migrations_are_idempotent(db, db_path, emb_settings):
    tables = db.all("SELECT name, sql FROM sqlite_master ORDER BY name")
    assert schema_version(db) == SCHEMA_VERSION
    assert migrate(db) == SCHEMA_VERSION
    again = connect(db_path, embedding=emb_settings)
    assert again.all("SELECT name, sql FROM sqlite_master ORDER BY name") == tables
    again.close()


def test_reconnecting_does_not_rebuild_the_vec_tables(db, db_path, embedder, emb_settings):
    item = add_item(db, kind="note", title="T", content="Some note text.")
    index_item(db, item, embedder=embedder)
    # A marker a rebuild would lose: rebuilt tables are re-filled from relational rows only.
    marker = np.ones(DIMS, dtype="<f4").tobytes()
    db.execute(
        "INSERT INTO vec_chunk_embeddings(chunk_id, embedding) VALUES (424242, ?)", (marker,)
    )
    again = connect(db_path, embedding=emb_settings)
    assert again.scalar("SELECT count(*) FROM vec_chunk_embeddings WHERE chunk_id = 424242") == 1
    assert get_state(again, item)["status"] == "indexed"
    again.close()


def test_deleting_an_item_cascades_to_its_chunks_and_vectors(db, embedder):
    item = add_item(db, kind="note", title="T", content=corpus_text("ch04-03-slices.md"))
    index_item(db, item, embedder=embedder)
    db.execute("DELETE FROM knowledge_items WHERE id = ?", (item,))
    assert db.scalar("SELECT count(*) FROM note_chunks") == 0
    assert db.scalar("SELECT count(*) FROM note_chunk_embeddings") == 0


# -- dimension resolution --------------------------------------------------------------------


def _embedding_row(db, model: str, dims: int) -> None:
    item = add_item(db, kind="note", title="x", content="x")
    with as_a_run(db):  # a run's rows (a host's would go: schema migration 16)
        chunk_id = db.scalar(
            "INSERT INTO note_chunks(item_id, chunk_index, content, method, start_offset, "
            "end_offset, embed_hash) VALUES (?, 0, 'x', 'structure', 0, 1, 'h') RETURNING id",
            (item,),
        )
        db.execute(
            "INSERT INTO note_chunk_embeddings(chunk_id, model, dimensions, vector) "
            "VALUES (?,?,?,?)",
            (chunk_id, model, dims, np.zeros(dims, dtype="<f4").tobytes()),
        )


def test_resolution_1_the_latest_embedding_row_of_the_configured_model(tmp_path):
    db = connect(tmp_path / "a.db", vec=False)
    settings = EmbeddingSettings(provider="openai", model="my-model")  # unknown model
    _embedding_row(db, "my-model", 768)
    _embedding_row(db, "other-model", 1024)  # more recent, but not this model's
    assert resolve_dimensions(db, settings).dimensions == 768
    assert resolve_dimensions(db, settings).source == "embedding row"
    # The row beats the configured model's known dimension and the setting.
    known = EmbeddingSettings(provider="local")  # all-MiniLM-L6-v2: 384
    _embedding_row(db, "all-MiniLM-L6-v2", 999)
    assert resolve_dimensions(db, known).dimensions == 999
    # Rows of the configured model at two dimensions (KIDX_EMBEDDING__DIMENSIONS 256, then
    # 512): the most recent one's, whatever order the rows were written in.
    _embedding_row(db, "my-model", 512)
    _embedding_row(db, "my-model", 256)
    with as_a_run(db):
        for dims, at in (
            (768, "2025-01-01T00:00:00.000Z"),
            (256, "2026-01-01T00:00:00.000Z"),
            (512, "2026-06-01T00:00:00.000Z"),
        ):
            db.execute(
                "UPDATE note_chunk_embeddings SET created_at = ? WHERE model = 'my-model' "
                "AND dimensions = ?",
                (at, dims),
            )
    assert resolve_dimensions(db, settings).dimensions == 512
    db.close()


def test_resolution_2_the_configured_models_dimension(tmp_path):
    db = connect(tmp_path / "b.db", vec=False)
    _embedding_row(db, "some-other-model", 1024)
    local = EmbeddingSettings(provider="local")
    assert (resolve_dimensions(db, local).dimensions, resolve_dimensions(db, local).source) == (
        384,
        "model",
    )
    shortened = EmbeddingSettings(provider="openai", model="text-embedding-3-large", dimensions=256)
    assert resolve_dimensions(db, shortened).dimensions == 256
    assert resolve_dimensions(db, EmbeddingSettings(provider="openai")).dimensions == 1536
    db.close()


def test_resolution_3_the_setting_default_1536(tmp_path):
    db = connect(tmp_path / "c.db", vec=False)
    unknown = EmbeddingSettings(provider="openai", model="mystery")
    assert (resolve_dimensions(db, unknown).dimensions, resolve_dimensions(db, unknown).source) == (
        1536,
        "setting",
    )
    set_ = EmbeddingSettings(provider="openai", model="mystery", dimensions=100)
    assert resolve_dimensions(db, set_).dimensions == 100
    db.close()


def test_a_process_without_a_provider_keeps_the_index_s_dimension(tmp_path, standin):
    """`KIDX_EMBEDDING__PROVIDER=none` (a CLI that only reads): no model to resolve from. Its
    connection keeps the vec tables as they are; the default model's 1536 dimensions would
    rebuild them, and mark every item pending, at each command (and the workers back)."""
    path = tmp_path / "n.db"
    db = connect(path, embedding=standin_settings(standin))  # 64 dimensions
    item = add_item(db, kind="note", title="t", content="A note about ownership.")
    index_item(db, item, embedder=FakeEmbedder())
    db.close()
    none = connect(path, embedding=EmbeddingSettings(provider="none"))
    assert (none.dimensions, none.resolution.source) == (64, "vec tables")
    assert vec_table_dimensions(none) == dict.fromkeys(vec_table_dimensions(none), 64)
    assert get_state(none, item)["status"] == "indexed"
    none.close()
    fresh = connect(tmp_path / "fresh.db", embedding=EmbeddingSettings(provider="none"))
    assert fresh.resolution.source == "setting"  # nothing to keep yet
    fresh.close()


@pytest.mark.parametrize("vector", ["text of 256 characters", "dimensions 'abc'"])
def test_an_embedding_row_kidx_cannot_read_is_no_vector_and_stops_nothing(
    tmp_path, standin, vector
):
    """A host's row with a TEXT vector (the length CHECK counts characters) or a TEXT
    dimension: read as no vector (resolution, the fallback, the rebuild, the repair), and
    its item is embedded again by the sweep; no process is kept from opening the file."""
    path = tmp_path / "h.db"
    settings = standin_settings(standin)
    db = connect(path, embedding=settings)
    ids = [add_item(db, kind="note", title=f"n{i}", content=f"Note {i} text.") for i in range(2)]
    for i in ids:
        index_item(db, i, embedder=FakeEmbedder())
    if vector.startswith("text"):
        chunk = db.scalar("SELECT id FROM note_chunks WHERE item_id = ?", (ids[0],))
        db.execute(forge_vector("note_chunk_embeddings", "chunk_id"), ("a" * 4 * DIMS, chunk))
    else:
        db.execute(
            "INSERT INTO memories(id, content) VALUES (1, 'm'); "
            "INSERT INTO memory_embeddings(memory_id, model, dimensions, vector, created_at) "
            "VALUES (1, ?, 'abc', x'', '9999')",
            (FakeEmbedder().model_id,),
        )
    with db.atomic():
        set_meta(db, "vec_behind", "1")  # the next connection rebuilds every vec table
    db.close()
    db = connect(path, embedding=settings.model_copy(update={"model": "fake", "dimensions": None}))
    try:
        assert db.dimensions == DIMS
        no_vec = connect(path, embedding=settings, vec=False, read_only=True)
        hits = search_chunks(no_vec, "Note 1 text.", FakeEmbedder(), k=2, mode="vector").hits
        no_vec.close()
        assert hits and hits[0].item_id == ids[1]
        drift = reconcile(db, model="fake", max_items=10)
        if vector.startswith("text"):
            assert drift.to_index == [ids[0]]
            index_item(db, ids[0], embedder=FakeEmbedder())
        assert (
            db.scalar("SELECT count(*) FROM note_chunk_embeddings WHERE typeof(vector) != 'blob'")
            == 0
        )
        assert mirror_problems(db) == []
    finally:
        db.close()


def test_dimension_change_rebuilds_and_refills_so_knn_keeps_working(tmp_path, standin):
    path = tmp_path / "d.db"
    settings_a = standin_settings(standin)  # 64 dimensions
    db = connect(path, embedding=settings_a)
    model_a = build_embedder(settings_a, dimensions=db.dimensions)
    notes = {
        add_item(db, kind="note", title=f"N{i}", content=f"Note number {i} about topic {i}."): i
        for i in range(5)
    }
    for item in notes:
        index_item(db, item, embedder=model_a)
    db.close()

    # Another model, another dimension: the tables are rebuilt at 32 and the items pending.
    settings_b = standin_settings(standin, model="other-embed", dimensions=32)
    db = connect(path, embedding=settings_b)
    assert set(vec_table_dimensions(db).values()) == {32}
    assert db.scalar("SELECT count(*) FROM vec_chunk_embeddings") == 0
    assert {get_state(db, i)["status"] for i in notes} == {"pending"}
    db.close()

    # Back to the first model: rebuilt at 64 and re-filled from the relational rows, with no
    # embedding call; KNN over the re-filled rows finds each note by its own text.
    requests = standin.requests
    db = connect(path, embedding=settings_a)
    assert set(vec_table_dimensions(db).values()) == {DIMS}
    assert db.scalar("SELECT count(*) FROM vec_chunk_embeddings") == 5
    assert db.scalar("SELECT count(*) FROM vec_note_embeddings") == 5
    assert standin.requests == requests
    model_a = build_embedder(settings_a, dimensions=db.dimensions)
    for item, i in notes.items():
        result = search(db, f"Note number {i} about topic {i}.", model_a, k=3)
        assert result.via == "vec"
        assert result.hits[0].item_id == item
        assert result.hits[0].score == pytest.approx(1.0, abs=1e-5)
    db.close()


# -- degraded modes --------------------------------------------------------------------------


def test_without_sqlite_vec_everything_relational_works(tmp_path, standin):
    settings = standin_settings(standin)
    db = connect(tmp_path / "e.db", embedding=settings, vec=False)
    assert not db.vec_loaded
    assert not db.table_exists("vec_chunk_embeddings")
    model = build_embedder(settings, dimensions=db.dimensions)
    item = add_item(db, kind="note", title="Slices", content=corpus_text("ch04-03-slices.md"))
    result = index_item(db, item, embedder=model)
    assert result.status == "indexed" and result.chunks > 1
    assert db.scalar("SELECT count(*) FROM note_chunk_embeddings") == result.chunks
    found = search(db, "Slices\n\nanything", model, k=3)
    assert found.via == "fallback" and "not loaded" in found.reason
    db.close()
    # Once sqlite-vec is back, the tables are created and filled from the relational rows.
    db = connect(tmp_path / "e.db", embedding=settings)
    assert db.scalar("SELECT count(*) FROM vec_chunk_embeddings") == result.chunks
    db.close()


def test_a_missing_vec_table_falls_back(db, embedder):
    item = add_item(db, kind="note", title="T", content="A note about closures and iterators.")
    index_item(db, item, embedder=embedder)
    db.execute("DROP TABLE vec_chunk_embeddings")
    result = search(db, "T\n\nA note about closures and iterators.", embedder, k=1)
    assert result.via == "fallback" and "vec_chunk_embeddings is missing" in result.reason
    assert result.hits[0].item_id == item


def test_python_sqlite3_is_never_imported():
    """Two SQLite libraries in one process crashed here: the engine must not load sqlite3."""
    code = (
        "import sys, tempfile, os, worker.pipeline, worker.retrieval, worker.store, ops.cli;"
        "import testkit.standin, worker.providers.openai, worker.providers.local, ops.doctor;"
        "ops.doctor._warm_up();"  # what `kidx doctor` imports before its checks
        "from worker.store import connect;"
        "db = connect(os.path.join(tempfile.mkdtemp(), 'x.db'));"  # loads sqlite-vec
        "assert db.vec_loaded;"
        "print('sqlite3' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_fake_embedder_model_mismatch_is_not_reused(db):
    """A vector made by another model is never reused, even for identical text."""
    item = add_item(db, kind="note", title="T", content="Identical text for two models.")
    first = FakeEmbedder(model_id="model-one")
    index_item(db, item, embedder=first)
    second = FakeEmbedder(model_id="model-two")
    result = index_item(db, item, embedder=second)
    assert result.embedded == 1 and result.reused == 0 and len(second.calls) == 1
    assert db.scalar("SELECT model FROM note_chunk_embeddings") == "model-two"


def wal_frames(path: Path) -> int:
    """The frames in the WAL, as another connection's checkpoint sees them (PASSIVE: it
    copies what it can and waits for nothing)."""
    other = Database(path)
    try:
        return int(other.conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1])
    finally:
        other.conn.close()  # not `close()`: its checkpoint at close would empty the WAL


def test_the_wal_is_checkpointed_by_a_thread_and_removed_at_close(db_path):
    """The thread copies the pages into the database file while the connection stays open
    (a worker keeps its own for its whole life), and the next writer starts the WAL again,
    cut back to its size limit. The thread once only counted its calls: SQLite's C call did
    nothing on its fresh connection, and a worker's WAL grew without end."""
    db = Database(db_path)
    db.execute("CREATE TABLE big(x BLOB)")
    with db.atomic():  # about 6,000 pages of 4 KB: past the threshold and the size limit
        db.executemany("INSERT INTO big VALUES (?)", [(b"x" * 4000,) for _ in range(6000)])
    checkpointer = db._checkpointer
    deadline = time.monotonic() + 10
    while checkpointer.copied < 6000 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert checkpointer.runs >= 1 and checkpointer.copied >= 6000
    assert db_path.stat().st_size > 6000 * 4000  # in the database file, the WAL still open
    with db.atomic():  # the next write starts the WAL from its beginning
        db.execute("INSERT INTO big VALUES (x'00')")
    assert wal_frames(db_path) < 10
    assert Path(f"{db_path}-wal").stat().st_size <= WAL_SIZE_LIMIT
    assert db.scalar("SELECT count(*) FROM big") == 6001
    db.close()
    assert not Path(f"{db_path}-wal").exists()


def test_migration_5_gives_autoincrement_ids_past_every_leftover_and_the_triggers(tmp_path):
    """A database of schema 4 whose newest item was deleted with foreign keys off: after the
    migration, ids are never given again (not even the deleted one's), and a delete on a
    connection with foreign keys off leaves no relational row."""
    from worker.store.schema import MIGRATIONS, _statements

    path = tmp_path / "old.db"
    old = Database(path)
    for number, sql in MIGRATIONS[:4]:
        for statement in _statements(sql):
            old.execute(statement)
        old.execute(
            "INSERT INTO index_meta(key, value) VALUES ('schema_version', ?) "
            "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
            (str(number),),
        )
    old.execute("PRAGMA foreign_keys = OFF")
    for n in (1, 2, 3):
        old.execute("INSERT INTO knowledge_items(id, kind, content) VALUES (?, 'note', 'x')", (n,))
        old.execute("INSERT INTO item_index_state(item_id) VALUES (?)", (n,))
    old.execute("DELETE FROM knowledge_items WHERE id = 3")  # its state row lingers
    old.close()
    db = connect(path, vec=False)
    assert schema_version(db) == SCHEMA_VERSION
    assert [r[0] for r in db.all("SELECT id FROM knowledge_items ORDER BY id")] == [1, 2]
    assert add_item(db, kind="note", title="new", content="A new note.") == 4  # not 3
    db.execute("PRAGMA foreign_keys = OFF")  # as a host's connection has them
    db.execute("DELETE FROM knowledge_items WHERE id = 4")
    assert db.scalar("SELECT count(*) FROM item_index_state WHERE item_id = 4") == 0
    db.execute("PRAGMA foreign_keys = ON")
    assert add_item(db, kind="note", title="newer", content="And another.") == 5
    db.close()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": "bogus"}, "unknown kind 'bogus'"),
        ({"title": 5}, "the title must be text (str), not int"),
        ({"title": None}, "the title must be text (str), not NoneType"),
        ({"content": b"bytes"}, "the content must be text (str), not bytes"),
        ({"source": 7}, "the source must be text (str), not int"),
        ({"content": "a\udce9b"}, "the content is not UTF-8: it holds a lone surrogate U+DCE9"),
        ({"title": "\ud800"}, "the title is not UTF-8: it holds a lone surrogate U+D800"),
    ],
)
def test_a_python_caller_s_wrong_values_are_one_clear_error_and_nothing_is_written(
    db, fields, message
):
    """They failed as raw TypeErrors, UnicodeEncodeErrors and constraint errors, or a number
    was stored as a title or a source."""
    item = add_item(db, kind="note", title="Kept", content="The text as it was.")
    before = db.all("SELECT * FROM knowledge_items")
    with pytest.raises(InvalidInput, match=re.escape(message)):
        add_item(db, **{"kind": "note", "title": "t", "content": "text", **fields})
    update = {k: v for k, v in fields.items() if k in ("content", "title") and v is not None}
    if update:  # (update_content's title None keeps the title)
        with pytest.raises(InvalidInput, match=re.escape(message)):
            update_content(db, item, **{"content": "text", **update})
    assert db.all("SELECT * FROM knowledge_items") == before
