"""The one run path (tasks/run.py) in-process: a real SQLite file, the real Redis (database 3)
for the locks and revokes, a recording fake embedder, and a stand-in for the Celery task that
records what the run asks of it. The same path, against real workers, is tests/test_queue.py,
tests/test_groups.py and the fault suite."""

from __future__ import annotations

import json
import math
import os
import signal
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import structlog
from celery.exceptions import Ignore
from celery.signals import before_task_publish

from conftest import FakeEmbedder
from stack import REDIS_DB, broker_url, flush
from tasks import GROUP, NOTE
from tasks.cancel import TERMINATED, RunScope, mark_revoked, reset
from tasks.group import GroupRun
from tasks.index import SingleRun
from tasks.lock import LockSet, rerun_key
from tasks.run import (
    IndexFailed,
    backoff,
    bad_arguments,
    changed,
    longest_countdown,
    stored_reason,
)
from tasks.runtime import Runtime
from tasks.streak import SharedStreak, streak_key
from worker.app import create_app
from worker.errors import PermanentProviderError, TransientProviderError
from worker.log import Redact
from worker.pipeline import IndexResult
from worker.providers.http import RetryLater
from worker.settings import FilesSettings, load_settings
from worker.sources import Reader
from worker.store.db import Database
from worker.store.items import Status, add_item, get_state, set_state, update_content
from worker.store.jobs import create_batch, get_batch, record_starts
from worker.store.schema import migrate

RUN_DB = REDIS_DB  # this process's Redis database (tests/stack.py)

# Every item's result, whatever befell it, has the fields of an indexed one (DESIGN §4).
RESULT_FIELDS = set(IndexResult(0, "indexed").as_dict())


class Retried(Exception):
    """What the stand-in task's retry() returns, for the run to raise."""


class FakeTask:
    """What the run asks of a Celery task, recorded."""

    def __init__(self, app: Any, name: str) -> None:
        self.app, self.name = app, name
        self.request = SimpleNamespace(id=str(uuid.uuid4()), retries=0)
        self.revoked: list[str] = []
        self.events: list[str] = []
        self.retried: list[float] = []
        self.backend = SimpleNamespace(
            mark_as_revoked=lambda task_id, *a, **k: self.revoked.append(task_id)
        )

    def send_event(self, name: str, **_: Any) -> None:
        self.events.append(name)

    def retry(self, *, exc: Exception, countdown: float, max_retries: int) -> Retried:
        self.retried.append(countdown)
        return Retried(str(exc))


class Flaky(FakeEmbedder):
    """Fails every request while `down` (a provider that may recover)."""

    down = False

    def embed_batch(self, texts: list[str]) -> Any:
        if self.down:
            self.calls.append(list(texts))
            raise TransientProviderError("the stand-in provider is down for now")
        return super().embed_batch(texts)


@pytest.fixture
def rt(db, emb_settings) -> Iterator[Runtime]:
    flush(RUN_DB)
    settings = load_settings(
        db=db.path,
        broker_url=broker_url(RUN_DB),
        embedding=emb_settings.model_dump(),
        tasks={"max_retries": 1},
    )
    client = redis.Redis.from_url(broker_url(RUN_DB))
    runtime = Runtime(
        settings=settings,
        db=db,
        embedder=Flaky(),
        chat=None,
        reader=Reader(),
        redis=client,
        scope=RunScope(),
        redact=Redact(["sk-test-key-not-for-logs"]),
        pid=os.getpid(),
    )
    runtime.app = create_app(settings)  # type: ignore[attr-defined]
    yield runtime
    runtime.app.close()  # type: ignore[attr-defined]
    client.close()
    flush(RUN_DB)


def notes(db: Any, n: int, word: str = "note") -> list[int]:
    return [
        add_item(db, kind="note", title=f"{word} {k}", content=f"# {word} {k}\n\n" + "Words. " * 60)
        for k in range(n)
    ]


def group(rt: Runtime, ids: list[int], batch_id: int | None = None) -> tuple[GroupRun, FakeTask]:
    task = FakeTask(rt.app, GROUP)  # type: ignore[attr-defined]
    run = GroupRun(
        task,
        rt,
        ids,
        reason="test",
        batch_id=batch_id,
        structure_only=False,
        started=time.monotonic(),
    )
    record_starts(rt.db, [(run.job(i)[0], i) for i in run.ids], GROUP, batch_id, "test")
    return run, task


def single(
    rt: Runtime,
    item_id: int,
    batch_id: int | None = None,
    task_id: str | None = None,
    attempt: int = 0,
) -> tuple[SingleRun, FakeTask]:
    """The single-item task's run; `task_id`, `attempt`: a redelivery or a retry of one."""
    from worker.store.jobs import record_start

    task = FakeTask(rt.app, NOTE)  # type: ignore[attr-defined]
    task.request.id = task_id or task.request.id
    task.request.retries = attempt
    run = SingleRun(
        task,
        rt,
        [item_id],
        reason="test",
        batch_id=batch_id,
        structure_only=False,
        started=time.monotonic(),
        kinds=frozenset({"note"}),
    )
    record_start(rt.db, run.task_id, attempt, NOTE, item_id, batch_id, "test")
    return run, task


def job_states(rt: Runtime, run: Any) -> dict[int, str]:
    return {
        i: rt.db.scalar(
            "SELECT state FROM index_jobs WHERE task_id = ? AND attempt = ?", run.job(i)
        )
        for i in run.ids
    }


def test_a_group_indexes_its_items_with_shared_requests_and_records_each(rt) -> None:
    ids = notes(rt.db, 5)
    batch = create_batch(rt.db, "reindex", len(ids))
    run, _ = group(rt, ids, batch)
    result = run.execute()
    assert result["items"] == 5 and result["indexed"] == 5
    assert set(job_states(rt, run).values()) == {"success"}
    assert get_batch(rt.db, batch)["ok"] == 5 and get_batch(rt.db, batch)["state"] == "done"
    embedder = rt.embedder
    texts = sum(len(c) for c in embedder.calls)  # type: ignore[union-attr]
    assert texts == 5 and len(embedder.calls) == 1  # one request for the five items' texts


