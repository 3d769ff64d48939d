"""The connection: apsw (it bundles SQLite and can load extensions; Python's sqlite3 here cannot),
WAL, a busy timeout, foreign keys, and `atomic()` write transactions that take the write lock
up front (`BEGIN IMMEDIATE`), so that several writer processes queue instead of failing with
`database is locked`.

Never import Python's `sqlite3` into a process that uses this: two SQLite libraries in one
process crashed here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import apsw

from worker.errors import StoreError
from worker.log import get_logger
from worker.store.checkpoint import Checkpointer

log = get_logger("kidx.store")

Params = Sequence[Any] | dict[str, Any]

WAL_SIZE_LIMIT = 16 * 1024 * 1024  # bytes


@dataclass(frozen=True)
class Resolution:
    """The index's dimension, and where it came from (worker.store.vec resolves it)."""

    dimensions: int
    source: str  # "embedding row", "model", "setting", "vec tables" (no provider)
    model: str | None = None  # the configured embedding model (None: no provider)


def vec_library_path() -> str:
    """sqlite-vec's library, found without importing the `sqlite_vec` package: that package
    imports Python's sqlite3, and two SQLite libraries in one process crashed here."""
    spec = importlib.util.find_spec("sqlite_vec")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the sqlite-vec package is not installed")
    return os.path.join(next(iter(spec.submodule_search_locations)), "vec0")


def _sha256(value: bytes | None) -> str | None:
    return None if value is None else hashlib.sha256(value).hexdigest()


