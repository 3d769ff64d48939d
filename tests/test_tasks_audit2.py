"""The producer, the tasks' refusals and the queue commands as an audit found them: sends that
failed outside the broker's errors, arguments the producer took and its tasks refused, refusals
without a job row or outside their batch, ids given twice, promises the sweep does not keep,
and a read-only command that opened the store as a writer. Against a real prefork worker, the
real Redis (this test process's databases) and the `kidx` console script."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from conftest import FakeEmbedder, standin_settings
from stack import SPARE_DB, Stack, broker_url, flush, free_port, running_stack, wait_for
from tasks import producer
from worker.bulk import index_item
from worker.errors import BrokerUnavailable, InvalidInput, WrongTaskKind
from worker.providers import build_embedder
from worker.store import Database, connect, vec_table_dimensions
from worker.store.items import add_item
from worker.store.jobs import create_batch, get_batch

pytestmark = [pytest.mark.stack]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("audit2"), Stack) as s:
        yield s


def counts(db: Database) -> tuple[int, int]:
    return (
        int(db.scalar("SELECT count(*) FROM index_jobs")),
        int(db.scalar("SELECT count(*) FROM index_batches")),
    )


def error_line(result: Any) -> str:
    """The run failed with one `error:` line (besides JSON log records)."""
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, result.stderr
    assert "bug in kidx" not in result.stderr and "Traceback" not in result.stderr
    return lines[0]


def failure(result: Any) -> BaseException:
    with pytest.raises(Exception) as caught:
        result.get(timeout=60)
    assert result.state == "FAILURE"
    return caught.value


# -- 1. any failure of a send forgets its rows, and names the broker or the result backend ------


def host_app(broker: str, backend: str | None = None) -> Celery:
    return Celery("host", broker=broker, backend=backend)


def close(app: Celery) -> None:
    for name in ("_kidx_ping", "_kidx_ping_backend"):
        if (client := getattr(app, name, None)) is not None:
            client.close()
    app.close()


def send_failure_case(case: str) -> tuple[str, str | None, str]:
    """The broker, backend and message of a case, made in the test: the URLs hold this xdist
    process's database and a free port, which must stay out of the test's id (every process
    must collect the same ids)."""
    if case == "redis-py-refuses-a-parameter":
        # a query parameter redis-py does not take: TypeError, once "a bug in kidx"
        return broker_url(SPARE_DB) + "?foo=1", None, r"the broker at \S+ is not usable \(TypeError"
    if case == "backend-celery-cannot-load":
        # a backend Celery cannot load: ModuleNotFoundError
        return broker_url(SPARE_DB), "foo://bar", r"the result backend at foo://bar is not usable"
    # a result backend's Redis that is down, the broker up: asked first, within the patience
    # (its own ConnectionError, not Celery's 20 retries' RuntimeError), and named
    return (
        broker_url(SPARE_DB),
        f"redis://127.0.0.1:{free_port()}/1",
        r"the result backend at \S+ did not answer \(ConnectionError",
    )


@pytest.mark.parametrize(
    "case", ["redis-py-refuses-a-parameter", "backend-celery-cannot-load", "backend-down"]
)
def test_a_send_that_fails_for_any_reason_leaves_no_queued_row_and_names_what_failed(
    stack: Stack, case: str
) -> None:
    broker, backend, words = send_failure_case(case)
    item = stack.note("Sent", "A note whose task cannot be sent.")
    before = counts(stack.db)
    app = host_app(broker, backend)
    try:
        with pytest.raises(BrokerUnavailable, match=words) as caught:
            producer.enqueue(stack.db, item, app=app)
        assert f"item {item} is saved, and the reconcile sweep sends it" in str(caught.value)
        with pytest.raises(BrokerUnavailable, match=words):
            producer.send_batch(stack.db, [item], app=app)
    finally:
        close(app)
        flush(SPARE_DB)
    jobs, batches = counts(stack.db)
    assert jobs == before[0]  # no `queued` row left
    assert batches == before[1] + 1
    batch = get_batch(stack.db, int(stack.db.scalar("SELECT max(id) FROM index_batches")))
    assert batch is not None and batch["state"] == "aborted"


# -- 2. the producer refuses what its tasks would refuse, before any row -----------------------


def test_the_producer_refuses_what_its_tasks_refuse_before_writing_anything(
    stack: Stack, tmp_path: Path
) -> None:
    db, app = stack.db, stack.app
    note = stack.note("A note", "Its text.")
    file = add_item(db, kind="file", title="f", content="", source=str(tmp_path / "f.md"))
    items = int(db.scalar("SELECT count(*) FROM knowledge_items"))
    before = counts(db)
    bad: list[tuple[type[Exception], str, Any]] = [
        (
            InvalidInput,
            "64-bit integer, not '",
            lambda: producer.enqueue_note(db, str(note), app=app),
        ),
        (InvalidInput, "not True", lambda: producer.enqueue_note(db, True, app=app)),
        (InvalidInput, "not 1.0", lambda: producer.enqueue_note(db, 1.0, app=app)),
        (WrongTaskKind, "is a file item", lambda: producer.enqueue_note(db, file, app=app)),
        (
            WrongTaskKind,
            "is a note item",
            lambda: producer.enqueue_knowledge_item(db, note, app=app),
        ),
        (InvalidInput, "64-bit integer", lambda: producer.enqueue(db, 2**70, app=app)),
        (InvalidInput, "64-bit integer", lambda: producer.enqueue(db, None, app=app)),
        (
            InvalidInput,
            "the reason must be text",
            lambda: producer.enqueue(db, note, app=app, reason=5),
        ),
        (InvalidInput, "countdown", lambda: producer.enqueue(db, note, app=app, countdown=-5)),
        (
            InvalidInput,
            "countdown",
            lambda: producer.enqueue(db, note, app=app, countdown=float("nan")),
        ),
        (InvalidInput, "countdown", lambda: producer.enqueue(db, note, app=app, countdown=1e300)),
        (
            InvalidInput,
            "no batch with id 424242",
            lambda: producer.enqueue(db, note, app=app, batch_id=424242),
        ),
        (
            InvalidInput,
            "structure_only",
            lambda: producer.enqueue(db, note, app=app, structure_only="yes"),
        ),
        (InvalidInput, "at least one item", lambda: producer.send_batch(db, [], app=app)),
        (InvalidInput, "not True", lambda: producer.send_batch(db, [note, True], app=app)),
        (
            InvalidInput,
            "group_size",
            lambda: producer.send_batch(db, [note, file], app=app, group_size=0),
        ),
        (InvalidInput, "non-empty", lambda: producer.add_file(db, "", app=app)),
        (InvalidInput, "non-empty", lambda: producer.add_url(db, None, app=app)),
        # raised as apsw's CHECK failure, OverflowError, ValueError (a second audit)
        (
            InvalidInput,
            "kind must be one of reindex, reconcile, retry, not 'foo'",
            lambda: producer.send_batch(db, [note], app=app, kind="foo"),
        ),
        (
            InvalidInput,
            "kind must be one of",
            lambda: producer.send_batch(db, [note], app=app, kind="re\ud800"),
        ),
        (InvalidInput, "countdown", lambda: producer.enqueue(db, note, app=app, countdown=10**400)),
        (InvalidInput, "NUL", lambda: producer.add_file(db, str(tmp_path / "a\0b"), app=app)),
        (InvalidInput, "not a valid URL", lambda: producer.add_url(db, "http://x/\ud800", app=app)),
    ]
    for error, words, call in bad:
        with pytest.raises(error, match=words) as raised:
            call()
        str(raised.value).encode()  # text that can be printed and logged (no lone surrogate)
    assert counts(db) == before
    assert db.scalar("SELECT count(*) FROM knowledge_items") == items


def test_a_numpy_item_id_is_sent_as_the_integer_it_is(stack: Stack) -> None:
    """check_item_id took a numpy integer, but enqueue sent the raw value: an 8-byte BLOB
    item_id in index_jobs, and kombu's JSON refused it as a broker that did not take it."""
    import numpy as np

    db, app = stack.db, stack.app
    note = stack.note("A note", "Its text.")
    task_id = producer.enqueue(db, np.int64(note), app=app)
    row = db.one("SELECT typeof(item_id), item_id FROM index_jobs WHERE task_id = ?", (task_id,))
    assert row == ("integer", note)


