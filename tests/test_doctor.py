"""`kidx doctor` against real processes: Redis, a prefork worker, beat, Flower, the stand-in.

The command runs as a subprocess, as an operator runs it. A healthy stack is all `ok` with exit
status 0; each broken part (Redis, the worker, the provider, its dimension, sqlite-vec, the
vec mirror, failed and stuck jobs) makes it exit 1 with one FAIL line that names the cause.
The stack uses a Redis database of its own, so the other queue tests can run at the same time.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from pydantic import SecretStr

from conftest import corpus_text
from ops.doctor import CHECKS, Check, run_checks
from scheduler.beat import HEARTBEAT_KEY
from stack import (
    CELERY,
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
from testkit.standin import StandIn
from worker.store import connect, repair_vectors
from worker.store.fts import sync_fts
from worker.store.schema import SCHEMA_VERSION

# Real worker processes (not in make test-quick); one xdist worker runs the whole module, so
# its module-scoped stack starts once.
pytestmark = [pytest.mark.stack]

DOCTOR_DB = REDIS_DB  # this process's Redis database (tests/stack.py)
CHAPTER = "ch10-02-traits.md"  # 20 chunks
WORKER = "doctor1"
BROKER_PASSWORD = "s3cret-broker-pw"
CHUNK_ENV = {"KIDX_CHUNK__MODEL": "standin-chat", "KIDX_CHUNK__MAX_RETRIES": "0"}


class DoctorStack(Stack):
    """A worker, a beat and Flower on Redis database DOCTOR_DB, one indexed note."""

    def __init__(self, tmp: Path, standin: StandIn) -> None:
        from worker.app import create_app
        from worker.settings import load_settings
        from worker.store import connect

        self.tmp, self.standin, self.worker_name = tmp, standin, WORKER
        self.port = free_port()
        self.env = queue_env(
            tmp,
            standin.base_url,
            KIDX_BROKER_URL=broker_url(DOCTOR_DB),
            KIDX_FLOWER__PORT=str(self.port),
            KIDX_CHUNK__BASE_URL=standin.base_url,
        )
        self.settings = load_settings(
            db=tmp / "kidx.db",
            broker_url=broker_url(DOCTOR_DB),
            embedding={
                "provider": "openai",
                "model": "standin-embed",
                "base_url": standin.base_url,
                "dimensions": 64,
            },
        )
        self.app = create_app(self.settings)
        self.db = connect(tmp / "kidx.db", embedding=self.settings.embedding)
        self.redis = redis.Redis.from_url(broker_url(DOCTOR_DB))
        self.worker = self.beat = self.flower = None
        try:
            self.worker = start_worker(self.env, tmp, self.app, name=WORKER)
            beat = [*CELERY, "beat", "--loglevel=INFO", f"--schedule={tmp}/beat-schedule"]
            self.beat = Proc(beat, self.env, tmp / "beat.log")
            self.flower = start_flower(self.env, tmp, self.port)
            wait_for(lambda: self.redis.exists(HEARTBEAT_KEY), 30, "beat's heartbeat", every=0.2)
            self.item = self.note("Traits", corpus_text(CHAPTER))
            self.app.send_task("GenerateEmbedding", args=[self.item]).get(timeout=60)
        except BaseException:
            self.close()
            raise

    def doctor(self, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], dict]:
        """Run `kidx doctor`; the result and {check: (level, text)} from its lines."""
        exe = str(Path(sys.executable).parent / "kidx")
        out = subprocess.run(
            [exe, "doctor", *args],
            env={**self.env, **env},
            cwd=str(self.tmp),
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines: dict[str, tuple[str, str]] = {}
        if "--json" not in args:
            for line in out.stdout.splitlines():
                level, name, text = line.split(None, 2)
                lines[name] = (level, text)
        return out, lines

    def close(self) -> None:
        for proc in (self.flower, self.beat, self.worker):
            if proc is not None:
                proc.stop()
        self.db.close()
        self.redis.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DoctorStack]:
    flush(DOCTOR_DB)
    with StandIn(dimensions=64) as standin:
        s = DoctorStack(tmp_path_factory.mktemp("doctor"), standin)
        try:
            yield s
        finally:
            s.close()
            flush(DOCTOR_DB)


@pytest.fixture(autouse=True)
def _fresh_standin(stack: DoctorStack) -> None:
    stack.standin.reset()


def failing(lines: dict[str, tuple[str, str]]) -> list[str]:
    return [name for name, (level, _) in lines.items() if level == "FAIL"]


def test_a_healthy_stack_is_all_ok_and_exits_0(stack):
    out, lines = stack.doctor(**CHUNK_ENV)
    assert out.returncode == 0, out.stdout + out.stderr
    assert list(lines) == list(CHECKS)
    assert {level for level, _ in lines.values()} == {"ok"}, out.stdout
    chunks = stack.db.scalar("SELECT count(*) FROM note_chunks")
    assert chunks >= 20 and f"vec_chunk_embeddings {chunks}" in lines["rows"][1]
    assert f"{WORKER}@" in lines["workers"][1]
    assert lines["beat"][1].startswith("heartbeat ")
    assert lines["redis"][1].startswith(broker_url(DOCTOR_DB))
    assert lines["flower"][1] == f"http://127.0.0.1:{stack.port}/healthcheck"
    assert "64 dimensions" in lines["embedding"][1] and "64" in lines["dimensions"][1]
    assert lines["chunk"][1] == "standin-chat answers" and stack.standin.chat.requests == 1
    assert stack.standin.texts == ["kidx doctor"]


def test_a_chunk_deadline_past_half_the_soft_time_limit_is_a_warning(stack):
    out, lines = stack.doctor(
        **CHUNK_ENV, KIDX_TASKS__SOFT_TIME_LIMIT="100", KIDX_CHUNK__DEADLINE="50"
    )
    assert out.returncode == 0, out.stdout + out.stderr  # a warning, not a failure
    level, text = lines["chunk"]
    assert level == "WARN", text
    assert "KIDX_CHUNK__DEADLINE (50 s) is not under half of KIDX_TASKS__SOFT_TIME_LIMIT" in text
    assert text.endswith("set KIDX_CHUNK__DEADLINE under 50"), text


def test_json_is_a_list_of_checks_and_shows_the_last_sweeps(stack):
    from worker.reconcile import record_sweep

    record_sweep(stack.db, "reconcile", {"sent": 2})
    try:
        out, _ = stack.doctor("--json")
    finally:
        stack.db.execute("DELETE FROM index_meta WHERE key = 'last_reconcile'")
    assert out.returncode == 0, out.stdout + out.stderr
    checks = json.loads(out.stdout)
    assert [c["check"] for c in checks] == list(CHECKS)
    for c in checks:
        assert set(c) == {"check", "ok", "level", "detail", "fix"}
        assert c["ok"] is True and c["level"] == "ok" and c["fix"] == "" and c["detail"]
    sweeps = next(c for c in checks if c["check"] == "sweeps")
    assert "reconcile at" in sweeps["detail"] and "sent 2" in sweeps["detail"]


def test_redis_down_names_it_and_never_prints_the_password(stack):
    url = f"redis://:{BROKER_PASSWORD}@127.0.0.1:{free_port()}/{DOCTOR_DB}"
    out, lines = stack.doctor(KIDX_BROKER_URL=url)
    assert out.returncode == 1
    assert failing(lines) == ["redis"], out.stdout
    assert "Redis unreachable at redis://***@127.0.0.1" in lines["redis"][1]
    assert "KIDX_BROKER_URL" in lines["redis"][1]
    assert lines["workers"] == ("WARN", "not checked: Redis is unreachable")
    assert BROKER_PASSWORD not in out.stdout + out.stderr


def test_no_worker_names_it(stack):
    stack.worker.stop()
    try:
        out, lines = stack.doctor()
    finally:
        stack.worker = start_worker(stack.env, stack.tmp, stack.app, name=WORKER)
    assert out.returncode == 1
    assert failing(lines) == ["workers"], out.stdout
    assert lines["workers"][1] == (
        "no worker answered a ping: start one (celery -A worker.app worker)"
    )


def test_provider_down_names_it(stack):
    stack.standin.fail_status = 500
    out, lines = stack.doctor()
    assert out.returncode == 1
    assert failing(lines) == ["embedding"], out.stdout
    assert "did not answer" in lines["embedding"][1] and "500" in lines["embedding"][1]
    assert stack.standin.requests == 1  # no retries: the doctor answers now


def test_wrong_provider_dimension_names_both_dimensions(stack):
    stack.standin.dimensions = 32
    out, lines = stack.doctor()
    assert out.returncode == 1
    assert failing(lines) == ["embedding"], out.stdout
    assert lines["embedding"][1] == (
        "wrong dimension: the provider returns 32, the index has 64: "
        "set KIDX_EMBEDDING__DIMENSIONS or switch back the model"
    )


def test_sqlite_vec_missing_names_it(stack):
    bogus = stack.tmp / "not-sqlite-vec.so"
    bogus.write_text("not a shared library")
    out, lines = stack.doctor(KIDX_VEC_PATH=str(bogus))
    assert out.returncode == 1
    assert failing(lines) == ["sqlite-vec"], out.stdout
    assert lines["sqlite-vec"][1].startswith("cannot load sqlite-vec")
    assert "KIDX_VEC_PATH" in lines["sqlite-vec"][1]
    assert lines["rows"] == ("WARN", "not checked: sqlite-vec is not loaded")


def test_sqlite_vec_off_is_a_warning_not_a_failure(stack):
    out, lines = stack.doctor(KIDX_VEC="off")
    assert out.returncode == 0, out.stdout
    assert lines["sqlite-vec"][0] == "WARN" and "KIDX_VEC=off" in lines["sqlite-vec"][1]
    assert not failing(lines)


def test_vec_rows_deleted_behind_kidx_s_back_are_counted(stack):
    chunks = stack.db.all("SELECT id FROM note_chunks WHERE item_id = ?", (stack.item,))
    for (cid,) in chunks[:3]:
        stack.db.execute("DELETE FROM vec_chunk_embeddings WHERE chunk_id = ?", (cid,))
    stack.db.execute(
        "INSERT INTO vec_chunk_embeddings(chunk_id, embedding) VALUES (888888, ?)",
        (np.ones(64, dtype="<f4").tobytes(),),
    )
    try:
        out, lines = stack.doctor()
    finally:
        repaired = repair_vectors(stack.db, 64)
    assert repaired.restored == {"vec_chunk_embeddings": 3}  # the damage was as described
    assert out.returncode == 1
    assert failing(lines) == ["rows"], out.stdout
    assert lines["rows"][1].startswith(
        "3 vectors missing from vec_chunk_embeddings; 1 orphan in vec_chunk_embeddings: "
        "run a reconcile sweep"
    )


def test_chunks_deleted_behind_kidx_s_back_name_their_item(stack):
    """The vec rows of deleted chunks are orphans (`rows`); the item they were cut from looks
    indexed and is found no more: `leftovers` names it, until it is indexed again."""
    stack.db.execute("DELETE FROM note_chunks WHERE item_id = ? AND chunk_index = 0", (stack.item,))
    try:
        out, lines = stack.doctor()
    finally:  # as a sweep mends it: the stale keyword row, then the item indexed again
        sync_fts(stack.db)
        stack.app.send_task("GenerateEmbedding", args=[stack.item]).get(timeout=60)
    assert out.returncode == 1
    assert failing(lines) == ["rows", "leftovers", "keywords"], out.stdout
    assert lines["leftovers"][1].startswith(
        f"1 indexed item with chunk rows deleted or added by hand ({stack.item}): run a reconcile"
    )
    out, lines = stack.doctor()
    assert [lines[c][0] for c in ("rows", "leftovers", "keywords")] == ["ok"] * 3, out.stdout


def test_failed_and_stuck_jobs_are_two_problems_on_two_lines(stack):
    from worker.store.items import add_item

    failed = add_item(stack.db, kind="note", title="Failed", content="It failed.")
    stuck = add_item(stack.db, kind="note", title="Stuck", content="Its worker died.")
    stack.db.execute(
        "UPDATE item_index_state SET status = 'failed', last_error = 'boom 401' WHERE item_id = ?",
        (failed,),
    )
    stack.db.execute(
        "INSERT INTO index_jobs(task_id, task_name, item_id, state, started_at) VALUES "
        "('t-stuck', 'GenerateEmbedding', ?, 'started', strftime('%Y-%m-%dT%H:%M:%fZ', 'now', "
        "'-1 hour'))",
        (stuck,),
    )
    try:
        out, lines = stack.doctor()
    finally:
        stack.db.execute("DELETE FROM index_jobs WHERE task_id = 't-stuck'")
        stack.db.execute("DELETE FROM knowledge_items WHERE id IN (?, ?)", (failed, stuck))
    assert out.returncode == 1
    assert failing(lines) == ["failed", "stuck"], out.stdout
    assert lines["failed"][1] == (
        "1 item failed to index (last: boom 401): "
        "see `kidx jobs --failed`, then `kidx retry --failed`"
    )
    assert lines["stuck"][1].startswith("stuck: 1 run started and 0 items indexing")
    assert f"kidx retry {stuck}" in lines["stuck"][1]


def test_three_problems_make_three_fail_lines_and_every_line_is_one_check(stack):
    stack.standin.fail_status = 503
    bogus = stack.tmp / "not-sqlite-vec.so"
    bogus.write_text("not a shared library")
    started = time.monotonic()
    out, lines = stack.doctor(
        KIDX_BROKER_URL=f"redis://127.0.0.1:{free_port()}/0", KIDX_VEC_PATH=str(bogus)
    )
    assert time.monotonic() - started < 20
    assert out.returncode == 1
    assert sorted(failing(lines)) == ["embedding", "redis", "sqlite-vec"], out.stdout
    assert out.stdout.count("FAIL") == 3
    assert len(out.stdout.splitlines()) == len(CHECKS)


def test_a_slow_provider_is_bounded_by_the_timeout(stack):
    stack.standin.delay = 30
    started = time.monotonic()
    out, lines = stack.doctor("--timeout", "1")
    assert time.monotonic() - started < 15
    assert out.returncode == 1
    assert failing(lines) == ["embedding"], out.stdout


@pytest.mark.parametrize(
    ("version", "expected", "fix"),
    [
        (
            str(SCHEMA_VERSION + 1),
            f"written by a newer kidx (this one knows {SCHEMA_VERSION})",
            "upgrade kidx",
        ),
        ("nine", "not a number", "restore a backup"),
    ],
)
def test_a_database_of_another_schema_fails_with_what_to_do(
    stack, tmp_path, version, expected, fix
):
    """A newer kidx's database, or one whose version is not a number, is not this kidx's:
    one FAIL line saying what to do, and the other database checks do not read it."""
    path = tmp_path / "other.db"
    db = connect(path, vec=False)
    db.execute("UPDATE index_meta SET value = ? WHERE key = 'schema_version'", (version,))
    db.close()
    out, lines = stack.doctor("--timeout", "10", KIDX_DB=str(path))
    assert out.returncode == 1, out.stdout
    level, text = lines["database"]
    assert level == "FAIL" and expected in text and fix in text, text
    for name in ("dimensions", "rows"):
        assert "not checked" in lines[name][1], lines[name]


def test_a_check_that_hangs_or_raises_stops_nothing_else(stack, monkeypatch):
    import ops.doctor

    def hangs(settings: Any, timeout: float) -> str:
        time.sleep(30)
        return "never"

    def raises(settings: Any, timeout: float) -> str:
        raise RuntimeError("line one\nline two, with sk-queue-secret-7777")

    fake = {"hangs": hangs, "raises": raises, "fine": lambda s, t: "fine"}
    monkeypatch.setattr(ops.doctor, "CHECKS", fake)
    key = {"api_key": SecretStr("sk-queue-secret-7777")}
    settings = stack.settings.model_copy(
        update={"embedding": stack.settings.embedding.model_copy(update=key)}
    )
    started = time.monotonic()
    checks = run_checks(settings, timeout=0.5)
    assert time.monotonic() - started < 3
    assert checks == [
        Check("hangs", "fail", "no answer within 0.5 s", "try a longer --timeout"),
        Check("raises", "fail", "RuntimeError: line one line two, with ***", "see the message"),
        Check("fine", "ok", "fine"),
    ]
