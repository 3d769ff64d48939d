"""`kidx backup DEST`: SQLite's online backup, safe while workers write.

The copy is taken in one step, inside one read transaction: a consistent snapshot that writers
do not wait for (WAL). A backup taken in steps restarts whenever another connection commits
between two steps, so under steady writes it never ended. The copy is written beside DEST under
a temporary name and renamed over it once checked: a failed or interrupted backup never leaves
a partial file at DEST, and never costs the backup that was there.
"""

from __future__ import annotations

import glob
import os
import stat
import time
from pathlib import Path

import apsw
import click

from ops.cli.base import Ctx, cli, command, sqlite_detail, sqlite_problem
from worker.errors import InvalidInput, StoreError

SQLITE_HEADER = b"SQLite format 3\x00"
SIDE_FILES = ("-journal", "-wal", "-shm")


def _is_sqlite_or_empty(path: Path) -> bool:
    """DEST may be replaced (--force) when it is a SQLite database or empty, not any file.
    Opened without following a link and without waiting (a FIFO put there since DEST was
    looked at would block), and read only if it is (still) a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return False
        head = os.read(fd, len(SQLITE_HEADER))
    finally:
        os.close(fd)
    return head in (b"", SQLITE_HEADER)


FILE_TYPES = {
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFDIR: "a directory",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFSOCK: "a socket",
}


def _dest_type(dest: Path) -> str | None:
    """What DEST is, if it exists and is not a regular file (not followed if a link): a backup
    renamed over a device node, a FIFO or a link replaces that, not what it leads to, and
    reading a FIFO to look for SQLite's header waits forever."""
    try:
        mode = os.lstat(dest).st_mode
    except FileNotFoundError:
        return None
    except OSError as e:
        raise InvalidInput(f"cannot look at {dest}: {e.strerror or e}") from None
    if stat.S_ISREG(mode):
        return None
    return FILE_TYPES.get(stat.S_IFMT(mode), "something else")


def _remove_with_side_files(path: Path) -> None:
    for p in (path, *(path.with_name(path.name + s) for s in SIDE_FILES)):
        p.unlink(missing_ok=True)


def _remove_dead_partials(dest: Path) -> None:
    """The temporary files of backups to DEST whose process is gone (SIGKILL, a power cut):
    named by their pid, so that a backup running now keeps its own."""
    for p in dest.parent.glob(f".{glob.escape(dest.name)}.*.partial"):
        pid = p.name[len(dest.name) + 2 : -len(".partial")]
        if pid.isdigit() and not _alive(int(pid)):
            _remove_with_side_files(p)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process (or no pid at all: not ours to judge)
    return True


def _open_source(source: Path, dest: Path, busy_timeout_ms: int) -> apsw.Connection:
    """The database, opened read-only, and read once: SQLite opens a file (and a WAL
    database's -wal and -shm) only at its first read, so that what fails here is the source's,
    and is said as the source's (it named DEST when the backup's first step failed)."""
    src = None
    try:
        src = apsw.Connection(str(source), flags=apsw.SQLITE_OPEN_READONLY)
        src.set_busy_timeout(busy_timeout_ms)
        src.execute("SELECT count(*) FROM sqlite_schema").fetchall()
    except apsw.Error as e:
        if src is not None:
            src.close()
        if isinstance(e, apsw.CantOpenError):
            problem = (
                f"cannot open the database {source}{sqlite_detail(e)}: check that it, its "
                "folder and its -wal and -shm files are readable (a database in WAL mode also "
                "needs its folder writable, or its -shm present: a read-only mount refuses that)"
            )
        else:
            problem = sqlite_problem(e, source)
        raise StoreError(f"backup failed, nothing written to {dest}: {problem}") from None
    return src


def _copy(src: apsw.Connection, partial: Path) -> list[tuple[str, ...]]:
    """Copy `src` into the new file `partial` in one step; its integrity check's rows."""
    try:
        out = apsw.Connection(str(partial))
        try:
            with out.backup("main", src, "main") as b:
                b.step(-1)  # every page, under one read snapshot
            return list(out.execute("PRAGMA integrity_check"))
        finally:
            out.close()
    finally:
        src.close()


@command(cli)
@click.argument("dest", type=click.Path(dir_okay=False, path_type=str))
@click.option("--force", is_flag=True, help="Replace DEST if it exists (a SQLite file only).")
def backup(ctx: Ctx, dest: str, force: bool) -> None:
    """Copy the database to DEST while it is in use (SQLite's online backup)."""
    if dest.endswith(("/", os.sep)):  # pathlib drops the slash: `bk/` became a file named bk
        raise InvalidInput(f"{dest} names a directory: give the backup's file name ({dest}kidx.db)")
    _backup(ctx, Path(dest), force)


def _backup(ctx: Ctx, dest: Path, force: bool) -> None:
    source = Path(ctx.settings.db)
    if not source.is_file():
        raise InvalidInput(f"no database at {source}")
    kind = _dest_type(dest)
    if kind is not None:
        raise InvalidInput(f"{dest} is {kind}, not a regular file: not replacing it")
    if dest.exists() and not force:
        raise InvalidInput(f"{dest} exists (use --force to replace it)")
    if dest.resolve() == source.resolve():
        raise InvalidInput("the backup cannot be the database itself")
    for suffix in ("-wal", "-shm", "-journal"):
        # SQLite's own file beside the database: an empty WAL passed for a SQLite file one
        # may replace, and SQLite would truncate the backup written there at its next open.
        if dest.resolve() == source.resolve().with_name(source.resolve().name + suffix):
            raise InvalidInput(
                f"{dest} is the database's {suffix} file, SQLite's own: not a backup"
            )
    if dest.exists() and not _is_sqlite_or_empty(dest):
        raise InvalidInput(f"{dest} is not a SQLite database: not replacing it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_partials(dest)
    partial = dest.with_name(f".{dest.name}.{os.getpid()}.partial")
    started = time.monotonic()
    src = _open_source(source, dest, ctx.settings.busy_timeout_ms)
    try:
        check = _copy(src, partial)
        if check != [("ok",)]:
            raise StoreError(f"the copy of {source} failed its integrity check: {check}")
        for suffix in SIDE_FILES:  # the old DEST's: replayed onto the new file, they'd corrupt it
            dest.with_name(dest.name + suffix).unlink(missing_ok=True)
        partial.replace(dest)
    except apsw.Error as e:
        _remove_with_side_files(partial)
        problem = sqlite_problem(e, source if _is_source_error(e) else dest)
        raise StoreError(f"backup failed, nothing written to {dest}: {problem}") from None
    except BaseException:
        _remove_with_side_files(partial)
        raise
    info = {
        "backup": str(dest),
        "bytes": dest.stat().st_size,
        "integrity": "ok",
        "seconds": round(time.monotonic() - started, 3),
    }
    ctx.emit(
        info,
        lambda: click.echo(
            f"backed up {source} to {dest} ({info['bytes']} bytes, "
            f"integrity {info['integrity']}, {info['seconds']} s)"
        ),
    )


def _is_source_error(e: apsw.Error) -> bool:
    """The new file is kidx's own: an error about what a database holds is the source's."""
    return isinstance(e, apsw.NotADBError | apsw.CorruptError | apsw.BusyError)