# -- 3. ids given twice --------------------------------------------------------------------------


def test_an_id_given_twice_is_run_and_sent_once(stack: Stack) -> None:
    item = stack.note("Twice", "alpha text about ownership and borrowing")
    ran = stack.kidx("index", str(item), str(item), str(item), "--inline", "--json")
    assert ran.returncode == 0, ran.stderr
    results = json.loads(ran.stdout)
    assert [(r["item_id"], r["status"]) for r in results] == [(item, "indexed")]
    sent = stack.kidx("enqueue", str(item), str(item), "--json")
    assert sent.returncode == 0, sent.stderr
    tasks = json.loads(sent.stdout)
    assert [s["item_id"] for s in tasks] == [item]
    wait_for(
        lambda: (
            stack.db.scalar(
                "SELECT state FROM index_jobs WHERE task_id = ?", (tasks[0]["task_id"],)
            )
            not in (None, "queued", "started")
        ),
        60,
        "the one task to end",
    )


def test_index_all_on_an_empty_database_says_so_as_reindex_does(stack: Stack) -> None:
    env = {"KIDX_DB": str(stack.tmp / "empty.db")}
    assert stack.kidx("init", env=env).returncode == 0
    for args in (("index", "--all"), ("index", "--all", "--inline"), ("reindex", "--all")):
        assert "there are no items to index" in error_line(stack.kidx(*args, env=env))