def test_a_single_run_is_a_group_of_one_with_the_items_result(rt) -> None:
    (item,) = notes(rt.db, 1)
    run, _ = single(rt, item)
    result = run.execute()
    assert result["item_id"] == item and result["status"] == "indexed" and result["chunks"] == 1
    assert "duration_ms" in result and job_states(rt, run) == {item: "success"}


def test_a_busy_item_is_coalesced_and_asks_its_holder_for_one_more_run(rt) -> None:
    busy, free = notes(rt.db, 2)
    other = LockSet(rt.redis, rt.db.instance(), [busy], "someone-else", 30)
    assert other.acquire() == ([busy], [])
    run, _ = group(rt, [busy, free])
    result = run.execute()
    assert {r["item_id"]: r["status"] for r in result["results"]} == {
        busy: "coalesced",
        free: "indexed",
    }
    assert all(set(r) >= RESULT_FIELDS for r in result["results"])  # the same shape
    # The holder will run it once more.
    assert rt.redis.get(rerun_key(rt.db.instance(), busy)) is not None
    other.release()


def test_two_databases_sharing_a_redis_never_share_an_items_lock(rt, tmp_path) -> None:
    """Item ids are per database: item 1 of another kidx database, being indexed there, does
    not make this database's item 1 `coalesced`; the same file under another path (a worker
    in a container, a CLI on the host) is the same database, and meets its own locks."""
    (item,) = notes(rt.db, 1)
    elsewhere = Database(tmp_path / "elsewhere.db")
    migrate(elsewhere)
    assert elsewhere.instance() != rt.db.instance()
    there = LockSet(rt.redis, elsewhere.instance(), [item], "a-run-of-the-other-database", 30)
    assert there.acquire() == ([item], [])
    try:
        run, _ = single(rt, item)
        assert run.execute()["status"] == "indexed"
        link = tmp_path / "same-file.db"
        link.symlink_to(rt.db.path)
        same = Database(link)
        assert same.instance() == rt.db.instance()
        here = LockSet(rt.redis, same.instance(), [item], "a-run-through-the-link", 30)
        assert here.acquire() == ([item], [])
        run, _ = single(rt, item)
        result = run.execute()
        assert result["status"] == "coalesced" and set(result) >= RESULT_FIELDS
        here.release()
        same.close()
    finally:
        there.release()
        elsewhere.close()


def test_an_item_changed_and_asked_for_while_it_ran_is_indexed_once_more(rt) -> None:
    (item,) = notes(rt.db, 1)
    run, _ = single(rt, item)
    embedder = rt.embedder
    original = embedder.embed_batch  # type: ignore[union-attr]

    other = Database(rt.db.path)  # an editor's own connection (this one is the run's)

    def edit_while_embedding(texts: list[str]) -> Any:
        if len(embedder.calls) == 0:  # type: ignore[union-attr]
            update_content(other, item, "# Edited\n\nThe text changed while it was indexed.")
            rt.redis.set(rerun_key(rt.db.instance(), item), "another-task")
        return original(texts)

    embedder.embed_batch = edit_while_embedding  # type: ignore[union-attr, method-assign]
    result = run.execute()
    other.close()
    assert len(embedder.calls) == 2  # type: ignore[union-attr]
    assert result["status"] == "indexed"
    content = rt.db.scalar("SELECT content FROM note_chunks WHERE item_id = ?", (item,))
    assert "changed while it was indexed" in content


def test_an_item_fixed_and_asked_for_while_its_run_failed_it_is_sent_again(rt) -> None:
    """The provider refuses the note's text for good; meanwhile a host fixes it and sends a
    task, which ends coalesced, trusting the run: the run kept requests only for items it
    indexed, and the fixed note stayed failed until the retry sweep's backoff."""
    item = add_item(rt.db, kind="note", title="n", content="# n\n\nBAD " + "Words. " * 40)
    run, _ = single(rt, item)
    other = Database(rt.db.path)  # the host's own connection
    sent: list[int] = []

    def refuse(texts: list[str]) -> Any:
        if not sent and not rt.redis.exists(rerun_key(rt.db.instance(), item)):
            update_content(other, item, "# n\n\nfixed " + "Words. " * 40)
            rt.redis.set(rerun_key(rt.db.instance(), item), "the host's task")
        raise PermanentProviderError("400: input rejected")

    rt.embedder.embed_batch = refuse  # type: ignore[union-attr, method-assign]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tasks.run.enqueue", lambda db, item_id, **kw: sent.append(item_id) or "next")
        with pytest.raises(IndexFailed, match="400"):
            run.execute()
    other.close()
    assert sent == [item]  # a run of its own, for the fixed text
    assert not rt.redis.exists(rerun_key(rt.db.instance(), item))


def test_an_item_asked_for_while_its_run_asked_for_a_retry_is_left_to_that_retry(rt) -> None:
    """A request for an item whose run ended `retry` (its retry is on its way, with its
    backoff) was sent on at once as well: a second run while the provider is down."""
    (item,) = notes(rt.db, 1)
    run, _ = single(rt, item)
    rt.embedder.down = True  # type: ignore[union-attr]
    flaky = rt.embedder.embed_batch  # type: ignore[union-attr]

    def ask_meanwhile(texts: list[str]) -> Any:
        rt.redis.set(rerun_key(rt.db.instance(), item), "the host's task")
        return flaky(texts)

    rt.embedder.embed_batch = ask_meanwhile  # type: ignore[union-attr, method-assign]
    sent: list[int] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tasks.run.enqueue", lambda db, item_id, **kw: sent.append(item_id) or "next")
        with pytest.raises(Retried):
            run.execute()
    assert sent == []


