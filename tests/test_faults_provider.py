"""The fault suite, the provider: chaos (a third of its answers are 500, 429 or too slow) and a
total outage for a whole batch, then its return (tests/faultkit.py: the stack and the checks)."""

from __future__ import annotations

import json
import random
import time

import pytest

from faultkit import (
    CHAOS_ITEMS,
    DIMS,
    LONG,
    OUTAGE_ITEMS,
    SEED,
    clean_problems,
    fault_stack,
    indexed_without_vectors,
    not_indexed,
    paragraph,
    quiet,
    short_note,
    statuses,
    store_problems,
)
from faults_report import record
from stack import (
    free_port,
    wait_for,
)
from tasks.producer import enqueue, send_batch
from testkit.standin import StandIn

pytestmark = [pytest.mark.fault, pytest.mark.stack]


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
            # Three failed requests stop the batch, whichever groups sent them: the item whose
            # request was the third failed, every other item was skipped.
            assert ran == 1
            assert batch["skipped"] >= OUTAGE_ITEMS - ran
            assert set(statuses(s.db, items).values()) == {"failed"}  # none left pending
            assert s.db.scalar("SELECT count(*) FROM note_chunks") == 0
            # The provider returns; `kidx retry --failed` sends them all, and all are indexed.
            standin.start()
            out = s.kidx("retry", "--failed", "--wait", "--json", timeout=LONG)
            assert out.returncode == 0, out.stderr
            retried = json.loads(out.stdout)
            assert retried["kind"] == "retry" and retried["total"] == len(items), retried
            assert retried["state"] == "done" and retried["ok"] == len(items), retried
            assert set(statuses(s.db, items).values()) == {"indexed"}
            lost = len(not_indexed(s.db, items))
            assert lost == 0
            assert store_problems(s.db) == []
            problems = [p for i in items for p in clean_problems(s.db, i, *texts[i])]
            assert problems == []
            checked = len(items)
    finally:
        record("total outage", faults=faults, checked=checked, lost=lost)
