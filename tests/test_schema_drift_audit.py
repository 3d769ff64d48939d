"""kidx's schema changed by a careless host application, found by an audit: a bare apsw
connection (foreign keys off, no sqlite-vec) that does not drop kidx's tables but makes them
again otherwise, renames them away and back, adds its own triggers and indexes, or takes a
name a later migration gives kidx. Indexing goes on where it safely can; where it cannot,
every run fails with one line naming the table (or trigger, or index) and what to do, and no
row of the host's is lost. A real SQLite file with sqlite-vec; the provider is the stand-in
over HTTP."""

from __future__ import annotations

from pathlib import Path

import apsw
import pytest
from test_cli import Kidx, base_env
from test_dropped_tables import as_host, indexed_file, swept

from conftest import mirror_problems
from worker.bulk import index_item
from worker.errors import StoreError
from worker.indexers.memories import add_memory, embed_memories
from worker.reconcile import reconcile
from worker.retrieval import search_chunks
from worker.settings import EmbeddingSettings
from worker.store import connect
from worker.store.items import add_item


def host_sql(db_path: Path, sql: str) -> str:
    conn = apsw.Connection(str(db_path))
    try:
        return conn.execute(sql).fetchone()[0]
    finally:
        conn.close()


def remake(db_path: Path, table: str, old: str = "", new: str = "", fill: str = "*") -> None:
    """The host makes `table` again, its rows kept: by `CREATE TABLE AS` (`old` empty: the
    names and the rows, without the keys, NOT NULL, defaults and REFERENCES), or by kidx's
    own CREATE with `old` replaced by `new`."""
    conn = apsw.Connection(str(db_path))
    try:
        conn.execute("PRAGMA legacy_alter_table = ON")  # (else the rename checks kidx's triggers)
        sql = conn.execute("SELECT sql FROM sqlite_schema WHERE name = ?", (table,)).fetchone()[0]
        assert old in sql
        conn.execute(f"ALTER TABLE {table} RENAME TO host_old")
        if old:
            conn.execute(sql.replace(old, new))
            conn.execute(f"INSERT INTO {table} SELECT {fill} FROM host_old")
        else:
            conn.execute(f"CREATE TABLE {table} AS SELECT * FROM host_old")
        conn.execute("DROP TABLE host_old")
    finally:
        conn.close()


def works(db_path: Path, emb_settings: EmbeddingSettings, embedder, items: dict[str, int]) -> None:
    """Every item indexed again by the sweep, a new one indexed, search finds them, and a
    DELETE of an item takes what it had."""
    db = connect(db_path, embedding=emb_settings)
    try:
        swept(db, embedder)
        new = add_item(db, kind="note", title="Otters", content="Otters hold hands asleep.")
        assert index_item(db, new, embedder=embedder).status == "indexed"
        states = dict(db.all("SELECT item_id, status FROM item_index_state"))
        assert states == {**{i: "indexed" for i in items.values()}, new: "indexed"}
        counts = dict(db.all("SELECT item_id, chunk_count FROM item_index_state"))
        chunks = dict(db.all("SELECT item_id, count(*) FROM note_chunks GROUP BY item_id"))
        assert chunks == counts
        assert db.scalar("SELECT count(*) FROM note_chunks WHERE id IS NULL") == 0
        assert mirror_problems(db) == []
        hits = search_chunks(db, "Zebra migration on the plains.", embedder, k=3).hits
        assert hits[0].item_id == items["short"]
        db.execute("DELETE FROM knowledge_items WHERE id = ?", (items["long"],))
        assert not db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (items["long"],))
    finally:
        db.close()


