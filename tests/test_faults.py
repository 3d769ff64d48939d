"""The fault suite, against the real stack: a prefork worker with two pool processes, the HTTP
stand-in as the provider, Redis database 5 as broker and result backend, a real SQLite file.

    crash            pool processes killed with SIGKILL at random moments while items are indexed
    provider chaos   a third of the provider's answers are 500, 429 or too slow
    total outage     the provider is down for a whole batch, then comes back
    edit storm       notes edited and enqueued many times a second, with two workers
    hostile input    bad notes, files, URLs, task arguments and messages
    security         pickle refused, Flower closed without credentials, no secret in a log

Each test records its figures (runs, kills, faults injected, items checked, items lost) in
`faults_report.FIGURES`; conftest.py prints them at the end of the run. The numbers are bounded
for CI; `make soak` (KIDX_SOAK=1) runs the same tests with larger ones, and any figure can be set
alone through its variable (KIDX_FAULT_CRASH_ITEMS=..., see `scale`).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from celery import Celery

from conftest import integrity, keyword_rows_problems
from faults_report import record
from stack import (
    API_KEY,
    REDIS_DB,
    Proc,
    Stack,
    broker_url,
    flush,
    free_port,
    queue_env,
    start_flower,
    start_worker,
    wait_for,
)
from tasks.lock import lock_key
from tasks.producer import enqueue, send_batch
from testkit.standin import StandIn, vector_for
from worker.chunking import MAX_CHUNK_SIZE, chunk_structure, text_hash
from worker.providers.base import to_blob
from worker.store.items import add_item, update_content

pytestmark = [pytest.mark.fault, pytest.mark.stack]

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


# -- the stack on database 5 ----------------------------------------------------------------


class FaultStack(Stack):
    """`stack.Stack` on Redis database 5 (worker env, the Celery app, the client), with one or
    more worker nodes."""

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
    """A stack on a flushed database 5, flushed again afterwards, with nothing left running."""
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
        given = chunk.embedding_input(title)
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


# -- crash ----------------------------------------------------------------------------------


def alive_pools(s: FaultStack, killed: list[int]) -> list[int]:
    """Pool processes not killed yet (a killed one is listed until the worker reaps it, which
    may take seconds)."""
    if not s.worker.alive():
        raise AssertionError(f"the worker exited:\n{s.worker.log[-3000:]}")
    return [p for p in pool_pids(s.worker) if p not in killed]


def kill_pool_processes(
    s: FaultStack, rng: random.Random, items: list[int], count: int, killed: list[int]
) -> None:
    """SIGKILL a pool process `count` times, each when a random number of items is indexed
    and a random fraction of a run later, so that every kill lands in the work, however fast
    it goes. `killed` gets each victim as it falls (the figures count them, pass or fail)."""
    moments = sorted(rng.sample(range(2, len(items) * 2 // 3), count))
    for moment in moments:
        wait_for(lambda m=moment: indexed_count(s.db) >= m, LONG, f"{moment} indexed")
        time.sleep(rng.uniform(0, 0.1))  # a random moment of a run (not a wait)
        victim = rng.choice(wait_for(lambda: alive_pools(s, killed), 30, "a pool process"))
        assert indexed_count(s.db) < len(items), f"all indexed before kill {len(killed) + 1}"
        os.kill(victim, signal.SIGKILL)
        killed.append(victim)


def test_crash_pool_processes_killed_at_random_moments_lose_nothing(tmp_path):
    rng = random.Random(SEED)
    killed: list[int] = []
    lost, checked = CRASH_ITEMS, 0
    try:
        with fault_stack(tmp_path) as s:
            texts = {}
            for n in range(CRASH_ITEMS):
                text = short_note(rng, n)
                texts[s.note(f"Crash note {n}", text)] = (f"Crash note {n}", text)
            items = sorted(texts)
            # A provider call takes 80 ms: the work outlasts the kills and the replacements.
            s.standin.delay = 0.08
            task_ids = [enqueue(s.db, i, app=s.app, reason="crash") for i in items]
            kill_pool_processes(s, rng, items, CRASH_KILLS, killed)
            # The worker replaced every one of them, and goes on.
            wait_for(
                lambda: len(alive_pools(s, killed)) == 2 and len(pool_pids(s.worker)) == 2,
                60,
                "two new pool processes",
            )
            wait_for(
                lambda: not not_indexed(s.db, items), LONG, "every item to be indexed", every=0.5
            )
            for task_id in task_ids:
                assert s.app.AsyncResult(task_id).get(timeout=60)["status"] == "indexed"
            lost = len(not_indexed(s.db, items))
            assert store_problems(s.db) == []
            problems = [p for i in items for p in clean_problems(s.db, i, *texts[i])]
            assert problems == []
            checked = len(items)
            assert not [i for i in items if s.redis.exists(lock_key(i))]
            runs = dict(s.db.all("SELECT state, count(*) FROM index_jobs GROUP BY state"))
            assert set(runs) <= {"success", "coalesced"}, runs
            # Most kills caught a task running (the rest, a process between two tasks).
            mid_task = s.logs.count("WorkerLostError")
            assert mid_task >= CRASH_KILLS // 2, mid_task
    finally:
        record("crash", kills=len(killed), faults=len(killed), checked=checked, lost=lost)


GROUP_CRASH_ITEMS = scale("group_crash_items", 120, 1200)
GROUP_CRASH_KILLS = scale("group_crash_kills", 4, 20)


def test_crash_of_bulk_groups_loses_nothing_and_counts_each_item_once(tmp_path):
    """The same crash through a batch: `kidx.index_group` tasks (groups of items sharing
    requests and write transactions) are redelivered whole when their process dies; what a
    dead group wrote stays, the rest is done again, and the batch counts every item once."""
    rng = random.Random(SEED + 10)
    killed: list[int] = []
    lost, checked = GROUP_CRASH_ITEMS, 0
    try:
        with fault_stack(tmp_path) as s:
            texts = {}
            for n in range(GROUP_CRASH_ITEMS):
                text = short_note(rng, n)
                texts[s.note(f"Group crash note {n}", text)] = (f"Group crash note {n}", text)
            items = sorted(texts)
            s.standin.delay = 0.08
            batch_id, task_ids = send_batch(s.db, items, app=s.app)
            kill_pool_processes(s, rng, items, GROUP_CRASH_KILLS, killed)

            def batch() -> dict[str, Any]:
                return s.db.dicts("SELECT * FROM index_batches WHERE id = ?", (batch_id,))[0]

            wait_for(lambda: batch()["state"] != "running", LONG, "the batch to end", every=0.5)
            lost = len(not_indexed(s.db, items))
            counts = batch()
            assert (counts["state"], counts["ok"], counts["failed"], counts["skipped"]) == (
                "done",
                len(items),
                0,
                0,
            ), counts
            assert store_problems(s.db) == []
            problems = [p for i in items for p in clean_problems(s.db, i, *texts[i])]
            assert problems == []
            checked = len(items)
            assert not [i for i in items if s.redis.exists(lock_key(i))]
            assert len(task_ids) >= 2 and s.logs.count("WorkerLostError") >= 1
    finally:
        record("crash", kills=len(killed), faults=len(killed), checked=checked, lost=lost)


# -- provider chaos -------------------------------------------------------------------------

CHAOS_ENV = {
    "KIDX_EMBEDDING__TIMEOUT": "0.5",  # the stand-in's slow answers take 1 s
    "KIDX_EMBEDDING__MAX_RETRIES": "0",  # every fault reaches the pipeline's failure count
    "KIDX_TASKS__MAX_RETRIES": "2",
    "KIDX_TASKS__RETRY_BACKOFF": "0.2",
    "KIDX_TASKS__RETRY_BACKOFF_MAX": "2",
    "KIDX_SCHEDULER__RETRY_BACKOFF": "0",
    "KIDX_SCHEDULER__RETRY_MAX_ATTEMPTS": "1000",
}


def test_provider_chaos_every_item_ends_indexed_through_retries_and_sweeps(tmp_path):
    rng = random.Random(SEED + 1)
    faults, lost, checked, sweeps = 0, CHAOS_ITEMS, 0, 0
    try:
        with fault_stack(tmp_path, env=CHAOS_ENV) as s:
            texts = {}
            for n in range(CHAOS_ITEMS):
                text = short_note(rng, n) + "\n" + paragraph(rng, f"n{n}tail", 1200)
                texts[s.note(f"Chaos note {n}", text)] = (f"Chaos note {n}", text)
            items = sorted(texts)
            s.standin.chaos, s.standin.chaos_seed = 0.3, SEED
            s.standin.chaos_delay, s.standin.chaos_retry_after = 1.0, 1
            for i in items:
                enqueue(s.db, i, app=s.app, reason="chaos")
            broken: set[int] = set()

            def settled() -> bool:
                broken.update(indexed_without_vectors(s.db))
                return quiet(s.db)

            deadline = time.monotonic() + LONG
            while True:
                wait_for(settled, LONG, "the runs to settle", every=0.2)
                if not not_indexed(s.db, items) or time.monotonic() > deadline:
                    break
                # Failed items go back through the retry sweep, partial ones through reconcile.
                for name in ("kidx.retry_sweep", "kidx.reconcile"):
                    s.app.send_task(name).get(timeout=60)
                    sweeps += 1
                wait_for(settled, LONG, "the sweeps' runs to settle", every=0.2)
            faults = sum(s.standin.chaos_faults.values())
            lost = len(not_indexed(s.db, items))
            assert broken == set(), "indexed with a chunk lacking its vector"
            assert lost == 0, statuses(s.db, not_indexed(s.db, items))
            assert 0.2 <= faults / s.standin.requests <= 0.4  # about a third of the calls
            assert min(s.standin.chaos_faults.values()) > 0  # every kind of fault happened
            assert sweeps > 0  # the task retries alone did not get everything through
            assert store_problems(s.db) == []
            problems = [p for i in items for p in clean_problems(s.db, i, *texts[i])]
            assert problems == []
            checked = len(items)
    finally:
        record("provider chaos", faults=faults, checked=checked, lost=lost)


# -- total outage ---------------------------------------------------------------------------


def test_total_outage_aborts_the_batch_and_retry_failed_completes_it(tmp_path):
    standin = StandIn(dimensions=DIMS, port=free_port())  # the same port when it comes back
    rng = random.Random(SEED + 2)
    faults, lost, checked = 0, OUTAGE_ITEMS, 0
    try:
        with fault_stack(tmp_path, standin) as s:
            texts = {}
            for n in range(OUTAGE_ITEMS):
                text = paragraph(rng, f"outage{n}", 900)
                texts[s.note(f"Outage note {n}", text)] = (f"Outage note {n}", text)
            items = sorted(texts)
            standin.stop()  # connection refused, for every call
            batch_id, task_ids = send_batch(s.db, items, app=s.app)
            for task_id in task_ids:
                s.app.AsyncResult(task_id).get(timeout=LONG, propagate=False)
            batch = s.db.dicts("SELECT * FROM index_batches WHERE id = ?", (batch_id,))[0]
            assert batch["state"] == "aborted", batch
            assert "3 consecutive failures" in batch["abort_reason"]
            assert "connection failed" in batch["abort_reason"]
            ran = s.db.scalar(
                "SELECT count(DISTINCT item_id) FROM index_jobs WHERE batch_id = ? "
                "AND state IN ('failed', 'retry')",
                (batch_id,),
            )
            # Every run of the batch met the outage: it failed, or was skipped for the abort.
            faults = s.db.scalar(
                "SELECT count(*) FROM index_jobs WHERE batch_id = ? AND state "
                "IN ('failed', 'retry', 'skipped')",
                (batch_id,),
            )
            assert 3 <= ran <= 3 + 2  # three failures, and what two processes had in flight
            assert batch["skipped"] >= OUTAGE_ITEMS - ran
            assert set(statuses(s.db, items).values()) == {"failed"}  # none left pending
            assert s.db.scalar("SELECT count(*) FROM note_chunks") == 0
            # The provider returns; `kidx retry --failed` sends them all, and all are indexed.
            standin.start()
            out = s.kidx("retry", "--failed", "--json")
            assert out.returncode == 0, out.stderr
            sent = json.loads(out.stdout)
            assert sorted(x["item_id"] for x in sent) == items
            for x in sent:
                assert s.app.AsyncResult(x["task_id"]).get(timeout=LONG)["status"] == "indexed"
            lost = len(not_indexed(s.db, items))
            assert lost == 0
            assert store_problems(s.db) == []
            problems = [p for i in items for p in clean_problems(s.db, i, *texts[i])]
            assert problems == []
            checked = len(items)
    finally:
        record("total outage", faults=faults, checked=checked, lost=lost)


# -- edit storm -----------------------------------------------------------------------------


def edit(rng: random.Random, blocks: list[str], n: int) -> list[str]:
    """One edit of a note's paragraphs: replace, insert, delete or extend one."""
    blocks = list(blocks)
    k = rng.randrange(len(blocks))
    op = rng.choice(("replace", "insert", "delete", "extend"))
    if op == "delete" and len(blocks) > 4 and not blocks[k].startswith("#"):
        del blocks[k]
    elif op == "insert":
        blocks.insert(k + 1, paragraph(rng, f"e{n}", rng.randint(100, 900)))
    elif op == "replace" and not blocks[k].startswith("#"):
        blocks[k] = paragraph(rng, f"e{n}", rng.randint(100, 900))
    else:
        blocks[k] = blocks[k] + " " + sentence(rng, f"e{n}")
    return blocks


