"""`kidx backup DEST`: SQLite's online backup, safe while workers write.

The copy is taken in one step, inside one read transaction: a consistent snapshot that writers
do not wait for (WAL). A backup taken in steps restarts whenever another connection commits
between two steps, so under steady writes it never ended. The copy is written beside DEST into
a temporary file of its own (an unpredictable name, created exclusively, mode 0600) and renamed
over DEST once checked: a failed or interrupted backup never leaves a partial file at DEST, and
never costs the backup that was there.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import re
import stat
import tempfile
import time
from pathlib import Path

import apsw
import click

from ops.cli.base import Ctx, cli, command, printable, sqlite_detail, sqlite_problem
from worker.errors import InvalidInput, StoreError
from worker.regular import read_regular

SQLITE_HEADER = b"SQLite format 3\x00"
SIDE_FILES = ("-journal", "-wal", "-shm")
PARTIAL = ".partial"
# What a temporary's name holds besides DEST's (cut to fit): `.`, `.`, a pid of up to 10
# digits, `.`, mkstemp's 8 random characters and `.partial`; and the longest side file SQLite
# makes beside it (`-journal`; the copy's `-wal` failed at 256 bytes).
PARTIAL_EXTRA = 3 + 10 + 8 + len(PARTIAL) + max(map(len, SIDE_FILES))
# No file by that name: none, or a name too long for one (DEST's -journal, when DEST's own
# name is near the longest: SQLite could not have made it either).
NO_SUCH_FILE = (errno.ENOENT, errno.ENOTDIR, errno.ENAMETOOLONG)


def _is_sqlite_or_empty(path: Path) -> bool:
    """DEST may be replaced (--force) when it is a SQLite database or empty, not any file.
    Opened without following a link and without waiting (a FIFO put there since DEST was
    looked at would block), and read only if it is (still) a regular file."""
    head = read_regular(path, len(SQLITE_HEADER))
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


def _with_side_files(path: Path) -> list[tuple[str, Path]]:
    return [("", path), *((s, path.with_name(path.name + s)) for s in SIDE_FILES)]


def _identity(path: Path) -> tuple[int, int] | None:
    """The file a name reaches (a link followed), or None if there is none."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno in NO_SUCH_FILE:
            return None
        raise InvalidInput(f"cannot look at {path}: {e.strerror or e}") from None
    return st.st_dev, st.st_ino


def _refuse_the_databases_own_files(source: Path, dest: Path) -> None:
    """DEST and its -journal, -wal and -shm (which a backup deletes) are none of the database's
    files, by name or by identity: a bind mount or a hard link reaches the same file by another
    path, and --force then replaced the live database and deleted its -wal and -shm."""
    by_name: dict[Path, str] = {}
    by_id: dict[tuple[int, int], str] = {}
    for suffix, path in _with_side_files(source):
        by_name[path.resolve()] = suffix  # a -wal SQLite has yet to create is SQLite's too
        if (ident := _identity(path)) is not None:
            by_id[ident] = suffix
    for mine, path in _with_side_files(dest):
        theirs = by_name.get(path.resolve())
        if theirs is None and (ident := _identity(path)) is not None:
            theirs = by_id.get(ident)
        if theirs is None:
            continue
        if mine == theirs == "":
            raise InvalidInput(f"the backup cannot be the database itself: {dest} is {source}")
        if mine == "":
            # An empty WAL passed for a SQLite file one may replace, and SQLite would truncate
            # the backup written there at its next open.
            raise InvalidInput(
                f"{dest} is the database's {theirs} file, SQLite's own: not a backup"
            )
        what = "the database" if theirs == "" else f"the database's {theirs} file"
        raise InvalidInput(f"{path} is {what} ({source}{theirs}): a backup to {dest} deletes it")


def _remove_files(path: Path, own: tuple[int, int] | None = None) -> None:
    """`path` and its side files, never a directory (a leftover one must not stop a backup,
    nor is it ours to empty); `own`: remove `path` only if it is still that file."""
    for suffix, p in _with_side_files(path):
        with contextlib.suppress(OSError):  # what cannot go stays; the backup's error matters
            st = os.lstat(p)
            if stat.S_ISDIR(st.st_mode):
                continue
            if suffix == "" and own is not None and (st.st_dev, st.st_ino) != own:
                continue
            p.unlink()


def _unlink_if_any(path: Path) -> None:
    try:
        path.unlink()
    except OSError as e:
        if e.errno not in NO_SUCH_FILE:
            raise


