"""The write fence: a run writes nothing of an item another run has started on since this run
read it (audit: a run whose lock expired while its pool process was stopped resumed, wrote its
older chunks and, for a file, its older text over the newer index, and set the item `indexed`;
nothing ever noticed for files, URLs and code).

Two runs of the engine on two connections of a real SQLite file with sqlite-vec, the second
run made to happen at an exact step of the first: from inside the first run's embedding request
(`Interloper`, after its `indexing` mark) or right after it read the item (`after_read`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import worker.bulk
from conftest import FakeEmbedder, keyword_rows_problems, mirror_problems
from worker.bulk import index_items
from worker.chunking import text_hash
from worker.errors import Cancelled, IndexAborted, PermanentProviderError
from worker.indexers import IndexOptions
from worker.pipeline import IndexResult
from worker.settings import EmbeddingSettings, FilesSettings
from worker.sources import Reader
from worker.store import Database, connect
from worker.store.items import add_item

TEXT1 = "# Doc\n\n" + "\n\n".join(
    f"## Part {k}\n\nPart {k} alpha " + "one two three. " * 30 for k in range(4)
)
TEXT2 = "# Doc\n\n" + "\n\n".join(
    f"## Part {k}\n\nPart {k} BETA " + "four five six. " * 30 for k in range(4)
)
FILLER = "A short note that is indexed beside the item."


class Item:
    """A note or a file holding TEXT1, that `edit` turns into TEXT2 (a host's plain SQL, an
    edit on disk), and the options of a run of it under a task id."""

    def __init__(self, db: Database, kind: str, root: Path) -> None:
        self.db, self.kind, self.root = db, kind, root
        self.path = root / "doc.md"
        if kind == "file":
            self.path.write_text(TEXT1, encoding="utf-8")
            self.id = add_item(db, kind="file", title="Doc", content="", source=str(self.path))
        else:
            self.id = add_item(db, kind="note", title="Doc", content=TEXT1)

    def edit(self, conn: Database) -> None:
        if self.kind == "file":
            self.path.write_text(TEXT2, encoding="utf-8")
        else:
            conn.execute("UPDATE knowledge_items SET content = ? WHERE id = ?", (TEXT2, self.id))

    def options(self, task_id: str, **kwargs: Any) -> IndexOptions:
        return IndexOptions(
            task_id=task_id, reader=Reader(FilesSettings(roots=[self.root])), **kwargs
        )

    def stored(self) -> set[str]:
        """Which text the item's chunks are of."""
        chunks = [
            r[0]
            for r in self.db.all("SELECT content FROM note_chunks WHERE item_id = ?", (self.id,))
        ]
        assert chunks
        return {"TEXT2" if "BETA" in c else "TEXT1" if "alpha" in c else "?" for c in chunks}

    def state(self) -> tuple[Any, ...]:
        row = self.db.one(
            "SELECT status, last_task_id, indexed_hash FROM item_index_state WHERE item_id = ?",
            (self.id,),
        )
        assert row is not None
        return row


@pytest.fixture(params=["note", "file"])
def item(request: pytest.FixtureRequest, db: Database, tmp_path: Path) -> Item:
    root = tmp_path / "docs"
    root.mkdir()
    return Item(db, request.param, root)


@pytest.fixture
def other(db: Database, emb_settings: EmbeddingSettings) -> Iterator[Database]:
    """A second connection: the other run's, as another worker process has."""
    conn = connect(db.path, embedding=emb_settings)
    yield conn
    conn.close()


def second_run(item: Item, conn: Database, task_id: str) -> IndexResult | Exception:
    """The run that takes the item: the text is edited, and a run indexes it whole."""
    item.edit(conn)
    return index_items(conn, [item.id], embedder=FakeEmbedder(), options=item.options(task_id))[
        item.id
    ]


class Interloper(FakeEmbedder):
    """One text a request, so that an item of several chunks is still being embedded after its
    `indexing` mark: at the first request that finds the mark made (`marked`), `act` runs, as
    the first run's process would be stopped meanwhile. Later requests fail if `refuse`."""

    def __init__(self, marked: Callable[[], bool], act: Callable[[], None]) -> None:
        super().__init__()
        self.batch_size = 1
        self.marked, self.act = marked, act
        self.acted = False
        self.refuse = False

    def embed_batch(self, texts: list[str]) -> np.ndarray:
        if not self.acted and self.marked():
            self.acted = True
            self.act()
        if self.refuse:
            raise PermanentProviderError("refused: the stand-in says no")
        return super().embed_batch(texts)


