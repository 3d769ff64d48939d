"""kidx's time columns against a host that writes any value in them with plain SQL (foreign
keys off), and against a machine clock that was set back: a time kidx cannot read, or one in
the future, counts as unknown in the safe direction (an item is neither hidden nor left failed
for good, nor sent on every sweep).

A real SQLite file with sqlite-vec; the host is a bare apsw connection with no kidx code."""

from __future__ import annotations

import json
import time

import apsw
import pytest

from worker.reconcile import Backoff, due_retries, mark_overrun, queued_jobs, reconcile
from worker.store import connect
from worker.store.db import Database
from worker.store.items import add_item
from worker.store.vec import config_conflict

# As the retry sweep waits: 60 s, then doubling, at most 6 h; five attempts.
BACKOFF = Backoff(max_attempts=5, backoff=60.0, backoff_max=6 * 3600.0)

# What a host (or a clock set back) may leave in a time column: no time SQLite reads, a Unix
# epoch or a negative number (julianday() reads neither), far in the future.
RECORD = "SELECT value FROM index_meta WHERE key = 'embedding_config'"
UNREADABLE = ["soon", "", 1796000000, -5, "9999-12-31T00:00:00.000Z"]


def retries(db: Database) -> list[int]:
    return due_retries(db, max_attempts=5, backoff=60.0, backoff_max=6 * 3600.0)


@pytest.mark.parametrize("when", UNREADABLE)
def test_a_failed_item_whose_time_kidx_cannot_read_is_retried_once(db, host, when):
    """A failed item's `updated_at` that is no time, or in the future, rested failed for good:
    the retry sweep never sent it again. It is due; its run writes a real time."""
    item = add_item(db, kind="note", title="Failed", content="A note that failed once.")
    spent = add_item(db, kind="note", title="Spent", content="A note out of attempts.")
    host.execute(
        "UPDATE item_index_state SET status = 'failed', attempts = 1, updated_at = ? "
        "WHERE item_id = ?",
        (when, item),
    )
    host.execute(
        "UPDATE item_index_state SET status = 'failed', attempts = 5, updated_at = ? "
        "WHERE item_id = ?",
        (when, spent),
    )
    assert retries(db) == [item]
    # once: as a run leaves it, failed just now, it waits its backoff
    host.execute(
        "UPDATE item_index_state SET attempts = 2, "
        "updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') WHERE item_id = ?",
        (item,),
    )
    assert retries(db) == []


@pytest.mark.parametrize("when", UNREADABLE)
def test_a_partial_item_whose_time_kidx_cannot_read_is_sent_again(db, host, when):
    """The reconcile sweep leaves a `partial` item to the same backoff: one with such a time
    was never sent again for its missing vectors."""
    item = add_item(db, kind="note", title="Partial", content="A note half embedded.")
    host.execute(
        "UPDATE item_index_state SET status = 'partial', attempts = 1, updated_at = ?, "
        "indexed_hash = (SELECT content_hash FROM knowledge_items WHERE id = item_id) "
        "WHERE item_id = ?",
        (when, item),
    )
    drift = reconcile(db, model="standin-embed", max_items=100, backoff=BACKOFF)
    assert drift.to_index == [item]


FUTURE = ["9999-12-31T00:00:00.000Z", "2027-12-07T10:00Z"]  # a host's; a clock set back a year


@pytest.mark.parametrize("when", FUTURE)
@pytest.mark.parametrize("state", ["started", "queued"])
def test_a_run_recorded_in_the_future_does_not_hide_its_item(db, host, when, state):
    """A job row `started` or `queued` at a time in the future (a host's, or written before
    the clock was set back) had a negative age: younger than any horizon, its item was taken
    for busy by both sweeps until that time came (year 9999: for good), and no sweep ended the
    row (`mark_overrun`, `queued_jobs`: older than never)."""
    item = add_item(db, kind="note", title="Hidden", content="A note never indexed.")
    running = add_item(db, kind="note", title="Running", content="A note being indexed.")
    column = "started_at" if state == "started" else "queued_at"
    host.execute(
        f"INSERT INTO index_jobs(task_id, attempt, task_name, item_id, state, {column}) "
        f"VALUES ('t-1', 0, 'kidx.index_item', ?, ?, ?)",
        (item, state, when),
    )
    # (the other side: a run a few seconds ahead, a clock set back a little, is under way)
    host.execute(
        f"INSERT INTO index_jobs(task_id, attempt, task_name, item_id, state, {column}) "
        f"VALUES ('t-2', 0, 'kidx.index_item', ?, ?, "
        "strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '+5 seconds'))",
        (running, state),
    )
    drift = reconcile(db, model="standin-embed", max_items=100, backoff=BACKOFF)
    assert drift.to_index == [item]
    if state == "started":
        assert mark_overrun(db, 600.0) == 1
        assert db.scalar("SELECT state FROM index_jobs WHERE task_id = 't-1'") == "failed"
    else:
        assert queued_jobs(db, older_than=120.0) == ["t-1"]