@pytest.mark.parametrize(
    ("table", "old", "new", "fill"),
    [
        # note_chunks without its INTEGER PRIMARY KEY: every write of an item, the sweep and
        # `add_item` failed on `foreign key mismatch - "note_chunk_embeddings" referencing
        # "note_chunks"`, a raw apsw error
        ("note_chunks", "", "", ""),
        # item_index_state without its key: `ON CONFLICT clause does not match any PRIMARY KEY
        # or UNIQUE constraint`, and the items stayed `indexing` for good
        ("item_index_state", "", "", ""),
        # a column of the host's that no INSERT of kidx's gives: every item failed on
        # `NOT NULL constraint failed: note_chunks.host_tag`
        (
            "note_chunks",
            "embed_hash   TEXT NOT NULL,",
            "embed_hash TEXT NOT NULL, host_tag TEXT NOT NULL,",
            "*, 'x'",
        ),
        # content of NUMERIC affinity: a chunk '42' was stored as the number 42
        ("note_chunks", "content      TEXT NOT NULL", "content NUMERIC NOT NULL", "*"),
    ],
    ids=["note_chunks-copied", "item_index_state-copied", "extra-not-null", "numeric-content"],
)
def test_a_derived_table_a_host_made_again_otherwise_is_made_again_and_refilled(
    table: str,
    old: str,
    new: str,
    fill: str,
    db_path: Path,
    emb_settings: EmbeddingSettings,
    embedder,
) -> None:
    items = indexed_file(db_path, emb_settings, embedder)
    remake(db_path, table, old, new, fill)
    works(db_path, emb_settings, embedder, items)
    db = connect(db_path, embedding=emb_settings)
    try:
        n = add_item(db, kind="note", title="Number", content="42")
        assert index_item(db, n, embedder=embedder).status == "indexed"
        kind = db.scalar("SELECT typeof(content) FROM note_chunks WHERE item_id = ?", (n,))
        assert kind == "text"
    finally:
        db.close()


def test_a_table_a_host_renamed_away_and_made_again_leaves_no_reference_to_the_old_name(
    db_path: Path, emb_settings: EmbeddingSettings, embedder
) -> None:
    """`ALTER TABLE note_chunks RENAME TO old`, kidx's CREATE again, the rows copied, `DROP
    TABLE old`: SQLite's rename rewrote kidx's triggers and the REFERENCES of
    note_chunk_embeddings to name `old`, and every write (an item's, the host's own DELETE
    of an item) failed on `no such table: main.old`, a raw apsw error at every run."""
    items = indexed_file(db_path, emb_settings, embedder)
    conn = apsw.Connection(str(db_path))
    try:
        sql = host_sql(db_path, "SELECT sql FROM sqlite_schema WHERE name = 'note_chunks'")
        conn.execute("ALTER TABLE note_chunks RENAME TO old")
        conn.execute(sql)
        conn.execute("INSERT INTO note_chunks SELECT * FROM old")
        conn.execute("DROP TABLE old")
    finally:
        conn.close()
    works(db_path, emb_settings, embedder, items)


def test_a_trigger_a_rename_rewrote_is_made_again(
    db_path: Path, emb_settings: EmbeddingSettings, embedder
) -> None:
    """memory_refusals renamed away and made again: `memories_deleted_refusal` named the
    dropped table, and every DELETE of a memory failed, the host's too, for good."""
    indexed_file(db_path, emb_settings, embedder)
    sql = host_sql(db_path, "SELECT sql FROM sqlite_schema WHERE name = 'memory_refusals'")
    as_host(db_path, "ALTER TABLE memory_refusals RENAME TO old", sql, "DROP TABLE old")
    connect(db_path, embedding=emb_settings).close()
    as_host(db_path, "DELETE FROM memories")  # the host's own, foreign keys off
    db = connect(db_path, embedding=emb_settings)
    try:
        assert db.scalar("SELECT count(*) FROM memories") == 0
        triggers = db.all("SELECT name FROM sqlite_schema WHERE sql LIKE '%\"old\"%'")
        assert triggers == []
    finally:
        db.close()