class _Counter:
    """A count that is also a callback (a connection's rollback hook)."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> None:
        self.n += 1


class Database:
    """One SQLite connection with the project's settings and small query helpers."""

    def __init__(
        self,
        path: str | Path,
        *,
        busy_timeout_ms: int = 30_000,
        create: bool = True,
        wal: bool = True,
    ) -> None:
        """`create=False`: a file that is not there is an error (StoreError), and nothing is
        created, neither the file nor its folder: what a command that only reads or changes
        an existing database wants, so that a mistyped path is said, not made. `wal=False`:
        the file's journal mode is left as it is (`kidx doctor`, which only looks: it switched
        another program's database to WAL for good, and wrote a header into an empty file)."""
        self.path = Path(path)
        self._instance: str | None = None
        flags: dict[str, int] = {}  # apsw's default: read-write, created if missing
        if str(path) != ":memory:":
            if self.path.exists() and not self.path.is_file():
                # (a device: SQLite opened /dev/zero and left /dev/zero-journal beside it)
                raise StoreError(f"{path} is not a regular file: not a database")
            if create:
                try:
                    self.path.parent.mkdir(parents=True, exist_ok=True)
                except (FileExistsError, NotADirectoryError):  # a file where a folder goes
                    blocking = next(p for p in self.path.parents if p.exists())
                    raise StoreError(
                        f"cannot create {path}: {blocking} is a file, not a folder"
                    ) from None
            elif not self.path.exists():
                raise StoreError(f"no database at {path}; run `kidx init`")
            else:  # if it went since: an error, not a new file
                flags["flags"] = apsw.SQLITE_OPEN_READWRITE
        try:
            self.conn = apsw.Connection(str(path), **flags)
            self.busy_timeout_ms = busy_timeout_ms
            self.conn.set_busy_handler(self._busy)
            self.execute("PRAGMA foreign_keys = ON")
            mode = self.scalar("PRAGMA journal_mode" + (" = WAL" if wal else ""))
            self.execute("PRAGMA synchronous = NORMAL")
            # What the WAL file is cut back to when a writer starts it again (every page
            # checkpointed): a bulk run's 100 MB WAL is not kept on disk for good.
            self.execute(f"PRAGMA journal_size_limit = {WAL_SIZE_LIMIT}")
        except (apsw.BusyError, apsw.LockedError):
            # Switching the file to WAL needs it to itself: a host's transaction on a file it
            # set to `journal_mode = DELETE` held it, and SQLite says only "database is locked"
            raise StoreError(
                f"cannot open database {path}: it stayed locked for "
                f"{busy_timeout_ms / 1000:g} s (another program's transaction, or a backup): "
                "try again when it ends, or raise KIDX_BUSY_TIMEOUT_MS"
            ) from None
        except apsw.Error as e:
            raise StoreError(
                f"cannot open database {path}: {_open_problem(e, self.path)}"
            ) from None
        if wal and str(path) != ":memory:" and str(mode).lower() != "wal":
            raise StoreError(f"cannot switch {path} to WAL (journal_mode is {mode})")
        # The sha256 of stored bytes (a text's hash is that of its UTF-8): what a writer
        # compares with the hash of the text it read (worker.pipeline).
        self.conn.create_scalar_function("kidx_sha256", _sha256, 1, deterministic=True)
        # Checkpoints off the committing thread (worker/store/checkpoint.py says why).
        self._checkpointer: Checkpointer | None = None
        if str(path) != ":memory:":
            self._checkpointer = Checkpointer(str(path))
            self.conn.set_wal_hook(self._checkpointer.hook)
        self.vec_loaded = False
        self.vec_version: str | None = None
        self.vec_error: str | None = None
        self._depth = 0
        self._on_commit: list[tuple[int, Callable[[], None]]] = []  # (depth, what)
        self._busy_since = 0.0
        self.resolution: Resolution | None = None
        # Rollbacks on this connection, counted for `change_version`: a rollback restores rows
        # but moves neither data_version nor total_changes. SQLite's hook sees every rollback
        # of a whole transaction (ours, a failed COMMIT's, its own on SQLITE_FULL), not a
        # savepoint's: `_undo` counts those.
        self._rollbacks = _Counter()  # not a bound method: the hook would keep self alive
        self.conn.set_rollback_hook(self._rollbacks)

    def _busy(self, prior_calls: int) -> bool:
        """Wait for another writer's lock, polling every fraction of a millisecond at first.

        SQLite's own busy timeout sleeps 1, 2, 5, 10, 15, 20, 25 ms... between tries: a
        worker process whose write waits on another's (a few ms) lost ten or more, and with
        two processes writing most items waited (measured: bench/throughput.py)."""
        now = time.monotonic()
        if prior_calls == 0:
            self._busy_since = now
        if (now - self._busy_since) * 1000 >= self.busy_timeout_ms:
            return False
        time.sleep(min(0.0002 * (prior_calls + 1), 0.005))
        return True

    # -- sqlite-vec -------------------------------------------------------------------------

    def load_vec(self, path: str | Path | None = None) -> bool:
        """Load sqlite-vec (the package's library, or `path`); on failure remember why and
        carry on without it."""
        try:
            self.conn.enable_load_extension(True)
            self.conn.load_extension(str(path) if path else vec_library_path())
            self.conn.enable_load_extension(False)
            self.vec_version = self.scalar("SELECT vec_version()")
            self.vec_loaded = True
        except (ImportError, apsw.Error, AttributeError, OSError) as e:
            self.vec_error = f"{type(e).__name__}: {e}"
            log.warning("sqlite-vec unavailable, retrieval will fall back", reason=self.vec_error)
        return self.vec_loaded

    # -- queries ----------------------------------------------------------------------------

    def execute(self, sql: str, params: Params = ()) -> apsw.Cursor:
        return self.conn.execute(sql, params)

    def executemany(self, sql: str, rows: Iterable[Params]) -> None:
        self.conn.executemany(sql, rows)

    def all(self, sql: str, params: Params = ()) -> list[tuple[Any, ...]]:
        return list(self.conn.execute(sql, params))

    def one(self, sql: str, params: Params = ()) -> tuple[Any, ...] | None:
        cur = self.conn.execute(sql, params)
        try:
            return next(cur, None)
        finally:
            cur.close()  # an open statement keeps SQLite's copy of the row (a 20 MB text...)

    def scalar(self, sql: str, params: Params = ()) -> Any:
        row = self.one(sql, params)
        return row[0] if row else None

    def instance(self) -> str:
        """This database's own random name, made by the first process that asks and kept in
        `index_meta`: what names its items in Redis (locks, re-run requests, a batch's failure
        count), so that two kidx databases sharing a Redis never meet there, and a worker in a
        container and a CLI on the host, which see the file under two paths, always do."""
        if self._instance is None:
            # As bytes: apsw cannot read a host's TEXT there that is not UTF-8 (every command
            # failed as a bug); every process decodes them alike, so all name the same keys.
            query = "SELECT CAST(value AS BLOB) FROM index_meta WHERE key = 'instance'"
            try:
                # read first: a reader (`kidx status`) took the write lock to find the name
                # there, and waited out another writer's transaction for it
                value = self.scalar(query) if self.table_exists("index_meta") else None
                if value is None:
                    with self.atomic():
                        self.execute(
                            "INSERT OR IGNORE INTO index_meta(key, value) "
                            "VALUES ('instance', lower(hex(randomblob(8))))"
                        )
                        value = self.scalar(query)
            except (apsw.BusyError, apsw.LockedError):
                # Another writer past the busy timeout: the name if it has one (a read needs no
                # lock); never a guess, kept for the connection's life, naming other keys than
                # every other process's (both held one item's lock)
                value = self.scalar(query) if self.table_exists("index_meta") else None
                if value is None:
                    raise
            except apsw.Error:  # a full disk, a read-only file: its name if it has one
                value = self.scalar(query) if self.table_exists("index_meta") else None
            if value is None:  # (only a database kidx could never write to)
                value = hashlib.sha256(str(self.path.resolve()).encode()).hexdigest()[:16]
            if isinstance(value, bytes):
                value = value.decode("utf-8", errors="replace")
            self._instance = str(value)[:64]  # a host may have written anything there
        return self._instance

    def change_version(self) -> tuple[int, int, int]:
        """Moves whenever the database changes: another connection's commit (`PRAGMA
        data_version`), this connection's own writes, or its rollback of them (of a transaction
        or a savepoint). What a reader keeps is valid while it stays the same."""
        return (
            int(self.scalar("PRAGMA data_version")),
            int(self.conn.total_changes()),
            self._rollbacks.n,
        )

    def dicts(self, sql: str, params: Params = ()) -> list[dict[str, Any]]:
        cur = self.conn.cursor()
        names: list[str] = []

        def as_dict(c: apsw.Cursor, row: tuple[Any, ...]) -> dict[str, Any]:
            if not names:  # the description is readable only while the statement runs
                names.extend(d[0] for d in c.get_description())
            return dict(zip(names, row, strict=True))

        cur.row_trace = as_dict
        return list(cur.execute(sql, params))

    def table_exists(self, name: str) -> bool:
        return bool(self.scalar("SELECT 1 FROM sqlite_master WHERE name = ?", (name,)))

    # -- transactions -----------------------------------------------------------------------

    @contextmanager
    def atomic(self) -> Iterator[Database]:
        """A write transaction (BEGIN IMMEDIATE); nested calls are savepoints.

        A COMMIT that fails (a full disk, an I/O error) rolls back and re-raises: the
        connection is never left inside a transaction that a later call would mistake for its
        own. SQLite may roll a whole transaction back by itself (SQLITE_FULL, SQLITE_IOERR):
        a savepoint then has nothing to undo, and no further statement of the unit runs
        outside a transaction (StoreError instead)."""
        if self._depth == 0:
            self.execute("BEGIN IMMEDIATE")
        else:
            self._still_open()
            self.execute(f"SAVEPOINT sp{self._depth}")
        self._depth += 1
        try:
            yield self
        except BaseException:
            self._depth -= 1
            self._undo()
            self._drop_on_commit(self._depth + 1)
            raise
        self._depth -= 1
        if self._depth == 0:
            self._commit()
        else:
            self._still_open()
            try:
                self.execute(f"RELEASE sp{self._depth}")
            except BaseException:  # (an interrupt, a host's hook): undone, as a failed body is
                self._undo()
                self._drop_on_commit(self._depth + 1)
                raise
            # what the savepoint asked is its parent's now: a sibling's rollback keeps it
            self._on_commit = [(min(d, self._depth), w) for d, w in self._on_commit]

    @contextmanager
    def reading(self) -> Iterator[Database]:
        """One snapshot for several reads: a search ranks chunks, then reads the rows it
        ranked, and a commit in between (an item deleted, its chunk ids given to another's
        new chunks) would pair one chunk's score with another's text. A deferred read
        transaction; in WAL mode writers go on. Inside a transaction: that one."""
        if self._depth or not self.conn.get_autocommit():
            yield self
            return
        self.execute("BEGIN")
        changes = self.conn.total_changes()
        try:
            yield self
        finally:
            if not self.conn.get_autocommit():
                try:
                    self.execute("COMMIT")  # nothing written: it only ends the snapshot
                except apsw.Error:
                    # A keyword table whose index FTS5 found corrupt (search went on without
                    # it) fails the COMMIT of a read as well: what was read stands.
                    if not self.conn.get_autocommit():
                        self.execute("ROLLBACK")
                    if self.conn.total_changes() != changes:
                        raise

    @contextmanager
    def committing(self) -> Iterator[Database]:
        """A write transaction that commits even when an exception passes through it: each
        unit of work in it is an `atomic()` savepoint that rolls back alone, so only units that
        ended well are committed. One write lock for many items (a bulk run), where a
        transaction each would make several writer processes queue once an item. When the
        COMMIT fails, or SQLite rolled the transaction back by itself, nothing of it is kept
        and the error is raised (StoreError for the latter)."""
        if self._depth:
            yield self
            return
        self.execute("BEGIN IMMEDIATE")
        self._depth = 1
        try:
            yield self
        finally:
            self._depth = 0
            if self.conn.get_autocommit():
                self._drop_on_commit(1)
                raise StoreError("the write transaction was rolled back by SQLite")
            self._commit()

    @contextmanager
    def writing_index(self) -> Iterator[None]:
        """kidx's own writes of chunks and vectors, told from a host's by the triggers that
        drop those (schema migration 16): a row in `kidx_writer` while they run, deleted
        before the transaction commits. No other connection sees it: SQLite has one writer
        at a time, and the row is never committed. Inside a transaction only."""
        if self.conn.get_autocommit():
            raise StoreError("kidx writes chunks and vectors inside a transaction only")
        self.execute("INSERT OR IGNORE INTO kidx_writer(id) VALUES (1)")
        try:
            yield
        finally:
            if not self.conn.get_autocommit():  # (SQLite may have rolled it all back)
                self.execute("DELETE FROM kidx_writer")

    def on_commit(self, what: Callable[[], None]) -> None:
        """Run `what` once the write transaction under way commits (now, outside one): what
        must not happen unless the transaction's rows are kept, and must not hold the write
        lock while it waits (a message to the broker). Dropped when the transaction, or the
        savepoint it was asked in, rolls back."""
        if self._depth == 0:
            what()
            return
        self._on_commit.append((self._depth, what))

    def _drop_on_commit(self, depth: int) -> None:
        """What was asked at `depth` or deeper goes with its rolled-back unit."""
        self._on_commit = [(d, w) for d, w in self._on_commit if d < depth]

    def _still_open(self) -> None:
        """Inside a unit of work, the transaction it belongs to must still be there."""
        if self.conn.get_autocommit():
            raise StoreError("the write transaction was rolled back by SQLite")

    def _undo(self) -> None:
        """Roll back the unit that failed (a savepoint, or the whole transaction), unless
        SQLite has already rolled the transaction back; the first error is the one raised."""
        self._rollbacks()  # SQLite's rollback hook does not see a savepoint's
        if self.conn.get_autocommit():
            return
        try:
            if self._depth == 0:
                self.execute("ROLLBACK")
            else:
                self.execute(f"ROLLBACK TO sp{self._depth}")
                self.execute(f"RELEASE sp{self._depth}")
        except apsw.Error as e:
            log.error("rollback failed", reason=f"{type(e).__name__}: {e}")

    def _commit(self) -> None:
        """COMMIT, then what was asked to run after it (`on_commit`), in order."""
        try:
            self.execute("COMMIT")
        except BaseException:
            self._drop_on_commit(1)
            if not self.conn.get_autocommit():
                try:
                    self.execute("ROLLBACK")
                except apsw.Error as e:
                    log.error("rollback failed", reason=f"{type(e).__name__}: {e}")
            raise
        after, self._on_commit = self._on_commit, []
        # Each runs, whatever the one before it raised (the first error is raised after them):
        # a group's retries are sent here, and the soft time limit during the first send lost
        # the others' (their items ended failed where their retries were due).
        failed: Exception | None = None
        for _, what in after:
            try:
                what()
            except Exception as e:
                failed = failed or e
        if failed is not None:
            raise failed

    def map_for_reading(self, megabytes: int = 1024) -> None:
        """Read the file through a memory map (PRAGMA mmap_size): a search scans every vector
        of a vec0 table, and through read() each query copied them all again (100k x 384:
        50 -> 35 ms, bench/search.py). For connections that search; a worker's would count the
        mapped pages it touches as its own memory."""
        self.execute(f"PRAGMA mmap_size = {int(megabytes) * 1024 * 1024}")

    @property
    def dimensions(self) -> int:
        """The index's resolved dimension (set by `connect()`)."""
        if self.resolution is None:
            raise StoreError("dimensions are resolved by connect(); this Database was opened bare")
        return self.resolution.dimensions

    def close(self) -> None:
        self.conn.close()
        if self._checkpointer is not None:  # its connection last: it leaves no -wal behind
            self._checkpointer.close()

    def __enter__(self) -> Database:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_problem(e: apsw.Error, path: Path) -> str:
    """Why SQLite could not open the file, in the user's terms: a folder kidx cannot write was
    "attempt to write a readonly database" for a command that only reads."""
    folder = path.parent
    if getattr(e, "extendedresult", None) == apsw.SQLITE_READONLY_DIRECTORY or (
        isinstance(e, apsw.CantOpenError)
        and folder.is_dir()
        and not os.access(folder, os.W_OK | os.X_OK)
    ):
        return (
            f"its folder {folder} is not writable: SQLite makes {path.name}-wal and "
            f"{path.name}-shm beside the file, even to read it"
        )
    if isinstance(e, apsw.ReadOnlyError):
        return f"{e} (the file, or its -wal or -shm beside it, is read-only: kidx writes to them)"
    return str(e)


# A cursor kidx wrote: digits only (`str.isdigit` takes `²`, which int() does not).
_CURSOR = re.compile(rb"-?[0-9]+")


def meta_cursor(db: Database, key: str) -> int | None:
    """An `index_meta` record that holds where a sweep's slice stopped (a key); None, to start
    from the first, for none or a host's value (`--5`, `²`, out of range, not UTF-8)."""
    last = db.scalar("SELECT CAST(value AS BLOB) FROM index_meta WHERE key = ?", (key,))
    after = int(last) if isinstance(last, bytes) and _CURSOR.fullmatch(last) else None
    return after if after is not None and -(2**63) <= after < 2**63 else None


def set_meta(db: Database, key: str, value: str) -> None:
    """An `index_meta` record, written or replaced, in the caller's transaction."""
    db.execute(
        "INSERT INTO index_meta(key, value) VALUES (?, ?) "
        "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
        (key, value),
    )
