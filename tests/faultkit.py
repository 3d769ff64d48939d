"""What the fault suite's modules share (tests/test_faults_*.py): the stack on this process's
Redis database, the figures of the suite, the texts it indexes and the checks of a store after
faults. The suite, against the real stack: a prefork worker with two pool processes, the HTTP
stand-in as the provider, a Redis database of the test process as broker and result backend, a
real SQLite file.

Each test records its figures (runs, kills, faults injected, items checked, items lost) in
`faults_report.FIGURES`; conftest.py prints them at the end of the run. The numbers are bounded
for CI; `make soak` (KIDX_SOAK=1) runs the same tests with larger ones, and any figure can be set
alone through its variable (KIDX_FAULT_CRASH_ITEMS=..., see `scale`). One module per fault class
(or two), so that pytest-xdist's `--dist loadfile` spreads them over its processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import redis

from conftest import integrity, keyword_rows_problems
from stack import (
    REDIS_DB,
    Proc,
    Stack,
    broker_url,
    flush,
    queue_env,
    start_worker,
)
from testkit.standin import StandIn, vector_for
from worker.chunking import MAX_CHUNK_SIZE, chunk_structure, text_hash
from worker.providers.base import to_blob

FAULT_DB = REDIS_DB  # this process's Redis database (tests/stack.py)
DIMS = 64
FLOWER_USER, FLOWER_PASSWORD = "ops", "flower-pass-123"  # what queue_env gives Flower
SOAK = os.environ.get("KIDX_SOAK", "") not in ("", "0")


def scale(name: str, bounded: int, soak: int) -> int:
    """A figure of the suite: KIDX_FAULT_<NAME> if set, else the soak or the bounded value."""
    value = os.environ.get(f"KIDX_FAULT_{name.upper()}")
    return int(value) if value else (soak if SOAK else bounded)


SEED = scale("seed", 5, 5)
CRASH_ITEMS = scale("crash_items", 300, 3000)
CRASH_KILLS = scale("crash_kills", 10, 50)
CHAOS_ITEMS = scale("chaos_items", 100, 1000)
OUTAGE_ITEMS = scale("outage_items", 100, 1000)
STORM_NOTES = scale("storm_notes", 20, 100)
STORM_EDITS = scale("storm_edits", 200, 2000)
STORM_SECONDS = scale("storm_seconds", 10, 60)
BIG_NOTE = scale("big_note_bytes", 20_000_000, 20_000_000)
# How long the waits for a whole workload may take: the soak's are longer, in proportion.
LONG = 600.0 if SOAK else 180.0

WORDS = [
    "ownership",
    "borrow",
    "lifetime",
    "trait",
    "generic",
    "closure",
    "iterator",
    "vector",
    "string",
    "slice",
    "module",
    "crate",
    "pattern",
    "match",
    "enum",
    "struct",
    "method",
    "reference",
    "pointer",
    "thread",
    "channel",
    "mutex",
    "async",
    "future",
    "error",
    "result",
    "option",
    "panic",
    "macro",
    "test",
    "cargo",
    "heap",
    "stack",
    "memory",
    "value",
    "move",
    "copy",
    "clone",
    "drop",
]


# -- the stack on this process's Redis database ---------------------------------------------


class FaultStack(Stack):
    """`stack.Stack` on this process's Redis database (worker env, the Celery app, the
    client), with one or more worker nodes."""

    def __init__(
        self,
        tmp: Path,
        standin: StandIn,
        *,
        env: dict[str, str] | None = None,
        workers: tuple[str, ...] = ("fault1",),
        concurrency: int = 2,
    ) -> None:
        from worker.app import create_app
        from worker.settings import load_settings
        from worker.store import connect

        self.tmp = tmp
        self.standin = standin
        self.env = queue_env(
            tmp, standin.base_url, KIDX_BROKER_URL=broker_url(FAULT_DB), **(env or {})
        )
        self.settings = load_settings(
            db=tmp / "kidx.db",
            broker_url=broker_url(FAULT_DB),
            embedding={
                "provider": "openai",
                "model": "standin-embed",
                "base_url": standin.base_url,
                "dimensions": DIMS,
            },
        )
        self.app = create_app(self.settings)
        self.db = connect(tmp / "kidx.db", embedding=self.settings.embedding)
        self.redis = redis.Redis.from_url(broker_url(FAULT_DB))
        self.workers: list[Proc] = []
        self.worker_name = workers[0]
        try:
            for name in workers:
                self.workers.append(
                    start_worker(self.env, tmp, self.app, name=name, concurrency=concurrency)
                )
        except BaseException:
            self.close()
            raise
        self.worker = self.workers[0]

    @property
    def logs(self) -> str:
        return "".join(w.log for w in self.workers)

    def close(self) -> None:
        for w in self.workers:
            w.stop()
        self.db.close()
        self.redis.close()


@contextlib.contextmanager
def fault_stack(tmp: Path, standin: StandIn | None = None, **kw: Any) -> Iterator[FaultStack]:
    """A stack on this process's database, flushed before and after, nothing left running."""
    flush(FAULT_DB)
    server = standin or StandIn(dimensions=DIMS)
    with server:
        s = FaultStack(tmp, server, **kw)
        try:
            yield s
        finally:
            s.close()
            flush(FAULT_DB)


