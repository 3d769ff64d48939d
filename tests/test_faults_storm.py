"""The fault suite, edit storm: notes edited and enqueued many times a second, with two workers
(tests/faultkit.py: the stack and the checks)."""

from __future__ import annotations

import random
import time

import pytest

from faultkit import (
    LONG,
    SEED,
    STORM_EDITS,
    STORM_NOTES,
    STORM_SECONDS,
    fault_stack,
    paragraph,
    quiet,
    sentence,
    slice_problems,
    store_problems,
    vector_problems,
)
from faults_report import record
from stack import wait_for
from tasks.producer import enqueue
from worker.chunking import text_hash
from worker.store.items import update_content

pytestmark = [pytest.mark.fault, pytest.mark.stack]


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