# -- 4. a broker that is down: promise only what the sweep does -------------------------------


def test_a_refused_send_promises_the_sweep_only_for_items_it_sends(stack: Stack) -> None:
    indexed = stack.kidx("add", "note", "--title", "a", "--text", "alpha text", "--inline")
    assert indexed.returncode == 0, indexed.stderr
    done = int(indexed.stdout.split()[0])
    pending = stack.note("Pending", "A note no run has indexed yet.")
    down = {
        "KIDX_BROKER_URL": f"redis://127.0.0.1:{free_port()}/0",
        "KIDX_TASKS__BROKER_PATIENCE": "1.5",
    }
    line = error_line(stack.kidx("enqueue", str(done), env=down))
    assert f"item {done} was not sent: run the command again once the broker is back" in line
    assert "sweep" not in line
    line = error_line(stack.kidx("enqueue", str(pending), env=down))
    assert f"item {pending} is saved, and the reconcile sweep sends it" in line
    line = error_line(stack.kidx("reindex", "--all", env=down))
    batch_id = int(stack.db.scalar("SELECT max(id) FROM index_batches"))
    assert f"batch {batch_id} was aborted" in line and "sweep" not in line
    assert get_batch(stack.db, batch_id)["state"] == "aborted"  # type: ignore[index]


# -- 5, 6. refusals: a job row, the duration, and a count in their batch ------------------------


@pytest.mark.parametrize("ids", [["7"], [], 7])
def test_a_group_refused_for_its_ids_has_its_job_row_and_is_counted(
    stack: Stack, ids: object
) -> None:
    batch = create_batch(stack.db, "reindex", 1)
    result = stack.app.send_task("kidx.index_group", args=[ids], kwargs={"batch_id": batch})
    message = str(failure(result))
    assert "list of 64-bit integers" in message and "(after " in message
    row = stack.db.one(
        "SELECT item_id, batch_id, state, duration_ms, error FROM index_jobs WHERE task_id = ?",
        (result.id,),
    )
    assert row is not None and row[:3] == (None, batch, "failed") and row[3] is not None
    assert "(after " in row[4]
    assert {k: get_batch(stack.db, batch)[k] for k in ("state", "failed")} == {  # type: ignore[index]
        "state": "done",
        "failed": 1,
    }


@pytest.mark.parametrize("group", [False, True], ids=["single", "group"])
def test_a_task_refused_for_another_argument_is_counted_in_its_batch(
    stack: Stack, group: bool
) -> None:
    """Its job rows dropped the batch id: the batch never counted them, and ran for good."""
    ids = [stack.note(f"n{n}", f"Note {n}.") for n in range(2 if group else 1)]
    batch_id = create_batch(stack.db, "reindex", len(ids))
    kwargs = {"batch_id": batch_id, "reason": 5}
    if group:
        result = stack.app.send_task("kidx.index_group", args=[ids], kwargs=kwargs)
    else:
        result = stack.app.send_task("GenerateEmbedding", args=ids, kwargs=kwargs)
    assert "reason must be a string" in str(failure(result))
    batch = get_batch(stack.db, batch_id)  # counted before the task's failure was stored
    assert batch is not None
    assert (batch["state"], batch["failed"], batch["total"]) == ("done", len(ids), len(ids))
    assert stack.db.scalar(
        "SELECT count(*) FROM index_jobs WHERE batch_id = ? AND state = 'failed'", (batch_id,)
    ) == len(ids)


# -- 7. tasks that take no argument --------------------------------------------------------------


@pytest.mark.parametrize("name", ["kidx.embed_memories", "kidx.reconcile", "kidx.retry_sweep"])
def test_a_task_without_arguments_refuses_one_in_one_line(stack: Stack, name: str) -> None:
    error = failure(stack.app.send_task(name, args=[5], kwargs={"x": 1}))
    assert type(error).__name__ == "InvalidInput", repr(error)
    assert str(error) == f"{name} takes no arguments, not (5, x=...)"
    # Named as Celery's call names its first parameter: its TypeError came first.
    error = failure(stack.app.send_task(name, kwargs={"self": 1}))
    assert str(error) == f"{name} takes no arguments, not (self=...)", repr(error)


# -- 8. kidx jobs only reads --------------------------------------------------------------------