def marked_by(conn: Database, item_id: int, task_id: str) -> Callable[[], bool]:
    def marked() -> bool:
        row = conn.one(
            "SELECT status, last_task_id FROM item_index_state WHERE item_id = ?", (item_id,)
        )
        return row == ("indexing", task_id)

    return marked


def ids_of(db: Database, item: Item, path: str) -> list[int]:
    """A run of the item alone, or of the item after another (a bulk run: the item is written
    in a shared transaction, new items together through `write_new_items`)."""
    if path == "one":
        return [item.id]
    return [add_item(db, kind="note", title="Filler", content=FILLER), item.id]


@pytest.mark.parametrize("path", ["one", "bulk"])
@pytest.mark.parametrize("second", ["t2", "t1"], ids=["another task", "a duplicate delivery"])
def test_a_run_taken_over_between_its_mark_and_its_write_writes_nothing(
    db: Database, other: Database, item: Item, path: str, second: str
) -> None:
    """The audit's interleaving: t1 marks the item, then stalls in its embedding request; the
    text is edited and t2 indexes it whole; t1 resumes. t1 writes nothing of it (no chunk, no
    text, no state) and its result says `coalesced`; the other items of its run are written.
    A duplicate delivery of t1 (same task id) is told apart by the mark's time. A retry of t1
    afterwards (same task id, next attempt) writes."""
    ids = ids_of(db, item, path)
    seen: dict[int, IndexResult | Exception] = {}

    def act() -> None:
        seen[item.id] = second_run(item, other, second)

    embedder = Interloper(marked_by(other, item.id, "t1"), act)
    results = index_items(db, ids, embedder=embedder, options=item.options("t1"))

    assert embedder.acted
    assert isinstance(seen[item.id], IndexResult) and seen[item.id].status == "indexed"
    assert item.stored() == {"TEXT2"}
    assert item.state() == ("indexed", second, text_hash(TEXT2))
    if item.kind == "file":  # the text a host reads is the newer one
        assert db.scalar("SELECT content FROM knowledge_items WHERE id = ?", (item.id,)) == TEXT2
    result = results[item.id]
    assert isinstance(result, IndexResult)
    assert result.status == "coalesced"
    assert "another run has started on the item" in (result.error or "")
    for filler in ids[:-1]:
        assert isinstance(results[filler], IndexResult) and results[filler].status == "indexed"
    assert mirror_problems(db) == [] and keyword_rows_problems(db) == []

    retry = index_items(db, [item.id], embedder=FakeEmbedder(), options=item.options("t1"))
    assert isinstance(retry[item.id], IndexResult) and retry[item.id].status == "indexed"
    assert item.state() == ("indexed", "t1", text_hash(TEXT2))


@pytest.fixture
def after_read(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str | None, int], Callable[[], None]]:
    """(task id, item id) -> what happens right after that run has read and chunked the item,
    before its `indexing` mark (once)."""
    hooks: dict[tuple[str | None, int], Callable[[], None]] = {}
    prepare = worker.bulk.prepare_item

    def prepare_then(*args: Any, **kwargs: Any) -> Any:
        work = prepare(*args, **kwargs)
        item, options = args[1], args[3]
        hook = hooks.pop((options.task_id, item.id), None)
        if hook is not None:
            hook()
        return work

    monkeypatch.setattr(worker.bulk, "prepare_item", prepare_then)
    return hooks


