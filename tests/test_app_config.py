"""The Celery app's reliability settings (LESSONS.md), and their validation at start-up."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from worker.app import TASK_MODULES, create_app
from worker.errors import ConfigError
from worker.settings import load_settings


def test_json_only_acks_late_reject_on_lost_prefetch_one_and_one_visibility_timeout():
    settings = load_settings(
        tasks={"time_limit": 900, "soft_time_limit": 800, "visibility_timeout": 1200}
    )
    conf = create_app(settings).conf
    assert conf.accept_content == ["json"] and conf.result_accept_content == ["json"]
    assert conf.task_serializer == conf.result_serializer == "json"
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    assert conf.broker_transport_options["visibility_timeout"] == 1200
    assert conf.result_backend_transport_options["visibility_timeout"] == 1200
    assert conf.task_time_limit == 900 and conf.task_soft_time_limit == 800
    assert conf.worker_send_task_events and conf.task_send_sent_event
    assert conf.task_track_started and conf.result_extended
    assert set(TASK_MODULES) <= set(conf.include)
    # a pool process's memory is given back: replaced past 1 GB by default
    assert conf.worker_max_memory_per_child == 1024 * 1024
    assert conf.worker_max_tasks_per_child is None


def test_pool_processes_are_replaced_as_configured_or_never():
    conf = create_app(
        load_settings(tasks={"max_tasks_per_child": 50, "max_memory_per_child": 300})
    ).conf
    assert conf.worker_max_tasks_per_child == 50
    assert conf.worker_max_memory_per_child == 300 * 1024
    never = create_app(load_settings(tasks={"max_memory_per_child": 0})).conf
    assert never.worker_max_memory_per_child is None


def test_the_tasks_have_the_seeds_names():
    import tasks.index  # noqa: F401 - registers the tasks on the app
    from worker.app import app

    assert {"GenerateEmbedding", "GenerateKnowledgeItemEmbedding"} <= set(app.tasks)


@pytest.mark.parametrize(
    "tasks",
    [
        {"time_limit": 600, "soft_time_limit": 600},
        {"time_limit": 700, "soft_time_limit": 600, "visibility_timeout": 700},
    ],
)
def test_limits_out_of_order_are_refused_at_start(tasks):
    with pytest.raises(ConfigError, match="KIDX_TASKS"):
        load_settings(tasks=tasks)


@pytest.mark.parametrize(
    ("flower", "variable"),
    [
        ({"user": "kidx", "password": "Tr0ub4dor,horse"}, "KIDX_FLOWER__PASSWORD"),  # 2 creds
        ({"user": "ops,admin", "password": "a long password"}, "KIDX_FLOWER__USER"),
        ({"user": "ops:admin", "password": "a long password"}, "KIDX_FLOWER__USER"),
        ({"user": "ops", "password": "pässwörd"}, "KIDX_FLOWER__PASSWORD"),  # a 500, each page
    ],
)
def test_flower_credentials_that_flower_would_mangle_are_refused_at_start(flower, variable):
    """FLOWER_BASIC_AUTH is split on commas (a password `a,b` became the credentials `kidx:a`
    and `b`), and Flower's hmac.compare_digest refuses non-ASCII text."""
    with pytest.raises(ConfigError, match=variable) as e:
        load_settings(flower=flower)
    assert flower["password"] not in str(e.value)  # the message never shows the secret


@pytest.mark.parametrize(
    ("overrides", "variable"),
    [
        ({"busy_timeout_ms": 0}, "KIDX_BUSY_TIMEOUT_MS"),
        ({"tasks": {"lock_ttl": 660}}, r"lock_ttl \(660 s\) must be below time_limit \(660 s\)"),
        ({"tasks": {"retry_backoff": 10, "retry_backoff_max": 5}}, "KIDX_TASKS: .*retry_backoff"),
        ({"scheduler": {"retry_backoff": 600, "retry_backoff_max": 60}}, "KIDX_SCHEDULER"),
        ({"embedding": {"backoff": 5, "backoff_max": 1}}, "KIDX_EMBEDDING: .*backoff_max"),
        ({"embedding": {"timeout": "inf"}}, "KIDX_EMBEDDING__TIMEOUT"),
        ({"chunk": {"connect_timeout": float("inf")}}, "KIDX_CHUNK__CONNECT_TIMEOUT"),
        ({"urls": {"timeout": "inf"}}, "KIDX_URLS__TIMEOUT"),
        ({"scheduler": {"reconcile_every": "inf"}}, "KIDX_SCHEDULER__RECONCILE_EVERY"),
        # beat could not schedule these: it crashed, or never sent the sweep while doctor said ok
        ({"scheduler": {"reconcile_every": 1e15}}, "KIDX_SCHEDULER__RECONCILE_EVERY"),
        ({"scheduler": {"retry_every": 3e11}}, "KIDX_SCHEDULER__RETRY_EVERY"),
        ({"tasks": {"retry_backoff_max": "inf"}}, "KIDX_TASKS__RETRY_BACKOFF_MAX"),
        ({"db": ""}, "KIDX_DB"),
        ({"db": "."}, "KIDX_DB"),
        # a user with no home: pathlib's RuntimeError went out as "a bug in kidx"
        ({"db": "~no-such-user-kidx/kidx.db"}, "KIDX_DB: .*no home directory"),
        ({"data_dir": "~no-such-user-kidx/data"}, "KIDX_DATA_DIR: .*no home directory"),
        ({"vec_path": "~no-such-user-kidx/vec0.so"}, "KIDX_VEC_PATH: .*no home directory"),
        ({"files": {"roots": ["~no-such-user-kidx/r"]}}, "KIDX_FILES__ROOTS: .*no home"),
        (
            {"embedding": {"provider": "local", "model": "~no-such-user-kidx/m"}},
            "KIDX_EMBEDDING__MODEL: .*no home directory",
        ),
    ],
)
def test_settings_that_make_no_sense_are_refused_at_start(overrides, variable):
    with pytest.raises(ConfigError, match=variable):
        load_settings(**overrides)