def test_kidx_jobs_keeps_the_index_during_a_model_switch(stack: Stack) -> None:
    """`kidx jobs` with the old model still configured, half-way through a switch, opened the
    store as a writer: the vec tables went back to the old dimension and the re-indexed items
    `pending`."""
    path = stack.tmp / "switch.db"
    old = standin_settings(stack.standin)  # 64 dimensions, as the stack's environment
    db = connect(path, embedding=old)
    embedder = build_embedder(old, dimensions=db.dimensions)
    assert embedder is not None
    ids = [add_item(db, kind="note", title=f"n{n}", content=f"Note {n} text.") for n in range(3)]
    for i in ids:
        index_item(db, i, embedder=embedder)
    embedder.close()
    db.close()
    db = connect(path, embedding=standin_settings(stack.standin, model="new", dimensions=32))
    index_item(db, ids[0], embedder=FakeEmbedder(32, "new"))
    db.close()

    def state() -> tuple[dict[str, int | None], list[tuple[object, ...]]]:
        bare = Database(path)
        try:
            rows = bare.all("SELECT item_id, status, dimensions FROM item_index_state")
            return vec_table_dimensions(bare), rows
        finally:
            bare.close()

    before = state()
    assert set(before[0].values()) == {32}
    ran = stack.kidx("jobs", env={"KIDX_DB": str(path)})
    assert ran.returncode == 0, ran.stderr
    assert state() == before


# -- 10. the small ones --------------------------------------------------------------------------


@pytest.mark.parametrize("task_id", ["", ":", "abc:", ":5", " x"])
def test_cancel_refuses_an_empty_or_malformed_id(stack: Stack, task_id: str) -> None:
    assert "not a task id" in error_line(stack.kidx("cancel", task_id))


def test_reindex_wait_says_it_timed_out(stack: Stack) -> None:
    """No worker on this broker: the batch is still running when the timeout passes."""
    env = {"KIDX_DB": str(stack.tmp / "timeout.db"), "KIDX_BROKER_URL": broker_url(SPARE_DB)}
    try:
        assert stack.kidx("init", env=env).returncode == 0
        assert stack.kidx("add", "note", "--title", "t", "--text", "x y", env=env).returncode == 0
        ran = stack.kidx("reindex", "--all", "--wait", "--timeout", "0.2", env=env)
        assert ran.returncode == 1, ran.stderr
        assert "running" in ran.stdout and "stopped waiting after 0.2 s (--timeout)" in ran.stdout
        ran = stack.kidx("reindex", "--all", "--wait", "--timeout", "0.2", "--json", env=env)
        assert ran.returncode == 1 and json.loads(ran.stdout)["timed_out"] is True
    finally:
        flush(SPARE_DB)


def test_adding_a_file_again_with_a_title_takes_the_title(stack: Stack) -> None:
    root = stack.tmp / "files"
    root.mkdir(exist_ok=True)
    (root / "f.md").write_text("# Title\n\nSome text about traits.\n")
    env = {"KIDX_FILES__ROOTS": str(root)}
    ids = []
    for title in ("Old", "New"):
        ran = stack.kidx("add", "file", str(root / "f.md"), "--title", title, "--inline", env=env)
        assert ran.returncode == 0, ran.stderr
        ids.append(int(ran.stdout.split()[0]))
    assert ids[0] == ids[1]
    assert stack.db.scalar("SELECT title FROM knowledge_items WHERE id = ?", (ids[0],)) == "New"


def test_a_retries_header_of_any_value_is_a_count_within_bounds() -> None:
    """Celery's `retries` header as a host's message may set it: what is no count is 0, a
    negative count 0 (from -1000, Celery's retry went on a thousand times), a count past the
    largest KIDX_TASKS__MAX_RETRIES that largest (10**30 could not be stored)."""
    from tasks import attempt_of
    from worker.settings import RETRIES_MAX

    for junk in ("abc", "3", [1], None, 1.0, True, {"n": 1}):
        assert attempt_of(junk) == 0, junk
    assert attempt_of(-1000) == 0
    assert attempt_of(10**30) == RETRIES_MAX
    assert [attempt_of(n) for n in range(4)] == [0, 1, 2, 3]


def test_task_arguments_are_bound_as_python_binds_them_and_what_it_refuses_is_named() -> None:
    from tasks.run import bind_arguments

    given = bind_arguments("item_id", (7, "why"), {"batch_id": 3, "colour": "red"})
    assert given == (7, "why", 3, False, (), {"colour": "red"}, [])
    twice = bind_arguments("item_id", (7,), {"item_id": 8, "structure_only": True})
    assert (twice.first, twice.structure_only, twice.twice) == (7, True, ["item_id"])
    extra = bind_arguments("item_ids", ([1], None, None, False, "x"), {})
    assert extra.extra == ("x",) and extra.first == [1]