@pytest.mark.parametrize("path", ["one", "bulk"])
@pytest.mark.parametrize("row", [True, False], ids=["state row", "no state row"])
def test_an_item_taken_between_its_read_and_its_mark_is_read_again(
    db: Database, other: Database, item: Item, after_read: Any, path: str, row: bool
) -> None:
    """t1 read TEXT1; before its mark, the text is edited and t2 indexes it. t1's text may be
    older than t2's (here it is): t1 does not mark the item on what it read, it reads it again
    and indexes what is there now. An item with no state row yet (a host's) is fenced too: t2
    made the row in between."""
    ids = ids_of(db, item, path)
    if not row:
        db.execute("DELETE FROM item_index_state WHERE item_id = ?", (item.id,))
    seen: dict[str, IndexResult | Exception] = {}
    after_read[("t1", item.id)] = lambda: seen.setdefault("t2", second_run(item, other, "t2"))

    results = index_items(db, ids, embedder=FakeEmbedder(), options=item.options("t1"))

    assert isinstance(seen["t2"], IndexResult) and seen["t2"].status == "indexed"
    result = results[item.id]
    assert isinstance(result, IndexResult) and result.status == "indexed"
    assert item.stored() == {"TEXT2"}
    assert item.state() == ("indexed", "t1", text_hash(TEXT2))
    if item.kind == "file":
        assert db.scalar("SELECT content FROM knowledge_items WHERE id = ?", (item.id,)) == TEXT2
    assert mirror_problems(db) == [] and keyword_rows_problems(db) == []


def test_the_run_that_read_the_newer_text_is_not_fenced_out_by_an_older_one(
    db: Database, emb_settings: EmbeddingSettings, item: Item, after_read: Any
) -> None:
    """t1 read TEXT1 and stalled before its mark; the text was edited and t2 read TEXT2; then
    t1 marked and wrote, before t2 marked. Had t2 given the item up as taken, TEXT1 would stay
    for good: t2 reads the item again and indexes TEXT2. (This order also ends well without
    the fence, the last writer having read last: the test keeps the fence from breaking it.)"""
    gates = {task: (threading.Event(), threading.Event()) for task in ("t1", "t2")}
    outcomes: dict[str, Any] = {}

    def stall(task: str) -> None:
        read, go = gates[task]
        read.set()
        assert go.wait(30)

    def run(task: str) -> None:
        conn = connect(db.path, embedding=emb_settings)
        try:
            after_read[(task, item.id)] = lambda: stall(task)
            outcomes[task] = index_items(
                conn, [item.id], embedder=FakeEmbedder(), options=item.options(task)
            )[item.id]
        except Exception as e:  # shown by the assertion below
            outcomes[task] = e
        finally:
            conn.close()

    t1 = threading.Thread(target=run, args=("t1",))
    t1.start()
    assert gates["t1"][0].wait(30)
    item.edit(db)
    t2 = threading.Thread(target=run, args=("t2",))
    t2.start()
    assert gates["t2"][0].wait(30)
    gates["t1"][1].set()
    t1.join(30)
    gates["t2"][1].set()
    t2.join(30)

    assert [getattr(outcomes[t], "status", outcomes[t]) for t in ("t1", "t2")] == [
        "indexed",
        "indexed",
    ]
    assert item.stored() == {"TEXT2"}
    assert item.state() == ("indexed", "t2", text_hash(TEXT2))


def test_a_run_the_sweep_ended_as_overrun_writes_nothing(
    db: Database, other: Database, item: Item
) -> None:
    """t1 marked the item and stalled past the hard time limit; the sweep ended its job and
    its item `failed` (`mark_overrun`, same task id), for the retry sweep. t1 resumed: it does
    not write over that (its result says `coalesced`); the item stays `failed`."""
    from tasks import NOTE
    from worker.reconcile import mark_overrun
    from worker.store.jobs import record_start

    record_start(db, "t1", 0, NOTE, item.id, None, None)

    def overrun() -> None:
        other.execute("UPDATE index_jobs SET started_at = datetime('now', '-1 day')")
        assert mark_overrun(other, 60) == 1

    embedder = Interloper(marked_by(other, item.id, "t1"), overrun)
    result = index_items(db, [item.id], embedder=embedder, options=item.options("t1"))[item.id]

    assert embedder.acted
    assert isinstance(result, IndexResult) and result.status == "coalesced"
    assert db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (item.id,)) == 0
    assert db.one(
        "SELECT status, last_task_id, attempts FROM item_index_state WHERE item_id = ?",
        (item.id,),
    ) == ("failed", "t1", 1)


