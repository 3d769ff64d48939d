"""The sweeps against values a host application wrote with plain SQL (tests/host.py: its own
process, foreign keys off): each case below crashed a sweep, every time it ran, or was not
reported. A real SQLite file with sqlite-vec; the provider is the stand-in over HTTP."""

from __future__ import annotations

import pytest

from conftest import mirror_problems
from host import host
from tasks.producer import delete_item
from worker.bulk import index_item
from worker.errors import InvalidInput
from worker.reconcile import (
    due_retries,
    last_sweeps,
    mark_overrun,
    queued_jobs,
    reconcile,
    record_sweep,
)
from worker.store import connect
from worker.store.db import Database
from worker.store.items import add_item
from worker.store.vec import VEC_TABLES, vec_behind

CURSOR = "vec_verified:vec_chunk_embeddings"


@pytest.mark.parametrize("value", ["--5", "²"])
def test_a_verify_cursor_a_host_wrote_is_started_over_never_a_crash(db: Database, value):
    """`_verify` took any string that was digits once its leading `-`s were stripped for a
    number: `int('--5')` and `int('²')` (a digit to `str.isdigit`) raised ValueError, which no
    one caught: every reconcile sweep crashed until the row went."""
    add_item(db, kind="note", title="A note", content="Some text.")
    host(db.path, ("INSERT INTO index_meta(key, value) VALUES (?, ?)", [CURSOR, value]))
    drift = reconcile(db, model="standin-embed", max_items=10)
    assert drift.repaired["replaced"] == {}
    # read from the first key: every row was compared, so the cursor starts over
    assert db.scalar("SELECT value FROM index_meta WHERE key = ?", (CURSOR,)) is None


def test_a_failed_item_whose_updated_at_is_not_a_time_is_not_due_never_a_crash(db: Database):
    """`due_retries` compared the wait (NULL: julianday of a host's text) with the backoff:
    TypeError, and the retry sweep crashed every time. Such a wait is unknown: the item is
    due (it rested failed for good before; tests/test_time_columns_audit.py)."""
    bad, good = (add_item(db, kind="note", title=t, content="Text.") for t in ("bad", "good"))
    host(
        db.path,
        (
            "UPDATE item_index_state SET status = 'failed', attempts = 1, "
            "updated_at = '2000-01-01T00:00:00Z' WHERE item_id = ?",
            [good],
        ),
        (
            "UPDATE item_index_state SET status = 'failed', attempts = 1, updated_at = 'soon' "
            "WHERE item_id = ?",
            [bad],
        ),
    )
    assert due_retries(db, max_attempts=5, backoff=60.0, backoff_max=3600.0) == [bad, good]


def test_last_sweeps_skips_what_is_not_a_sweep_record(db: Database):
    """`kidx status` and `kidx doctor` read every `last_%` row of index_meta as a sweep's JSON
    object: a host's row there (`_` is LIKE's any character: `lastly` matched too) that is not
    JSON, or not an object, crashed both (JSONDecodeError; `.get` of a list)."""
    record_sweep(db, "retry_sweep", {"sent": 2})
    host(
        db.path,
        ("INSERT INTO index_meta(key, value) VALUES ('last_reconcile', 'yesterday')", []),
        ("INSERT INTO index_meta(key, value) VALUES ('lastly', '[1, 2]')", []),
        ("INSERT INTO index_meta(key, value) VALUES ('last_seen', '3')", []),
        ("INSERT INTO index_meta(key, value) VALUES ('last_deep', ?)", ["[" * 100_000]),
    )
    sweeps = last_sweeps(db)
    assert list(sweeps) == ["retry_sweep"] and sweeps["retry_sweep"]["sent"] == 2


def test_queued_jobs_are_task_ids_a_broker_can_hold(db: Database):
    """A queued row whose task id a host wrote as a BLOB came back as bytes, and the reconcile
    sweep's look into the broker (scheduler.tasks._lost_jobs: `job.split(":")`) crashed on it
    every time: no lost task was ever marked again; as TEXT that is not UTF-8, apsw's read
    raised UnicodeDecodeError. Only a UTF-8 text id can be a Celery task's."""
    host(
        db.path,
        *(
            (
                "INSERT INTO index_jobs(task_id, attempt, task_name, item_id, state, queued_at) "
                f"VALUES ({sql}, 0, 'kidx.index_item', 1, 'queued', '2000-01-01T00:00:00Z')",
                [task_id],
            )
            for sql, task_id in (
                ("?", {"hex": "01ff"}),
                ("CAST(? AS TEXT)", {"hex": "ff41"}),
                ("?", "a-task-id"),
            )
        ),
    )
    assert queued_jobs(db, older_than=120.0) == ["a-task-id"]


NOT_UTF8 = {"hex": "ff41"}  # bound as a BLOB, stored by CAST(? AS TEXT): TEXT apsw cannot read


