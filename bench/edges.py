"""How long each hostile case of the edges (issue 11) holds kidx, against the limit it must
keep: a trickling web server and provider (the total deadline), a broker that refuses or never
answers (the producer's patience), a code row naming /dev/zero (refused before it is opened),
and the sweep after a host deleted items with plain SQL (leftovers and orphans removed).

    python bench/edges.py [--limit 3] [--items 500]

Prints a table and writes bench/results/edges.json. Timings are this machine's; the column
that matters is `÷ limit`, which stays at or under about 1 wherever a limit applies.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from testkit.standin import StandIn  # noqa: E402

RESULTS = ROOT / "bench" / "results" / "edges.json"


@contextlib.contextmanager
def trickling() -> Iterator[str]:
    """A server on 127.0.0.1 that sends one header byte every 0.3 s, forever."""
    stop = threading.Event()
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)

    def drip(conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.recv(65536)
            for byte in b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX: " + b"a" * 9999:
                if stop.wait(0.3):
                    return
                conn.sendall(bytes([byte]))

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=drip, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        server.close()


def timed(fn: Callable[[], Any]) -> tuple[float, str]:
    """Seconds until `fn` ended, and how (its exception's first words)."""
    started = time.monotonic()
    try:
        fn()
        outcome = "returned"
    except BaseException as e:
        outcome = f"{type(e).__name__}: {' '.join(str(e).split())}"[:70]
    return time.monotonic() - started, outcome


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--limit", type=float, default=3.0, help="deadline and patience, seconds")
    ap.add_argument("--items", type=int, default=500, help="items a host deletes with SQL")
    args = ap.parse_args()
    limit = args.limit
    from worker.log import configure_logging

    configure_logging(level="error")  # the refusals are the table's, not the log's

    from tasks.producer import add_note
    from worker.app import create_app
    from worker.bulk import index_items
    from worker.providers import build_embedder
    from worker.reconcile import reconcile
    from worker.settings import EmbeddingSettings, FilesSettings, UrlSettings, load_settings
    from worker.sources import Reader
    from worker.sources.urls import fetch_url
    from worker.store import connect
    from worker.store.items import add_item, get_item

    rows: list[dict[str, Any]] = []

    def row(case: str, lim: float | None, seconds: float, outcome: str) -> None:
        rows.append(
            {
                "case": case,
                "limit_s": lim,
                "seconds": round(seconds, 3),
                "of_limit": round(seconds / lim, 2) if lim else None,
                "outcome": outcome,
            }
        )

    with tempfile.TemporaryDirectory() as tmp, trickling() as slow, StandIn(64) as standin:
        work = Path(tmp)
        urls = UrlSettings(allow_hosts=["127.0.0.1"], timeout=limit)
        row("URL, server trickling headers", limit, *timed(lambda: fetch_url(f"{slow}/page", urls)))
        emb = EmbeddingSettings(
            provider="openai",
            model="m",
            base_url=f"{slow}/v1",
            dimensions=64,
            timeout=limit,
            max_retries=0,
        )
        trickled = build_embedder(emb, dimensions=64)
        assert trickled is not None
        row("provider trickling its answer", limit, *timed(lambda: trickled.embed(["a text"])))
        trickled.close()

        db = connect(work / "edges.db", embedding=db_embedding(standin))
        hole = socket.create_server(("127.0.0.1", 0))
        closed = socket.create_server(("127.0.0.1", 0))
        closed_port = closed.getsockname()[1]
        closed.close()
        for name, port in (("refusing", closed_port), ("silent", hole.getsockname()[1])):
            settings = load_settings(
                db=work / "edges.db",
                tasks={"broker_patience": limit},
                broker_url=f"redis://127.0.0.1:{port}/0",
            )
            app = create_app(settings)
            row(
                f"producer, broker {name}",
                limit,
                *timed(lambda a=app: add_note(db, "t", "a note", app=a)),
            )
            app.close()
        hole.close()

        code = add_item(db, kind="code", title="zero", content="", source="/dev/zero")
        reader = Reader(FilesSettings(roots=[Path("/")]))  # even with / allowed
        row("code row naming /dev/zero", None, *timed(lambda: reader.text(get_item(db, code))))

        embedder = build_embedder(db_embedding(standin), dimensions=db.dimensions)
        assert embedder is not None
        ids = [
            add_item(db, kind="note", title=f"n{i}", content=f"Note {i}. " * 40)
            for i in range(args.items)
        ]
        index_items(db, ids, embedder=embedder)
        embedder.close()
        db.close()
        # A host deletes them with plain SQL (its own process, foreign keys off), and drops
        # the trigger first (a database from before it): every kind of leftover is made.
        statements = [
            ["DROP TRIGGER knowledge_items_deleted", []],
            [f"DELETE FROM knowledge_items WHERE id IN ({','.join(map(str, ids))})", []],
        ]
        subprocess.run(
            [sys.executable, str(ROOT / "tests" / "host_sql.py"), str(work / "edges.db")],
            input=json.dumps(statements),
            text=True,
            check=True,
            capture_output=True,
        )
        db = connect(work / "edges.db", embedding=db_embedding(standin))
        drift: dict[str, Any] = {}

        def sweep() -> None:
            drift["d"] = reconcile(db, model="standin-embed", max_items=10, locked=lambda i: set())

        seconds, outcome = timed(sweep)
        removed = drift["d"].repaired if "d" in drift else {}
        total = sum(removed.get("leftovers_removed", {}).values()) + sum(
            removed.get("orphans_deleted", {}).values()
        )
        row(
            f"sweep after {args.items} deleted by SQL",
            None,
            seconds,
            f"{outcome}: {total} rows removed",
        )
        db.close()

    header = f"{'case':<34} {'limit s':>8} {'seconds':>8} {'÷ limit':>8}  outcome"
    print(header)
    print("-" * len(header))
    for r in rows:
        lim = f"{r['limit_s']:g}" if r["limit_s"] else "-"
        of = f"{r['of_limit']:.2f}" if r["of_limit"] is not None else "-"
        print(f"{r['case']:<34} {lim:>8} {r['seconds']:>8.3f} {of:>8}  {r['outcome']}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=2) + "\n")


def db_embedding(standin: StandIn) -> Any:
    from worker.settings import EmbeddingSettings

    return EmbeddingSettings(
        provider="openai", model="standin-embed", base_url=standin.base_url, dimensions=64
    )


if __name__ == "__main__":
    main()
