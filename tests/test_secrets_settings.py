"""A password in a provider's base URL reaches no log, stored error or stream."""

from __future__ import annotations

import base64
import json
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import apsw
import pytest
import redis
import structlog

from conftest import DIMS
from incli import run_kidx
from ops import doctor
from tasks import NOTE
from tasks.index import SingleRun
from tasks.run import IndexFailed
from tasks.runtime import build_runtime
from worker.app import create_app
from worker.providers.http import ProviderHTTPError
from worker.providers.openai import OpenAIEmbeddings
from worker.settings import EmbeddingSettings, load_settings
from worker.store.items import add_item
from worker.store.jobs import record_start

NO_BROKER = "redis://127.0.0.1:1/9"  # nothing listens: an inline run needs no broker
RUN_BROKER = "redis://127.0.0.1:6379/9"  # a task run's locks (this suite's Redis database)
WRITTEN = "hunter2%21secret"  # the password as the URL has it
PASSWORD = "hunter2!secret"  # as the client sends it
TOKEN = base64.b64encode(f"bob:{PASSWORD}".encode()).decode()  # the basic-auth header's


def _with_credentials(base_url: str, password: str = WRITTEN) -> str:
    return base_url.replace("http://", f"http://bob:{password}@", 1)


def _sql(db: Path, sql: str) -> list[tuple]:
    conn = apsw.Connection(str(db))
    try:
        return list(conn.execute(sql))
    finally:
        conn.close()


def _leaks(text: str) -> list[str]:
    return [s for s in (WRITTEN, PASSWORD, TOKEN, "bob:") if s in text]


# -- the password in a base URL --------------------------------------------------------------


def test_a_base_url_password_reaches_no_log_no_stored_error_and_no_stream(
    tmp_path, standin, monkeypatch
):
    """`kidx add --inline` over real HTTP: the credentials reach the server (basic auth), the
    failure names the provider as http://***@host, and the password is nowhere else."""
    standin.fail_status = 503  # retried once (a warning naming the provider), then given up
    data = tmp_path / "data"
    data.mkdir()  # where the command writes its log file
    env = {
        "KIDX_DB": str(tmp_path / "kidx.db"),
        "KIDX_DATA_DIR": str(data),
        "KIDX_BROKER_URL": NO_BROKER,
        "KIDX_LOG_LEVEL": "debug",
        "KIDX_LOG_FORMAT": "json",
        "KIDX_EMBEDDING__PROVIDER": "openai",
        "KIDX_EMBEDDING__MODEL": "standin-embed",
        "KIDX_EMBEDDING__BASE_URL": _with_credentials(standin.base_url),
        "KIDX_EMBEDDING__DIMENSIONS": str(DIMS),
        "KIDX_EMBEDDING__MAX_RETRIES": "1",
        "KIDX_EMBEDDING__BACKOFF": "0.01",
        "HF_HUB_OFFLINE": "1",
    }
    added = run_kidx(
        ["add", "note", "--title", "x", "--text", "hello world", "--inline"], env, tmp_path
    )
    assert standin.requests == 2 and standin.headers[0]["authorization"] == f"Basic {TOKEN}"
    status = run_kidx(["status", "1", "--json"], env, tmp_path)
    log = (data / "log" / "kidx.log").read_text(encoding="utf-8")
    assert "provider call failed, retrying" in log  # the log holds the provider's failures
    last_error = _sql(tmp_path / "kidx.db", "SELECT last_error FROM item_index_state")[0][0]
    assert "standin-embed at http://***@127.0.0.1:" in last_error
    places = {
        "the log file": log,
        "add's stderr": added.stderr,
        "add's stdout": added.stdout,
        "status": status.stdout + status.stderr,
        "last_error": last_error,
    }
    assert {where: _leaks(text) for where, text in places.items() if _leaks(text)} == {}
    for name, value in env.items():  # what the command's logging and redaction are given
        monkeypatch.setenv(name, value)
    assert {WRITTEN, PASSWORD} <= set(load_settings().secrets())