def test_an_unchanged_note_asked_for_again_while_it_ran_is_not_run_again(rt) -> None:
    """A duplicate delivery asks for the item while its run holds it: the note's text is the
    one just indexed, so no second pass and no follow-up task (`changed` read no hash at all,
    and every item counted as changed)."""
    (item,) = notes(rt.db, 1)
    run, _ = single(rt, item)
    embedder = rt.embedder
    original = embedder.embed_batch  # type: ignore[union-attr]

    def ask_again(texts: list[str]) -> Any:
        rt.redis.set(rerun_key(rt.db.instance(), item), "a duplicate delivery")
        return original(texts)

    embedder.embed_batch = ask_again  # type: ignore[union-attr, method-assign]
    sent: list[str] = []
    before_task_publish.connect(record := lambda sender=None, **_: sent.append(sender))
    try:
        assert run.execute()["status"] == "indexed"
    finally:
        before_task_publish.disconnect(record)
    assert len(embedder.calls) == 1 and sent == []  # type: ignore[union-attr]
    assert changed(rt, item) is False
    update_content(rt.db, item, "# New\n\nAnother text.")
    assert changed(rt, item) is True


def test_a_file_asked_for_again_is_run_again(rt, tmp_path) -> None:
    """A file's text is read only by a run: asked for again, it is changed (it may be)."""
    item = add_item(rt.db, kind="file", title="f.md", content="", source=str(tmp_path / "f.md"))
    assert changed(rt, item) is True


@pytest.mark.parametrize("where", ["the locks' release", "a follow-up send"])
def test_an_error_after_every_item_ended_well_leaves_the_task_a_success(rt, where) -> None:
    """A broker restart as the locks go, or a follow-up task the broker refuses: the items are
    indexed and their job rows say so; the task is not a FAILURE (its failure was a bare
    StopIteration, naming nothing)."""
    (item,) = notes(rt.db, 1)
    run, _ = single(rt, item)
    with pytest.MonkeyPatch.context() as mp:
        if where == "the locks' release":
            release = LockSet.release

            def broken(self: LockSet) -> list[int]:
                release(self)
                raise redis.ConnectionError("Connection reset by peer (Redis restarted)")

            mp.setattr(LockSet, "release", broken)
        else:
            mp.setattr("tasks.run.changed", lambda rt, item_id: True)
            mp.setattr(LockSet, "release", lambda self: [item])
            mp.setattr(
                "tasks.run.enqueue",
                lambda *a, **k: (_ for _ in ()).throw(redis.ConnectionError("broker down")),
            )
        result = run.execute()
    assert result["status"] == "indexed"
    assert job_states(rt, run) == {item: "success"}


def test_a_provider_that_may_recover_retries_the_single_run_and_sends_a_group_item_on(rt) -> None:
    rt.embedder.down = True  # type: ignore[union-attr]
    (one,) = notes(rt.db, 1, "one")
    run, task = single(rt, one)
    with pytest.raises(Retried, match="is down for now"):
        run.execute()
    assert task.retried and job_states(rt, run) == {one: "retry"}
    (two,) = notes(rt.db, 1, "two")
    run, task = group(rt, [two])
    result = run.execute()
    (only,) = result["results"]
    assert only["status"] == "retry" and only["next"]  # a task of its own, sent with a delay
    assert set(only) >= RESULT_FIELDS and only["chunks"] == 0
    assert job_states(rt, run) == {two: "retry"}


def _retried_in_a_batch(rt: Runtime) -> tuple[int, int, FakeTask]:
    """A note of a batch of one whose single run asked for a retry (the provider down)."""
    (item,) = notes(rt.db, 1)
    batch = create_batch(rt.db, "reindex", 1)
    rt.embedder.down = True  # type: ignore[union-attr]
    run, task = single(rt, item, batch)
    with pytest.raises(Retried):
        run.execute()
    return item, batch, task


def test_a_batch_item_whose_retry_was_lost_ends_its_batch_and_is_counted_once(rt) -> None:
    """The retry's send failed (Celery drops the message), or Redis lost it in its countdown:
    nothing counted the item again, and the batch stayed running for good (`kidx reindex
    --wait` with it)."""
    from worker.reconcile import close_lost_retries

    item, batch, task = _retried_in_a_batch(rt)
    assert get_batch(rt.db, batch)["state"] == "running"
    assert close_lost_retries(rt.db, 3600) == 0  # its retry may still come
    rt.db.execute("UPDATE index_jobs SET finished_at = datetime('now', '-2 hours')")
    assert close_lost_retries(rt.db, 3600) == 1
    done = get_batch(rt.db, batch)
    assert (done["state"], done["ok"], done["skipped"]) == ("done", 0, 1)
    rt.embedder.down = False  # type: ignore[union-attr]
    late, _ = single(rt, item, batch, task_id=task.request.id, attempt=1)  # after all
    assert late.execute()["status"] == "indexed"
    after = get_batch(rt.db, batch)
    assert (after["ok"], after["skipped"]) == (0, 1)  # not counted twice
    again, _ = single(rt, item, batch, task_id=task.request.id)  # the closed attempt, again
    assert again.execute()["status"] in ("indexed", "coalesced")
    assert (get_batch(rt.db, batch)["ok"], get_batch(rt.db, batch)["skipped"]) == (0, 1)


