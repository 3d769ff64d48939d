"""`kidx backup`: an online copy while another process writes, checked and usable."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from stack import REDIS_DB, broker_url
from worker.store import connect
from worker.store.items import add_item

WRITER = textwrap.dedent(
    """
    import sys, time
    from worker.store import connect
    from worker.store.items import add_item
    db = connect(sys.argv[1], vec=False)
    deadline = time.monotonic() + 3
    n = 0
    while time.monotonic() < deadline:
        add_item(db, kind="note", title=f"w{n}", content="written during the backup " * 20)
        n += 1
    print(n)
    """
)


KIDX = str(Path(sys.executable).parent / "kidx")


def _env(db: Path) -> dict[str, str]:
    return {
        **os.environ,
        "KIDX_DB": str(db),
        "HF_HUB_OFFLINE": "1",
        "KIDX_BROKER_URL": broker_url(REDIS_DB),
    }


def _backup(
    source: Path, cwd: Path, *args: str, timeout: float = 60
) -> subprocess.CompletedProcess:
    """`kidx backup ARGS` of the database at `source`, as a user runs it."""
    return subprocess.run(
        [KIDX, "backup", *args],
        env=_env(source),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_backup_taken_while_another_process_writes_is_whole(tmp_path: Path):
    source, dest = tmp_path / "live.db", tmp_path / "copy.db"
    db = connect(source, vec=False)
    for i in range(500):
        add_item(db, kind="note", title=f"n{i}", content="some text of a note " * 50)
    db.close()
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(source)],
        env=_env(source),
        stdout=subprocess.PIPE,
        text=True,
    )
    out = _backup(source, tmp_path, str(dest), "--json")
    written = int(writer.communicate(timeout=30)[0].strip())
    assert out.returncode == 0, out.stderr
    assert '"integrity": "ok"' in out.stdout and written > 0
    copy = connect(dest, vec=False)
    assert copy.scalar("PRAGMA integrity_check") == "ok"
    assert 500 <= copy.scalar("SELECT count(*) FROM knowledge_items") <= 500 + written
    copy.close()
    again = _backup(source, tmp_path, str(dest))
    assert again.returncode == 1 and "exists" in again.stderr


MAX_COMMITS = 200_000  # the writer's bounds: far more than it commits during one backup
WRITER_SECONDS = 30.0


class Writer(threading.Thread):
    """Commits a note at a time on its own connection until told to stop (or its bounds)."""

    def __init__(self, path: Path) -> None:
        super().__init__(daemon=True)
        self.path = path
        self.committed = 0
        self.first = threading.Event()
        self.stop = threading.Event()
        self.stopped_by_us = False
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            db = connect(self.path, vec=False)
        except BaseException as e:  # the test sees it, rather than a thread's stderr
            self.error = e
            self.first.set()
            return
        deadline = time.monotonic() + WRITER_SECONDS
        try:
            for n in range(MAX_COMMITS):
                if self.stop.is_set():
                    self.stopped_by_us = True
                    return
                if time.monotonic() > deadline:
                    return
                add_item(db, kind="note", title=f"w{n}", content="written during the backup")
                self.committed += 1
                self.first.set()
        except BaseException as e:
            self.error = e
        finally:
            db.close()
            self.first.set()


def test_a_backup_ends_while_another_connection_keeps_committing(tmp_path: Path):
    """A backup taken in steps restarts at each commit of another connection, so under steady
    writes it never ended; in one step it ends while the writer is still writing, and holds
    every row committed before it started."""
    source, dest = tmp_path / "live.db", tmp_path / "copy.db"
    db = connect(source, vec=False)
    for i in range(200):
        add_item(db, kind="note", title=f"n{i}", content="some text of a note " * 50)
    with db.atomic():  # ~24 MB: many of the old backup's 1024-page steps
        db.execute("CREATE TABLE filler(b BLOB)")
        db.execute(
            "WITH RECURSIVE n(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM n WHERE i < 6000) "
            "INSERT INTO filler SELECT randomblob(4000) FROM n"
        )
    db.close()
    writer = Writer(source)
    writer.start()
    try:
        assert writer.first.wait(30) and writer.error is None, writer.error
        before = 200 + writer.committed  # committed before the backup starts
        out = _backup(source, tmp_path, str(dest), "--json", timeout=WRITER_SECONDS * 4)
    finally:
        writer.stop.set()
        writer.join(60)
    assert writer.error is None, writer.error
    assert out.returncode == 0, out.stderr
    assert writer.stopped_by_us, "the backup ended only once the writer had stopped"
    assert writer.committed > before - 200
    copy = connect(dest, vec=False)
    try:
        assert copy.scalar("PRAGMA integrity_check") == "ok"
        assert before <= copy.scalar("SELECT count(*) FROM knowledge_items")
        assert copy.scalar("SELECT count(*) FROM filler") == 6000
    finally:
        copy.close()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("copy")) == ["copy.db"]


def test_a_failed_backup_leaves_nothing_and_says_why_in_one_line(tmp_path: Path):
    """A source that is not a database: one line naming it, and no file at DEST, no
    -journal, no partial copy beside it; an older backup at DEST is kept."""
    source = tmp_path / "notes.db"
    source.write_bytes(b"not a database, only text " * 400)
    backups = tmp_path / "backups"
    out = _backup(source, tmp_path, str(backups / "copy.db"))
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert str(source) in lines[0] and "not a database" in lines[0]
    assert list(backups.iterdir()) == []

    older = backups / "copy.db"
    good = connect(tmp_path / "good.db", vec=False)
    add_item(good, kind="note", title="kept", content="an older backup")
    good.close()
    shutil.copyfile(tmp_path / "good.db", older)
    out = _backup(source, tmp_path, str(older), "--force")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert [p.name for p in backups.iterdir()] == ["copy.db"]
    kept = connect(older, vec=False)
    assert kept.scalar("SELECT title FROM knowledge_items") == "kept"
    kept.close()


def test_force_does_not_replace_a_file_that_is_not_a_database(tmp_path: Path):
    source = tmp_path / "live.db"
    connect(source, vec=False).close()
    precious = tmp_path / "thesis.docx"
    precious.write_bytes(b"PK\x03\x04 a document, not a database")
    out = _backup(source, tmp_path, str(precious), "--force")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "not a SQLite database" in out.stderr
    assert precious.read_bytes() == b"PK\x03\x04 a document, not a database"


def test_a_dest_that_ends_with_a_slash_is_refused_not_made_a_file(tmp_path: Path):
    """`kidx backup ./bk/` wrote a file named `bk` (pathlib drops the slash)."""
    source = tmp_path / "live.db"
    connect(source, vec=False).close()
    out = _backup(source, tmp_path, "bk/")
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    assert "names a directory" in out.stderr and "bk/kidx.db" in out.stderr
    assert not (tmp_path / "bk").exists()
    assert _backup(source, tmp_path, "bk/kidx.db").returncode == 0
    assert (tmp_path / "bk" / "kidx.db").read_bytes().startswith(b"SQLite format 3")


def test_what_a_killed_backup_left_goes_at_the_next_and_a_running_ones_stays(tmp_path: Path):
    """A backup SIGKILLed mid-copy leaves `.DEST.<pid>.partial` (and its -journal) beside
    DEST: the next backup to DEST removes them; a partial whose process still runs is its."""
    source = tmp_path / "live.db"
    db = connect(source, vec=False)
    add_item(db, kind="note", title="n", content="a note")
    db.close()
    backups = tmp_path / "backups"
    backups.mkdir()
    gone = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    dead = backups / f".copy.db.{int(gone.stdout)}.partial"
    dead.write_bytes(b"SQLite format 3\x00 half a copy")
    (backups / f"{dead.name}-journal").write_bytes(b"its journal")
    running = backups / f".copy.db.{os.getpid()}.partial"  # this process is alive
    running.write_bytes(b"SQLite format 3\x00 a copy under way")
    other = backups / f".other.db.{int(gone.stdout)}.partial"  # another DEST's: not ours
    other.write_bytes(b"SQLite format 3\x00")
    out = _backup(source, tmp_path, str(backups / "copy.db"))
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in backups.iterdir()) == sorted(
        ["copy.db", running.name, other.name]
    )


def _live(tmp_path: Path) -> Path:
    source = tmp_path / "live.db"
    db = connect(source, vec=False)
    add_item(db, kind="note", title="n", content="a note")
    db.close()
    return source


def _one_line_error(out: subprocess.CompletedProcess) -> str:
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


def test_force_does_not_open_nor_replace_a_fifo(tmp_path: Path):
    """Reading a FIFO for SQLite's header waited for a writer forever; now DEST is looked at
    (lstat) and refused, with or without --force, and stays a FIFO."""
    source = _live(tmp_path)
    fifo = tmp_path / "copy.db"
    os.mkfifo(fifo)
    for args in ((str(fifo), "--force"), (str(fifo),)):
        line = _one_line_error(_backup(source, tmp_path, *args, timeout=30))
        assert str(fifo) in line and "FIFO" in line and "not replacing it" in line
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir() if "copy" in p.name) == ["copy.db"]


def test_force_does_not_replace_a_symbolic_link(tmp_path: Path):
    """A link is not a regular file: not replaced (a rename would replace the link, not what
    it leads to), whether it leads to a document or to an empty file."""
    source = _live(tmp_path)
    doc, empty = tmp_path / "notes.txt", tmp_path / "empty"
    doc.write_text("my notes, not a database")
    empty.write_bytes(b"")
    for target in (doc, empty):
        link = tmp_path / f"to-{target.name}.db"
        link.symlink_to(target)
        line = _one_line_error(_backup(source, tmp_path, str(link), "--force"))
        assert str(link) in line and "symbolic link" in line
        assert link.is_symlink() and os.readlink(link) == str(target)
    assert doc.read_text() == "my notes, not a database" and empty.read_bytes() == b""


def test_force_does_not_replace_a_device_node(tmp_path: Path):
    """A character device read as empty, so --force renamed the copy over the node. The node
    here is one made for the test under tmp_path (the null device's numbers), never /dev's."""
    source = _live(tmp_path)
    node = tmp_path / "copy.db"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        pytest.skip("cannot make a device node here (no CAP_MKNOD)")
    line = _one_line_error(_backup(source, tmp_path, str(node), "--force"))
    assert str(node) in line and "character device" in line
    assert stat.S_ISCHR(os.lstat(node).st_mode)
    assert os.lstat(node).st_rdev == os.makedev(1, 3)


def test_a_source_that_cannot_be_opened_is_named_not_dest(tmp_path: Path):
    """A WAL database whose -wal cannot be opened (here a directory stands at its name: a
    read-only mount as root cannot be had in a test) failed at the backup's first step, told
    as "cannot open DEST (not an error)"; now the source is opened and read first, and its
    failure names it."""
    source = _live(tmp_path)
    (tmp_path / "live.db-wal").mkdir()
    dest = tmp_path / "copy.db"
    line = _one_line_error(_backup(source, tmp_path, str(dest)))
    assert f"cannot open the database {source}" in line, line
    assert line.count(str(dest)) == 1 and "nothing written to" in line  # only as what is spared
    assert "not an error" not in line
    assert sorted(p.name for p in tmp_path.iterdir() if "copy" in p.name) == []


def test_the_restore_runbook_stops_the_workers_and_removes_wal_and_shm_first():
    """Put at KIDX_DB beside a leftover kidx.db-wal, the copy gets the old database's last
    pages replayed onto it: the runbook says to stop every worker and delete -wal and -shm
    before the copy goes in place."""
    text = " ".join((Path(__file__).resolve().parents[1] / "ops" / "README.md").read_text().split())
    restore = text[text.index("To restore") : text.index("## Drift")]
    put = restore.index("Put the copy at `KIDX_DB`")
    assert restore.index("Stop every process that opens the database") < put
    assert "worker and beat" in restore
    assert restore.index("`kidx.db-wal`") < put and restore.index("`kidx.db-shm`") < put
    assert "replay" in restore


@pytest.mark.parametrize("suffix", ["-wal", "-shm", "-journal"])
def test_force_does_not_write_over_the_databases_own_wal_shm_or_journal(
    tmp_path: Path, suffix: str
):
    """An empty WAL (after a checkpoint) passed for a file `--force` may replace: the backup
    went there, where SQLite's next connection truncates it, and the live database's WAL was
    swapped for a copy of the database while other connections held it."""
    source = tmp_path / "live.db"
    db = connect(source, vec=False)
    try:
        item = add_item(db, kind="note", title="Kept", content="A note that must survive.")
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        companion = Path(f"{source}{suffix}")
        before = companion.read_bytes() if companion.exists() else None
        assert suffix != "-wal" or before == b""  # the case that passed for a SQLite file
        out = _backup(source, tmp_path, str(companion), "--force")
        assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
        assert f"the database's {suffix} file" in out.stderr
        assert (companion.read_bytes() if companion.exists() else None) == before
        assert not list(tmp_path.glob("*.partial"))
        assert db.scalar("SELECT title FROM knowledge_items WHERE id = ?", (item,)) == "Kept"
    finally:
        db.close()


def test_a_backup_is_a_database_of_its_own_instance(tmp_path: Path):
    """The copy kept the original's instance id: pointed at one Redis, the two shared their
    item locks, sweep locks and batch abort counts (batch ids overlap too)."""
    source = tmp_path / "kidx.db"
    db = connect(source, vec=False)
    item = add_item(db, kind="note", title="kept", content="A note the copy keeps.")
    original = db.instance()
    db.close()
    out = _backup(source, tmp_path, str(tmp_path / "copy.db"))
    assert out.returncode == 0, out.stderr
    copy = connect(tmp_path / "copy.db", vec=False)
    try:
        assert copy.instance() != original and len(copy.instance()) == 16
        assert copy.scalar("SELECT title FROM knowledge_items WHERE id = ?", (item,)) == "kept"
    finally:
        copy.close()
    again = connect(source, vec=False)
    assert again.instance() == original  # the database's own is untouched
    again.close()


def test_a_backup_of_a_file_that_is_not_kidxs_is_refused(tmp_path: Path):
    """A mistyped --db in a nightly job: another program's database, or an empty file, was
    copied and reported "integrity ok" (every other command refuses it)."""
    import apsw

    other = tmp_path / "other.db"
    conn = apsw.Connection(str(other))
    conn.execute("CREATE TABLE invoices(id INTEGER PRIMARY KEY, total REAL)")
    conn.close()
    empty = tmp_path / "empty.db"
    empty.touch()
    for source, what in ((other, "it has tables invoices"), (empty, "it is empty")):
        line = _one_line_error(_backup(source, tmp_path, str(tmp_path / "copy.db")))
        assert f"{source} is not a kidx database ({what})" in line, line
        assert not (tmp_path / "copy.db").exists()


def test_a_backup_opens_from_read_only_storage(tmp_path: Path):
    """The copy kept WAL mode in its header: on read-only storage (an archive, a read-only
    mount) SQLite could not open it at all, for it needs the -shm beside it."""
    import apsw

    source = tmp_path / "kidx.db"
    db = connect(source, vec=False)
    add_item(db, kind="note", title="kept", content="A note the copy keeps.")
    db.close()
    out = _backup(source, tmp_path, str(tmp_path / "copy.db"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "copy.db").read_bytes()[18:20] == b"\x01\x01"  # rollback journal
    uri = f"file:{tmp_path / 'copy.db'}?immutable=1"  # (as on storage nothing can be made)
    conn = apsw.Connection(uri, flags=apsw.SQLITE_OPEN_READONLY | apsw.SQLITE_OPEN_URI)
    assert conn.execute("SELECT title FROM knowledge_items").fetchall() == [("kept",)]
    conn.close()


def test_the_backup_line_shows_an_escape_in_a_path_as_text(tmp_path: Path):
    """The success line printed the paths as given: an escape sequence in a name drove the
    terminal (every other line of kidx shows it as U+FFFD)."""
    source = tmp_path / "kidx.db"
    connect(source, vec=False).close()
    dest = tmp_path / "copy\x1b[2J.db"
    out = _backup(source, tmp_path, str(dest))
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout and "copy\ufffd[2J.db" in out.stdout
    assert dest.is_file()