def test_a_task_run_stores_and_says_its_failure_without_the_password(tmp_path, standin):
    """The worker's path (tasks/run.py, with the runtime a worker builds): the job row's error,
    the item's last error, the failure the Tasks page shows and every log event as emitted
    (before any redaction) name the provider without the password."""
    standin.fail_status = 400  # a permanent refusal: the job fails with its reason
    settings = load_settings(
        db=tmp_path / "kidx.db",
        broker_url=RUN_BROKER,
        embedding={
            "provider": "openai",
            "model": "standin-embed",
            "base_url": _with_credentials(standin.base_url),
            "dimensions": DIMS,
            "max_retries": 0,
        },
    )
    rt = build_runtime(settings)
    app = create_app(settings)
    task = SimpleNamespace(
        app=app, name=NOTE, request=SimpleNamespace(id=str(uuid.uuid4()), retries=0)
    )
    task.send_event = lambda *a, **k: None
    try:
        item = add_item(rt.db, kind="note", title="x", content="hello world")
        record_start(rt.db, task.request.id, 0, NOTE, item, None, "test")
        run = SingleRun(
            task,
            rt,
            [item],
            reason="test",
            batch_id=None,
            structure_only=False,
            started=time.monotonic(),
            kinds=frozenset({"note"}),
        )
        with structlog.testing.capture_logs() as events, pytest.raises(IndexFailed) as failed:
            run.execute()
        job_error = rt.db.scalar("SELECT error FROM index_jobs WHERE item_id = ?", (item,))
        last_error = rt.db.scalar(
            "SELECT last_error FROM item_index_state WHERE item_id = ?", (item,)
        )
    finally:
        app.close()
        rt.close()
        client = redis.Redis.from_url(RUN_BROKER)
        client.flushdb()  # the run's lock and revoke keys
        client.close()
    assert standin.headers[0]["authorization"] == f"Basic {TOKEN}"
    assert "http://***@127.0.0.1:" in job_error and "HTTP 400" in job_error
    places = {
        "index_jobs.error": job_error,
        "last_error": last_error,
        "the task's failure": str(failed.value),
        "log events": json.dumps(events, default=str),
    }
    assert {where: _leaks(text) for where, text in places.items() if _leaks(text)} == {}


def test_a_server_quoting_the_credentials_back_has_them_masked(standin):
    """An error answer that repeats the password or the Authorization header it was sent."""
    echo = {"error": {"message": f"no user bob with {PASSWORD} (Basic {TOKEN})", "code": "auth"}}
    standin.raw_answer = (401, {"Content-Type": "application/json"}, json.dumps(echo).encode())
    settings = EmbeddingSettings(
        provider="openai",
        model="standin-embed",
        base_url=_with_credentials(standin.base_url),
        dimensions=DIMS,
        max_retries=0,
    )
    model = OpenAIEmbeddings(settings, dimensions=DIMS)
    try:
        with pytest.raises(ProviderHTTPError) as e:
            model.embed_batch(["hello"])
    finally:
        model.close()
    assert "HTTP 401 auth: no user bob with *** (Basic ***)" in str(e.value)
    assert _leaks(str(e.value)) == []


def test_doctor_names_the_provider_without_its_password(monkeypatch):
    """A password too short for the log redaction (under 4 characters) is still never shown:
    the provider is named by its URL without user:password@."""
    monkeypatch.setattr(doctor, "CHECKS", {"chunk": doctor.check_chunk})
    settings = load_settings(chunk={"model": "m", "base_url": "http://bob:pw9@127.0.0.1:9/v1"})
    [check] = doctor.run_checks(settings, timeout=2)
    assert check.level == "fail" and "m at http://***@127.0.0.1:9/v1" in check.detail
    assert "pw9" not in check.detail + check.fix and "bob" not in check.detail


def test_the_secrets_include_each_provider_base_url_password():
    settings = load_settings(
        embedding={"provider": "openai", "base_url": "http://u:emb%40pass1@10.0.0.1/v1"},
        chunk={"model": "m", "base_url": "https://u:chunk-pass-2@llm.example/v1"},
    )
    assert {"emb%40pass1", "emb@pass1", "chunk-pass-2"} <= set(settings.secrets())
    assert "u" not in settings.secrets()  # a user is no secret: masked, it would cut words
