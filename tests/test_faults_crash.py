"""The fault suite, crash: pool processes killed with SIGKILL at random moments while items
are indexed, one item a task and in bulk groups (tests/faultkit.py: the stack and the checks)."""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Any

import pytest

from faultkit import (
    CRASH_ITEMS,
    CRASH_KILLS,
    LONG,
    SEED,
    FaultStack,
    clean_problems,
    fault_stack,
    indexed_count,
    not_indexed,
    pool_pids,
    scale,
    short_note,
    store_problems,
)
from faults_report import record
from stack import wait_for
from tasks.lock import lock_key
from tasks.producer import enqueue, send_batch

pytestmark = [pytest.mark.fault, pytest.mark.stack]


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
            assert not [i for i in items if s.redis.exists(lock_key(s.db.instance(), i))]
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
            assert not [i for i in items if s.redis.exists(lock_key(s.db.instance(), i))]
            assert len(task_ids) >= 2 and s.logs.count("WorkerLostError") >= 1
    finally:
        record("crash", kills=len(killed), faults=len(killed), checked=checked, lost=lost)
