"""`kidx doctor`'s database check says how big the WAL is, and warns when it is not being
emptied: a worker's WAL once grew for as long as the worker ran (its checkpoints did nothing)."""

from __future__ import annotations

import apsw
import pytest

import ops.doctor
from ops.doctor import Warn, check_database
from worker.settings import Settings
from worker.store import connect


def test_a_wal_that_is_not_emptied_is_a_warning(tmp_path, monkeypatch):
    path = tmp_path / "kidx.db"
    connect(path, vec=False).close()
    host = apsw.Connection(str(path))  # a host's connection: no checkpoint of its own
    try:
        host.execute("PRAGMA wal_autocheckpoint = 0")
        host.execute("CREATE TABLE host_blobs(x BLOB)")
        with host:
            for _ in range(800):
                host.execute("INSERT INTO host_blobs VALUES (zeroblob(4000))")
        settings = Settings(db=path)
        assert "WAL 0.0 MB" not in check_database(settings, 5.0)  # some MB, under the limit
        monkeypatch.setattr(ops.doctor, "WAL_WARN_BYTES", 1024 * 1024)
        with pytest.raises(Warn, match=r"WAL 3\.\d MB\): the WAL is not being emptied") as e:
            check_database(settings, 5.0)
        assert "read transaction" in e.value.fix
    finally:
        host.close()


def test_a_database_without_a_wal_file_says_0_mb(tmp_path):
    path = tmp_path / "kidx.db"
    connect(path, vec=False).close()  # the last connection closed: no -wal file left
    assert "WAL 0.0 MB" in check_database(Settings(db=path), 5.0)


def test_doctor_changes_nothing_in_a_file_that_is_not_a_kidx_database(tmp_path):
    """It opened the file as kidx does: another program's database (journal_mode DELETE) was
    switched to WAL for good, and an empty file got a 4 KB header."""
    from ops.doctor import Fail

    other = tmp_path / "other.db"
    conn = apsw.Connection(str(other))
    conn.execute("CREATE TABLE theirs(x); INSERT INTO theirs VALUES (1)")
    conn.close()
    before = other.read_bytes()
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    for path in (other, empty):
        with pytest.raises(Fail, match=r"kidx database|schema"):
            check_database(Settings(db=path), 5.0)
    assert other.read_bytes() == before  # its header still says: no WAL
    conn = apsw.Connection(str(other))
    assert conn.execute("PRAGMA journal_mode").fetchall() == [("delete",)]
    conn.close()
    assert empty.stat().st_size == 0


def test_a_file_that_is_not_a_database_is_one_fail_line_and_the_rest_not_checked(tmp_path):
    """Eight checks each said `fail StoreError: ... file is not a database`: one broken part
    is one FAIL line, the checks that need it are warnings (`NotChecked`)."""
    from ops.doctor import run_checks

    path = tmp_path / "text.db"
    path.write_text("just some text, not SQLite\n" * 100)
    checks = {c.check: c for c in run_checks(Settings(db=path), 2.0)}
    failed = [name for name, c in checks.items() if c.level == "fail" and "database" in c.detail]
    assert failed == ["database"], {n: (c.level, c.detail) for n, c in checks.items()}
    assert "not a database" in checks["database"].detail
    for name in ("rows", "leftovers", "keywords", "failed", "stuck", "sweeps"):
        assert checks[name].level == "warn", (name, checks[name].detail)


def test_the_keyword_check_warns_when_another_writer_holds_the_lock_its_check_needs(tmp_path):
    """FTS5's integrity check is an INSERT command: with a worker's write under way it failed
    the check (`BusyError: database is locked`), and doctor exited 1 on a healthy database."""
    from ops.doctor import check_keywords

    path = tmp_path / "kidx.db"
    connect(path, vec=False).close()
    settings = Settings(db=path)
    assert check_keywords(settings, 0.5).startswith("one keyword row per chunk")
    writer = apsw.Connection(str(path))
    try:
        writer.execute("BEGIN IMMEDIATE")
        with pytest.raises(Warn, match=r"integrity check not run .*BusyError") as e:
            check_keywords(settings, 0.5)
        assert e.value.level == "warn" and "one keyword row per chunk" in e.value.detail
        writer.execute("ROLLBACK")
    finally:
        writer.close()