@pytest.mark.parametrize("ending", ["refused", "cancelled"])
def test_a_stale_runs_failure_is_not_recorded_over_the_newer_index(
    db: Database, other: Database, item: Item, ending: str
) -> None:
    """t1 marked the item, t2 took it and indexed TEXT2, then t1 failed (its provider refused)
    or was cancelled: t1's outcome is its own (the exception), the item's state t2's."""
    cancelled = threading.Event()

    def act() -> None:
        second_run(item, other, "t2")
        if ending == "refused":
            embedder.refuse = True
        else:
            cancelled.set()

    embedder = Interloper(marked_by(other, item.id, "t1"), act)
    options = item.options("t1", cancel=cancelled.is_set)
    if ending == "refused":
        outcome = index_items(db, [item.id], embedder=embedder, options=options)[item.id]
        assert isinstance(outcome, IndexAborted)
    else:
        with pytest.raises(Cancelled):
            index_items(db, [item.id], embedder=embedder, options=options)

    assert embedder.acted
    assert item.stored() == {"TEXT2"}
    assert item.state() == ("indexed", "t2", text_hash(TEXT2))


# -- through real prefork workers ----------------------------------------------------------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from stack import Stack, running_stack

    tmp = tmp_path_factory.mktemp("fencing")
    (tmp / "docs").mkdir()
    env = {"KIDX_FILES__ROOTS": str(tmp / "docs"), "KIDX_TASKS__LOCK_TTL": "3"}
    with running_stack(tmp, lambda t, si: Stack(t, si, env=env)) as s:
        yield s


@pytest.mark.stack
def test_a_pool_process_stopped_past_its_lock_does_not_write_over_the_newer_index(
    stack: Any,
) -> None:
    """The audit's repro, shorter: t1's pool process is stopped (SIGSTOP) in its embedding
    request, past its lock's TTL; the file is edited and t2 takes the item and indexes it; t1
    resumes. The index, the stored text and the state are t2's, and stay so (nothing to send
    for the sweep: a file's text is read by its runs only)."""
    import os
    import signal

    from stack import wait_for, worker_pids
    from tasks.lock import lock_key
    from tasks.producer import enqueue

    db = stack.db
    path = stack.tmp / "docs" / "doc.md"
    path.write_text(TEXT1, encoding="utf-8")
    item = add_item(db, kind="file", title="Doc", content="", source=str(path))
    stack.standin.reset()
    stack.standin.delay = 5.0  # t1's request: long enough to stop its process in it
    t1 = enqueue(db, item, app=stack.app)
    wait_for(lambda: stack.standin.requests >= 1, 30, "t1's request at the provider")
    pid = wait_for(lambda: worker_pids(stack.app).get(t1), 30, "t1's pool process")
    os.kill(pid, signal.SIGSTOP)
    try:
        if stack.standin.texts:  # answered before the stop landed: no interleaving to test
            pytest.skip("the machine was too slow to stop t1 within its request")
        key = lock_key(db.instance(), item)
        wait_for(lambda: not stack.redis.exists(key), 30, "t1's lock to expire")
        path.write_text(TEXT2, encoding="utf-8")
        stack.standin.delay = 0.0
        t2 = enqueue(db, item, app=stack.app)
        assert stack.app.AsyncResult(t2).get(timeout=60)["status"] == "indexed"
    finally:
        os.kill(pid, signal.SIGCONT)

    def ended(task_id: str) -> bool:
        states = [r[0] for r in db.all("SELECT state FROM index_jobs WHERE task_id = ?", (t1,))]
        return bool(states) and "started" not in states and "queued" not in states

    wait_for(lambda: ended(t1), 60, "t1 to end")
    chunks = [r[0] for r in db.all("SELECT content FROM note_chunks WHERE item_id = ?", (item,))]
    assert chunks and all("alpha" not in c for c in chunks), chunks
    assert db.scalar("SELECT content FROM knowledge_items WHERE id = ?", (item,)) == TEXT2
    state = db.one("SELECT status, indexed_hash FROM item_index_state WHERE item_id = ?", (item,))
    assert state == ("indexed", text_hash(TEXT2))
    assert "coalesced: not written" in stack.worker.log
    job = db.one("SELECT state FROM index_jobs WHERE task_id = ? ORDER BY attempt DESC", (t1,))
    assert job == ("coalesced",)  # not a success: it wrote nothing