def test_a_group_item_s_retry_sent_as_a_task_of_its_own_is_not_taken_for_lost(rt) -> None:
    """A group retries an item as a new task (its own id), which the lost-retry check took
    for no later attempt: an hour on, the item counted skipped, then again when its task ran.
    Its own task's loss is `mark_lost`'s to see. A redelivery of a closed attempt is not
    counted again either."""
    from worker.reconcile import close_lost_retries

    rt.embedder = FailsFlaky()
    ids = notes(rt.db, 1) + notes(rt.db, 1, "FLAKY")
    batch = create_batch(rt.db, "reindex", 2)
    run, _ = group(rt, ids, batch)
    run.execute()
    rt.db.execute("UPDATE index_jobs SET finished_at = datetime('now', '-2 hours')")
    assert close_lost_retries(rt.db, 3600) == 0
    assert get_batch(rt.db, batch)["state"] == "running"  # its task's run is to come


def test_a_redelivered_attempt_that_had_asked_for_its_retry_counts_its_own_end(rt) -> None:
    """The worker died after the attempt's `retry` was recorded and before the retry was
    sent: Celery delivers that attempt again, whose success the batch never counted (the
    `retry` had marked the row counted), and the batch stayed running for good."""
    item, batch, task = _retried_in_a_batch(rt)
    rt.embedder.down = False  # type: ignore[union-attr]
    again, _ = single(rt, item, batch, task_id=task.request.id)
    assert again.execute()["status"] == "indexed"
    done = get_batch(rt.db, batch)
    assert (done["state"], done["ok"]) == ("done", 1)


class FailsFlaky(FakeEmbedder):
    """Refuses, for now, any request with a text naming FLAKY (the others, sent alone, pass)."""

    def embed_batch(self, texts: list[str]) -> Any:
        if any("FLAKY" in t for t in texts):
            raise TransientProviderError("FLAKY is down for now")
        return super().embed_batch(texts)


def test_a_group_items_retry_is_sent_once_the_write_that_reported_it_commits(rt) -> None:
    """An item whose only text failed for now is reported with the items written beside it,
    inside their write transaction: its retry's message goes after the COMMIT, not while
    every other writer waits for the lock (and not at all if the transaction rolls back)."""
    rt.embedder = FailsFlaky()
    ids = notes(rt.db, 3) + notes(rt.db, 1, "FLAKY")
    in_transaction: list[bool] = []

    def published(sender: str | None = None, **_: Any) -> None:
        in_transaction.append(not rt.db.conn.get_autocommit())

    before_task_publish.connect(published)
    try:
        run, _ = group(rt, ids)
        result = run.execute()
    finally:
        before_task_publish.disconnect(published)
    statuses = {r["item_id"]: r["status"] for r in result["results"]}
    assert statuses == {**dict.fromkeys(ids[:3], "indexed"), ids[3]: "retry"}
    assert in_transaction == [False]  # one message, the retry's, sent outside
    assert job_states(rt, run)[ids[3]] == "retry"


def test_backoff_honours_retry_after_only_up_to_what_the_broker_holds() -> None:
    """A countdown past the visibility timeout (less the run's time limit) would have Redis run
    the task twice; 1e12 s overflows Celery's ETA. NaN or a negative wait is no wait."""
    settings = load_settings(tasks={"visibility_timeout": 3600, "time_limit": 660})
    rt = SimpleNamespace(settings=settings)
    cap = longest_countdown(settings.tasks)
    assert cap == 3600 - 660
    assert backoff(rt, 0, 1000.0) == 1000.0  # a wait the broker holds is honoured
    for asked in (86_400.0, 1e12, math.inf):
        assert backoff(rt, 0, asked) == cap
    first = settings.tasks.retry_backoff
    for asked in (math.nan, -5.0, None):
        assert first * 0.5 <= backoff(rt, 0, asked) <= first * 1.5
    settings.tasks.retry_backoff_max = 1e9  # the exponential part is capped too
    assert backoff(rt, 5000, None) == cap
    for countdown in (backoff(rt, 0, 1e12), backoff(rt, 5000, math.inf)):
        datetime.now(UTC) + timedelta(seconds=countdown)  # what Celery makes of it: no overflow


class AskedToWait(FakeEmbedder):
    """A provider answering 429 with a Retry-After far beyond any countdown."""

    def embed_batch(self, texts: list[str]) -> Any:
        self.calls.append(list(texts))
        raise RetryLater("HTTP 429: slow down", retry_after=1e12)


def test_a_huge_retry_after_is_retried_within_the_broker_s_hold_not_an_overflow(rt) -> None:
    """Retry-After: 1e12 made Celery's retry raise OverflowError after the job row said
    `retry` (a single run), and failed a group's item with it (its retry could not be sent)."""
    rt.embedder = AskedToWait()
    cap = longest_countdown(rt.settings.tasks)
    (one,) = notes(rt.db, 1, "one")
    run, task = single(rt, one)
    with pytest.raises(Retried, match="slow down"):
        run.execute()
    (countdown,) = task.retried
    assert countdown == cap and job_states(rt, run) == {one: "retry"}
    rt.app.amqp.as_task_v2(str(uuid.uuid4()), NOTE, args=(one,), countdown=countdown)
    (two,) = notes(rt.db, 1, "two")
    run, _ = group(rt, [two])
    (only,) = run.execute()["results"]
    assert only["status"] == "retry" and only["next"], only  # its retry was sent
    assert job_states(rt, run) == {two: "retry"}


def test_a_reason_sqlite_cannot_store_is_refused_and_kept_out_of_the_job_row() -> None:
    """JSON's "\\ud800" decodes to a lone surrogate: recording it raised UnicodeEncodeError
    before the task's job row was written."""
    lone = "edit \ud800 now"
    problem = bad_arguments(None, 1, lone, None, False)  # type: ignore[arg-type]
    assert problem == "reason must be UTF-8 text, not a string with a lone surrogate at character 5"
    assert stored_reason(lone) is None and stored_reason(["x"]) is None
    assert stored_reason("é" * 300) == "é" * 200 and stored_reason("") is None
    assert bad_arguments(None, 1, "edit é 🙂", None, False) is None  # type: ignore[arg-type]


