"""WAL checkpoints on a thread of the process, with a connection of their own.

SQLite checkpoints in the commit that takes the WAL past 1000 pages: that writer copies the
pages into the database file and waits for two fsyncs before its COMMIT returns. In a bulk run
that was a fifth of a worker's time (0.23-0.30 s -> 0.19-0.25 s for the corpus, in-process,
measured with /tmp scripts beside bench/throughput.py). Here the commit only signals a thread,
which runs a PASSIVE checkpoint (it never blocks a writer or a reader) while the worker goes
on; apsw lets go of the GIL while SQLite works.
"""

from __future__ import annotations

import threading

import apsw

from worker.log import get_logger

log = get_logger("kidx.store")

PAGES = 1000  # SQLite's own threshold (wal_autocheckpoint's default)


class Checkpointer:
    """The WAL hook of one connection, and the thread it wakes."""

    def __init__(self, path: str, pages: int = PAGES) -> None:
        self.path = path
        self.pages = pages
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.runs = 0
        self.copied = 0  # pages copied into the database file, in all

    def hook(self, conn: apsw.Connection, dbname: str, pages: int) -> int:
        """Called by SQLite after each commit with the WAL's size in pages."""
        if pages >= self.pages:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, daemon=True, name="kidx-checkpoint"
                )
                self._thread.start()
            self._wake.set()
        return apsw.SQLITE_OK

    def _run(self) -> None:
        conn = apsw.Connection(self.path)
        try:
            while True:
                self._wake.wait()
                self._wake.clear()
                if self._stop.is_set():
                    return
                try:
                    # The PRAGMA, not `conn.wal_checkpoint()`: a connection that has read
                    # nothing does not know the file is in WAL mode, and SQLite's C call then
                    # does nothing and says (-1, -1); the PRAGMA reads the schema first.
                    # (With the C call no checkpoint ever ran: this hook replaces SQLite's
                    # own, and a worker's WAL grew for as long as it kept its connection.)
                    _, _, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    self.runs += 1
                    self.copied += max(copied, 0)
                except apsw.Error as e:  # the next commit past the threshold tries again
                    log.warning("WAL checkpoint failed", path=self.path, reason=str(e))
        finally:
            conn.close()

    def close(self) -> None:
        """Stop the thread (a checkpoint under way ends first) and close its connection."""
        if self._thread is not None:
            self._stop.set()
            self._wake.set()
            self._thread.join(timeout=30)
            self._thread = None