def test_edit_storm_each_note_ends_indexed_as_its_final_text(tmp_path):
    rng = random.Random(SEED + 3)
    lost, checked, edits = STORM_NOTES, 0, 0
    try:
        with fault_stack(tmp_path, workers=("storm1", "storm2")) as s:
            notes: dict[int, list[str]] = {}
            for n in range(STORM_NOTES):
                blocks = [f"# Storm note {n}"]
                for k in range(2):
                    blocks.append(f"## Part {k}")
                    blocks += [paragraph(rng, f"n{n}k{k}p{p}", 500) for p in range(3)]
                notes[s.note(f"Storm note {n}", "\n\n".join(blocks))] = blocks
            items = sorted(notes)
            first = [enqueue(s.db, i, app=s.app) for i in items]
            for task_id in first:
                s.app.AsyncResult(task_id).get(timeout=60)
            # Some notes are hot (weights 1, 1/2, 1/3, ...: the first gets about a quarter of
            # the edits), and a provider call takes 50 ms: runs of the same note overlap.
            weights = [1 / (k + 1) for k in range(len(items))]
            s.standin.delay = 0.05
            task_ids = []
            started = time.monotonic()
            for n in range(STORM_EDITS):
                # Evenly spread over the storm's seconds (pacing, not a wait).
                time.sleep(max(0.0, started + n * STORM_SECONDS / STORM_EDITS - time.monotonic()))
                item = rng.choices(items, weights)[0]
                notes[item] = edit(rng, notes[item], n)
                update_content(s.db, item, "\n\n".join(notes[item]))
                task_ids.append(enqueue(s.db, item, app=s.app, reason="storm"))
                edits += 1
            took = time.monotonic() - started
            results = [s.app.AsyncResult(t).get(timeout=LONG, propagate=False) for t in task_ids]
            failures = [r for r in results if not isinstance(r, dict)]
            assert failures == []

            def final(i: int) -> bool:
                state = s.db.one(
                    "SELECT status, indexed_hash FROM item_index_state WHERE item_id = ?", (i,)
                )
                return state == ("indexed", text_hash("\n\n".join(notes[i])))

            wait_for(
                lambda: quiet(s.db) and all(final(i) for i in items),
                60,
                "every note to be indexed as its final text",
                every=0.2,
            )
            lost = sum(1 for i in items if not final(i))
            problems = [
                f"item {i}: {p}"
                for i in items
                for p in slice_problems(s.db, i, "\n\n".join(notes[i]))
            ]
            assert problems == []
            served = {text_hash(t): t for t in s.standin.texts}
            assert vector_problems(s.db, served, items) == []
            assert store_problems(s.db) == []
            checked = len(items)
            assert "database is locked" not in s.logs
            assert not s.db.scalar("SELECT count(*) FROM index_jobs WHERE state = 'failed'")
            assert took < STORM_SECONDS + 5  # the edits came as fast as asked
            # Runs overlapped: some enqueues found their note being indexed (by either worker).
            coalesced = [r for r in results if r.get("status") == "coalesced"]
            assert coalesced
            assert all("succeeded" in w.log for w in s.workers)  # both workers took a share
    finally:
        record("edit storm", faults=edits, checked=checked, lost=lost)


