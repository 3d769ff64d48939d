"""Shared fixtures: a real SQLite file with sqlite-vec, a real HTTP stand-in on 127.0.0.1."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import apsw
import numpy as np
import pytest
from hypothesis import settings as hypothesis_settings

from testkit.standin import StandIn
from worker.providers import build_embedder
from worker.providers.base import EmbeddingModel
from worker.settings import EmbeddingSettings
from worker.store import Database, connect

os.environ.setdefault("HF_HUB_OFFLINE", "1")
hypothesis_settings.register_profile("default", max_examples=300)
hypothesis_settings.register_profile("deep", max_examples=5000)
hypothesis_settings.register_profile("quick", max_examples=25)  # make test-quick
hypothesis_settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "rustbook"
DIMS = 64


def corpus_text(name: str) -> str:
    path = CORPUS / name
    if not path.is_file():
        raise FileNotFoundError(f"the corpus must be beside the checkout: {path}")
    return path.read_text(encoding="utf-8")


DATA_DIR = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, a module that starts a stack must run whole in one process (its
    stack starts once; its tests run in order): `--dist loadfile` does that; a run without them
    (`-m "not stack"`, make test-quick) may balance test by test. (`loadgroup` no
    longer groups anything under pytest 9.2, which ignores the node ids xdist rewrites.)"""
    dist = getattr(config.option, "dist", "no")
    no_stack = "not stack" in (getattr(config.option, "markexpr", "") or "")  # test-quick
    if getattr(config.option, "numprocesses", None) and dist not in ("no", "loadfile", "load"):
        raise pytest.UsageError(f"run the suite with --dist loadfile, not --dist {dist}")
    if dist == "load" and not no_stack:
        raise pytest.UsageError("--dist load splits the stack modules: use --dist loadfile")
    # Where a `kidx` command run in-process writes its log file (and anything else under the
    # data directory), unless a test says otherwise: not the checkout's ./data.
    if "KIDX_DATA_DIR" not in os.environ:
        made = tempfile.mkdtemp(prefix="kidx-tests-data-")
        os.environ["KIDX_DATA_DIR"] = made
        config.stash[DATA_DIR] = made


def pytest_unconfigure(config: pytest.Config) -> None:
    if made := config.stash.get(DATA_DIR, None):
        shutil.rmtree(made, ignore_errors=True)


@pytest.fixture
def standin() -> Iterator[StandIn]:
    with StandIn(dimensions=DIMS) as server:
        yield server


def standin_settings(server: StandIn, **overrides: object) -> EmbeddingSettings:
    values: dict[str, object] = {
        "provider": "openai",
        "model": "standin-embed",
        "base_url": server.base_url,
        "dimensions": DIMS,
        "api_key": "sk-test-key-not-for-logs",
        "batch_size": 8,
        "max_retries": 1,
        "backoff": 0.01,
        "backoff_max": 0.05,
        "timeout": 2.0,
    }
    values.update(overrides)
    return EmbeddingSettings(**values)  # type: ignore[arg-type]


@pytest.fixture
def emb_settings(standin: StandIn) -> EmbeddingSettings:
    return standin_settings(standin)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "kidx.db"


@pytest.fixture
def db(db_path: Path, emb_settings: EmbeddingSettings) -> Iterator[Database]:
    database = connect(db_path, embedding=emb_settings)
    yield database
    database.close()


@pytest.fixture
def host(db: Database) -> Iterator[apsw.Connection]:
    """A host application's connection to `db`'s file: plain SQL, foreign keys off, no
    sqlite-vec."""
    conn = apsw.Connection(str(db.path))
    conn.execute("PRAGMA busy_timeout = 5000")
    yield conn
    conn.close()


@pytest.fixture
def embedder(db: Database, emb_settings: EmbeddingSettings) -> Iterator[EmbeddingModel]:
    model = build_embedder(emb_settings, dimensions=db.dimensions)
    assert model is not None
    yield model
    model.close()


def integrity(db: Any) -> str:
    """PRAGMA integrity_check on a long-lived connection: its FTS5 tables first read what other
    connections wrote (worker.store.fts.refresh_fts says why)."""
    from worker.store.fts import refresh_fts

    refresh_fts(db)
    return str(db.scalar("PRAGMA integrity_check"))


def keyword_rows_problems(db: Any) -> list[str]:
    """Keyword rows against chunk rows, both tables: what differs (nothing, when in order)."""
    problems = []
    for fts, table in (("note_chunks_fts", "note_chunks"), ("code_chunks_fts", "code_chunks")):
        rows = {r[0] for r in db.all(f"SELECT rowid FROM {fts}")}
        ids = {r[0] for r in db.all(f"SELECT id FROM {table}")}
        if rows != ids:
            problems.append(f"{fts}: missing {sorted(ids - rows)}, stale {sorted(rows - ids)}")
    return problems


def forge_vector(table: str, key: str) -> str:
    """SQL putting a host's vector (parameters: the vector, then the key) in place of the one
    under that key, as a host's `INSERT OR REPLACE` does: an UPDATE of a vector is dropped at
    once (schema migration 15), and these tests are of the vectors that stay."""
    return (
        f"INSERT OR REPLACE INTO {table}({key}, model, dimensions, created_at, vector) "
        f"SELECT {key}, model, dimensions, created_at, ? FROM {table} WHERE {key} = ?"
    )