def test_three_failures_in_a_row_abort_the_batch_and_its_other_items_are_skipped(rt) -> None:
    rt.settings.tasks.max_retries = 0  # each failure final
    rt.embedder.down = True  # type: ignore[union-attr]
    ids = notes(rt.db, 5)
    batch = create_batch(rt.db, "reindex", len(ids))
    for item in ids[:3]:
        run, _ = group(rt, [item], batch)
        with pytest.raises(IndexFailed, match="is down for now"):
            run.execute()
    assert get_batch(rt.db, batch)["state"] == "aborted"
    run, _ = group(rt, ids[3:], batch)
    result = run.execute()
    assert result["skipped"] == 2 and {get_state(rt.db, i)["status"] for i in ids[3:]} == {"failed"}
    assert all(set(r) >= RESULT_FIELDS and r["model"] is None for r in result["results"])


def test_a_batchs_runs_share_their_count_of_failed_provider_requests(rt) -> None:
    """Two failed requests of another process's run of the batch, in Redis: this run's first
    failed request is the third, and stops the batch; a request that succeeds resets it."""
    rt.settings.tasks.max_retries = 0
    ids = notes(rt.db, 4)
    batch = create_batch(rt.db, "reindex", len(ids))
    streak = SharedStreak(rt.redis, streak_key(rt.db.instance(), batch))
    streak.failed("HTTP 500 (another process)")
    streak.ok()  # a success in between: the count starts again
    assert streak.current() == (0, "HTTP 500 (another process)")
    streak.failed("HTTP 500 (another process)")
    streak.failed("HTTP 500 (another process)")
    rt.embedder.down = True  # type: ignore[union-attr]
    run, _ = group(rt, ids[:2], batch)
    with pytest.raises(IndexFailed, match="3 consecutive failures of the provider's requests"):
        run.execute()
    assert len(rt.embedder.calls) == 1  # type: ignore[union-attr]
    assert get_batch(rt.db, batch)["state"] == "aborted"
    assert streak.current()[0] == 3
    # Another database's batch of the same id has a count of its own.
    assert SharedStreak(rt.redis, streak_key("another-database", batch)).current() == (0, "")
    late, _ = group(rt, ids[2:], batch)
    assert late.execute()["skipped"] == 2
    assert len(rt.embedder.calls) == 1  # type: ignore[union-attr]


def test_an_aborted_batchs_late_run_leaves_an_item_a_later_run_indexed(rt) -> None:
    """A run of an aborted batch queued before `kidx retry --failed` may start after the
    retry's run indexed its item: the skip must not turn that item back to failed."""
    rt.settings.tasks.max_retries = 0
    rt.embedder.down = True  # type: ignore[union-attr]
    ids = notes(rt.db, 6)
    batch = create_batch(rt.db, "reindex", len(ids))
    late, _ = group(rt, ids[3:], batch)  # queued now (as the producer records), runs last
    rt.db.executemany(
        "UPDATE index_jobs SET queued_at = started_at WHERE task_id = ?",
        [(late.job(i)[0],) for i in ids[3:]],
    )
    for item in ids[:3]:
        run, _ = group(rt, [item], batch)
        with pytest.raises(IndexFailed):
            run.execute()
    rt.embedder.down = False  # type: ignore[union-attr]
    retried, _ = single(rt, ids[3])
    assert retried.execute()["status"] == "indexed"
    set_state(rt.db, ids[5], status="indexing", last_task_id="another-run")  # in flight
    result = late.execute()
    assert result["skipped"] == 3
    assert get_state(rt.db, ids[3])["status"] == "indexed"  # the later run's outcome stands
    assert get_state(rt.db, ids[4])["status"] == "failed"  # not run: retry --failed finds it
    assert "batch" in get_state(rt.db, ids[4])["last_error"]
    assert get_state(rt.db, ids[5])["status"] == "indexing"  # that run will say how it ended


def test_a_revoke_before_the_start_ends_revoked_and_writes_nothing(rt) -> None:
    ids = notes(rt.db, 2)
    run, task = group(rt, ids)
    mark_revoked(rt.redis, [run.task_id])
    with pytest.raises(Ignore):
        run.execute()
    assert task.revoked == [run.task_id] and task.events == ["task-revoked"]
    assert set(job_states(rt, run).values()) == {"revoked"}
    assert rt.db.scalar("SELECT count(*) FROM note_chunks") == 0
    assert rt.embedder.calls == []  # type: ignore[union-attr]


def test_a_revoke_seen_before_the_start_leaves_another_runs_index_as_it_is(rt) -> None:
    """The revoke key outlived its run's start (`kidx cancel` with no worker up): the task
    ends revoked, and does not mark `cancelled` an item another run indexed since it was
    queued, nor one another run is indexing now; an item no run touched is cancelled."""
    ids = notes(rt.db, 3)
    run, _ = group(rt, ids)  # queued now
    other, _ = group(rt, ids[:1])
    other.execute()  # indexed after the revoked task was queued
    set_state(rt.db, ids[1], status=Status.INDEXING, last_task_id="another-run")
    mark_revoked(rt.redis, [run.task_id])
    with pytest.raises(Ignore):
        run.execute()
    assert [get_state(rt.db, i)["status"] for i in ids] == ["indexed", "indexing", "cancelled"]