# -- hostile input --------------------------------------------------------------------------


class Opener:
    """Unpickled, this opens (creates) the file it names: a pickle that runs code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def send_pickle(url: str, name: str, args: list[Any], kwargs: dict[str, Any]) -> str:
    """Send a task serialised with pickle, as an attacker (or an old client) would."""
    evil = Celery(broker=url, backend=url)
    evil.conf.update(task_serializer="pickle", accept_content=["pickle", "json"])
    task_id = str(uuid.uuid4())
    evil.send_task(name, args=args, kwargs=kwargs, task_id=task_id, serializer="pickle")
    evil.close()
    return task_id


def send_raw_json(url: str, body: bytes) -> str:
    """Send a message with a JSON content type and a body that is not JSON."""
    from kombu import Connection

    task_id = str(uuid.uuid4())
    with Connection(url) as conn:
        producer = conn.Producer()
        producer.publish(
            body,
            routing_key="celery",
            exchange="",
            content_type="application/json",
            content_encoding="utf-8",
            serializer=None,
            headers={
                "id": task_id,
                "task": "GenerateEmbedding",
                "lang": "py",
                "argsrepr": "",
                "kwargsrepr": "",
                "origin": "test",
                "retries": 0,
            },
        )
    return task_id


@dataclass
class Case:
    """One hostile input: how it is sent, and what must come of it.

    expect: `indexed` (its chunks exact slices of `text`), `failed` (the item `failed` with
    `words` in its reason, and the task's FAILURE), `refused` (the task's FAILURE, with `words`),
    or `logged` (no task runs; the worker's log says why, with `words`)."""

    name: str
    expect: str
    words: str = ""
    item: int | None = None
    task_id: str | None = None
    text: str | None = None
    mark: str = ""  # for `logged`: what names the message in the log (Celery's line for a
    # refused pickle names no task id, but quotes the body)


def hostile_cases(s: FaultStack, root: Path) -> list[Case]:
    url = broker_url(FAULT_DB)
    cases: list[Case] = []

    def note(name: str, text: str, expect: str = "indexed", words: str = "") -> None:
        item = add_item(s.db, kind="note", title=name, content=text)
        cases.append(Case(name, expect, words, item, enqueue(s.db, item, app=s.app), text))

    def raw_note(name: str, text: str) -> None:  # written by a host application, unchecked
        item = s.db.scalar(
            "INSERT INTO knowledge_items(kind, title, content) VALUES ('note', ?, ?) RETURNING id",
            (name, text),
        )
        cases.append(Case(name, "empty", "empty", item, enqueue(s.db, item, app=s.app), text))

    def source(name: str, kind: str, where: str, words: str) -> None:
        item = add_item(s.db, kind=kind, title=name, content="", source=where)
        cases.append(Case(name, "failed", words, item, enqueue(s.db, item, app=s.app)))

    def task(name: str, words: str, task: str, *args: Any, **kwargs: Any) -> None:
        cases.append(
            Case(
                name,
                "refused",
                words,
                task_id=s.app.send_task(task, args=list(args), kwargs=kwargs).id,
            )
        )

    rng = random.Random(SEED + 4)
    raw_note("empty note", "")
    raw_note("white space only", " \n\n\t  \n" * 1000)
    big, size = [], 0
    while size < BIG_NOTE:
        part = paragraph(rng, f"big{len(big)}", 4000) + "\n\n"
        if len(big) % 50 == 0:
            part = f"## Big section {len(big)}\n\n" + part
        big.append(part)
        size += len(part)
    note("20 MB note", "".join(big))
    note("1 MB line without a space", "abcdefghij" * 100_000)
    note("NUL bytes", "A note\x00with NUL\x00 bytes in it. " * 200)
    note(
        "deeply nested Markdown",
        "".join(">" * d + f" quote {d}\n" for d in range(1, 400))
        + "\n"
        + "".join("  " * d + f"- item {d}\n" for d in range(400))
        + "\n"
        + "*" * 5000
        + "_" * 5000
        + "[" * 3000
        + "]" * 3000,
    )
    note(
        "10,000 headings",
        "".join(f"{'#' * (1 + h % 6)} Heading {h}\n\nBody {h}.\n\n" for h in range(10_000)),
    )
    note(
        "a fence never closed",
        "Intro.\n\n```python\n" + "".join(f"line_{n} = {n} * 2\n" for n in range(4000)),
    )
    (root / "latin1.md").write_bytes("Caf\xe9 cr\xe8me, not UTF-8.\n".encode("latin-1") * 50)
    source("invalid UTF-8 in a file", "file", str(root / "latin1.md"), "is not UTF-8 text")
    (root / "binary.md").write_bytes(b"\x00\x01\x02binary\x00" * 100)
    source("NUL bytes in a file", "file", str(root / "binary.md"), "binary")
    (root / "empty.md").write_bytes(b"")
    source("an empty file", "file", str(root / "empty.md"), "the file is empty")
    source("a file outside the roots", "file", "/etc/hostname", "outside the allowed folders")
    (root / "escape.md").symlink_to("/etc/passwd")
    source("a symlink out of the roots", "file", str(root / "escape.md"), "outside the allowed")
    source("a file that is not there", "file", str(root / "missing.md"), "no such file")
    source(
        "a URL to a refused address",
        "url",
        f"{s.standin.base_url}/embeddings",
        "is not a public address",
    )
    source(
        "a URL to the metadata service",
        "url",
        "http://169.254.169.254/latest/meta-data/",
        "is not a public address",
    )
    source("a URL that is not http", "url", "file:///etc/passwd", "http")
    must = "the item id must be a positive integer, not "
    task("a non-integer item id", must + "'abc'", "GenerateEmbedding", "abc")
    task("a negative item id", must + "-7", "GenerateEmbedding", -7)
    task("a fractional item id", must + "1.5", "GenerateEmbedding", 1.5)
    task("a boolean item id", must + "True", "GenerateEmbedding", True)
    task("no item id", "item_id", "GenerateEmbedding")
    task(
        "an unknown task argument",
        "unexpected keyword argument 'colour'",
        "GenerateEmbedding",
        cases[0].item,
        colour="red",
    )
    task("an unknown task", "NoSuchTask", "NoSuchTask", 1)
    marker = root.parent / "pickle-ran"
    pickled = send_pickle(url, "GenerateEmbedding", [cases[2].item], {"reason": Opener(marker)})
    cases.append(
        Case(
            "a pickle-serialised message",
            "logged",
            "untrusted content of type pickle",
            task_id=pickled,
            mark=marker.name,
        )
    )
    garbled = send_raw_json(url, b"{this is not json")
    cases.append(
        Case(
            "a message whose JSON does not parse",
            "logged",
            "can't decode",
            task_id=garbled,
            mark=garbled,
        )
    )
    return cases


def test_hostile_input_gets_a_clear_error_or_a_correct_index_and_the_worker_serves_on(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    env = {"KIDX_FILES__ROOTS": str(root), "KIDX_EMBEDDING__BATCH_SIZE": "64"}
    faults, lost, checked = 0, 0, 0
    try:
        with fault_stack(tmp_path, env=env) as s:
            control_text = "# Control\n\n" + "\n\n".join(
                paragraph(random.Random(SEED), f"control{p}", 600) for p in range(5)
            )
            control = s.note("Control", control_text)
            s.app.AsyncResult(enqueue(s.db, control, app=s.app)).get(timeout=60)
            before = snapshot(s.db, control)
            cases = hostile_cases(s, root)
            faults = len(cases)
            assert faults >= 15
            outcomes = {c.name: outcome(s, c) for c in cases}
            lost = sum(1 for v in outcomes.values() if v != "ok")
            assert {k: v for k, v in outcomes.items() if v != "ok"} == {}
            assert not (tmp_path / "pickle-ran").exists()  # the pickle was never loaded
            # What was indexed carries the provider's vector for each chunk's embedder input.
            served = {text_hash(t): t for t in s.standin.texts}
            indexed = [c.item for c in cases if c.expect == "indexed" and c.item is not None]
            assert vector_problems(s.db, served, indexed) == []
            # Nothing else was touched; the worker serves on, with both its processes.
            assert snapshot(s.db, control) == before
            assert store_problems(s.db) == []
            after = s.note("After the storm", "An ordinary note, sent after every bad one.")
            assert (
                s.app.AsyncResult(enqueue(s.db, after, app=s.app)).get(timeout=60)["status"]
                == "indexed"
            )
            wait_for(lambda: two_pool_processes(s.worker), 30, "two pool processes")
            checked = len(cases) + 2
    finally:
        record("hostile input", faults=faults, checked=checked, lost=lost)


def snapshot(db: Any, item: int) -> list[tuple[Any, ...]]:
    return db.all(
        "SELECT c.id, c.chunk_index, c.start_offset, c.end_offset, c.content, e.vector, "
        "v.embedding FROM note_chunks c JOIN note_chunk_embeddings e ON e.chunk_id = c.id "
        "JOIN vec_chunk_embeddings v ON v.chunk_id = c.id WHERE c.item_id = ? "
        "ORDER BY c.chunk_index",
        (item,),
    )


def outcome(s: FaultStack, case: Case) -> str:
    """'ok', or what went wrong with this case."""
    if case.expect == "logged":
        wait_for(lambda: case.mark in s.worker.log, 30, f"the worker to log {case.name}")
        lines = [x for x in log_lines(s.worker.log) if case.mark in x["event"]]
        said = " ".join(json.dumps(x) for x in lines).lower()
        ran = s.db.scalar("SELECT count(*) FROM index_jobs WHERE task_id = ?", (case.task_id,))
        if ran or case.words not in said:
            return f"ran {ran} times; the log says: {said[:300]}"
        return "ok"
    result = s.app.AsyncResult(case.task_id)
    value = result.get(timeout=LONG, propagate=False)
    if case.expect == "refused":
        if result.state != "FAILURE" or case.words not in str(value):
            return f"{result.state}: {value!r}"[:300]
        return "ok"
    state = s.db.one(
        "SELECT status, last_error FROM item_index_state WHERE item_id = ?", (case.item,)
    )
    chunks = s.db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (case.item,))
    if case.expect == "failed":
        if state is None or state[0] != "failed" or case.words not in (state[1] or ""):
            return f"state {state}"
        if result.state != "FAILURE" or case.words not in str(value):
            return f"{result.state}: {value!r}"[:300]
        return "ok" if chunks == 0 else f"{chunks} chunks written"
    if case.expect == "empty":  # nothing to index: a clear refusal, or indexed with no chunk
        refused = state and state[0] == "failed" and "empty" in (state[1] or "")
        nothing = state and state[0] == "indexed" and chunks == 0
        return "ok" if refused or nothing else f"state {state}, {chunks} chunks"
    assert case.text is not None
    if state is None or state[0] != "indexed" or result.state != "SUCCESS":
        return f"state {state}, task {result.state}: {value!r}"[:300]
    problems = slice_problems(s.db, case.item, case.text)
    return "ok" if problems == [] and chunks > 0 else f"{chunks} chunks: {problems}"


def test_hostile_an_item_id_beyond_64_bits_gets_the_one_line_failure(tmp_path):
    with fault_stack(tmp_path, workers=("hostile2",)) as s:
        result = s.app.send_task("GenerateEmbedding", args=[2**70])
        value = result.get(timeout=60, propagate=False)
        assert result.state == "FAILURE"
        assert re.fullmatch(rf"item {2**70}: .+ \(after \d+\.\d s\)", str(value)), repr(value)


# -- security -------------------------------------------------------------------------------


def test_security_pickle_refused_flower_closed_and_no_secret_in_any_log(tmp_path):
    faults, checked = 0, 0
    try:
        with fault_stack(tmp_path, workers=("secure1",)) as s:
            port = free_port()
            flower = start_flower(s.env, s.tmp, port)
            try:
                base = f"http://127.0.0.1:{port}"
                # A pickle message is refused by the worker, not loaded, not run.
                marker = tmp_path / "pickle-ran"
                item = s.note("Target of a pickle", "A note that a pickle message names.")
                pickled = send_pickle(
                    broker_url(FAULT_DB), "GenerateEmbedding", [item], {"reason": Opener(marker)}
                )
                faults += 1
                # Celery's line names no task id, but quotes the body (and so the marker's name).
                wait_for(lambda: marker.name in s.worker.log, 30, "the worker to see the message")
                said = [x for x in log_lines(s.worker.log) if marker.name in x["event"]]
                assert said and all(x["level"] in ("error", "warning", "critical") for x in said)
                assert "untrusted content of type pickle" in json.dumps(said)
                assert not marker.exists()
                assert (
                    s.db.scalar("SELECT count(*) FROM index_jobs WHERE task_id = ?", (pickled,))
                    == 0
                )
                assert s.state(item)["status"] == "pending"
                assert s.app.AsyncResult(pickled).state == "PENDING"  # nothing stored
                # Flower: closed without the credentials, everywhere.
                for method, path in (
                    ("GET", "/"),
                    ("GET", "/tasks"),
                    ("GET", "/api/tasks"),
                    ("GET", "/api/workers"),
                    ("GET", f"/api/task/info/{pickled}"),
                    ("POST", f"/api/task/revoke/{pickled}"),
                    ("POST", "/api/task/async-apply/GenerateEmbedding"),
                ):
                    for auth in (None, (FLOWER_USER, "wrong"), ("intruder", FLOWER_PASSWORD)):
                        r = httpx.request(method, base + path, auth=auth, timeout=5)
                        assert r.status_code == 401, (method, path, auth, r.status_code)
                        faults += 1
                ok = httpx.get(f"{base}/api/tasks", auth=(FLOWER_USER, FLOWER_PASSWORD), timeout=5)
                assert ok.status_code == 200
                # Flower got its credentials in its environment, not on its command line.
                cmdline = Path(f"/proc/{flower.popen.pid}/cmdline").read_bytes().decode()
                assert "flower" in cmdline and FLOWER_PASSWORD not in cmdline
                # Secrets that reach a log call are masked: the provider quotes the key back,
                # a client puts the password in a URL.
                s.standin.fail_status, s.standin.error_code = 401, API_KEY
                quoted = s.note("Quoted key", "The provider's refusal quotes the API key.")
                with pytest.raises(Exception, match="HTTP 401"):
                    s.app.AsyncResult(enqueue(s.db, quoted, app=s.app)).get(timeout=60)
                s.standin.reset()
                faults += 1
                r = httpx.get(f"{base}/api/tasks", params={"password": FLOWER_PASSWORD}, timeout=5)
                assert r.status_code == 401
                faults += 1
                worker_log, flower_log = s.worker.log, flower.log
                refusal = [
                    x
                    for x in log_lines(worker_log)
                    if x.get("item_id") == quoted and x["level"] == "error"
                ]
                assert refusal and "***" in json.dumps(refusal)  # it was there, and masked
                for name, log in (("worker", worker_log), ("flower", flower_log)):
                    assert API_KEY not in log, f"the API key is in the {name} log"
                    assert FLOWER_PASSWORD not in log, f"the Flower password is in the {name} log"
                checked = 2
            finally:
                flower.stop()
    finally:
        record("security", faults=faults, checked=checked)


def test_security_the_api_key_is_not_stored_in_errors(tmp_path):
    with fault_stack(tmp_path, workers=("secure2",)) as s:
        s.standin.fail_status, s.standin.error_code = 401, API_KEY
        item = s.note("Quoted key", "The provider's refusal quotes the API key.")
        result = s.app.AsyncResult(enqueue(s.db, item, app=s.app))
        with pytest.raises(Exception, match="HTTP 401"):
            result.get(timeout=60)
        stored = [
            str(result.result),
            s.db.scalar("SELECT last_error FROM item_index_state WHERE item_id = ?", (item,)),
            s.db.scalar("SELECT error FROM index_jobs WHERE task_id = ?", (result.id,)),
        ]
        assert all("HTTP 401" in x for x in stored)
        assert not [x for x in stored if API_KEY in x]
