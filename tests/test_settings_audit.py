"""Settings that were accepted and then failed later, or were silently ignored: a local model the
provider cannot load, misspelt KIDX_ names (in the environment and in .env), values past what
Redis, Celery or a socket can hold, a .env that is not UTF-8, `~` in paths, blank values, and
Redis URLs or result backends Celery refuses only at the first send. Each is now refused when
the settings are built, in one line naming the variable; none of these tests needs Redis."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import types
import typing
from datetime import UTC, datetime, timedelta
from pathlib import Path

import annotated_types
import pytest
from pydantic import BaseModel

from worker.errors import ConfigError
from worker.settings import (
    DAY,
    MAX_BYTES,
    MONTH,
    NOT_SETTINGS,
    NOT_SETTINGS_PREFIX,
    EmbeddingSettings,
    FilesSettings,
    Settings,
    load_settings,
    unknown_variables,
)

ROOT = Path(__file__).resolve().parents[1]
CELERY = Path(sys.executable).with_name("celery")
DEAD_BROKER = "redis://127.0.0.1:9/0"  # never reached: every run here stops before


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No KIDX_ variable of the calling shell, and a working directory with no .env."""
    for name in list(os.environ):
        if name.upper().startswith("KIDX_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)


def refused(variable: str) -> str:
    """The one line load_settings raises, which must name `variable`."""
    with pytest.raises(ConfigError) as e:
        load_settings()
    line = str(e.value)
    assert "\n" not in line and variable in line, line
    return line


def start(tmp_path: Path, command: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`celery -A worker.app <command>` as the README starts it, with only `env` as KIDX_
    variables (and a .env, if the test wrote one in tmp_path)."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("KIDX_")}
    base.update(PYTHONPATH=str(ROOT), KIDX_BROKER_URL=DEAD_BROKER, KIDX_DATA_DIR=str(tmp_path))
    base.update(env)
    return subprocess.run(
        [str(CELERY), "-A", "worker.app", command, "--loglevel=INFO"],
        cwd=tmp_path,
        env=base,
        capture_output=True,
        text=True,
        timeout=60,
    )


# -- A: the local model ---------------------------------------------------------------------


def test_a_local_model_the_provider_cannot_load_is_refused_at_start(monkeypatch, tmp_path):
    """A typo of the bundled name was found by the first task, after `kidx index --inline` had
    rebuilt the vec tables at 1536 dimensions and marked the item failed."""
    monkeypatch.setenv("KIDX_EMBEDDING__PROVIDER", "local")
    monkeypatch.setenv("KIDX_EMBEDDING__MODEL", "all-MiniLM-L6-v3")
    line = refused("KIDX_EMBEDDING__MODEL")
    assert "all-MiniLM-L6-v3" in line and "all-MiniLM-L6-v2" in line  # the names it knows
    (tmp_path / "empty").mkdir()
    monkeypatch.setenv("KIDX_EMBEDDING__MODEL", str(tmp_path / "empty"))
    assert "without config.json" in refused("KIDX_EMBEDDING__MODEL")


def test_the_local_models_that_load_are_taken(monkeypatch, tmp_path):
    monkeypatch.setenv("KIDX_EMBEDDING__PROVIDER", "local")
    for name in ("all-MiniLM-L6-v2", "sentence-transformers/all-MiniLM-L6-v2", " "):
        monkeypatch.setenv("KIDX_EMBEDDING__MODEL", name)
        assert load_settings().embedding.model.endswith("all-MiniLM-L6-v2")
    model = tmp_path / "home" / "models" / "mine"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KIDX_EMBEDDING__MODEL", "~/models/mine")
    assert load_settings().embedding.model == "~/models/mine"
    # another provider's model is the server's business
    monkeypatch.setenv("KIDX_EMBEDDING__PROVIDER", "openai")
    monkeypatch.setenv("KIDX_EMBEDDING__MODEL", "all-MiniLM-L6-v3")
    assert load_settings().embedding.model == "all-MiniLM-L6-v3"


# -- B: misspelt names ----------------------------------------------------------------------

TYPOS = [
    ("KIDX_BROKER_ULR", "redis://10.0.0.9:6379/3", "KIDX_BROKER_URL"),
    ("KIDX_EMBEDDING_MODEL", "nomic-embed-text", "KIDX_EMBEDDING__MODEL"),
    ("KIDX_BUSY_TIMEOUT", "60000", "KIDX_BUSY_TIMEOUT_MS"),
    ("KIDX_LOGLEVEL", "debug", "KIDX_LOG_LEVEL"),
    ("KIDX_EMBEDING__MODEL", "nomic-embed-text", "KIDX_EMBEDDING__MODEL"),
    ("KIDX_TASKS__CONCURENCY", "4", "KIDX_TASKS__CONCURRENCY"),
    ("KIDX_EMBEDDING__MODEL__NAME", "x", None),
]


@pytest.mark.parametrize(("name", "value", "meant"), TYPOS)
def test_a_misspelt_variable_is_refused_not_ignored(monkeypatch, name, value, meant):
    monkeypatch.setenv(name, value)
    line = refused(name)
    assert "no such setting" in line
    if meant:
        assert f"did you mean {meant}?" in line


@pytest.mark.parametrize(("name", "value", "meant"), TYPOS)
def test_a_misspelt_variable_in_dotenv_is_refused_too(tmp_path, name, value, meant):
    """.env was never scanned: a misspelt group there was accepted, though refused in the
    environment."""
    (tmp_path / ".env").write_text(f"OPENAI_API_KEY=sk-x\n{name}={value}\n")
    line = refused(name)
    assert "(in .env)" in line and "no such setting" in line


def test_the_variables_kidx_and_its_tools_set_are_taken(monkeypatch, tmp_path):
    """Every KIDX_ name the repository's tools, compose file, benchmarks and docs set is a
    setting or one of the few deliberately not (the fault tests' figures, the screenshot)."""
    sources = [ROOT / "Makefile", ROOT / "docker-compose.yml", ROOT / "Dockerfile"]
    sources += [ROOT / ".ci" / "run", ROOT / "README.md", ROOT / "tests" / "faultkit.py"]
    for folder in ("ops", "bench", "testkit", "worker", "tasks", "scheduler", "docs"):
        sources += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".sh")]
    found = set()
    for path in sources:
        if path.is_file() and path.name != "settings.py":  # its docstrings quote typos
            # a quoted refusal (README: "KIDX_LOGLEVEL: no such setting") names no variable
            text = re.sub(r"\bKIDX_\w+: no such setting", "", path.read_text("utf-8"))
            found |= set(re.findall(r"\bKIDX_[A-Z0-9_]*[A-Z0-9]\b", text))
    assert "KIDX_SOAK" in found and "KIDX_TASKS_SCREENSHOT" in found
    assert unknown_variables(sorted(found)) == []
    # and they start a process: in the environment, in lower case, a group as JSON, in .env
    for name in [*sorted(NOT_SETTINGS), NOT_SETTINGS_PREFIX + "CRASH_KILLS"]:
        monkeypatch.setenv(name, "1")
    monkeypatch.setenv("kidx_log_level", "debug")
    monkeypatch.setenv("KIDX_TASKS", '{"concurrency": 3}')
    (tmp_path / ".env").write_text("KIDX_EMBEDDING__BATCH_SIZE=8\nOTHER_TOOL_VAR=1\n")
    settings = load_settings()
    assert (settings.log_level, settings.tasks.concurrency) == ("debug", 3)
    assert settings.embedding.batch_size == 8