# What only kidx writes (`Database.writing_index`'s mark): a host's chunk or vector rows go at
# once (schema migration 16). Statements for the tests that plant rows a run, or a database
# from before that migration, could hold: the first before them, the second after.
AS_A_RUN = "INSERT OR IGNORE INTO kidx_writer(id) VALUES (1)"
AFTER_THE_RUN = "DELETE FROM kidx_writer"


@contextmanager
def as_a_run(conn: Any) -> Iterator[None]:
    """`AS_A_RUN` around the block, on a Database or an apsw connection."""
    conn.execute(AS_A_RUN)
    try:
        yield
    finally:
        conn.execute(AFTER_THE_RUN)


class Mute:
    """A hung Redis: a TCP server on 127.0.0.1 that takes every connection and what is sent,
    and answers nothing; counts the connections (a client whose command timed out drops its
    connection and opens another for the next)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.connections = 0
        self.lock = threading.Lock()
        self.stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with self.lock:
                self.connections += 1
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        conn.settimeout(0.1)
        with conn:
            while not self.stop.is_set():
                try:
                    data = conn.recv(4096)
                except TimeoutError:
                    continue
                except OSError:
                    return
                if not data:
                    return

    def wait_for(self, connections: int) -> None:
        """Until that many connections came (accept runs on a thread of its own)."""
        deadline = time.monotonic() + 5
        while self.connections < connections and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.fixture
def mute() -> Iterator[Mute]:
    server = Mute()
    yield server
    server.close()


def mirror_problems(db: Any) -> list[str]:
    """Each vec table against the relational vectors of the index's dimension: the same keys,
    and in a quantized table the quantized float vector (nothing, when in order)."""
    from worker.store.vec import VEC_TABLES

    problems = []
    for t in VEC_TABLES:
        have = dict(db.all(f"SELECT {t.key}, embedding FROM {t.name}"))
        want = dict(
            db.all(
                f"SELECT {t.source_key}, {t.value('vector')} FROM {t.source} WHERE dimensions = ?",
                (db.dimensions,),
            )
        )
        if have.keys() != want.keys():
            problems.append(
                f"{t.name}: missing {sorted(want.keys() - have.keys())}, "
                f"orphans {sorted(have.keys() - want.keys())}"
            )
        wrong = sorted(k for k in have.keys() & want.keys() if bytes(have[k]) != bytes(want[k]))
        if wrong:
            problems.append(f"{t.name}: rows unlike their vectors {wrong}")
    return problems


class FakeEmbedder(EmbeddingModel):
    """Records its calls; deterministic vectors. For unit tests of our own logic only."""

    def __init__(self, dimensions: int = DIMS, model_id: str = "fake") -> None:
        self.dimensions = dimensions
        self.model_id = model_id
        self.batch_size = 8
        self.calls: list[list[str]] = []

    def embed_batch(self, texts: list[str]) -> np.ndarray:
        self.calls.append(list(texts))
        rng = [np.random.default_rng(zlib.crc32(t.encode())) for t in texts]
        return np.stack([r.standard_normal(self.dimensions) for r in rng]).astype(np.float32)


# -- a page server for URL sources --


class Pages:
    """A page server on 127.0.0.1: path -> (status, content type, body); counts requests."""

    def __init__(self) -> None:
        self.routes: dict[str, tuple[int, str, bytes]] = {}
        self.hits: dict[str, int] = {}
        pages = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                pages.hits[self.path] = pages.hits.get(self.path, 0) + 1
                status, ctype, body = pages.routes.get(self.path, (404, "text/plain", b"no"))
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def chat_model(standin: Any, **overrides: Any) -> Any:
    """A chunk model at the stand-in: no retries, 2 s (`overrides` change either)."""
    from worker.providers.chat import ChatModel
    from worker.settings import ChunkSettings

    values: dict[str, Any] = {
        "model": "standin-chat",
        "base_url": standin.base_url,
        "max_retries": 0,
        "timeout": 2,
    }
    values.update(overrides)
    return ChatModel(ChunkSettings(**values))


@pytest.fixture
def chat(standin: Any) -> Iterator[Any]:
    model = chat_model(standin)
    yield model
    model.close()


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """A server of `handler` on loopback, its base URL; stopped at the end."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture
def pages() -> Iterator[Pages]:
    p = Pages()
    yield p
    p.close()


# -- the fault suite (tests/test_faults_*.py): its figures at the end of the run --


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from faults_report import summary

    summary(terminalreporter)


def pytest_sessionfinish(session: pytest.Session) -> None:
    """In a pytest-xdist worker: hand the figures to the controlling process, which prints."""
    output = getattr(session.config, "workeroutput", None)
    if output is not None:
        from faults_report import FIGURES

        output["fault_figures"] = FIGURES


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    from faults_report import merge

    merge(getattr(node, "workeroutput", {}).get("fault_figures", {}))
