"""A password in a provider's base URL reaches no log, stored error or stream; settings that
would be accepted and then silently never work are refused at start, naming the variable."""

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
from worker.errors import ConfigError, InvalidInput
from worker.providers.http import ProviderHTTPError
from worker.providers.openai import OpenAIEmbeddings
from worker.settings import EmbeddingSettings, UrlSettings, load_settings
from worker.sources.urls import _Policy
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


# -- settings refused at start ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("10.0.0.0/33", "bad prefix length"),
        ("http://127.0.0.1:8080", "has a scheme"),
        ("127.0.0.1:8080", "has a port"),
        ("not a host!", "has a space"),
        ("internal.example/docs", "has a path"),
        ("*.internal.example", "wildcard"),
        ("bad_host!", "not a host name"),
        ("127.1", "IP address in full"),
    ],
)
def test_an_allow_hosts_entry_no_url_could_match_is_refused(monkeypatch, entry, why):
    monkeypatch.setenv("KIDX_URLS__ALLOW_HOSTS", f"localhost,{entry}")
    with pytest.raises(ConfigError, match="KIDX_URLS__ALLOW_HOSTS") as e:
        load_settings()
    assert repr(entry) in str(e.value) and why in str(e.value)
    with pytest.raises(InvalidInput, match="KIDX_URLS__ALLOW_HOSTS"):  # unvalidated settings
        _Policy(UrlSettings.model_construct(allow_hosts=[entry]))


def test_allow_hosts_entries_are_kept_as_fetches_match_them(monkeypatch):
    given = " 10.0.0.5/8, [::1], 192.168.1.7, Internal.Example., bücher.example, my_service"
    monkeypatch.setenv("KIDX_URLS__ALLOW_HOSTS", given)
    urls = load_settings().urls
    assert urls.allow_hosts == [
        "10.0.0.0/8",
        "::1/128",
        "192.168.1.7/32",
        "internal.example",
        "xn--bcher-kva.example",
        "my_service",
    ]
    policy = _Policy(urls)
    no_dns = lambda host, port: ["10.1.2.3"]  # noqa: E731
    assert policy.check("10.200.0.1", 80, no_dns) == ["10.200.0.1"]
    assert policy.check("internal.example", 80, no_dns) == ["10.1.2.3"]


def test_model_names_are_stripped_and_blank_means_unset(monkeypatch):
    monkeypatch.setenv("KIDX_CHUNK__MODEL", "   ")
    monkeypatch.setenv("KIDX_EMBEDDING__MODEL", "  ")
    settings = load_settings()
    assert settings.chunk.model == ""  # structural chunking, not a model named "   "
    assert settings.embedding.model == "all-MiniLM-L6-v2"  # the provider's default
    monkeypatch.setenv("KIDX_CHUNK__MODEL", " llama3.1 ")
    monkeypatch.setenv("KIDX_EMBEDDING__PROVIDER", "openai")  # local refuses a model it lacks
    monkeypatch.setenv("KIDX_EMBEDDING__MODEL", "\tnomic-embed-text\n")
    settings = load_settings()
    assert (settings.chunk.model, settings.embedding.model) == ("llama3.1", "nomic-embed-text")


@pytest.mark.parametrize(
    "url",
    [
        "http://",
        "http://:8080/v1",
        "http://127.0.0.1:0/v1",
        "http://127.0.0.1:99999/v1",
        "http://127.0.0.1:port/v1",
        "http://127.0.0.1 /v1",
        "http://u:pw-in-msg@127.0.0.1/v1?api-key=x",  # the query would swallow /embeddings
        "http://127.0.0.1/v1#top",
    ],
)
def test_a_base_url_httpx_could_not_use_is_refused_without_showing_it(url):
    with pytest.raises(ConfigError, match="KIDX_CHUNK__BASE_URL") as e:
        load_settings(chunk={"model": "m", "base_url": url})
    assert "pw-in-msg" not in str(e.value)


def test_a_base_url_with_spaces_or_slashes_around_it_is_taken_trimmed():
    chunk = load_settings(chunk={"base_url": " http://127.0.0.1:11434/v1/ \n"}).chunk
    assert chunk.base_url == "http://127.0.0.1:11434/v1"


def test_an_api_key_is_stripped_and_one_no_header_can_carry_is_refused():
    """A key file's newline made every request fail as a connection error quoting the key."""
    key = load_settings(embedding={"api_key": " sk-abc123\n"}).embedding.api_key
    assert key is not None and key.get_secret_value() == "sk-abc123"
    assert load_settings(embedding={"api_key": "  "}).embedding.api_key is None
    for bad in ("sk-abc 123", "sk-äbc123"):
        with pytest.raises(ConfigError, match="KIDX_EMBEDDING__API_KEY") as e:
            load_settings(embedding={"api_key": bad})
        assert bad not in str(e.value)


def test_a_key_and_base_url_credentials_together_are_refused():
    """httpx sends the URL's user:password@ as basic auth, in place of the Bearer key."""
    with pytest.raises(ConfigError, match=r"KIDX_EMBEDDING: .*one or the other") as e:
        load_settings(embedding={"api_key": "sk-k1", "base_url": "http://bob:pw-x1@proxy/v1"})
    assert "pw-x1" not in str(e.value) and "sk-k1" not in str(e.value)


def test_a_misspelt_variable_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv("KIDX_EMBEDDING__PROVIDR", "openai")
    with pytest.raises(ConfigError, match="KIDX_EMBEDDING__PROVIDR: no such setting"):
        load_settings()
    monkeypatch.delenv("KIDX_EMBEDDING__PROVIDR")
    monkeypatch.setenv("KIDX_EMBEDING__MODEL", "nomic-embed-text")
    with pytest.raises(ConfigError, match="KIDX_EMBEDING__MODEL: no such settings group"):
        load_settings()


@pytest.mark.parametrize(
    ("overrides", "variable"),
    [
        ({"urls": {"content_types": "text/html,text/*"}}, "KIDX_URLS__CONTENT_TYPES"),
        ({"urls": {"content_types": "text/html; charset=utf-8"}}, "KIDX_URLS__CONTENT_TYPES"),
        ({"metrics": {"address": "http://0.0.0.0"}}, "KIDX_METRICS__ADDRESS"),
        ({"metrics": {"address": "127.0.0.1:9808"}}, "KIDX_METRICS__ADDRESS"),
        ({"flower": {"address": "0.0.0.0:5555"}}, "KIDX_FLOWER__ADDRESS"),
        ({"files": {"roots": "/srv/docs,docs"}}, "KIDX_FILES__ROOTS"),
        ({"result_backend": "redis://127.0.0.1:99999/1"}, "KIDX_RESULT_BACKEND"),
        ({"result_backend": "notaurl"}, "KIDX_RESULT_BACKEND"),
    ],
)
def test_other_values_that_would_silently_never_work_are_refused(overrides, variable):
    with pytest.raises(ConfigError, match=variable):
        load_settings(**overrides)


def test_the_values_those_checks_take():
    settings = load_settings(
        urls={"content_types": " Text/HTML ,application/pdf"},
        metrics={"address": "[::1]"},
        flower={"address": ""},
        files={"roots": "~/docs,/srv/docs"},
        result_backend="redis://127.0.0.1:6379/4",
    )
    assert settings.urls.content_types == ["text/html", "application/pdf"]
    assert (settings.metrics.address, settings.flower.address) == ("::1", "")
    assert settings.files.roots == [Path("~/docs"), Path("/srv/docs")]