# -- C: the worker and beat start-up --------------------------------------------------------


@pytest.mark.parametrize("command", ["worker", "beat"])
@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"KIDX_TASKS__CONCURRENCY": "-1"}, "KIDX_TASKS__CONCURRENCY"),
        ({"KIDX_BROKER_ULR": "redis://127.0.0.1:6379/3"}, "KIDX_BROKER_ULR"),
        (
            {"KIDX_EMBEDDING__PROVIDER": "local", "KIDX_EMBEDDING__MODEL": "all-MiniLM-L6-v3"},
            "KIDX_EMBEDDING__MODEL",
        ),
    ],
)
def test_a_bad_setting_stops_the_worker_and_beat_in_one_line(tmp_path, command, env, variable):
    """Celery wrapped the error of `worker.app`'s import in a 32-line traceback (and a local
    model typo started a worker that failed every task)."""
    done = start(tmp_path, command, **env)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error: invalid settings: "), lines
    assert variable in lines[0] and "Traceback" not in done.stdout + done.stderr


def test_a_misspelt_name_in_dotenv_stops_the_worker(tmp_path):
    (tmp_path / ".env").write_text("KIDX_EMBEDING__MODEL=nomic-embed-text\n")
    done = start(tmp_path, "worker")
    assert done.returncode == 2 and "KIDX_EMBEDING__MODEL (in .env)" in done.stderr