@pytest.mark.parametrize(
    ("table", "says"),
    [
        ("knowledge_items", "knowledge_items id is not its INTEGER PRIMARY KEY"),
        ("memories", "memories id is not its INTEGER PRIMARY KEY"),
    ],
)
def test_a_source_table_made_again_without_its_key_is_refused_naming_it(
    table: str, says: str, db_path: Path, emb_settings: EmbeddingSettings, embedder, tmp_path
) -> None:
    """knowledge_items copied by `CREATE TABLE AS` (its `id` no longer the rowid): every
    write failed on `foreign key mismatch` (`kidx add` told it as a bug); a new memory got the
    id NULL. What it holds cannot be made again: every process refuses the file, naming the
    table, and nothing is dropped."""
    indexed_file(db_path, emb_settings, embedder)
    remake(db_path, table)
    for _ in range(2):
        with pytest.raises(StoreError, match=f"{says}.*restore a backup"):
            connect(db_path, embedding=emb_settings)
    kidx = Kidx(tmp_path, base_env(db_path, "http://127.0.0.1:9/v1"))
    for args in (("status",), ("add", "note", "--title", "T", "--text", "x")):
        result = kidx(*args)
        assert result.returncode != 0
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0] and "bug" not in lines[0], result.stderr
    conn = apsw.Connection(str(db_path))
    try:
        assert conn.execute("SELECT count(*) FROM knowledge_items").fetchone()[0] == 2
        assert conn.execute("SELECT count(*) FROM memories").fetchone()[0] == 1
        assert conn.execute("SELECT count(*) FROM note_chunks").fetchone()[0] == 18
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("theirs", "says"),
    [
        (
            (
                "CREATE TABLE memory_refusals(id INTEGER PRIMARY KEY, note TEXT)",
                "INSERT INTO memory_refusals(note) VALUES ('the host''s own row')",
            ),
            "table memory_refusals is not kidx's.*rename it",
        ),
        (
            ("CREATE VIEW memory_refusals AS SELECT id, content AS note FROM memories",),
            "memory_refusals is not what kidx made.*rename it",
        ),
    ],
    ids=["table", "view"],
)
def test_a_host_object_under_a_name_a_later_migration_gives_kidx_is_kept_and_named(
    theirs: tuple[str, ...], says: str, db_path: Path, emb_settings: EmbeddingSettings, embedder
) -> None:
    """A file of schema 8 (before memory_refusals) where the host had a table of its own
    called `memory_refusals`: migration 9's `CREATE TABLE IF NOT EXISTS` took it for kidx's,
    and the next check dropped it as a kidx table missing its columns, the host's rows with
    it. A view of that name was refused, but after the migration had made kidx's triggers
    write to it: the host's own `DELETE FROM memories` failed ("cannot modify
    memory_refusals because it is a view"). Either is refused, named, before any migration,
    and kept; renamed, kidx's table is made."""
    indexed_file(db_path, emb_settings, embedder)
    as_host(
        db_path,
        "DROP TABLE memory_refusals",  # and what named it: schema 8 had neither
        "DROP TRIGGER memories_deleted_refusal",
        "DROP TRIGGER memories_inserted",
        "UPDATE index_meta SET value = '8' WHERE key = 'schema_version'",
        *theirs,
    )
    for _ in range(2):
        with pytest.raises(StoreError, match=says):
            connect(db_path, embedding=emb_settings)
    as_host(db_path, "DELETE FROM memories WHERE id < 0")  # the host's own writes still work
    kind = "VIEW" if "VIEW" in theirs[0] else "TABLE"
    if kind == "TABLE":
        assert host_sql(db_path, "SELECT count(*) FROM memory_refusals") == 1
        as_host(db_path, "ALTER TABLE memory_refusals RENAME TO host_refusals")
    else:
        as_host(db_path, "DROP VIEW memory_refusals")
    db = connect(db_path, embedding=emb_settings)
    try:
        assert {r[1] for r in db.all("PRAGMA table_info(memory_refusals)")} >= {"memory_id"}
        if kind == "TABLE":
            assert db.scalar("SELECT note FROM host_refusals") == "the host's own row"
    finally:
        db.close()


OTTERS = "Otters hold hands asleep."
ZEBRAS = "Zebra migration on the plains."  # the text of an indexed note's one chunk


