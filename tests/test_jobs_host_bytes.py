"""A discarded task's rows as a host may have left them (any bytes in any column): a row
under the group's task id whose key is not UTF-8 text, or whose item or batch id is not an
integer, raised UnicodeDecodeError (or passed a string on as an item id) when Celery discarded
the task (`end_discarded`, a revoke before the run), and nothing of it was recorded."""

from __future__ import annotations

from host import host
from worker.store.items import add_item, get_state
from worker.store.jobs import create_batch, end_discarded, group_job_id, record_queued_many


def test_a_discarded_group_ends_its_rows_whatever_a_host_wrote_beside_them(db):
    items = [add_item(db, kind="note", title=f"n{n}", content="text") for n in range(2)]
    batch = create_batch(db, "reindex", 2)
    runs = [(group_job_id("t1", i), i) for i in items]
    record_queued_many(db, runs, "kidx.index_group", batch, "test")
    host(
        db.path,
        (
            "INSERT INTO index_jobs(task_id, attempt, task_name, item_id, batch_id, state) "
            "VALUES (CAST(x'74313aff' AS TEXT), 0, 'x', 1, ?, 'queued'), "
            "('t1:zz', 0, 'x', CAST(x'ff' AS TEXT), 'b', 'queued')",
            [batch],
        ),
    )
    assert end_discarded(db, "t1", 0, "revoked before it ran") == 4
    for item in items:
        state = get_state(db, item)
        assert state["status"] == "cancelled" and state["last_error"] == "revoked before it ran"
    states = db.all("SELECT state FROM index_jobs")
    assert states == [("revoked",)] * 4
    skipped = db.scalar("SELECT skipped FROM index_batches WHERE id = ?", (batch,))
    assert skipped == 2  # kidx's two rows; a host's row has no key to count it by


def test_a_task_id_given_again_for_another_item_is_a_new_run_counted_in_its_batch(db):
    """A host that reuses a task id (its own ids, or none: a run reads "None") started the
    second run under the first's row: the old item and batch, and `counted` set, so the new
    run was never counted and its batch stayed running for good."""
    from worker.store.jobs import JobState, batch_outcome, record_end, record_start

    first, second = (add_item(db, kind="note", title=f"n{n}", content="text") for n in range(2))
    b1, b2 = create_batch(db, "reindex", 1), create_batch(db, "reindex", 1)
    record_start(db, "None", 0, "kidx.GenerateEmbedding", first, b1, "first")
    record_end(db, "None", 0, JobState.SUCCESS, 5)
    assert batch_outcome(db, b1, "ok", None, abort_after=3, job=("None", 0))["state"] == "done"

    record_start(db, "None", 0, "kidx.GenerateEmbedding", second, b2, "second")
    row = db.one("SELECT item_id, batch_id, reason, counted, state FROM index_jobs")
    assert row == (second, b2, "second", 0, "started")
    record_end(db, "None", 0, JobState.SUCCESS, 5)
    done = batch_outcome(db, b2, "ok", None, abort_after=3, job=("None", 0))
    assert (done["state"], done["ok"]) == ("done", 1)
    # The same run met again (a redelivery) is not counted twice.
    record_start(db, "None", 0, "kidx.GenerateEmbedding", second, b2, "second")
    assert db.scalar("SELECT counted FROM index_jobs") == 1
    again = batch_outcome(db, b2, "ok", None, abort_after=3, job=("None", 0))
    assert again["ok"] == 1