def test_a_terminate_that_comes_while_the_revoke_is_recorded_does_not_end_the_process(
    rt,
) -> None:
    """`kidx cancel --terminate` writes the revoke to Redis, then Celery sends SIGTERM: a run
    that saw the revoke first may be recording it when the signal comes. It must be taken as
    the cancellation it is (the job rows written), not end the process with them unwritten."""
    ids = notes(rt.db, 2)
    run, task = group(rt, ids)
    mark_revoked(rt.redis, [run.task_id])
    reached: list[int] = []
    # The process's own handler (billiard's ends the process): here, it records.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: reached.append(signum))
    original_end = run.end

    def end_then_terminated(*args: Any, **kwargs: Any) -> None:
        if not reached and not TERMINATED.is_set():
            os.kill(os.getpid(), signal.SIGTERM)  # the terminate, while the revoke is recorded
        original_end(*args, **kwargs)

    run.end = end_then_terminated  # type: ignore[method-assign]
    try:
        with pytest.raises(Ignore):
            run.execute()
    finally:
        signal.signal(signal.SIGTERM, previous)
        reset()
    assert reached == []  # the run's handler took it: it did not reach the process's own
    assert set(job_states(rt, run).values()) == {"revoked"}
    assert task.revoked == [run.task_id]


class Quoting(FakeEmbedder):
    """Refuses one text alone with a message that quotes the configured key (a provider of a
    host's own, not kidx's HTTP client, which masks its key itself)."""

    def embed_batch(self, texts: list[str]) -> Any:
        if any("Refused" in t for t in texts):
            raise PermanentProviderError(
                "400 invalid input for key sk-test-key-not-for-logs", per_input=True
            )
        return super().embed_batch(texts)


@pytest.mark.parametrize("kind", ["single", "group"])
def test_a_partial_items_error_reaches_the_result_without_a_secret(rt, kind) -> None:
    rt.embedder = Quoting()
    content = "# Kept\n\n" + "Words. " * 120 + "\n\n# Refused\n\n" + "Other words. " * 20
    item = add_item(rt.db, kind="note", title="partial", content=content)
    run, _ = single(rt, item) if kind == "single" else group(rt, [item])
    result = run.execute()
    shown = json.dumps(result)
    assert "partial" in shown and "invalid input for key ***" in shown
    assert "sk-test-key-not-for-logs" not in shown


@pytest.mark.parametrize("kind", ["note", "file"])
def test_an_item_a_run_never_got_to_for_redis_is_failed_for_the_retry_sweep(
    rt, tmp_path, kind
) -> None:
    """Redis refusing the item's lock failed the job, but the item kept `indexed` over its
    old text: neither sweep sent it again, and a file's new text was never read."""
    from worker.reconcile import due_retries

    source = tmp_path / "f.md"
    source.write_text("# F\n\n" + "Words. " * 60)
    if kind == "note":
        (item,) = notes(rt.db, 1)
    else:
        item = add_item(rt.db, kind="file", title="f.md", content="", source=str(source))
        rt.reader = Reader(FilesSettings(roots=[tmp_path]))
    run, _ = single(rt, item)
    run.kinds = frozenset({kind})
    assert run.execute()["status"] == "indexed"
    run, _ = single(rt, item)
    run.kinds = frozenset({kind})
    with pytest.MonkeyPatch.context() as mp:
        refused = redis.ConnectionError("Error 111 connecting to 127.0.0.1:6379")
        mp.setattr(LockSet, "acquire", lambda self: (_ for _ in ()).throw(refused))
        with pytest.raises(IndexFailed, match="ConnectionError"):
            run.execute()
    state = get_state(rt.db, item)
    assert state["status"] == "failed" and "ConnectionError" in state["last_error"]
    assert rt.db.scalar("SELECT attempts FROM item_index_state WHERE item_id = ?", (item,)) == 1
    assert due_retries(rt.db, max_attempts=5, backoff=0, backoff_max=0, horizon=0) == [item]


def test_a_retry_s_run_marks_over_its_own_task_s_earlier_failure(rt) -> None:
    """A retry keeps its task's id: the guard that keeps an item this run's engine already
    failed (its cause, its attempt) also kept the earlier attempt's failure, so a cancel of
    the retry left the item failed (sent again by the retry sweep), and a retry that Redis
    refused counted no attempt."""
    from worker.store.items import mark_not_run

    (item,) = notes(rt.db, 1)
    set_state(rt.db, item, status=Status.FAILED, last_task_id="T", attempts=1)
    rt.db.execute("UPDATE item_index_state SET updated_at = '2026-01-01T00:00:00.000Z'")
    assert mark_not_run(rt.db, item, "T", "T", "cancelled", Status.CANCELLED)
    assert get_state(rt.db, item)["status"] == "cancelled"
    set_state(rt.db, item, status=Status.FAILED, last_task_id="T")
    rt.db.execute("UPDATE item_index_state SET updated_at = '2026-01-01T00:00:00.000Z'")
    since = "2026-06-01T00:00:00.000Z"  # the retry's run started after that failure
    assert mark_not_run(rt.db, item, "T", "T", "Redis refused", attempt=True, since=since)
    attempts = "SELECT attempts FROM item_index_state WHERE item_id = ?"
    assert rt.db.scalar(attempts, (item,)) == 2
    # marked failed by this run already (its engine): left as it is, not counted twice
    assert not mark_not_run(rt.db, item, "T", "T", "again", attempt=True, since=since)
    assert rt.db.scalar(attempts, (item,)) == 2


def test_a_failure_of_the_task_layer_has_its_ki_embed_line(rt) -> None:
    """The seed: failure reasons under the [KI Embed] prefix, for what fails before the engine
    runs too (the engine logs its own): the wrong task for the item's kind, bad arguments."""
    from tasks.index import start
    from tasks.run import bind_arguments

    item = add_item(rt.db, kind="file", title="f.md", content="", source="/nowhere/f.md")
    run, _ = single(rt, item)  # GenerateEmbedding: notes only
    with structlog.testing.capture_logs() as logs, pytest.raises(IndexFailed):
        run.execute()
    failed = [e for e in logs if e["event"] == "[KI Embed] failed"]
    assert failed and "send GenerateKnowledgeItemEmbedding" in failed[0]["reason"]
    rt.app.kidx_runtime = rt  # type: ignore[attr-defined]
    task = FakeTask(rt.app, NOTE)  # type: ignore[attr-defined]
    with structlog.testing.capture_logs() as logs, pytest.raises(IndexFailed):
        start(task, bind_arguments("item_id", ("abc",), {}), frozenset({"note"}))
    refused = [e for e in logs if e["event"] == "[KI Embed] refused"]
    assert refused and "the item id must be a 64-bit integer" in refused[0]["reason"]


