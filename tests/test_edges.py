"""The edges, tried as a careless or hostile host application would: rows written with plain
SQL (Python's own sqlite3 module in a process of its own, foreign keys off), odd paths, bytes
where text belongs, servers that trickle, a broker that is away, a disk that is full, task
arguments of any type. Everything through the public surfaces: the `kidx` command, a real
prefork worker on Redis database 8, servers on 127.0.0.1. Each case checks a clear one-line
error, nothing lost, and that the worker's API key went nowhere.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import integrity
from host import host
from stack import API_KEY, REDIS_DB, SPARE_DB, Stack, flush, free_port, start_flower, wait_for
from tasks import GROUP, KNOWLEDGE_ITEM, NOTE
from tasks.lock import lock_key
from tasks.producer import add_note, delete_item, enqueue, send_batch, send_group
from testkit.standin import StandIn
from worker.errors import BrokerUnavailable
from worker.store.items import add_item

# Real worker processes (not in make test-quick); one xdist worker runs the whole module, so
# its module-scoped stack starts once.
pytestmark = [pytest.mark.stack]

EDGE_DB = REDIS_DB  # this process's Redis database (tests/stack.py)
FLOWER = ("ops", "flower-pass-123")  # queue_env's credentials
SECTION = "A paragraph about {w} that is long enough to stand as a chunk of its own. " * 12


def sections(word: str, n: int) -> str:
    return "\n\n".join(f"## {word} {k}\n\n" + SECTION.format(w=f"{word}{k}") for k in range(n))


class Edge(Stack):
    """The module's stack: a worker that reads files and code under `root`, fetches loopback
    URLs, and has an API key in its environment."""

    def __init__(self, tmp: Path, standin: StandIn) -> None:
        self.root = tmp / "root"
        self.root.mkdir()
        env = {
            "KIDX_FILES__ROOTS": str(self.root),
            "KIDX_URLS__ALLOW_HOSTS": "127.0.0.1",
            "KIDX_URLS__TIMEOUT": "60",  # the trickling server is cancelled, not timed out
            "KIDX_TASKS__GROUP_SIZE": "1",
        }
        super().__init__(tmp, standin, worker="edges", env=env, redis_db=EDGE_DB)

    def run(self, name: str, *args: Any, **kwargs: Any) -> tuple[str, Any]:
        """Send a task by name (as any Celery client would); its state and value."""
        result = self.app.send_task(name, args=list(args), kwargs=kwargs)
        value = result.get(timeout=60, propagate=False)
        return result.state, value

    def job(self, task_id: str) -> tuple[Any, ...] | None:
        return self.db.one("SELECT state, error FROM index_jobs WHERE task_id = ?", (task_id,))


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Edge]:
    flush(EDGE_DB)
    with StandIn(dimensions=64) as standin:
        s = Edge(tmp_path_factory.mktemp("edges"), standin)
        try:
            yield s
        finally:
            s.close()
            flush(EDGE_DB)


@pytest.fixture(autouse=True)
def _fresh_standin(edge: Edge) -> Iterator[None]:
    edge.standin.reset()
    yield
    edge.standin.reset()


def secret_anywhere(edge: Edge) -> list[str]:
    """Where the worker's API key got to: the database, the provider, the worker's log."""
    found = []
    for table, column in (
        ("knowledge_items", "content"),
        ("knowledge_items", "title"),
        ("note_chunks", "content"),
        ("code_chunks", "content"),
        ("item_index_state", "last_error"),
        ("index_jobs", "error"),
    ):
        n = edge.db.scalar(
            f"SELECT count(*) FROM {table} WHERE instr(CAST({column} AS BLOB), ?)",
            (API_KEY.encode(),),
        )
        if n:
            found.append(f"{table}.{column}")
    if any(API_KEY in t for t in edge.standin.texts):
        found.append("the provider")
    if API_KEY in edge.worker.log:
        found.append("the worker log")
    return found


# -- 1. a code row reads only what a file may ----------------------------------------------


def test_a_code_row_naming_any_path_is_refused_and_the_key_goes_nowhere(edge: Edge) -> None:
    fifo = edge.root / "pipe.py"
    os.mkfifo(fifo)
    (edge.root / "env.py").symlink_to("/proc/self/environ")
    cases = {
        "/proc/self/environ": "a special file system is never read",
        "/etc/passwd": "outside the allowed folders",
        "/dev/zero": "a special file system is never read",
        str(fifo): "is a FIFO, not a regular file",
        str(edge.root / "env.py"): "a special file system is never read",
        str(edge.root): "is a directory, not a regular file",
    }
    rows = host(
        edge.db_path,
        *(
            (
                "INSERT INTO knowledge_items(kind, title, source) VALUES (?, ?, ?) RETURNING id",
                [kind, f"{kind} {n}", source],
            )
            for kind in ("code", "file")  # one guard for every kind read from a path
            for n, source in enumerate(cases)
        ),
    )
    ids = [r[0][0] for r in rows]
    for item, (source, words) in zip(ids, [*cases.items(), *cases.items()], strict=True):
        state, value = edge.run(KNOWLEDGE_ITEM, item)
        assert state == "FAILURE" and words in str(value), (source, value)
        assert "\n" not in str(value)
        status = edge.state(item)
        assert status["status"] == "failed" and words in status["last_error"], source
        assert edge.db.scalar("SELECT count(*) FROM code_chunks WHERE item_id = ?", (item,)) == 0
    assert secret_anywhere(edge) == []
    # The worker was never blocked (the FIFO) nor flooded (/dev/zero): it serves on.
    after = edge.note("After the paths", "An ordinary note after the hostile code rows.")
    assert edge.run(NOTE, after)[1]["status"] == "indexed"
    # `kidx add code` refuses the same, before writing anything.
    before = edge.db.scalar("SELECT count(*) FROM knowledge_items")
    for path, words in (
        ("/etc", "outside the allowed folders"),
        (fifo, "not a regular file"),
        ("/proc/self", "special file system"),
    ):
        out = edge.kidx("add", "code", str(path), "--inline")
        assert out.returncode == 1 and words in out.stderr, out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert edge.db.scalar("SELECT count(*) FROM knowledge_items") == before


# -- 2. deletion, from either side ----------------------------------------------------------


def test_a_plain_sql_delete_is_survived_found_by_doctor_and_swept(edge: Edge, tmp_path) -> None:
    from worker.reconcile import reconcile
    from worker.store import connect

    db = tmp_path / "deleted.db"
    kidx_db = ("--db", str(db))
    for n in range(1, 6):
        assert (
            edge.kidx(
                "add", "note", *kidx_db, "--title", f"Note {n}", "--text", sections(f"topic{n}", 2)
            ).returncode
            == 0
        )
    assert edge.kidx("index", "--all", "--inline", *kidx_db).returncode == 0

    def chunks_of(item: int) -> int:
        out = edge.kidx("chunks", str(item), "--json", *kidx_db)
        return len(json.loads(out.stdout))

    n4, n5 = chunks_of(4), chunks_of(5)
    assert n4 >= 2 and n5 >= 2
    host(db, ("DELETE FROM knowledge_items WHERE id = 5", []))  # the newest, foreign keys off
    added = edge.kidx("add", "note", *kidx_db, "--title", "After", "--text", "A later note.")
    assert added.returncode == 0, added.stderr
    assert added.stdout.strip() == "6"  # an id is never given twice
    hits = json.loads(edge.kidx("search", "topic", "-k", "4", "--json", *kidx_db).stdout)
    assert sorted(h["item_id"] for h in hits) == [1, 2, 3, 4]  # k hits, none of them deleted

    def doctor() -> dict[str, str]:  # (the stack's checks answer fast: no worker here)
        out = edge.kidx("doctor", "--json", "--timeout", "1", *kidx_db)
        return {c["check"]: f"{c['level']} {c['detail']}" for c in json.loads(out.stdout)}

    report = doctor()
    assert report["rows"].startswith("fail") and "orphans in vec_chunk_embeddings" in report["rows"]
    assert report["leftovers"].startswith("ok")  # the trigger took the relational rows
    # A host (or an old database) without the trigger: the leftovers are named, then swept.
    host(
        db,
        ("DROP TRIGGER knowledge_items_deleted", []),
        ("DELETE FROM knowledge_items WHERE id = 4", []),
    )
    left = doctor()["leftovers"]
    assert left.startswith("fail") and "index states 1" in left and f"note chunks {n4}" in left
    assert f"chunk vectors {n4}" in left
    hits = json.loads(edge.kidx("search", "topic", "-k", "3", "--json", *kidx_db).stdout)
    assert sorted(h["item_id"] for h in hits) == [1, 2, 3]
    with contextlib.closing(connect(db, embedding=edge.settings.embedding)) as conn:
        drift = reconcile(conn, model="standin-embed", max_items=100, locked=lambda ids: set())
    assert drift.repaired["leftovers_removed"] == {
        "index states": 1,
        "note chunks": n4,
        "chunk vectors": n4,
    }
    assert drift.repaired["orphans_deleted"]["vec_chunk_embeddings"] == n4 + n5
    report = doctor()
    assert report["leftovers"].startswith("ok") and report["rows"].startswith("ok")
    added = edge.kidx("add", "note", *kidx_db, "--title", "Later", "--text", "Another one.")
    assert added.returncode == 0 and added.stdout.strip() == "7"


def test_kidx_delete_removes_everything_and_a_task_for_the_item_writes_nothing(edge: Edge):
    running = edge.note("Deleted while it runs", sections("doomed", 6))
    edge.standin.delay = 1.0
    task_id = enqueue(edge.db, running, app=edge.app)
    wait_for(lambda: edge.standin.requests >= 1, 30, "the run to reach the provider")
    out = edge.kidx("delete", str(running))
    assert out.returncode == 0 and out.stdout.strip() == f"deleted {running}"
    result = edge.app.AsyncResult(task_id)
    value = result.get(timeout=60, propagate=False)
    assert result.state == "FAILURE" and f"no item with id {running}" in str(value)
    for table in ("item_index_state", "note_chunks", "note_embeddings"):
        assert edge.db.scalar(f"SELECT count(*) FROM {table} WHERE item_id = ?", (running,)) == 0
    # One deleted while queued: a one-line failure, never retried.
    queued = edge.note("Deleted while queued", "Its task comes after it is gone.")
    delete_item(edge.db, queued)
    state, value = edge.run(NOTE, queued)
    assert state == "FAILURE" and str(value).startswith(f"item {queued}: no item with id")
    assert edge.db.scalar("SELECT count(*) FROM index_jobs WHERE item_id = ?", (queued,)) == 1
    # All or nothing: an unknown id deletes none.
    kept = edge.note("Kept", "This one stays.")
    out = edge.kidx("delete", str(kept), "987654321")
    assert out.returncode == 1 and "no item with id 987654321" in out.stderr
    assert edge.state(kept)["status"] == "pending"


# -- 3. bytes where text belongs ------------------------------------------------------------


def test_bytes_that_are_not_text_are_refused_or_shown_never_a_traceback(edge: Edge) -> None:
    good = "A note whose title a host wrote as bytes that are not UTF-8. " * 5
    nul = "Before\x00the NUL, and after it. " * 60
    rows = host(
        edge.db_path,
        *(
            (
                "INSERT INTO knowledge_items(kind, title, content) "
                "VALUES ('note', ?, ?) RETURNING id",
                [title, content],
            )
            for title, content in (
                ("blob", {"hex": "ff41424344"}),
                ("invalid text", {"hex": "41c328"}),
                ({"hex": "54c3a974c3a9ff"}, good),
                ("utf-8 blob", {"hex": b"Stored as a BLOB, yet it is text.".hex()}),
                ("nul", nul),
            )
        ),
    )
    blob, invalid, title, utf8, nuls = (r[0][0] for r in rows)
    host(
        edge.db_path,
        ("UPDATE knowledge_items SET content = CAST(content AS TEXT) WHERE id = ?", [invalid]),
    )
    for item, offset in ((blob, "byte 0xff at offset 0"), (invalid, "byte 0xc3 at offset 1")):
        state, value = edge.run(NOTE, item)
        assert state == "FAILURE" and "the content is not UTF-8 text" in str(value), value
        assert offset in str(value) and "\n" not in str(value)
        assert edge.state(item)["status"] == "failed"
        assert edge.db.scalar("SELECT state FROM index_jobs WHERE item_id = ?", (item,)) == "failed"
    for item in (title, utf8, nuls):
        state, value = edge.run(NOTE, item)
        assert state == "SUCCESS" and value["status"] == "indexed", value
    log = edge.worker.log
    for bad in ("UnicodeDecodeError", "AttributeError", "\\xff", "b'"):  # Celery's own
        assert bad not in log, bad  # trace of each IndexFailed is the only traceback there
    # Search keeps answering, the bad title shown with U+FFFD; the listings work.
    hits = json.loads(edge.kidx("search", good, "-k", "50", "--json").stdout)
    assert any(h["item_id"] == title and h["title"] == "Tété\ufffd" for h in hits)
    assert edge.kidx("status", "--json").returncode == 0
    # NUL characters: indexed, each chunk an exact slice, its length right.
    chunks = json.loads(edge.kidx("chunks", str(nuls), "--json").stdout)
    contents = edge.db.all(
        "SELECT content FROM note_chunks WHERE item_id = ? ORDER BY chunk_index", (nuls,)
    )
    for c, (content,) in zip(chunks, contents, strict=True):
        assert content == nul[c["start_offset"] : c["end_offset"]]
        assert c["length"] == len(content) == c["end_offset"] - c["start_offset"]


# -- 4. a server that trickles --------------------------------------------------------------


class Trickle:
    """A server on 127.0.0.1 that answers one header byte every `gap` seconds, forever."""

    def __init__(self, gap: float = 0.3) -> None:
        self.gap = gap
        self.connections = 0
        self._stop = threading.Event()
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.2)
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}/page"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            self.connections += 1
            threading.Thread(target=self._drip, args=(conn,), daemon=True).start()

    def _drip(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)
            for byte in b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Slow: " + b"a" * 999:
                if self._stop.wait(self.gap):
                    return
                conn.sendall(bytes([byte]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._server.close()


@pytest.fixture
def trickle() -> Iterator[Trickle]:
    server = Trickle()
    yield server
    server.close()


def test_a_trickling_server_meets_the_deadline_in_all(edge: Edge, trickle: Trickle) -> None:
    out = edge.kidx(
        "add", "url", trickle.url, "--inline", timeout=30, env={"KIDX_URLS__TIMEOUT": "2"}
    )
    assert out.returncode == 1, out.stderr
    assert "timed out (not done within the 2 s allowed in all)" in out.stderr


def test_a_trickling_provider_meets_its_timeout_in_all(trickle: Trickle) -> None:
    from worker.errors import TransientProviderError
    from worker.providers import build_embedder
    from worker.settings import EmbeddingSettings

    settings = EmbeddingSettings(
        provider="openai",
        model="trickled",
        base_url=trickle.url.rsplit("/", 1)[0] + "/v1",
        dimensions=64,
        timeout=1.5,
        max_retries=0,
    )
    embedder = build_embedder(settings, dimensions=64)
    assert embedder is not None
    with pytest.raises(TransientProviderError, match=r"timed out after 1\.5s"):
        embedder.embed(["a text the provider answers one byte at a time"])
    embedder.close()
    assert trickle.connections == 1


@pytest.mark.parametrize("terminate", [False, True], ids=["cancel", "terminate"])
def test_a_fetch_in_progress_is_cancelled_and_ends_revoked(
    edge: Edge, trickle: Trickle, terminate: bool
) -> None:
    item = add_item(
        edge.db,
        kind="url",
        title=f"trickle {terminate}",
        content="",
        source=f"{trickle.url}?{terminate}",
    )
    task_id = enqueue(edge.db, item, app=edge.app)
    wait_for(lambda: trickle.connections >= 1, 30, "the fetch to start")
    out = edge.kidx("cancel", task_id, *(["--terminate"] if terminate else []))
    assert out.returncode == 0, out.stderr
    result = edge.app.AsyncResult(task_id)
    wait_for(lambda: result.state == "REVOKED", 20, "the task to end revoked")
    wait_for(lambda: edge.job(task_id)[0] == "revoked", 10, "its job row to say so")
    assert edge.state(item)["status"] == "cancelled"


# -- 5. nothing waits an hour ---------------------------------------------------------------


@pytest.mark.parametrize("broker", ["refusing", "silent"])
def test_a_producer_with_the_broker_away_fails_fast_and_the_sweep_sends_later(
    edge: Edge, tmp_path: Path, broker: str
) -> None:
    from worker.app import create_app
    from worker.reconcile import reconcile
    from worker.settings import load_settings
    from worker.store import connect

    hole = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    port = hole.getsockname()[1] if broker == "silent" else free_port()
    settings = load_settings(
        db=tmp_path / "away.db",
        broker_url=f"redis://127.0.0.1:{port}/0",
        tasks={"broker_patience": 2},
        embedding=edge.settings.embedding,
    )
    app = create_app(settings)
    db = connect(settings.db, embedding=settings.embedding)
    try:
        with pytest.raises(
            BrokerUnavailable, match=f"the broker at redis://127.0.0.1:{port}/0"
        ) as e:
            add_note(db, "Written while the broker is away", "Its task could not be sent.", app=app)
        item = e.value.item_id
        assert f"item {item} is saved" in str(e.value)
        assert db.scalar("SELECT count(*) FROM index_jobs") == 0  # no `queued` left behind
        drift = reconcile(db, model="standin-embed", max_items=10, locked=lambda ids: set())
        assert drift.to_index == [item]  # sent by the next sweep, not an hour later
    finally:
        db.close()
        app.close()
        hole.close()


def test_an_inline_run_killed_mid_item_is_noticed_by_its_lock_and_swept(edge: Edge) -> None:
    item = edge.note("Killed inline", sections("killed", 3))
    key = lock_key(edge.db.instance(), item)
    edge.standin.delay = 30.0  # the run waits on the provider when it is killed
    exe = str(Path(sys.executable).parent / "kidx")
    run = subprocess.Popen(
        [exe, "index", str(item), "--inline"],
        env=edge.env,
        cwd=str(edge.tmp),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # (its `indexing` mark is written after its first request is sent, in its own time:
        # asked for at once, it was once still `pending`)
        wait_for(
            lambda: (
                edge.standin.requests >= 1
                and edge.redis.exists(key)
                and edge.state(item)["status"] == "indexing"
            ),
            30,
            "the inline run to hold the item's lock and mark it indexing",
        )
    finally:
        run.send_signal(signal.SIGKILL)
        run.wait(10)
    edge.standin.delay = 0.0
    wait_for(
        lambda: not edge.redis.exists(key),
        30,
        "the dead run's lock to expire",
    )
    state, summary = edge.run("kidx.reconcile")
    assert state == "SUCCESS" and summary["found"]["interrupted"] >= 1, summary
    wait_for(lambda: edge.state(item)["status"] == "indexed", 60, "the sweep to index it")


def test_two_inline_runs_of_the_same_items_embed_them_once(edge: Edge) -> None:
    items = [edge.note(f"Twice {n}", sections(f"twice{n}", 2)) for n in range(4)]
    edge.standin.delay = 3.0  # the first run still holds the locks when the second starts
    exe = str(Path(sys.executable).parent / "kidx")
    cmd = [exe, "index", *map(str, items), "--inline", "--json"]

    def start() -> subprocess.Popen[str]:
        return subprocess.Popen(
            cmd,
            env={**edge.env, "KIDX_TASKS__GROUP_SIZE": "128"},  # one group: all locked at once
            cwd=str(edge.tmp),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )

    first = start()
    wait_for(
        lambda: edge.redis.exists(lock_key(edge.db.instance(), items[0])),
        30,
        "the first run's locks",
    )
    second = start()
    outputs = [json.loads(p.communicate(timeout=120)[0]) for p in (first, second)]
    assert {r["status"] for r in outputs[0]} == {"indexed"}
    assert {r["status"] for r in outputs[1]} == {"coalesced"}  # reported, not embedded
    chunks = edge.db.scalar(
        f"SELECT count(*) FROM note_chunks WHERE item_id IN ({','.join('?' * len(items))})", items
    )
    # each chunk embedded once (texts of these items only: the module's worker may still be
    # indexing what an earlier test's sweep sent, and the stand-in counts those too)
    assert len([t for t in edge.standin.texts if "twice" in t]) == chunks


# -- 6. bounded embedder input --------------------------------------------------------------


def test_a_huge_title_is_cut_in_what_the_embedder_gets_never_where_stored(edge: Edge) -> None:
    title = "T" * 1_000_000
    item = add_item(edge.db, kind="note", title=title, content=sections("huge", 40))
    assert edge.run(NOTE, item)[1]["status"] == "indexed"
    sent = edge.standin.texts
    assert len(sent) >= 40 and max(map(len, sent)) < 2 * 1500
    assert sum(map(len, sent)) < 40 * 3000  # not 40 MB
    assert edge.db.scalar("SELECT length(title) FROM knowledge_items WHERE id = ?", (item,)) == (
        len(title)
    )


# -- 7. the smaller ones --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"batch_id": 987654}, "no batch with id 987654"),
        ({"batch_id": "one"}, "the batch id must be a positive integer, not 'one'"),
        ({"batch_id": [1]}, "the batch id must be a positive integer, not [1]"),
        ({"reason": {"why": 1}}, "reason must be a string"),
        # JSON's "\ud800" decodes to a lone surrogate, which SQLite cannot store: the job row
        # could not be written and the task crashed without one.
        ({"reason": "edit \ud800"}, "reason must be UTF-8 text"),
        ({"structure_only": "yes"}, "structure_only must be true or false"),
        # Python's TypeError would fail these before the run is recorded: no job row.
        ({"colour": "red", "item": 3}, "unknown task argument 'colour', 'item'"),
        ({"args": ["why", None, False, "extra"]}, "the task takes at most 4 arguments, not 5"),
    ],
    ids=[
        "unknown-batch",
        "text-batch",
        "list-batch",
        "dict-reason",
        "surrogate-reason",
        "text-flag",
        "unknown-argument",
        "extra-argument",
    ],
)
def test_junk_task_arguments_get_a_one_line_refusal_and_a_job_row(
    edge: Edge, kwargs: dict[str, Any], words: str
) -> None:
    item = edge.note(f"Junk {words}", "A note sent with junk arguments.")
    kwargs = dict(kwargs)
    more = kwargs.pop("args", [])
    for name, args in ((NOTE, [item, *more]), (GROUP, [[item, item], *more])):
        result = edge.app.send_task(name, args=args, kwargs=kwargs)
        value = result.get(timeout=60, propagate=False)
        assert result.state == "FAILURE" and words in str(value) and "\n" not in str(value)
        job = edge.job(result.id if name == NOTE else f"{result.id}:{item}")
        assert job is not None and job[0] == "failed" and words in job[1]


def test_url_credentials_are_never_stored_sent_or_shown(edge: Edge) -> None:
    url = "http://someone:hunter2-pw@127.0.0.1:9/private"
    out = edge.kidx("add", "url", url)
    assert (
        out.returncode == 1
        and "credentials" in out.stderr
        and "http://***@127.0.0.1" in (out.stderr)
    )
    assert "hunter2" not in out.stderr + out.stdout
    assert not edge.db.scalar(
        "SELECT count(*) FROM knowledge_items WHERE instr(source, ?)", ("hunter2",)
    )
    item = host(
        edge.db_path,
        (
            "INSERT INTO knowledge_items(kind, title, source) "
            "VALUES ('url', 'A host wrote it', ?) RETURNING id",
            [url],
        ),
    )[0][0][0]
    state, value = edge.run(KNOWLEDGE_ITEM, item)
    assert state == "FAILURE" and "credentials" in str(value) and "hunter2" not in str(value)
    assert "hunter2" not in (edge.state(item)["last_error"] or "x")
    assert "hunter2" not in edge.worker.log


def test_flower_metrics_need_the_credentials(edge: Edge) -> None:
    import httpx

    port = free_port()
    flower = start_flower(edge.env, edge.tmp, port)
    try:
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/metrics", timeout=10).status_code == 401
        assert httpx.get(f"{base}/metrics", auth=("ops", "wrong"), timeout=10).status_code == 401
        ok = httpx.get(f"{base}/metrics", auth=FLOWER, timeout=10)
        assert ok.status_code == 200 and "flower_" in ok.text
        assert httpx.get(f"{base}/healthcheck", timeout=10).status_code == 200
    finally:
        flower.stop()


def test_refused_inputs_in_a_row_do_not_abort_a_batch(edge: Edge) -> None:
    missing = [
        add_item(
            edge.db,
            kind="file",
            title=f"gone {n}",
            content="",
            source=str(edge.root / f"gone{n}.md"),
        )
        for n in range(4)
    ]
    notes = [edge.note(f"Batch note {n}", f"A note of the batch, number {n}.") for n in range(2)]
    batch_id, _ = send_batch(edge.db, missing + notes, app=edge.app, group_size=1)
    from worker.store.jobs import get_batch

    wait_for(lambda: get_batch(edge.db, batch_id)["state"] != "running", 60, "the batch to end")
    batch = get_batch(edge.db, batch_id)
    assert (batch["state"], batch["ok"], batch["failed"]) == ("done", 2, 4), batch


# -- 8. a full disk -------------------------------------------------------------------------


def test_a_commit_that_fails_rolls_back_and_the_connection_is_usable(tmp_path: Path) -> None:
    import apsw

    from worker.store import connect

    db = connect(tmp_path / "commit.db", vec=False)
    db.execute("PRAGMA defer_foreign_keys = ON")  # the violation is found at COMMIT
    with pytest.raises(apsw.ConstraintError), db.atomic():
        db.execute("INSERT INTO item_index_state(item_id) VALUES (424242)")
    assert db.conn.get_autocommit()  # rolled back, not left open
    assert db.scalar("SELECT count(*) FROM item_index_state") == 0
    item = add_item(db, kind="note", title="After", content="The connection works on.")
    assert db.scalar("SELECT count(*) FROM item_index_state WHERE item_id = ?", (item,)) == 1
    db.close()


def test_space_exhausted_mid_batch_fails_items_cleanly_and_writing_resumes(
    tmp_path: Path, standin: StandIn
) -> None:
    from conftest import standin_settings
    from worker.bulk import index_items
    from worker.pipeline import IndexResult
    from worker.providers import build_embedder
    from worker.store import connect

    settings = standin_settings(standin)
    db = connect(tmp_path / "full.db", embedding=settings)
    embedder = build_embedder(settings, dimensions=db.dimensions)
    assert embedder is not None
    first = add_item(db, kind="note", title="First", content=sections("first", 3))
    index_items(db, [first], embedder=embedder)
    before = db.all("SELECT id, content FROM note_chunks WHERE item_id = ?", (first,))
    update = sections("first-edited", 30)
    db.execute("UPDATE knowledge_items SET content = ? WHERE id = ?", (update, first))
    others = [
        add_item(db, kind="note", title=f"Big {n}", content=sections(f"big{n}", 30))
        for n in range(4)
    ]
    pages = db.scalar("PRAGMA page_count")
    db.execute(f"PRAGMA max_page_count = {pages + 12}")  # room for a little, not for all
    out = index_items(db, [*others, first], embedder=embedder)
    failed = {i: o for i, o in out.items() if not isinstance(o, IndexResult)}
    assert failed and all("database or disk is full" in str(o) for o in failed.values())
    assert db.conn.get_autocommit()  # no transaction left open
    assert integrity(db) == "ok"
    for item in failed:  # nothing half-written: a failed item keeps what it had
        chunks = db.all("SELECT id, content FROM note_chunks WHERE item_id = ?", (item,))
        assert chunks == (before if item == first else [])
    db.execute("PRAGMA max_page_count = 1073741823")  # the space returns
    again = index_items(db, list(failed), embedder=embedder)
    assert all(isinstance(o, IndexResult) and o.status == "indexed" for o in again.values())
    embedder.close()
    db.close()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 6 MB tmpfs of the test's own (root only: skipped where mounting is not allowed)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path, leave: int = 0) -> Path:
    """Fill the disk to the last byte but `leave`; the filler, to remove when the space
    should return."""
    margin = disk / "margin"
    margin.write_bytes(b"\0" * leave)
    filler = disk / "filler"
    # (unbuffered, the close's error suppressed too: a write cut short left bytes in the
    # buffer, and the close that flushed them failed with ENOSPC, outside the suppress)
    with contextlib.suppress(OSError), open(filler, "wb", buffering=0) as f:
        for _ in range(10_000):
            f.write(b"\0" * 65536)
    margin.unlink()
    return filler


def test_a_full_disk_under_a_worker_fails_items_with_the_reason_and_it_recovers(
    tmp_path: Path, small_disk: Path
) -> None:
    flush(SPARE_DB)
    with StandIn(dimensions=64) as standin:
        s = Stack(
            tmp_path, standin, worker="full", redis_db=SPARE_DB, db_path=small_disk / "kidx.db"
        )
        try:
            control = s.note("Control", sections("control", 3))
            assert s.app.send_task(NOTE, args=[control]).get(timeout=60)["status"] == "indexed"
            notes = [s.note(f"Full {n}", sections(f"full{n}", 20)) for n in range(4)]
            pools = sorted(
                Path(f"/proc/{s.worker.popen.pid}/task/{s.worker.popen.pid}/children")
                .read_text()
                .split()
            )
            # Room for the run's records, not for the chunks: the writes fail mid-group.
            s.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            filler = fill(small_disk, leave=96 * 1024)
            group = send_group(s.db, s.app, notes, None, "full disk")
            value = s.app.AsyncResult(group).get(timeout=60, propagate=False)
            assert str(value).count("database or disk is full") >= 3, value  # (or sent again)
            jobs = s.db.all("SELECT state FROM index_jobs WHERE task_id LIKE ?", (f"{group}:%",))
            assert "success" not in {j[0] for j in jobs}  # no run claims what was rolled back
            filler.unlink()  # the space returns: the same worker processes index again
            wait_for(lambda: integrity(s.db) == "ok", 10, "integrity")
            for n in notes:
                assert s.db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (n,)) == 0
            values = [s.app.send_task(NOTE, args=[n]).get(timeout=60) for n in notes]
            assert {v["status"] for v in values} == {"indexed"}
            after = sorted(
                Path(f"/proc/{s.worker.popen.pid}/task/{s.worker.popen.pid}/children")
                .read_text()
                .split()
            )
            assert after == pools  # no restart
        finally:
            s.close()
            flush(SPARE_DB)