# -- D: upper bounds ------------------------------------------------------------------------


def _numeric_fields(model: type[BaseModel], prefix: str = "KIDX_") -> list[tuple[str, list]]:
    fields = []
    for name, field in model.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            fields += _numeric_fields(kind, f"{prefix}{name.upper()}__")
            continue
        kinds = typing.get_args(kind) if isinstance(kind, types.UnionType) else (kind,)
        if any(k in (int, float) for k in kinds):
            fields.append((prefix + name.upper(), field.metadata))
    return fields


def test_every_numeric_setting_has_an_upper_bound():
    fields = _numeric_fields(Settings)
    assert len(fields) > 50
    unbounded = [
        name
        for name, metadata in fields
        if not any(isinstance(m, annotated_types.Le | annotated_types.Lt) for m in metadata)
    ]
    assert unbounded == []


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KIDX_TASKS__LOCK_TTL", "10000000000000000000"),  # Redis refused the lock's PX
        ("KIDX_TASKS__VISIBILITY_TIMEOUT", str(10**20)),  # embed_memories' lock's EX
        ("KIDX_FILES__MAX_BYTES", str(2**63 - 1)),  # OverflowError, "a bug in kidx"
        ("KIDX_URLS__MAX_BYTES", str(2**53)),
        ("KIDX_EMBEDDING__TIMEOUT", "1e10"),  # OverflowError: timestamp out of range
        ("KIDX_EMBEDDING__CONNECT_TIMEOUT", "1e10"),
        ("KIDX_URLS__TIMEOUT", "1e10"),
        ("KIDX_CHUNK__TIMEOUT", "1e10"),
        ("KIDX_TASKS__RETRY_BACKOFF_MAX", "1e14"),  # OverflowError in the retry's eta
        ("KIDX_TASKS__CONCURRENCY", str(10**20)),
        ("KIDX_SCHEDULER__RETRY_MAX_ATTEMPTS", "2000"),  # 2**1999 is no float
        ("KIDX_BUSY_TIMEOUT_MS", str(2**40)),
    ],
)
def test_a_value_past_what_works_is_refused(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    assert "less than or equal to" in refused(variable)


def test_the_largest_values_taken_work(monkeypatch, tmp_path):
    """At the bounds: the queue's longest retry countdown makes a message (Celery's eta), a
    file is read with the largest size limit, a request with the longest timeouts fails as a
    provider error, not an OverflowError."""
    from tasks.run import longest_countdown
    from worker.app import create_app
    from worker.errors import ProviderError
    from worker.providers import build_embedder
    from worker.sources.files import read_file

    settings = load_settings(
        broker_url=DEAD_BROKER,
        tasks={
            "soft_time_limit": MONTH - 2,
            "time_limit": MONTH - 1,
            "visibility_timeout": MONTH,
            "lock_ttl": MONTH - 2,
            "retry_backoff": MONTH,
            "retry_backoff_max": MONTH,
            "max_retries": 100,
            "concurrency": 256,
        },
        embedding={
            "provider": "openai",
            "base_url": "http://127.0.0.1:9/v1",  # nothing listens: refused at once
            "timeout": DAY,
            "connect_timeout": DAY,
            "max_retries": 0,
            "dimensions": 8,
        },
    )
    app = create_app(settings)
    countdown = MONTH + longest_countdown(settings.tasks)  # past what a retry is given
    message = app.amqp.as_task_v2("id-1", "kidx.index", args=[1], countdown=countdown)
    eta = datetime.fromisoformat(message.headers["eta"])
    assert eta > datetime.now(UTC) + timedelta(days=29)

    with pytest.raises(ProviderError):
        build_embedder(settings.embedding, dimensions=8).embed_checked(["a text"])

    (tmp_path / "a.md").write_text("# Hi\nsome text here\n")
    files = FilesSettings(roots=[tmp_path], max_bytes=MAX_BYTES)
    assert read_file(tmp_path / "a.md", files).startswith("# Hi")


# -- E: a .env that is not UTF-8 ------------------------------------------------------------


def test_a_dotenv_that_is_not_utf8_is_one_line_naming_the_byte(tmp_path):
    (tmp_path / ".env").write_bytes(b"KIDX_FLOWER__USER=caf\xe9\n")
    assert refused(".env is not UTF-8 (byte 0xe9 at position 21)")


def test_kidx_with_a_dotenv_that_is_not_utf8_says_so_not_a_bug(tmp_path):
    (tmp_path / ".env").write_bytes(b"KIDX_FLOWER__USER=caf\xe9\n")
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KIDX_")}
    done = subprocess.run(
        [str(Path(sys.executable).with_name("kidx")), "status", "--summary"],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(ROOT), "KIDX_DB": str(tmp_path / "k.db")},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "is not UTF-8 (byte 0xe9 at position 21)" in done.stderr
    assert "bug" not in done.stderr and "Traceback" not in done.stderr


def test_a_dotenv_with_a_byte_order_mark_is_read(tmp_path):
    (tmp_path / ".env").write_bytes("\ufeffKIDX_LOG_LEVEL=debug\n".encode())
    assert load_settings().log_level == "debug"


# -- F: ~ in paths --------------------------------------------------------------------------


def test_a_tilde_in_the_paths_is_the_home_folder(monkeypatch, tmp_path):
    """KIDX_DB='~/kidx.db' (a .env or an env_file: no shell expands it) made a folder named ~
    in the working directory."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("KIDX_DATA_DIR", "~/kidx-data")
    monkeypatch.setenv("KIDX_VEC_PATH", "~/lib/vec0")
    (tmp_path / ".env").write_text("KIDX_DB=~/kidx.db\n")
    home = tmp_path / "home"
    (home / "lib").mkdir(parents=True)
    (home / "lib" / "vec0.so").write_bytes(b"")  # (SQLite adds the suffix)
    settings = load_settings()
    assert (settings.db, settings.data_dir) == (home / "kidx.db", home / "kidx-data")
    assert settings.vec_path == home / "lib" / "vec0"


def test_an_in_memory_database_is_refused(monkeypatch):
    """KIDX_DB=:memory: gave each process a database of its own, gone when it closed: `kidx
    init` said all was well, and what a worker indexed was lost."""
    monkeypatch.setenv("KIDX_DB", ":memory:")
    with pytest.raises(ConfigError, match="':memory:' is a database of one connection"):
        load_settings()


# -- G: blank values ------------------------------------------------------------------------


def test_a_blank_path_is_unset(monkeypatch):
    """KIDX_VEC_PATH= was Path('.'), a library that never loaded (search silently fell back)."""
    monkeypatch.setenv("KIDX_VEC_PATH", "")
    monkeypatch.setenv("KIDX_DATA_DIR", " ")
    settings = load_settings()
    assert (settings.vec_path, settings.data_dir) == (None, Path("data"))


@pytest.mark.parametrize("value", ["", ",", " , "])
def test_an_empty_content_type_list_is_refused(monkeypatch, value):
    """It refused every URL."""
    monkeypatch.setenv("KIDX_URLS__CONTENT_TYPES", value)
    assert "at least one media type" in refused("KIDX_URLS__CONTENT_TYPES")


# -- H: Redis URLs and result backends ------------------------------------------------------


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/9?foo=1",  # TypeError at the first send
        "redis://127.0.0.1:6379/9?db=9",  # kombu: TypeError
        "redis://127.0.0.1:6379/9?socket_timeout=3",  # kombu: TypeError
        "redis://127.0.0.1:6379/9?heartbeat=10",  # redis-py (kidx's locks): TypeError
        "redis://127.0.0.1:6379/9?ssl_cert_reqs=required",  # TLS on a redis:// URL
        "rediss://127.0.0.1:6379/9?ssl_cert_reqs=CERT_REQUIRED",  # redis-py refuses it
        "rediss://127.0.0.1:6379/9?ssl_cert_reqs=required&ssl_cert_reqs=none",
    ],
)
@pytest.mark.parametrize("variable", ["KIDX_BROKER_URL", "KIDX_RESULT_BACKEND"])
def test_a_query_parameter_a_redis_client_refuses_is_refused(monkeypatch, url, variable):
    monkeypatch.setenv(variable, url)
    refused(variable)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/9",
        "rediss://127.0.0.1:6379/9",
        "rediss://127.0.0.1:6379/9?ssl_cert_reqs=none",
        "rediss://127.0.0.1:6379/9?ssl_cert_reqs=required&ssl_check_hostname=false"
        "&ssl_ca_certs=/etc/ssl/certs/ca-certificates.crt",
        "rediss://127.0.0.1:6379/9?ssl_certfile=/tmp/c.pem&ssl_keyfile=/tmp/c.key",
    ],
)
def test_the_redis_urls_taken_make_clients_all_three_libraries_accept(url):
    """kombu (the broker), Celery's Redis backend and redis-py (kidx's own clients) build their
    connections from the URL without a TypeError or ValueError; without ssl_cert_reqs a
    rediss:// URL verifies the certificate in all three (kombu turned verification off, and
    the backend refused the URL at the first result)."""
    import ssl

    import redis

    from worker.app import create_app

    app = create_app(load_settings(broker_url=url))
    backend = app.backend.connparams
    connection = app.connection_for_write()
    redis.Redis.from_url(url).connection_pool.make_connection()
    if url.startswith("rediss://"):
        reqs = ssl.CERT_NONE if "=none" in url else ssl.CERT_REQUIRED
        assert backend["ssl_cert_reqs"] == reqs
        assert connection.ssl.get("ssl_cert_reqs", ssl.CERT_REQUIRED) == reqs
    connection.release()


@pytest.mark.parametrize(
    "url",
    [
        "foo://bar",
        "rpc://",
        "mongodb://127.0.0.1/kidx",
        "cache+memcached://127.0.0.1:11211/",
        "db+sqlite",
        "file:///tmp/results",
    ],
)
def test_a_result_backend_kidx_does_not_take_is_refused(monkeypatch, url):
    """foo://bar passed, then the first send was a ModuleNotFoundError, "a bug in kidx"."""
    monkeypatch.setenv("KIDX_RESULT_BACKEND", url)
    line = refused("KIDX_RESULT_BACKEND")
    assert "redis://" in line and "db+" in line