def pool_pids(worker: Proc) -> list[int]:
    """The worker's pool processes (the children of its main process)."""
    pid = worker.popen.pid
    try:
        return sorted(int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    except FileNotFoundError:
        return []


def two_pool_processes(worker: Proc) -> list[int] | None:
    if not worker.alive():
        raise AssertionError(f"the worker exited:\n{worker.log[-3000:]}")
    pids = pool_pids(worker)
    return pids if len(pids) == 2 else None


def log_lines(text: str) -> list[dict[str, Any]]:
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


# -- texts ----------------------------------------------------------------------------------


def sentence(rng: random.Random, tag: str) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
    return f"{tag} {' '.join(words)}."


def paragraph(rng: random.Random, tag: str, size: int = 400) -> str:
    out = []
    while sum(len(s) + 1 for s in out) < size:
        out.append(sentence(rng, tag))
    return " ".join(out)


def short_note(rng: random.Random, n: int) -> str:
    """A note of three sections, each a chunk of its own (3 chunks, about 3,500 characters)."""
    sections = []
    for k in range(3):
        body = "\n\n".join(paragraph(rng, f"n{n}s{k}p{p}", 350) for p in range(3))
        sections.append(f"## Section {k} of note {n}\n\n{body}")
    return f"# Note {n}\n\n" + "\n\n".join(sections) + "\n"


# -- checks ---------------------------------------------------------------------------------


def store_problems(db: Any) -> list[str]:
    """Integrity, and the mirror against the truth: no orphan, none missing, every chunk with
    its vector, no duplicate chunk rows."""
    problems = []
    if (checked := integrity(db)) != "ok":
        problems.append(f"integrity_check: {checked}")
    pairs = (
        ("note_chunk_embeddings", "chunk_id", "vec_chunk_embeddings", "chunk_id"),
        ("note_embeddings", "item_id", "vec_note_embeddings", "item_id"),
    )
    for table, key, vec, vkey in pairs:
        truth = {r[0] for r in db.all(f"SELECT {key} FROM {table}")}
        mirror = {r[0] for r in db.all(f"SELECT {vkey} FROM {vec}")}
        if truth - mirror:
            problems.append(f"{len(truth - mirror)} {table} rows missing from {vec}")
        if mirror - truth:
            problems.append(f"{len(mirror - truth)} orphan rows in {vec}")
    chunks = {r[0] for r in db.all("SELECT id FROM note_chunks")}
    vectors = {r[0] for r in db.all("SELECT chunk_id FROM note_chunk_embeddings")}
    if vectors - chunks:
        problems.append(f"{len(vectors - chunks)} vectors without a chunk")
    duplicates = db.scalar(
        "SELECT count(*) FROM (SELECT item_id, start_offset, end_offset FROM note_chunks "
        "GROUP BY 1, 2, 3 HAVING count(*) > 1)"
    )
    if duplicates:
        problems.append(f"{duplicates} duplicate chunk rows")
    return problems + keyword_rows_problems(db)


def indexed_without_vectors(db: Any) -> list[int]:
    """Items `indexed` although one of their chunks has no vector (never allowed)."""
    return [
        r[0]
        for r in db.all(
            "SELECT DISTINCT c.item_id FROM note_chunks c JOIN item_index_state s "
            "ON s.item_id = c.item_id LEFT JOIN note_chunk_embeddings e ON e.chunk_id = c.id "
            "WHERE s.status = 'indexed' AND e.chunk_id IS NULL"
        )
    ]


def chunk_rows(db: Any, item: int) -> list[tuple[int, int, int, str, str]]:
    return db.all(
        "SELECT chunk_index, start_offset, end_offset, content, embed_hash FROM note_chunks "
        "WHERE item_id = ? ORDER BY chunk_index",
        (item,),
    )


def slice_problems(db: Any, item: int, text: str) -> list[str]:
    """The item's chunks against `text`: exact slices, at most the maximum, in order, covering
    every character that is not white space, one row each."""
    rows = chunk_rows(db, item)
    problems = []
    if [r[0] for r in rows] != list(range(len(rows))):
        problems.append("chunk_index is not 0..n-1")
    if any(content != text[s:e] for _, s, e, content, _ in rows):
        problems.append("a chunk is not an exact slice of the text")
    if any(e - s > MAX_CHUNK_SIZE for _, s, e, _, _ in rows):
        problems.append(f"a chunk is over {MAX_CHUNK_SIZE} characters")
    starts = [s for _, s, _, _, _ in rows]
    if starts != sorted(set(starts)):
        problems.append("chunk starts are not strictly increasing")
    covered = 0
    for _, s, e, _, _ in rows:
        if text[covered:s].strip():
            problems.append(f"text[{covered}:{s}] is not covered by any chunk")
            break
        covered = max(covered, e)
    if text[covered:].strip():
        problems.append(f"text[{covered}:] is not covered by any chunk")
    return problems


def clean_problems(db: Any, item: int, title: str, text: str) -> list[str]:
    """The item's index against what a clean run makes: the same chunks, each with the vector
    the provider gives for its embedder input."""
    expected = chunk_structure(text)
    rows = db.all(
        "SELECT c.chunk_index, c.start_offset, c.end_offset, c.content, c.embed_hash, e.vector "
        "FROM note_chunks c LEFT JOIN note_chunk_embeddings e ON e.chunk_id = c.id "
        "WHERE c.item_id = ? ORDER BY c.chunk_index",
        (item,),
    )
    got = [(r[0], r[1], r[2], r[3]) for r in rows]
    if got != [(c.index, c.start, c.end, c.content) for c in expected]:
        return [f"item {item}: its chunks differ from a clean run's"]
    problems = []
    for chunk, row in zip(expected, rows):
        given = chunk.embedding_input("")  # (no title: see Prose.plan)
        if row[4] != text_hash(given):
            problems.append(f"item {item} chunk {chunk.index}: another embedder input")
        elif row[5] != to_blob(vector_for(given, DIMS)):
            problems.append(f"item {item} chunk {chunk.index}: not the vector of its input")
    return problems


def vector_problems(db: Any, served: dict[str, str], items: list[int]) -> list[str]:
    """Each chunk's vector is the provider's vector for that chunk's embedder input (found by
    its hash among the texts the stand-in answered), in both stores."""
    problems = []
    marks = ",".join("?" * len(items))
    for chunk_id, item, embed_hash, vector, mirrored in db.all(
        "SELECT c.id, c.item_id, c.embed_hash, e.vector, v.embedding FROM note_chunks c "
        "LEFT JOIN note_chunk_embeddings e ON e.chunk_id = c.id "
        "LEFT JOIN vec_chunk_embeddings v ON v.chunk_id = c.id "
        f"WHERE c.item_id IN ({marks})",
        items,
    ):
        given = served.get(embed_hash)
        if given is None:
            problems.append(f"item {item} chunk {chunk_id}: its input was never embedded")
        elif vector != to_blob(vector_for(given, DIMS)) or mirrored != vector:
            problems.append(f"item {item} chunk {chunk_id}: not the vector of its input")
    return problems


def statuses(db: Any, items: list[int]) -> dict[int, str]:
    marks = ",".join("?" * len(items))
    found = dict(
        db.all(f"SELECT item_id, status FROM item_index_state WHERE item_id IN ({marks})", items)
    )
    return {i: found.get(i, "pending") for i in items}


def not_indexed(db: Any, items: list[int]) -> list[int]:
    return [i for i, s in statuses(db, items).items() if s != "indexed"]


def indexed_count(db: Any) -> int:
    return int(db.scalar("SELECT count(*) FROM item_index_state WHERE status = 'indexed'") or 0)


def quiet(db: Any) -> bool:
    """No run queued or under way."""
    return not db.scalar("SELECT count(*) FROM index_jobs WHERE state IN ('queued', 'started')")