def test_a_worker_s_runs_chunk_at_the_configured_target(rt) -> None:
    """`KIDX_CHUNK__TARGET` reaches the task's runs (tasks.run: IndexOptions.chunk_target)."""
    text = "\n\n".join(f"Paragraph {k}. " + "Words go on here. " * 8 for k in range(40))
    small, large = (add_item(rt.db, kind="note", title=t, content=text) for t in ("s", "l"))
    counts = {}
    for item, target in ((small, 650), (large, 1500)):
        rt.settings.chunk.target = target
        run, _ = single(rt, item)
        counts[target] = run.execute()["chunks"]
    assert counts[650] > counts[1500] * 1.5


def test_a_group_sent_on_keeps_its_reason_as_the_job_rows_keep_it(rt) -> None:
    """The items a group sends on went with its whole reason (any length a host gave), in
    the task's message and the new group's job rows, where the group's own rows hold the
    first 200 characters."""
    ids = notes(rt.db, 2)
    task = FakeTask(rt.app, GROUP)  # type: ignore[attr-defined]
    run = GroupRun(
        task, rt, ids, reason="r" * 5_000, batch_id=None, structure_only=False, started=0.0
    )
    run._send_on(ids)
    reasons = rt.db.all(
        "SELECT reason FROM index_jobs WHERE task_name = ? AND state = 'queued'", (GROUP,)
    )
    assert reasons == [("r" * 200,)] * 2


# -- a sixth review: requests and ends that were lost -------------------------------------------


def _edit_and_ask(rt: Runtime, items: list[int], other: Database, edit: int = 1) -> None:
    """A host edits `items` and sends their tasks, which find them locked and ask for more."""
    for item in items:
        update_content(other, item, f"# Edit {edit} of {item}\n\nThe text changed while it ran.")
        rt.redis.set(rerun_key(rt.db.instance(), item), "the host's task")


def test_a_group_past_its_deadline_sends_on_what_its_once_more_pass_did_not_start(rt) -> None:
    """Two items edited and asked for while a group ran past half its time limit: the
    once-more pass started the first alone (the deadline had passed) and the other's request
    was dropped, its asker `coalesced`: the edit was never indexed."""
    a, b = notes(rt.db, 2)
    run, _ = group(rt, [a, b])
    other = Database(rt.db.path)
    original = rt.embedder.embed_batch  # type: ignore[union-attr]

    def edit_then_run_late(texts: list[str]) -> Any:
        if not rt.embedder.calls:  # type: ignore[union-attr]
            _edit_and_ask(rt, [a, b], other)
            run.started -= rt.settings.tasks.soft_time_limit  # half the limit has gone by
        return original(texts)

    rt.embedder.embed_batch = edit_then_run_late  # type: ignore[union-attr, method-assign]
    sent: list[int] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tasks.run.enqueue", lambda db, item_id, **kw: sent.append(item_id) or "next")
        run.execute()
    other.close()
    indexed_again = [
        i
        for i in (a, b)
        if "changed while it ran"
        in rt.db.scalar("SELECT content FROM note_chunks WHERE item_id = ?", (i,))
    ]
    assert sorted(indexed_again + sent) == [a, b], (indexed_again, sent)


def test_items_a_run_never_started_before_its_soft_time_limit_are_left_failed(rt, tmp_path) -> None:
    """The soft time limit while the first of three files was read: the other two ended
    `failed` in their job rows but kept `indexed` over their old text, so neither `kidx
    retry --failed` nor a sweep ever read their new text."""
    from celery.exceptions import SoftTimeLimitExceeded

    from worker.reconcile import due_retries

    rt.reader = Reader(FilesSettings(roots=[tmp_path]))
    ids = []
    for name in "xyz":
        (tmp_path / f"{name}.md").write_text(f"# {name}\n\n" + "Old words. " * 40)
        ids.append(
            add_item(
                rt.db, kind="file", title=name, content="", source=str(tmp_path / f"{name}.md")
            )
        )
    for item in ids:
        run, _ = single(rt, item)
        run.kinds = frozenset({"file"})
        assert run.execute()["status"] == "indexed"

    class LimitAtTheFirst(Reader):
        def text(self, item: Any, *args: Any, **kw: Any) -> Any:
            if item.id == ids[0]:
                raise SoftTimeLimitExceeded()  # as billiard raises it, in the main thread
            return super().text(item, *args, **kw)

    rt.reader = LimitAtTheFirst(FilesSettings(roots=[tmp_path]))
    run, _ = group(rt, ids)
    with pytest.raises(IndexFailed, match="soft time limit"):
        run.execute()
    assert set(job_states(rt, run).values()) == {"failed"}
    assert {get_state(rt.db, i)["status"] for i in ids} == {"failed"}
    assert sorted(due_retries(rt.db, max_attempts=5, backoff=0, backoff_max=0, horizon=0)) == ids