def test_bookkeeping_text_that_is_not_utf8_is_read_as_no_value_never_a_crash(db: Database):
    """TEXT that is not UTF-8 (a C host's bytes) raised UnicodeDecodeError where the sweep
    read it: a verify cursor (every reconcile sweep), a sweep record (`kidx status`, `kidx
    doctor`), a job's item id (the busy items of every reconcile sweep)."""
    item = add_item(db, kind="note", title="A note", content="Some text.")
    record_sweep(db, "retry_sweep", {"sent": 1})
    host(
        db.path,
        ("INSERT INTO index_meta(key, value) VALUES (?, CAST(? AS TEXT))", [CURSOR, NOT_UTF8]),
        ("INSERT INTO index_meta(key, value) VALUES ('last_x', CAST(? AS TEXT))", [NOT_UTF8]),
        (
            "INSERT INTO index_meta(key, value) VALUES (CAST(? AS TEXT), '{}')",
            [{"hex": "6c6173745fff"}],
        ),
        (
            "INSERT INTO index_jobs(task_id, attempt, task_name, item_id, state, queued_at) "
            "VALUES ('t', 0, 'kidx.index_item', CAST(? AS TEXT), 'queued', "
            "strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))",
            [NOT_UTF8],
        ),
    )
    drift = reconcile(db, model="standin-embed", max_items=10)
    assert drift.to_index == [item] and drift.busy == 0
    assert db.scalar("SELECT count(*) FROM index_meta WHERE key = ?", (CURSOR,)) == 0
    assert list(last_sweeps(db)) == ["retry_sweep"]


def test_a_sweep_that_rebuilt_the_vec_tables_says_so(db: Database, embedder, emb_settings):
    """Vectors written by a process without sqlite-vec leave the database `vec_behind`; the
    sweep rebuilds every vec table from the relational vectors, and its summary (`kidx
    status`, the task's result) said nothing was repaired: the whole rebuild was in a
    RepairReport field (`rebuilt`) the sweep never reported."""
    first = add_item(db, kind="note", title="First", content="Zebras cross the plains.")
    index_item(db, first, embedder=embedder)
    bare = connect(db.path, embedding=emb_settings, vec=False)
    try:
        second = add_item(bare, kind="note", title="Second", content="Lava flows downhill.")
        assert index_item(bare, second, embedder=embedder).status == "indexed"
        assert vec_behind(bare)
    finally:
        bare.close()
    drift = reconcile(db, model=embedder.model_id, max_items=10)
    chunks = db.scalar("SELECT count(*) FROM note_chunk_embeddings")
    assert chunks >= 2 and mirror_problems(db) == []
    rebuilt = drift.repaired["tables_rebuilt"]
    assert rebuilt["vec_chunk_embeddings"] == rebuilt["vec_chunk_bits"] == chunks
    assert sorted(rebuilt) == sorted(t.name for t in VEC_TABLES)
    assert reconcile(db, model=embedder.model_id, max_items=10).repaired["tables_rebuilt"] == {}


def test_the_full_repair_reads_only_the_vectors_it_writes(db: Database, embedder):
    """Each sweep read every relational vector into memory (`_sweep`'s restore: a dict of all
    of them, for the chunk table and again for its bit mirror; `_verify`: each row of its
    slice), where only the missing or unlike ones are written: at 100k chunks of 1536
    dimensions, 600 MB a table every five minutes. Now a vector is read only to be written."""
    text = "\n\n".join(f"## Part {n}\n\n" + f"Sentence {n} about zebras. " * 40 for n in range(6))
    item = add_item(db, kind="note", title="Zebras", content=text)
    index_item(db, item, embedder=embedder)
    assert db.scalar("SELECT count(*) FROM note_chunk_embeddings") >= 3
    reconcile(db, model=embedder.model_id, max_items=10)  # the keyword rows' first check
    width = 4 * db.dimensions
    read: list[int] = []

    def count(cursor: object, row: tuple) -> tuple:
        read.extend(len(v) for v in row if isinstance(v, bytes) and len(v) == width)
        return row

    db.conn.row_trace = count
    try:
        clean = reconcile(db, model=embedder.model_id, max_items=10)
        assert read == [] and clean.repaired["restored"] == clean.repaired["replaced"] == {}
        chunk = db.scalar("SELECT min(chunk_id) FROM note_chunk_embeddings")
        db.execute("DELETE FROM vec_chunk_embeddings WHERE chunk_id = ?", (chunk,))
        mended = reconcile(db, model=embedder.model_id, max_items=10)
    finally:
        db.conn.row_trace = None
    assert mended.repaired["restored"] == {"vec_chunk_embeddings": 1}
    assert len(read) <= 1 and mirror_problems(db) == []


