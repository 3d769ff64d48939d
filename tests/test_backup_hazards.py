"""`kidx backup`'s hazards on the file system: another path to the live database, a link or a
directory at a temporary's name, a long DEST, and the copy's permissions.

Run in this process (`incli.run_kidx`): a backup's temporary name holds the pid of the process
that writes it, here this test's. No broker is needed.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import apsw
import pytest
from test_backup import _live

import ops.cli.backup as backup_module
from incli import run_kidx
from worker.store import Database, connect
from worker.store.items import add_item


def _kidx(source: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_kidx(["backup", *args], {"KIDX_DB": str(source), "HF_HUB_OFFLINE": "1"}, cwd)


def _one_line_error(out: subprocess.CompletedProcess[str]) -> str:
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


def _titles(path: Path) -> list[str]:
    db = connect(path, vec=False)
    try:
        assert db.scalar("PRAGMA integrity_check") == "ok"
        return [row[0] for row in db.execute("SELECT title FROM knowledge_items")]
    finally:
        db.close()


def _other_apps_database(path: Path) -> bytes:
    other = apsw.Connection(str(path))
    other.execute("CREATE TABLE accounts(name); INSERT INTO accounts VALUES ('not kidx''s')")
    other.close()
    return path.read_bytes()


def _dead_pid() -> int:
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(gone.stdout)


@pytest.fixture
def writer(tmp_path: Path) -> Iterator[Database]:
    """The live database held open by a writer: its -wal and -shm exist, its WAL is empty
    (checkpointed: an empty file passed for one --force may replace)."""
    db = connect(tmp_path / "live.db", vec=False)
    add_item(db, kind="note", title="Kept", content="A note that must survive.")
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    try:
        yield db
    finally:
        db.close()


@pytest.mark.parametrize(
    ("mine", "theirs", "says"),
    [
        ("", "", "the backup cannot be the database itself"),
        ("", "-wal", "is the database's -wal file"),
        ("-wal", "-wal", "is the database's -wal file"),
        ("-shm", "-shm", "is the database's -shm file"),
        ("-journal", "", "is the database ("),
    ],
)
def test_force_refuses_dest_or_its_side_files_reaching_the_live_databases_files(
    tmp_path: Path, writer: Database, mine: str, theirs: str, says: str
):
    """Compared by resolve() strings, another path to the same file (a bind mount; here a hard
    link, which needs no mount) passed: the live database was replaced, its -wal and -shm
    deleted, and a writer's commits lost. Now every pair is compared by identity."""
    source = tmp_path / "live.db"
    before = {s: os.stat(f"{source}{s}").st_ino for s in ("", "-wal", "-shm")}
    dest = tmp_path / "copy.db"
    link = Path(f"{dest}{mine}")
    os.link(f"{source}{theirs}", link)
    line = _one_line_error(_kidx(source, tmp_path, str(dest), "--force"))
    assert says in line and str(link) in line, line
    assert os.path.samefile(link, f"{source}{theirs}")
    assert {s: os.stat(f"{source}{s}").st_ino for s in ("", "-wal", "-shm")} == before
    assert not list(tmp_path.glob(".*.partial*"))
    add_item(writer, kind="note", title="After", content="committed after the refusal")
    assert [r[0] for r in writer.execute("SELECT title FROM knowledge_items")] == [
        "Kept",
        "After",
    ]


def test_a_link_at_the_old_temporary_name_is_not_written_through(tmp_path: Path):
    """The temporary was `.NAME.<pid>.partial`, opened through whatever stood there: a link
    put there beforehand turned the copy onto its target (another program's database), DEST
    became that link, and the backup said it succeeded."""
    source = _live(tmp_path)
    victim = tmp_path / "other-app.db"
    kept = _other_apps_database(victim)
    trap = tmp_path / f".copy.db.{os.getpid()}.partial"
    trap.symlink_to(victim)
    out = _kidx(source, tmp_path, str(tmp_path / "copy.db"))
    assert out.returncode == 0, out.stderr
    assert victim.read_bytes() == kept
    assert stat.S_ISREG(os.lstat(tmp_path / "copy.db").st_mode)
    assert _titles(tmp_path / "copy.db") == ["n"]
    assert trap.is_symlink()  # not ours (its pid runs): left alone