@pytest.mark.parametrize(
    ("statements", "text", "named", "cause"),
    [
        (
            (
                "CREATE TRIGGER host_check BEFORE INSERT ON note_chunks "
                "WHEN new.content LIKE '%otter%' BEGIN SELECT RAISE(ABORT, 'host says no'); END",
            ),
            OTTERS,
            "trigger host_check on note_chunks",
            "host says no",
        ),
        (  # an index on what the host writes as JSON, which some notes only look like
            (
                "CREATE INDEX host_json ON note_chunks(json_extract(content, '$.kind')) "
                "WHERE content LIKE '{%'",
            ),
            "{Otters} hold hands asleep.",
            "index host_json on note_chunks",
            "malformed JSON",
        ),
        (  # unique chunks, which kidx never promised: the same paragraph in two notes
            ("CREATE UNIQUE INDEX host_unique ON note_chunks(content)",),
            ZEBRAS,
            "index host_unique on note_chunks",
            "UNIQUE constraint failed: note_chunks.content",
        ),
        (  # a log table the host dropped since: every INSERT there fails, whatever its WHEN
            (
                "CREATE TABLE host_log(chunk_id)",
                "CREATE TRIGGER host_logged AFTER INSERT ON note_chunks "
                "WHEN new.content LIKE '%otter%' BEGIN INSERT INTO host_log VALUES (new.id); END",
                "DROP TABLE host_log",
            ),
            None,
            "trigger host_logged on note_chunks",
            "no such table: main.host_log",
        ),
        (  # a column of the host's whose CHECK kidx's rows, which leave it out, fail
            (
                "ALTER TABLE note_chunks ADD COLUMN host_tag TEXT "
                "CHECK (host_tag IS NOT NULL OR content NOT LIKE '%otter%')",
            ),
            OTTERS,
            "CHECK constraints on note_chunks",
            "CHECK constraint failed",
        ),
    ],
    ids=["raise", "json-index", "unique-index", "dropped-log", "check"],
)
def test_a_host_trigger_or_index_that_refuses_kidx_writes_is_named_in_the_failure(
    statements: tuple[str, ...],
    text: str | None,
    named: str,
    cause: str,
    db_path: Path,
    emb_settings: EmbeddingSettings,
    embedder,
) -> None:
    """A host's trigger or index on a kidx table that refuses some of kidx's writes failed
    those items with SQLite's words only ("host says no", "malformed JSON"), which name
    neither the trigger or index nor its table, nor say that it is not kidx's. The other
    items are indexed (`text`: the one refused; None: every one is); the failure names the
    host's object and what to do, and the item's previous index stands."""
    items = indexed_file(db_path, emb_settings, embedder)
    as_host(db_path, *statements)
    db = connect(db_path, embedding=emb_settings)
    try:
        if text is not None:
            fine = add_item(db, kind="note", title="Beavers", content="Beavers build dams.")
            assert index_item(db, fine, embedder=embedder).status == "indexed"
        refused = add_item(db, kind="note", title="Refused", content=text or OTTERS)
        with pytest.raises(StoreError) as failure:
            index_item(db, refused, embedder=embedder)
        message = str(failure.value)
        assert cause in message and named in message and "drop" in message, message
        assert "\n" not in message
        state = db.one(
            "SELECT status, last_error FROM item_index_state WHERE item_id = ?", (refused,)
        )
        assert state == ("failed", message)
        assert not db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (refused,))
        kept = db.scalar("SELECT status FROM item_index_state WHERE item_id = ?", (items["short"],))
        assert kept == "indexed"
    finally:
        db.close()


def test_a_host_trigger_that_refuses_new_items_is_named_by_kidx_add(
    db_path: Path, emb_settings: EmbeddingSettings, embedder, tmp_path
) -> None:
    """`add_item` (`kidx add`) failed on a host's trigger on item_index_state with
    `database ...: ConstraintError: read only`, naming neither the trigger nor its table."""
    indexed_file(db_path, emb_settings, embedder)
    as_host(
        db_path,
        "CREATE TRIGGER host_frozen BEFORE INSERT ON item_index_state "
        "BEGIN SELECT RAISE(ABORT, 'read only'); END",
    )
    kidx = Kidx(tmp_path, base_env(db_path, "http://127.0.0.1:9/v1"))
    result = kidx("add", "note", "--title", "T", "--text", "Otters.")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1, result.stderr
    assert "read only" in lines[0] and "trigger host_frozen on item_index_state" in lines[0]
    conn = apsw.Connection(str(db_path))
    try:  # nothing of it was written
        assert conn.execute("SELECT count(*) FROM knowledge_items").fetchone()[0] == 2
    finally:
        conn.close()


def test_a_host_trigger_that_writes_the_state_again_fails_the_run_naming_it(
    db_path: Path, emb_settings: EmbeddingSettings, embedder
) -> None:
    """A host's `touch updated_at` trigger on item_index_state wrote each row again as kidx
    wrote it: every run took that for another run's write (the claim token changed) and
    wrote nothing (`coalesced`), and the items stayed `indexing` for good, with no error
    anywhere. The run fails, naming the trigger; the item's previous index stands."""
    items = indexed_file(db_path, emb_settings, embedder)
    as_host(
        db_path,
        "CREATE TRIGGER host_touch AFTER UPDATE ON item_index_state BEGIN "
        "UPDATE item_index_state SET updated_at = datetime('now') "
        "WHERE item_id = new.item_id; END",
    )
    db = connect(db_path, embedding=emb_settings)
    try:
        db.execute(
            "UPDATE knowledge_items SET content = 'Lava flows.' WHERE id = ?", (items["short"],)
        )
        with pytest.raises(StoreError, match=r"trigger host_touch on item_index_state.*drop"):
            index_item(db, items["short"], embedder=embedder)
        status, error = db.one(
            "SELECT status, last_error FROM item_index_state WHERE item_id = ?", (items["short"],)
        )
        assert status == "failed" and "trigger host_touch" in error
        chunk = db.scalar("SELECT content FROM note_chunks WHERE item_id = ?", (items["short"],))
        assert chunk == "Zebra migration on the plains."
        as_host(db_path, "DROP TRIGGER host_touch")
        assert index_item(db, items["short"], embedder=embedder).status == "indexed"
    finally:
        db.close()


