"""A SQLite file that is not kidx's. Commands that expect kidx's database (every one but
`init` and `add`) refuse it in one line and write nothing, not even the switch to WAL: `kidx
status` once gave the file 51 tables, 12 triggers and WAL mode; `add` (and a worker) make a
new or empty file kidx's, and refuse one with another program's tables. `kidx init` alone
adds kidx's tables beside a host's own, and refuses, untouched, a file with tables of kidx's
names that are not kidx's (the migration failed half-way on another application's
`knowledge_items`)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import apsw
import pytest
from test_cli import Kidx, base_env, one_line_error

from worker.errors import StoreError
from worker.store import connect


def foreign(path: Path, sql: str) -> str:
    """A file another application made (rollback journal, its own tables); its sha256."""
    conn = apsw.Connection(str(path))
    conn.execute(sql)
    conn.close()
    return hashlib.sha256(path.read_bytes()).hexdigest()


def untouched(path: Path, digest: str) -> bool:
    return (
        hashlib.sha256(path.read_bytes()).hexdigest() == digest
        and not Path(f"{path}-wal").exists()
        and not Path(f"{path}-shm").exists()
    )


@pytest.fixture
def kidx(tmp_path: Path, standin) -> Kidx:
    work = tmp_path / "work"
    work.mkdir()
    return Kidx(work, base_env(tmp_path / "kidx.db", standin.base_url), process=True)


@pytest.mark.parametrize("command", [["status"], ["jobs"], ["chunks", "1"], ["search", "x"]])
def test_a_command_that_expects_kidx_s_database_refuses_another_file(kidx, tmp_path, command):
    path = tmp_path / "app.db"
    digest = foreign(path, "CREATE TABLE users(id INTEGER PRIMARY KEY, name TEXT)")
    line = one_line_error(kidx(*command, "--db", str(path)))
    assert "is not a kidx database (it has tables users)" in line and "kidx init" in line
    assert untouched(path, digest)


@pytest.mark.parametrize(
    "command",
    [["add", "note", "--title", "T", "--text", "x"], ["add", "memory", "The user likes tea."]],
)
def test_add_refuses_another_program_s_database_rather_than_adopt_it(kidx, tmp_path, command):
    """`kidx add --db` mistyped gave another program's database (Firefox's moz_places) 112
    of kidx's objects and WAL mode: only `kidx init` adds kidx's tables to such a file."""
    path = tmp_path / "places.db"
    digest = foreign(path, "CREATE TABLE moz_places(id INTEGER PRIMARY KEY, url TEXT)")
    line = one_line_error(kidx(*command, "--db", str(path)))
    assert "is not a kidx database (it has tables moz_places)" in line and "kidx init" in line
    assert untouched(path, digest)


def test_a_worker_refuses_another_program_s_database_and_an_empty_file_is_made_kidx_s(tmp_path):
    path = tmp_path / "places.db"
    digest = foreign(path, "CREATE TABLE moz_places(id INTEGER PRIMARY KEY, url TEXT)")
    with pytest.raises(StoreError, match="is not a kidx database"):
        connect(path, vec=False)  # (create=True: what a worker and `kidx add` open with)
    assert untouched(path, digest)
    empty = tmp_path / "new.db"
    empty.write_bytes(b"")  # made by a host for kidx (touch): kidx's to fill
    connect(empty, vec=False).close()
    db = connect(empty, vec=False, create=False)
    db.close()


def test_an_empty_file_is_not_kidx_s_either(tmp_path):
    path = tmp_path / "empty.db"
    path.write_bytes(b"")
    with pytest.raises(StoreError, match=r"is not a kidx database \(it is empty\)"):
        connect(path, vec=False, create=False)
    assert path.read_bytes() == b""


def test_init_adds_kidx_s_tables_beside_a_host_s_own(kidx, tmp_path):
    path = tmp_path / "app.db"
    foreign(path, "CREATE TABLE users(id INTEGER PRIMARY KEY, name TEXT)")
    kidx("init", "--db", str(path))
    db = connect(path, vec=False, create=False)  # now kidx's: opens
    try:
        assert db.table_exists("users") and db.table_exists("knowledge_items")
    finally:
        db.close()
    assert kidx("status", "--db", str(path)).returncode == 0


@pytest.mark.parametrize("command", [["init"], ["add", "note", "--title", "T", "--text", "x"]])
def test_tables_of_kidx_s_names_that_are_not_kidx_s_are_never_migrated(kidx, tmp_path, command):
    path = tmp_path / "other.db"
    digest = foreign(path, "CREATE TABLE knowledge_items(uid TEXT, body BLOB)")
    line = one_line_error(kidx(*command, "--db", str(path)))
    assert "has tables of kidx's names (knowledge_items)" in line
    assert untouched(path, digest)


def test_kidx_s_own_database_of_an_older_schema_still_opens(tmp_path):
    """What the refusal must not catch: a kidx database (its schema_version) opens and is
    migrated as before, whatever else it holds."""
    path = tmp_path / "kidx.db"
    connect(path, vec=False).close()
    conn = apsw.Connection(str(path))
    conn.execute("CREATE TABLE host_notes(x)")
    conn.close()
    db = connect(path, vec=False, create=False)
    try:
        assert db.scalar("SELECT count(*) FROM knowledge_items") == 0
    finally:
        db.close()