def test_a_temporary_replaced_during_the_copy_is_not_renamed_over_dest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Whatever stands at the temporary's name just before the rename is looked at (lstat):
    a link swapped in during the copy would have become DEST."""
    source = _live(tmp_path)
    victim = tmp_path / "other-app.db"
    kept = _other_apps_database(victim)
    real = backup_module._copy

    def copy_then_swap(src: apsw.Connection, partial: Path) -> list[tuple[str, ...]]:
        rows = real(src, partial)
        swap = partial.with_name("swap")
        swap.symlink_to(victim)
        swap.replace(partial)
        return rows

    monkeypatch.setattr(backup_module, "_copy", copy_then_swap)
    dest = tmp_path / "copy.db"
    line = _one_line_error(_kidx(source, tmp_path, str(dest)))
    assert f"nothing written to {dest}" in line and "replaced" in line, line
    assert not os.path.lexists(dest)
    assert victim.read_bytes() == kept


def test_a_leftover_directory_named_like_a_temporary_does_not_block_a_backup(tmp_path: Path):
    """A directory at this process's temporary name failed the backup (SQLite cannot open
    it), one at a dead backup's name failed it too (unlink: "Is a directory")."""
    source = _live(tmp_path)
    dirs = [
        tmp_path / f".copy.db.{os.getpid()}.partial",
        tmp_path / f".copy.db.{_dead_pid()}.partial",
        tmp_path / f".copy.db.{(gone := _dead_pid())}.abcd1234.partial-journal",
    ]
    for d in dirs:
        d.mkdir()
    dead = tmp_path / f".copy.db.{gone}.abcd1234.partial"  # whose -journal is that directory
    dead.write_bytes(b"SQLite format 3\x00 half a copy")
    out = _kidx(source, tmp_path, str(tmp_path / "copy.db"))
    assert out.returncode == 0, out.stderr
    assert _titles(tmp_path / "copy.db") == ["n"]
    assert all(d.is_dir() for d in dirs)  # not ours to empty
    assert not dead.exists()  # the dead backup's file went, its side file's directory stayed


def test_a_dead_backups_temporary_goes_and_a_running_ones_stays(tmp_path: Path):
    """The temporary's name is `.NAME.<pid>.<random>.partial`: a dead process's goes, with
    its -wal; this (running) process's stays."""
    source = _live(tmp_path)
    dead = tmp_path / f".copy.db.{_dead_pid()}.k2x_9zq0.partial"
    dead.write_bytes(b"SQLite format 3\x00 half a copy")
    Path(f"{dead}-wal").write_bytes(b"its wal")
    running = tmp_path / f".copy.db.{os.getpid()}.k2x_9zq0.partial"
    running.write_bytes(b"SQLite format 3\x00 a copy under way")
    assert _kidx(source, tmp_path, str(tmp_path / "copy.db")).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir() if "copy" in p.name) == [
        running.name,
        "copy.db",
    ]


def test_a_long_dest_name_is_backed_up_and_one_too_long_is_named(tmp_path: Path):
    """A name near the longest the folder takes failed on its temporary's longer name, in an
    error naming the hidden file; one longer than any file's is refused naming DEST."""
    source = _live(tmp_path)
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    longest = tmp_path / ("b" * (name_max - 3) + ".db")
    out = _kidx(source, tmp_path, str(longest))
    assert out.returncode == 0, out.stderr
    shutil.copyfile(longest, tmp_path / "check.db")  # no room for a -wal beside it to open it
    assert _titles(tmp_path / "check.db") == ["n"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".partial")]
    too_long = tmp_path / ("c" * (name_max + 1))
    line = _one_line_error(_kidx(source, tmp_path, str(too_long)))
    assert str(too_long) in line and ".partial" not in line, line


@pytest.mark.parametrize("mode", [0o600, 0o640])
def test_a_backup_is_no_more_readable_than_the_database(tmp_path: Path, mode: int):
    """Created under the umask (0644), the copy of a 0600 database was readable by all."""
    source = _live(tmp_path)
    os.chmod(source, mode)
    dest = tmp_path / "copy.db"
    old = os.umask(0o022)
    try:
        assert _kidx(source, tmp_path, str(dest)).returncode == 0
        assert stat.S_IMODE(os.stat(dest).st_mode) == mode
        os.chmod(dest, 0o644)  # an older backup, replaced with a new file
        assert _kidx(source, tmp_path, str(dest), "--force").returncode == 0
        assert stat.S_IMODE(os.stat(dest).st_mode) == mode
    finally:
        os.umask(old)