def test_a_host_trigger_that_refuses_memory_vectors_is_named_not_raised(
    db_path: Path, emb_settings: EmbeddingSettings, embedder
) -> None:
    """A host's trigger refusing memory_embeddings' rows made `embed_memories` (the sweep's
    `kidx.embed_memories`) and `add_memory` raise apsw.ConstraintError ("no vectors"), which
    names neither the trigger nor its table. The run ends with its error naming them (the
    sweep reports it and tries again later), `add_memory` with a StoreError, nothing
    written."""
    indexed_file(db_path, emb_settings, embedder)
    as_host(
        db_path,
        "UPDATE memories SET content = 'The user prefers coffee.'",  # its vector goes
        "CREATE TRIGGER host_no_vectors BEFORE INSERT ON memory_embeddings "
        "BEGIN SELECT RAISE(ABORT, 'no vectors'); END",
    )
    db = connect(db_path, embedding=emb_settings)
    try:
        report = embed_memories(db, embedder)
        assert report.embedded == 0 and report.left == 1
        assert "no vectors" in str(report.error)
        assert "trigger host_no_vectors on memory_embeddings" in str(report.error)
        with pytest.raises(StoreError, match="trigger host_no_vectors on memory_embeddings"):
            add_memory(db, "The user lives in Oslo.", embedder)
        assert db.scalar("SELECT count(*) FROM memories") == 1
    finally:
        db.close()


def _kept_leftover(db_path: Path, item_id: str) -> None:
    """A chunk left under `item_id` (SQL), a host's trigger refusing every DELETE of chunks,
    and a new note for the sweep to send."""
    as_host(
        db_path,
        "INSERT INTO note_chunks(item_id, chunk_index, content, method, start_offset, "
        f"end_offset, embed_hash) VALUES ({item_id}, 0, 'left by hand', 'structure', 0, 12, 'h')",
        "CREATE TRIGGER host_keep BEFORE DELETE ON note_chunks "
        "BEGIN SELECT RAISE(ABORT, 'keep chunks'); END",
        "INSERT INTO knowledge_items(kind, title, content) VALUES ('note', 'New', 'Otters.')",
    )


def test_a_host_trigger_that_refuses_the_sweeps_repairs_leaves_the_sweep_sending_items(
    db_path: Path, emb_settings: EmbeddingSettings, embedder
) -> None:
    """A host's trigger refusing DELETEs on note_chunks made every reconcile sweep raise
    apsw.ConstraintError ("keep chunks") while it removed a leftover chunk: no item was sent
    again, ever. The refused repair is logged naming the trigger and left; the sweep goes on
    and sends the items that need a run."""
    indexed_file(db_path, emb_settings, embedder)
    _kept_leftover(db_path, "999")
    db = connect(db_path, embedding=emb_settings)
    try:
        new = db.scalar("SELECT max(id) FROM knowledge_items")
        drift = reconcile(db, model=embedder.model_id, max_items=100)
        assert drift.to_index == [new]
        assert index_item(db, new, embedder=embedder).status == "indexed"
        assert db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = 999") == 1
    finally:
        db.close()


@pytest.mark.parametrize("item_id", ["'abc'", "CAST(x'ff' AS TEXT)", "x'01'"])
def test_a_kept_leftover_whose_item_id_is_no_integer_leaves_the_sweep_running(
    db_path: Path, emb_settings: EmbeddingSettings, embedder, item_id: str
) -> None:
    """The leftover the host's trigger keeps has no vector and an item id of text or bytes:
    the findings read it raw, and every sweep failed on it (TypeError in sorted(), or apsw's
    UnicodeDecodeError)."""
    indexed_file(db_path, emb_settings, embedder)
    _kept_leftover(db_path, item_id)
    db = connect(db_path, embedding=emb_settings)
    try:
        new = db.scalar("SELECT max(id) FROM knowledge_items")
        for _ in range(2):
            assert reconcile(db, model=embedder.model_id, max_items=100).to_index == [new]
    finally:
        db.close()