def test_the_result_backends_kidx_takes(monkeypatch):
    import worker.settings

    # SQLAlchemy and the database's driver there, whether this environment has them or not
    monkeypatch.setattr(worker.settings, "_sqlalchemy_problem", lambda url: None)
    for url in ("redis://127.0.0.1:6379/4", "db+postgresql+psycopg://h/k", "db+mysql://h/k"):
        assert load_settings(result_backend=url).result_backend == url


@pytest.mark.parametrize("url", ["db+sqlite:///results.db", "db+sqlite+pysqlite:///r.db"])
def test_a_sqlite_result_backend_is_refused(monkeypatch, url):
    """Python's sqlite3 in every worker beside kidx's apsw: two SQLite libraries, one process."""
    monkeypatch.setenv("KIDX_RESULT_BACKEND", url)
    assert "two SQLite libraries in one process" in refused("KIDX_RESULT_BACKEND")


def test_the_sqlalchemy_backend_without_sqlalchemy_is_refused_when_read(monkeypatch):
    """Taken, then the worker died at its start (Celery loads the backend for its banner)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n == "sqlalchemy" else real(n, *a)
    )
    monkeypatch.setenv("KIDX_RESULT_BACKEND", "db+postgresql://h/k")
    assert "needs SQLAlchemy" in refused("KIDX_RESULT_BACKEND")


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("db+oracle://h/k", "needs the database's driver here: No module named 'oracledb'"),
        ("db+nosuch://h/k", "not a database URL SQLAlchemy can use"),
    ],
)
def test_a_sqlalchemy_backend_whose_driver_or_dialect_is_missing_is_refused(
    monkeypatch, url, words
):
    """SQLAlchemy there, the driver not (psycopg for PostgreSQL): the worker died at its start
    all the same, on ModuleNotFoundError."""
    monkeypatch.setenv("KIDX_RESULT_BACKEND", url)
    assert words in refused("KIDX_RESULT_BACKEND")


# -- a second review of the settings -----------------------------------------------------------


@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("KIDX_EMBEDDING__MODEL", "text-\udcff-model"),  # b'\xff' from the environment
        ("KIDX_EMBEDDING__BASE_URL", "https://api.\udcff.example/v1"),
        ("KIDX_CHUNK__MODEL", "chat-\udcfe"),
    ],
)
def test_a_setting_that_is_not_utf8_is_named(monkeypatch, variable: str, value: str) -> None:
    """Accepted, it failed every command with UnicodeEncodeError, "a bug in kidx"."""
    monkeypatch.setenv("KIDX_EMBEDDING__PROVIDER", "openai")
    monkeypatch.setenv(variable, value)
    assert "not UTF-8" in refused(variable)


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/7/",  # kombu: "Database is int between 0 and limit - 1, not 7/"
        "redis://127.0.0.1:6379/7/1",
        "redis://127.0.0.1:6379/99999999999999999999999",
    ],
)
def test_a_broker_url_whose_database_kombu_or_redis_cannot_take_is_refused(monkeypatch, url):
    monkeypatch.setenv("KIDX_BROKER_URL", url)
    assert "database number" in refused("KIDX_BROKER_URL")


def test_a_scheme_in_capitals_is_written_as_celery_loads_it(monkeypatch) -> None:
    """`REDIS://` passed `urlsplit` (lower-cased) and Celery then looked for a module `REDIS`."""
    monkeypatch.setenv("KIDX_BROKER_URL", "REDIS://127.0.0.1:6379/7")
    monkeypatch.setenv("KIDX_RESULT_BACKEND", "Redis://127.0.0.1:6379/8")
    settings = load_settings()
    assert (settings.broker_url, settings.backend_url) == (
        "redis://127.0.0.1:6379/7",
        "redis://127.0.0.1:6379/8",
    )


def test_json_nested_thousands_deep_is_a_config_error(monkeypatch) -> None:
    monkeypatch.setenv("KIDX_FILES__ROOTS", "[" * 3000)
    assert "too deeply" in refused("KIDX_")


def test_a_variable_set_twice_in_two_cases_is_refused(monkeypatch, tmp_path) -> None:
    """The one later in the environment chose the database, silently."""
    monkeypatch.setenv("KIDX_DB", str(tmp_path / "a.db"))
    monkeypatch.setenv("kidx_db", str(tmp_path / "b.db"))
    assert "KIDX_DB, kidx_db" in refused("KIDX_DB is set 2 times")


def test_a_data_dir_that_is_a_file_is_refused(monkeypatch, tmp_path) -> None:
    (tmp_path / "afile").write_text("")
    monkeypatch.setenv("KIDX_DATA_DIR", str(tmp_path / "afile"))
    assert "afile is not a directory" in refused("KIDX_DATA_DIR")
    monkeypatch.setenv("KIDX_DATA_DIR", str(tmp_path / "afile" / "below"))
    assert "afile is not a directory" in refused("KIDX_DATA_DIR")


@pytest.mark.parametrize(("value", "words"), [("vec0.so", "absolute"), ("/no/vec0", "no such")])
def test_a_vec_path_that_loads_nothing_is_refused(monkeypatch, value: str, words: str) -> None:
    """Search fell back to the exact scan with only a warning in the log."""
    monkeypatch.setenv("KIDX_VEC_PATH", value)
    assert words in refused("KIDX_VEC_PATH")


@pytest.mark.parametrize(
    ("config", "dimensions"),
    [('{"hidden_size": 384}', 384), ('{"hidden_size": "384"}', None), ("not json", None)],
)
def test_a_local_model_directory_gives_its_dimension(tmp_path, config, dimensions) -> None:
    """Without KIDX_EMBEDDING__DIMENSIONS the index was made at 1536, and every vector of
    the directory's 384-dimension model was refused."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(config)
    settings = EmbeddingSettings(provider="local", model=str(tmp_path / "model"))
    assert settings.model_dimensions() == dimensions