def test_a_broker_url_celery_or_redis_py_would_refuse_fails_at_start():
    """kidx keeps its locks in the broker's Redis: only redis:// and rediss:// work, and a bad
    host, port or database number is found at start, not when the first task is sent."""
    for url in (
        "notaurl",
        "amqp://guest@127.0.0.1//",
        "unix:///run/redis.sock",  # redis-py takes it, kombu has no such transport
        "redis://",
        "redis://127.0.0.1:0/0",
        "redis://127.0.0.1:99999/0",
        "redis://127.0.0.1:port/0",
        "redis://127.0.0.1:6379/zero",
        "redis://127.0.0.1:6379/0?db=x",
    ):
        with pytest.raises(ConfigError, match="KIDX_BROKER_URL"):
            load_settings(broker_url=url)
    for url in ("redis://:secret@redis:6379/3", "rediss://cache.example", "redis://[::1]/"):
        assert load_settings(broker_url=url).broker_url == url


def test_the_secrets_to_redact_include_the_broker_and_backend_passwords():
    settings = load_settings(
        broker_url="redis://:broker-pass-1@127.0.0.1:6379/3",
        result_backend="redis://user:backend-pass-2@127.0.0.1:6379/4",
        embedding={"provider": "openai", "model": "m", "api_key": "sk-key-3"},
    )
    assert {"broker-pass-1", "backend-pass-2", "sk-key-3"} <= set(settings.secrets())


@pytest.mark.parametrize("where", ["taken", "192.0.2.1", "nonexistent.invalid"])
def test_flower_that_cannot_listen_says_so_in_one_line(tmp_path, where):
    """A port taken, an address not this machine's, a name that does not resolve: Flower
    ended on a traceback of forty lines."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        address = "127.0.0.1" if where == "taken" else where
        env = {k: v for k, v in os.environ.items() if not k.upper().startswith("KIDX_")}
        env |= {
            "KIDX_FLOWER__USER": "ops",
            "KIDX_FLOWER__PASSWORD": "a long password",
            "KIDX_FLOWER__ADDRESS": address,
            "KIDX_FLOWER__PORT": str(busy.getsockname()[1]),
            "KIDX_DATA_DIR": str(tmp_path / "data"),
            "KIDX_DB": str(tmp_path / "kidx.db"),
        }
        out = subprocess.run(
            [sys.executable, "-m", "ops.flower"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        busy.close()
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.count("\n") == 1 and "Flower cannot listen on" in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("env", "celery_level", "expected"),
    [
        ({"KIDX_LOG_LEVEL": "error"}, 20, "ERROR"),  # the setting, over every start's INFO
        ({"KIDX_LOG_LEVEL": "debug"}, 20, "DEBUG"),
        ({}, 20, "INFO"),  # unset: Celery's --loglevel
    ],
)
def test_a_workers_log_level_is_kidx_log_level_when_set(tmp_path, env, celery_level, expected):
    """Celery always hands its setup_logging a level (--loglevel=INFO in every start command,
    else WARNING): KIDX_LOG_LEVEL was never in force in a worker or beat."""
    script = (
        "import logging, worker.app as a\n"
        f"a._logging(loglevel={celery_level})\n"
        "print(logging.getLevelName(logging.getLogger().level))\n"
    )
    base = {k: v for k, v in os.environ.items() if k != "KIDX_LOG_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**base, "KIDX_DATA_DIR": str(tmp_path), **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == expected, done.stdout + done.stderr