def test_a_table_a_host_makes_again_while_a_worker_runs_is_mended_by_the_next_sweep(
    db_path: Path, emb_settings: EmbeddingSettings, embedder
) -> None:
    """A worker's connection lives as long as its process, and kidx's tables were checked
    only when it opened: note_chunks made again without its key while workers ran made every
    run and every sweep fail (`foreign key mismatch`) until the workers were restarted. The
    sweep makes it again and sends its items."""
    db = connect(db_path, embedding=emb_settings)  # the worker's, open throughout
    try:
        items = {"short": add_item(db, kind="note", title="Zebras", content=ZEBRAS)}
        assert index_item(db, items["short"], embedder=embedder).status == "indexed"
        remake(db_path, "note_chunks")
        assert reconcile(db, model=embedder.model_id, max_items=10).to_index == [items["short"]]
        assert index_item(db, items["short"], embedder=embedder).status == "indexed"
        assert db.scalar("SELECT count(*) FROM note_chunks WHERE id IS NOT NULL") == 1
        assert mirror_problems(db) == []
    finally:
        db.close()


def test_kidx_doctor_names_what_a_host_changed_in_the_schema(
    db_path: Path, emb_settings: EmbeddingSettings, embedder
) -> None:
    """`kidx doctor`'s database line said all was well (it opens the file without kidx's
    checks) while every kidx process refused it, or every run failed until a sweep made a
    table again. It fails for the first, warns for the second, and names a host's own
    triggers and indexes on kidx's tables."""
    from ops.doctor import Fail, Warn, check_database
    from worker.settings import Settings

    indexed_file(db_path, emb_settings, embedder)
    settings = Settings(db=db_path)
    as_host(
        db_path,
        "CREATE INDEX host_by_content ON note_chunks(content)",
        "CREATE TRIGGER host_t AFTER INSERT ON memories BEGIN SELECT 1; END",
    )
    said = check_database(settings, 5.0)
    assert "index host_by_content on note_chunks, trigger host_t on memories" in said
    remake(db_path, "note_chunks")
    with pytest.raises(Warn, match=r"note_chunks .*id is not its INTEGER PRIMARY KEY"):
        check_database(settings, 5.0)
    remake(db_path, "knowledge_items")
    with pytest.raises(Fail, match="knowledge_items id is not its INTEGER PRIMARY KEY") as e:
        check_database(settings, 5.0)
    assert not isinstance(e.value, Warn)


def test_a_host_holding_the_file_in_rollback_journal_mode_is_said_with_what_to_do(tmp_path):
    """A host set `journal_mode = DELETE` and holds a read transaction: kidx's switch back to
    WAL waits for it, then failed with SQLite's "database is locked" alone. The line now says
    what held it and what to do; the file is left as it was."""
    path = tmp_path / "kidx.db"
    connect(path).close()
    h = apsw.Connection(str(path))
    try:
        h.execute("PRAGMA journal_mode = DELETE")
        h.execute("BEGIN")
        h.execute("SELECT count(*) FROM knowledge_items").fetchall()  # holds a shared lock
        with pytest.raises(StoreError) as refused:
            connect(path, busy_timeout_ms=1000)
        h.execute("COMMIT")
    finally:
        h.close()
    said = str(refused.value)
    assert "\n" not in said and "locked for 1 s" in said, said
    assert "KIDX_BUSY_TIMEOUT_MS" in said and "another program" in said, said
    connect(path).close()  # once it ends, the file opens as before


@pytest.mark.parametrize("when", ["INSERT", "UPDATE"])
def test_a_host_trigger_that_refuses_job_rows_is_named(db, db_path, when):
    """A host's trigger refusing `index_jobs` rows failed the task (or the send) with
    SQLite's words alone ("no jobs here"), naming neither the trigger nor its table."""
    from worker.store.jobs import JobState, record_end, record_queued, record_start

    record_queued(db, "t-0", "GenerateEmbedding", 1, None, None)
    as_host(
        db_path,
        f"CREATE TRIGGER host_no_jobs BEFORE {when} ON index_jobs "
        "BEGIN SELECT RAISE(ABORT, 'no jobs here'); END",
    )
    with pytest.raises(StoreError) as refused:
        if when == "INSERT":
            record_queued(db, "t-1", "GenerateEmbedding", 1, None, None)
        else:
            record_end(db, "t-0", 0, JobState.SUCCESS, 5)
    said = str(refused.value)
    assert "trigger host_no_jobs on index_jobs" in said and "no jobs here" in said, said
    if when == "INSERT":
        with pytest.raises(StoreError, match="trigger host_no_jobs on index_jobs"):
            record_start(db, "t-2", 0, "GenerateEmbedding", 1, None, None)