@pytest.mark.parametrize("when", ["soon", "", 1796000000, -5])
def test_a_run_whose_time_is_no_time_is_ended_not_left_for_good(db, host, when):
    """A `started` row whose `started_at` SQLite cannot read was never an overrun, and a
    `queued` one's `queued_at` never old enough to look for in the broker: both stayed as they
    were for good (their batch running for good). The sweep ends the one, asks the broker of
    the other."""
    host.execute(
        "INSERT INTO index_jobs(task_id, attempt, task_name, item_id, state, started_at) "
        "VALUES ('t-1', 0, 'kidx.index_item', 1, 'started', ?)",
        (when,),
    )
    host.execute(
        "INSERT INTO index_jobs(task_id, attempt, task_name, item_id, state, queued_at) "
        "VALUES ('t-2', 0, 'kidx.index_item', 2, 'queued', ?)",
        (when,),
    )
    assert mark_overrun(db, 600.0) == 1
    assert db.scalar("SELECT state FROM index_jobs WHERE task_id = 't-1'") == "failed"
    assert queued_jobs(db, older_than=120.0) == ["t-2"]


@pytest.mark.parametrize("at", [253402214400.0, "Infinity", "year"])
def test_a_model_record_claimed_in_the_future_does_not_refuse_every_new_worker(
    db_path, emb_settings, at
):
    """`embedding_config`'s `at` (when the index was claimed, time.time()) later than a
    worker's start means a process of the old model claimed it after that worker read its
    settings: the worker leaves the index and refuses. One in the future (a clock set back
    since, a host's year 9999, JSON's Infinity) made every worker started before that time
    refuse to write, the index kept for the old model: none could be started that indexed."""
    connect(db_path, embedding=emb_settings).close()
    value = f'{{"model": "m-old", "dimensions": 64, "at": {at}}}'
    if at == "year":  # a clock set back a year since the old model's process claimed it
        value = value.replace("year", str(time.time() + 365 * 86400))
    host = apsw.Connection(str(db_path))
    host.execute("UPDATE index_meta SET value = ? WHERE key = 'embedding_config'", (value,))
    host.close()
    worker = connect(db_path, embedding=emb_settings, configured_at=time.time())
    try:
        assert config_conflict(worker) is None
        assert json.loads(worker.scalar(RECORD))["model"] == emb_settings.model
    finally:
        worker.close()


@pytest.mark.parametrize("when", FUTURE)
def test_an_item_marked_indexing_in_the_future_is_not_taken_for_a_run_for_good(db, host, when):
    """Without a look at the item locks (`locked` None), an `indexing` mark younger than the
    horizon is a run under way: one in the future was young until then, the item never sent
    again. One a few seconds ahead is still a run under way."""
    item = add_item(db, kind="note", title="Left", content="A note a dead run left.")
    running = add_item(db, kind="note", title="Running", content="A note being indexed.")
    host.execute(
        "UPDATE item_index_state SET status = 'indexing', updated_at = ? WHERE item_id = ?",
        (when, item),
    )
    host.execute(
        "UPDATE item_index_state SET status = 'indexing', "
        "updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '+5 seconds') WHERE item_id = ?",
        (running,),
    )
    drift = reconcile(db, model="standin-embed", max_items=100, backoff=BACKOFF)
    assert drift.found["interrupted"] == [item] and drift.to_index == [item]


@pytest.mark.parametrize("when", ["9999-12-31T00:00:00.000Z", "soon", 1796000000])
def test_kidx_doctor_calls_a_run_or_a_mark_at_no_time_or_in_the_future_stuck(
    db, host, emb_settings, when
):
    """`kidx doctor`'s stuck line took a time in the future for younger than the limit and a
    time SQLite cannot read for none: such a run, or an item left `indexing` so, was never
    named, while the sweeps end them as overruns. A run a few seconds ahead is under way."""
    from ops.doctor import Fail, check_stuck
    from worker.settings import load_settings

    run, mark, ahead = (
        add_item(db, kind="note", title=t, content="A note.") for t in ("run", "mark", "ahead")
    )
    host.execute(
        "INSERT INTO index_jobs(task_id, attempt, task_name, item_id, state, started_at) "
        "VALUES ('t-1', 0, 'kidx.index_item', ?, 'started', ?), "
        "('t-2', 0, 'kidx.index_item', ?, 'started', "
        "strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '+5 seconds'))",
        (run, when, ahead),
    )
    host.execute(
        "UPDATE item_index_state SET status = 'indexing', updated_at = ? WHERE item_id = ?",
        (when, mark),
    )
    settings = load_settings(db=db.path, embedding=emb_settings)
    with pytest.raises(Fail) as stuck:
        check_stuck(settings, 5.0)
    assert str(stuck.value).endswith(f"items {run} {mark}"), stuck.value
    assert "1 run started and 1 item indexing" in str(stuck.value)