def _partial_stem(dest: Path) -> str:
    """DEST's name as its temporaries' names hold it: cut so that they fit in the folder's
    longest name (a long DEST failed on its temporary's name, an error naming a hidden file)."""
    try:
        name_max = os.pathconf(dest.parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    stem = dest.name
    while stem and len(os.fsencode(stem)) > name_max - PARTIAL_EXTRA:
        stem = stem[:-1]
    return stem


def _remove_dead_partials(dest: Path) -> None:
    """The temporary files of backups to DEST whose process is gone (SIGKILL, a power cut):
    their names hold their pid, so that a backup running now keeps its own (`.NAME.PID.partial`
    is an older kidx's name)."""
    stem = _partial_stem(dest)
    name = re.compile(rf"\.{re.escape(stem)}\.(\d+)(?:\.[a-z0-9_]{{8}})?{re.escape(PARTIAL)}")
    for p in dest.parent.glob(f".{glob.escape(stem)}.*{PARTIAL}"):
        if (m := name.fullmatch(p.name)) and not _alive(int(m[1])):
            _remove_files(p)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process (or no pid at all: not ours to judge)
    return True


def _create_partial(dest: Path) -> tuple[int, Path]:
    """A new, empty file of our own beside DEST, mode 0600: created exclusively and not through
    a link, under a name no one can guess (a predictable one let a link put there beforehand
    turn the backup onto its target, another program's database)."""
    try:
        fd, name = tempfile.mkstemp(
            prefix=f".{_partial_stem(dest)}.{os.getpid()}.", suffix=PARTIAL, dir=dest.parent
        )
    except OSError as e:
        raise StoreError(
            f"backup failed, nothing written to {dest}: cannot create a file in its folder "
            f"{dest.parent}: {e.strerror or e}"
        ) from None
    return fd, Path(name)


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
    """Copy `src` into the empty file `partial` in one step; its integrity check's rows."""
    try:
        # Not created here, and not through a link. The journal in memory and the lock held
        # (no -shm for the WAL header the copy takes): fewer files opened by a name beside it.
        out = apsw.Connection(
            str(partial), flags=apsw.SQLITE_OPEN_READWRITE | apsw.SQLITE_OPEN_NOFOLLOW
        )
        try:
            out.execute("PRAGMA locking_mode=EXCLUSIVE; PRAGMA journal_mode=MEMORY").fetchall()
            with out.backup("main", src, "main") as b:
                b.step(-1)  # every page, under one read snapshot
            # The copy is a database of its own: the instance that names its keys in Redis
            # (locks, sweeps, abort counts) is its own, or the two would share them.
            if out.execute("SELECT 1 FROM sqlite_schema WHERE name = 'index_meta'").fetchall():
                out.execute(
                    "UPDATE index_meta SET value = lower(hex(randomblob(8))) WHERE key = 'instance'"
                )
            # A file of its own, not in WAL mode: on read-only storage (an archive, a
            # read-only mount) a WAL database cannot be opened at all, not even to restore.
            out.execute("PRAGMA journal_mode=DELETE").fetchall()
            return list(out.execute("PRAGMA integrity_check"))
        finally:
            out.close()
    finally:
        src.close()


def _check_still_ours(partial: Path, own: tuple[int, int], dest: Path) -> None:
    """The name about to be renamed over DEST is still the file created for the copy (not
    followed: a link there would be what DEST became)."""
    try:
        st = os.lstat(partial)
        ours = stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == own
    except FileNotFoundError:
        ours = False
    if not ours:
        raise StoreError(
            f"backup failed, nothing written to {dest}: its temporary file {partial} was "
            "replaced or removed during the copy"
        )


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
    _refuse_the_databases_own_files(source, dest)  # before --force is suggested
    if dest.exists() and not force:
        raise InvalidInput(f"{dest} exists (use --force to replace it)")
    if dest.exists() and not _is_sqlite_or_empty(dest):
        raise InvalidInput(f"{dest} is not a SQLite database: not replacing it")
    from worker.store import refuse_foreign

    # (a mistyped --db in a nightly job: another program's file, an empty one, copied "ok";
    # looked at once DEST is known not to be one of its files: opening it touches its -shm)
    refuse_foreign(source, must_be_kidx=True)
    # The copy is never more readable than the database: its permission bits, once written.
    mode = stat.S_IMODE(os.stat(source).st_mode) & 0o666
    dest.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_partials(dest)
    started = time.monotonic()
    fd, partial = _create_partial(dest)
    made = os.fstat(fd)
    own = (made.st_dev, made.st_ino)
    try:
        src = _open_source(source, dest, ctx.settings.busy_timeout_ms)
        check = _copy(src, partial)
        if check != [("ok",)]:
            raise StoreError(f"the copy of {source} failed its integrity check: {check}")
        _check_still_ours(partial, own, dest)
        os.fchmod(fd, mode)
        for suffix in SIDE_FILES:  # the old DEST's: replayed onto the new file, they'd corrupt it
            _unlink_if_any(dest.with_name(dest.name + suffix))
        partial.replace(dest)
    except apsw.Error as e:
        _remove_files(partial, own)
        problem = sqlite_problem(e, source if _is_source_error(e) else dest)
        raise StoreError(f"backup failed, nothing written to {dest}: {problem}") from None
    except BaseException:
        _remove_files(partial, own)
        raise
    finally:
        os.close(fd)
    ctx.done = f"the backup was written to {dest}"
    info = {
        "backup": str(dest),
        "bytes": dest.stat().st_size,
        "integrity": "ok",
        "seconds": round(time.monotonic() - started, 3),
    }
    ctx.emit(
        info,
        lambda: click.echo(  # (the paths as given may hold an escape sequence)
            printable(
                f"backed up {source} to {dest} ({info['bytes']} bytes, "
                f"integrity {info['integrity']}, {info['seconds']} s)"
            )
        ),
    )


def _is_source_error(e: apsw.Error) -> bool:
    """The new file is kidx's own: an error about what a database holds is the source's."""
    return isinstance(e, apsw.NotADBError | apsw.CorruptError | apsw.BusyError)