@pytest.mark.parametrize("blank", [" ", "\t", "  "])
def test_a_broker_url_led_by_blanks_keeps_its_scheme(monkeypatch, blank: str) -> None:
    """The scheme was cut from the value by its length, after the blanks urlsplit skips:
    ' redis://' became 'rediss://' (TLS against a plain Redis), '  redis://' 'redisis://'."""
    monkeypatch.setenv("KIDX_BROKER_URL", blank + "redis://127.0.0.1:6379/7")
    assert load_settings().broker_url == "redis://127.0.0.1:6379/7"


@pytest.mark.parametrize("variable", ["KIDX_DATA_DIR", "KIDX_VEC_PATH"])
def test_a_path_no_folder_can_be_looked_at_is_a_config_error(monkeypatch, variable) -> None:
    """`Path.exists` raised OSError (a name too long) out of the settings, no ConfigError."""
    monkeypatch.setenv(variable, "/tmp/" + "a" * 300 + "/x")
    assert "cannot be looked at" in refused(variable)


def test_a_local_model_name_no_folder_can_have_is_a_config_error(monkeypatch) -> None:
    monkeypatch.setenv("KIDX_EMBEDDING__PROVIDER", "local")
    monkeypatch.setenv("KIDX_EMBEDDING__MODEL", "/tmp/" + "m" * 300)
    assert "cannot be looked at" in refused("KIDX_EMBEDDING__MODEL")