def test_an_overrun_job_a_host_wrote_in_bytes_ends_failed_never_a_crash(db: Database):
    """`mark_overrun` (run by every reconcile sweep first) read the task id, item id and batch
    id of each overrun row: TEXT that is not UTF-8 in any of them raised UnicodeDecodeError,
    the sweep crashed, and the row stayed `started` to crash the next one. The item whose run
    it was still ends failed (its run's id compared as bytes)."""
    item = add_item(db, kind="note", title="Stuck", content="Text.")
    old = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-1 day')"
    host(
        db.path,
        (
            "UPDATE item_index_state SET status = 'indexing', last_task_id = CAST(? AS TEXT) "
            "WHERE item_id = ?",
            [{"hex": "ff41"}, item],
        ),
        (
            "INSERT INTO index_jobs(task_id, attempt, task_name, item_id, state, started_at) "
            f"VALUES (CAST(? AS TEXT), 0, 'kidx.index_item', ?, 'started', {old})",
            [{"hex": "ff41"}, item],
        ),
        (
            "INSERT INTO index_jobs(task_id, attempt, task_name, item_id, batch_id, state, "
            f"started_at) VALUES ('t2', CAST(? AS TEXT), 'kidx.index_item', CAST(? AS TEXT), "
            f"CAST(? AS TEXT), 'started', {old})",
            [NOT_UTF8, NOT_UTF8, NOT_UTF8],
        ),
    )
    assert mark_overrun(db, 3600.0) == 2
    assert db.scalar("SELECT count(*) FROM index_jobs WHERE state = 'failed'") == 2
    assert db.scalar("SELECT status FROM item_index_state WHERE item_id = ?", (item,)) == "failed"


@pytest.mark.parametrize("wrong", [True, "1", 1.0, 2**64])
def test_delete_item_refuses_an_id_that_is_no_integer_and_deletes_nothing(db: Database, wrong):
    """`delete_item(db, True)` deleted item 1 (and "1" or 1.0 did too: SQLite's affinity
    makes them 1), where every send of the producer refuses them (`check_item_id`: "True would
    be item 1"); 2**64 raised a bare OverflowError. Refused now, before anything is deleted."""
    first = add_item(db, kind="note", title="Keep me", content="Text.")
    assert first == 1
    with pytest.raises(InvalidInput, match="64-bit integer"):
        delete_item(db, wrong)
    assert db.scalar("SELECT count(*) FROM knowledge_items WHERE id = 1") == 1


def test_a_job_row_without_an_item_does_not_stop_the_retry_sweep(db: Database):
    """A run of a task whose arguments were no item id records its row with no item (NULL);
    while it was queued, started or waiting for a retry, `s.item_id NOT IN (... NULL ...)`
    was NULL for every failed item: the retry sweep sent none of them (for up to the
    visibility timeout, or for good while a dead worker's row stayed `started`)."""
    item = add_item(db, kind="note", title="Failed", content="Text.")
    host(
        db.path,
        (
            "UPDATE item_index_state SET status = 'failed', attempts = 1, "
            "updated_at = '2000-01-01T00:00:00Z' WHERE item_id = ?",
            [item],
        ),
        (
            "INSERT INTO index_jobs(task_id, attempt, task_name, item_id, state, started_at) "
            "VALUES ('junk', 0, 'kidx.index_item', NULL, 'started', "
            "strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))",
            [],
        ),
    )
    assert due_retries(db, max_attempts=5, backoff=60.0, backoff_max=3600.0) == [item]


def test_a_sweep_verifies_vec_rows_for_a_bounded_time_and_goes_on_next_time(db: Database):
    """`_verify` compared 10,000 rows a table under the write lock whatever they cost: a
    lookup into vec0 reads its chunk of 1,024 vectors (2 ms a row at 1536 dimensions), and
    every writer waited 7-12 s each sweep at 100k x 1536. Past its time it stops, and the
    next sweep goes on from there."""
    import numpy as np

    from conftest import FakeEmbedder
    from worker.store import repair

    fake = FakeEmbedder()
    for n in range(6):
        index_item(
            db, add_item(db, kind="note", title=f"n{n}", content=f"Text {n}."), embedder=fake
        )
    last = db.scalar("SELECT max(chunk_id) FROM note_chunk_embeddings")
    forged = np.ones(db.dimensions, dtype="<f4").tobytes()  # written behind kidx's back
    with db.atomic():
        db.execute("DELETE FROM vec_chunk_embeddings WHERE chunk_id = ?", (last,))
        db.execute(
            "INSERT INTO vec_chunk_embeddings(chunk_id, embedding) VALUES (?, ?)", (last, forged)
        )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(repair, "VERIFY_SECONDS", 0.0)  # spent at once: one step a sweep
        mp.setattr(repair, "VERIFY_STEP", 2)
        replaced = [repair.repair_vectors(db, db.dimensions).replaced for _ in range(3)]
    assert replaced[:2] == [{}, {}]  # two rows a sweep: the forged one is the sixth
    assert replaced[2].get("vec_chunk_embeddings") == 1
    assert mirror_problems(db) == []