def test_a_run_whose_lock_expired_leaves_the_new_holders_request_to_be_served(rt) -> None:
    """The run's lock expired while its process stood still; another run took the item, and
    a host's edit asked that run for more. The first run's write ended `coalesced` (the
    fence), but it took the request with its own and dropped it: the edit was never indexed."""
    import worker.pipeline

    (item,) = notes(rt.db, 1)
    run, _ = single(rt, item)
    fence = worker.pipeline.read_claim
    stolen: list[int] = []

    def another_run_took_it(db: Any, item_id: int) -> Any:
        """The fence's read, once the other run has marked the item and a host's edit asked
        it for more (written on the run's own connection: it holds the write lock here)."""
        if not stolen:
            stolen.append(item_id)
            db.execute(
                "UPDATE item_index_state SET status = 'indexing', claim = ~claim, "
                "last_task_id = 'the-other-run' WHERE item_id = ?",
                (item_id,),
            )
            update_content(db, item_id, "# Edited\n\nThe text changed while it ran.")
            rt.redis.set(rerun_key(rt.db.instance(), item_id), "the host's task")
        return fence(db, item_id)

    sent: list[int] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("worker.pipeline.read_claim", another_run_took_it)
        mp.setattr("tasks.run.enqueue", lambda db, item_id, **kw: sent.append(item_id) or "next")
        assert run.execute()["status"] == "coalesced"
    assert stolen == [item] and sent == [item]


def test_a_once_more_pass_a_provider_refuses_for_now_is_not_counted_again(rt) -> None:
    """A batch item indexed, edited while it ran, and its once-more pass met a provider down:
    the retry went into the batch, which counted the item a second time when it ran and ended
    `done` before its other item had run."""
    a, _ = notes(rt.db, 2)
    batch = create_batch(rt.db, "reindex", 2)
    run, task = single(rt, a, batch)
    other = Database(rt.db.path)
    original = rt.embedder.embed_batch  # type: ignore[union-attr]

    def edit_then_go_down(texts: list[str]) -> Any:
        first = not rt.embedder.calls  # type: ignore[union-attr]
        vectors = original(texts)  # (raises once down)
        if first:
            _edit_and_ask(rt, [a], other)
            rt.embedder.down = True  # type: ignore[union-attr]
        return vectors

    rt.embedder.embed_batch = edit_then_go_down  # type: ignore[union-attr, method-assign]
    sent: list[tuple[int, Any]] = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            "tasks.run.enqueue",
            lambda db, item_id, **kw: sent.append((item_id, kw.get("batch_id"))) or "next",
        )
        result = run.execute()
    other.close()
    assert result["status"] == "indexed" and not task.retried
    assert sent == [(a, None)]  # the edit, later, as a run of its own outside the batch
    counted = get_batch(rt.db, batch)
    assert (counted["state"], counted["ok"], counted["failed"]) == ("running", 1, 0)
    assert counted["consecutive_failures"] == 0


def test_a_time_limit_after_every_item_ended_keeps_the_result_and_the_request(rt) -> None:
    """The soft time limit while a follow-up was sent for an item asked for again: the
    item was dropped from the requests before the send, and the task failed with "the run
    failed" though its item was indexed."""
    from celery.exceptions import SoftTimeLimitExceeded

    (item,) = notes(rt.db, 1)
    run, _ = single(rt, item)
    other = Database(rt.db.path)
    original = rt.embedder.embed_batch  # type: ignore[union-attr]

    def edit_after_the_second_pass(texts: list[str]) -> Any:
        if len(rt.embedder.calls) == 1:  # type: ignore[union-attr]
            _edit_and_ask(rt, [item], other, edit=2)  # after the once-more pass read it
        return original(texts)

    def edit_before_the_first(texts: list[str]) -> Any:
        if not rt.embedder.calls:  # type: ignore[union-attr]
            _edit_and_ask(rt, [item], other)
        return edit_after_the_second_pass(texts)

    rt.embedder.embed_batch = edit_before_the_first  # type: ignore[union-attr, method-assign]
    sent: list[int] = []

    def slow_send(db: Any, item_id: int, **kw: Any) -> str:
        sent.append(item_id)
        if len(sent) == 1:
            raise SoftTimeLimitExceeded()  # the limit, during the first send
        return "next"

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("tasks.run.enqueue", slow_send)
        result = run.execute()
    other.close()
    assert result["status"] == "indexed"
    assert sent == [item, item]  # sent again by `_send_unserved`, not dropped


def test_a_rerun_request_outlives_the_longest_run_the_settings_allow(rt) -> None:
    """A request was kept 600 s: a run with a soft limit of 30 minutes took none made in its
    first 20 minutes (the asker ended `coalesced`, the edit never indexed)."""
    (item,) = notes(rt.db, 1)
    holder = LockSet(rt.redis, rt.db.instance(), [item], "the-holder", 30)
    assert holder.acquire() == ([item], [])
    try:
        rt.settings.tasks.soft_time_limit, rt.settings.tasks.time_limit = 7200, 7260
        run, _ = single(rt, item)
        assert run.execute()["status"] == "coalesced"
        assert rt.redis.ttl(rerun_key(rt.db.instance(), item)) >= 7260
    finally:
        holder.release()


def test_ends_a_locked_database_refused_leave_the_connections_own_wait_as_it_was(rt, host) -> None:
    """The short wait after a locked-out end was set on the process's connection: a refused
    task's ends (recorded before any run) left it at 100 ms for every later task of that pool
    process, and an end met during a run cut its items' own writes to 100 ms too."""
    from worker.store.jobs import JobState

    a, b = notes(rt.db, 2)
    run, _ = group(rt, [a, b])
    rt.db.busy_timeout_ms = 300
    host.execute("BEGIN IMMEDIATE")  # a host's long transaction
    try:
        run.end(a, JobState.FAILED, "refused", "bad", why="bad_input")
        assert run.locked_out and rt.db.busy_timeout_ms == 300
        run.end(b, JobState.FAILED, "refused", "bad", why="bad_input")  # (once, briefly)
        assert rt.db.busy_timeout_ms == 300
    finally:
        host.execute("ROLLBACK")
    run.end(b, JobState.FAILED, "refused", "bad", why="bad_input")  # the lock has gone
    assert not run.locked_out and job_states(rt, run)[b] == "failed"
