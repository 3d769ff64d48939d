"""docker-compose.yml, checked statically against what the native stack runs (ops/stack.py) and
the settings (worker/settings.py); and the cheap behaviour of `python -m ops.stack`."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml  # PyYAML: here through huggingface_hub and transformers (the local extra)
from pydantic import BaseModel

from ops import stack as ops_stack
from stack import free_port
from worker.settings import Settings, TaskSettings, variable_names

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("redis", "worker", "beat", "flower")
REF = re.compile(r"\$\{(?P<name>\w+)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def service(compose: dict[str, Any], name: str) -> dict[str, Any]:
    return compose["services"][name]


def as_python_args(command: list[str]) -> list[str]:
    """A compose command as the arguments after the interpreter, as ops/stack.py builds them."""
    if command[0] == "celery":
        return ["-m", "celery", *command[1:]]
    assert command[0] == "python", f"neither celery nor python: {command}"
    return command[1:]


def flags(args: list[str]) -> dict[str, str]:
    """`--name=value` and `-n value` options by name."""
    out: dict[str, str] = {}
    for i, a in enumerate(args):
        if a.startswith("--"):
            name, _, value = a.partition("=")
            out[name] = value
        elif a in {"-n", "-A"}:
            out[a] = args[i + 1]
    return out


def test_the_four_services_exist(compose: dict[str, Any]) -> None:
    assert set(SERVICES) <= set(compose["services"])


@pytest.mark.parametrize("name", ["worker", "beat", "flower"])
def test_each_command_is_one_the_native_stack_runs(compose: dict[str, Any], name: str) -> None:
    ours = as_python_args(service(compose, name)["command"])
    default = TaskSettings().concurrency
    native = {
        "worker": ops_stack.worker_args(default),
        "beat": ops_stack.beat_args(),
        "flower": ops_stack.flower_args(),
    }[name]
    full = ops_stack.commands(Settings(), Path("/data"))[name][1:]
    # The program and subcommand, in order: -m celery -A worker.app worker|beat, -m ops.flower.
    head = list(itertools.takewhile(lambda a: not a.startswith("--"), native))
    assert ours[: len(head)] == head
    # Every native flag with its value (the concurrency: the same setting, the same default).
    for flag, value in flags(native).items():
        assert flag in flags(ours), f"{name}: {flag} missing from {ours}"
        if flag == "--concurrency":
            value = f"${{KIDX_TASKS__CONCURRENCY:-{default}}}"
        assert flags(ours)[flag] == value, f"{name}: {flag}"
    # No option the native stack does not pass too (there, the paths are under its data dir).
    assert set(flags(ours)) <= set(flags(full)), f"{name}: options the native stack lacks"


def test_worker_statedb_is_per_replica(compose: dict[str, Any]) -> None:
    """%n is "kidx" for every replica (-n kidx@%h): the state file must name the host."""
    statedb = flags(service(compose, "worker")["command"])["--statedb"]
    assert statedb.startswith("/data/") and "%h" in statedb


def default_of(value: object) -> str | None:
    """What a compose value is when the host sets nothing (None: unknown or required)."""
    if value is None:
        return None  # passed through from the host when set there
    m = REF.fullmatch(str(value))
    if m is None:
        return str(value)
    return m["arg"] if m["op"] in {"-", ":-"} else None


def setting_exists(name: str) -> bool:
    parts = name.removeprefix("KIDX_").lower().split("__")
    model: type[BaseModel] = Settings
    for i, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return False
        kind = field.annotation
        nested = isinstance(kind, type) and issubclass(kind, BaseModel)
        if i == len(parts) - 1:
            return not nested  # KIDX_EMBEDDING alone is a group, not a setting
        if not nested:
            return False
        model = kind  # type: ignore[assignment]
    return False


def test_every_kidx_variable_is_a_real_setting(
    compose: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    text = re.sub(r"(^|\s)#.*$", "", (ROOT / "docker-compose.yml").read_text(), flags=re.M)
    referenced = {m["name"] for m in REF.finditer(text) if m["name"].startswith("KIDX_")}
    named = set(re.findall(r"\bKIDX_\w+", text))
    assert referenced and named >= referenced
    for key in sorted(named):
        assert setting_exists(key), f"{key} is not a setting of worker/settings.py"
    for key in list(os.environ):
        if key.startswith("KIDX_"):
            monkeypatch.delenv(key)
    for name in ("worker", "beat", "flower"):  # each service's settings, as it would build them
        env = {k: default_of(v) for k, v in service(compose, name)["environment"].items()}
        with monkeypatch.context() as m:
            for key, value in env.items():
                if value is not None:
                    m.setenv(key, value)
            s = Settings(_env_file=None)  # type: ignore[call-arg]
        assert s.db == Path("/data/kidx.db") and s.data_dir == Path("/data"), name
        assert s.broker_url == "redis://redis:6379/0", name
        assert s.tasks.concurrency == TaskSettings().concurrency, name
        if name == "flower":  # it listens in its container; the published port is the same
            assert (s.flower.address, s.flower.port) == ("0.0.0.0", 5555)


# DESIGN.md §6: "The same names appear in docker-compose.yml and the README."
DESIGN_SETTINGS = (
    "KIDX_DB",
    "KIDX_BROKER_URL",
    "KIDX_EMBEDDING__PROVIDER",
    "KIDX_EMBEDDING__MODEL",
    "KIDX_EMBEDDING__BASE_URL",
    "KIDX_EMBEDDING__API_KEY",
    "KIDX_EMBEDDING__DIMENSIONS",
    "KIDX_EMBEDDING__BATCH_SIZE",
    "KIDX_CHUNK__MODEL",
    "KIDX_CHUNK__BASE_URL",
    "KIDX_CHUNK__API_KEY",
    "KIDX_FLOWER__USER",
    "KIDX_FLOWER__PASSWORD",
    "KIDX_FILES__ROOTS",
    "KIDX_URLS__ALLOW_HOSTS",
)
DESIGN = ROOT.parent / "shared" / "design" / "DESIGN.md"


def design_settings(text: str) -> set[str]:
    """The variables DESIGN.md §6 names, its `__NAME` shorthands expanded (`__MODEL` after
    `KIDX_EMBEDDING__PROVIDER` is KIDX_EMBEDDING__MODEL)."""
    section = text.split("## 6.", 1)[1].split("\n## ", 1)[0].split("\n", 1)[1]
    names: set[str] = set()
    group = ""
    for token in re.findall(r"\bKIDX_\w+|(?<!\w)__[A-Z_]+", section):
        if token.startswith("KIDX_"):
            group = token.rpartition("__")[0] if "__" in token else ""
            names.add(token)
        elif group:
            names.add(group + token)
    return names


def test_every_setting_the_design_names_is_passed(compose: dict[str, Any]) -> None:
    """Not only the names present must be settings: every one DESIGN §6 lists must be there
    (KIDX_EMBEDDING__BATCH_SIZE was missing); Flower's credentials in Flower's service."""
    if DESIGN.exists():  # beside the clone in CI; the list above must stay the design's
        assert design_settings(DESIGN.read_text()) == set(DESIGN_SETTINGS)
    for key in DESIGN_SETTINGS:
        where = ("flower",) if key.startswith("KIDX_FLOWER__") else ("worker", "beat", "flower")
        for name in where:
            assert key in service(compose, name)["environment"], f"{name} lacks {key}"


def test_every_setting_reaches_the_containers(compose: dict[str, Any]) -> None:
    """Only the provider's and a few other variables were passed: KIDX_EMBEDDING__TIMEOUT,
    KIDX_TASKS__SOFT_TIME_LIMIT and most others, set on the host, never reached a worker.
    (A group's JSON form too; Flower's own only to Flower.)"""
    names = variable_names()
    every = [n for n in names[""] if n[5:] not in names]
    every += [n for group, more in names.items() if group for n in more]
    for name in ("worker", "beat", "flower"):
        env = service(compose, name)["environment"]
        wanted = [n for n in every if name == "flower" or not n.startswith("KIDX_FLOWER__")]
        # (a sqlite-vec library on the host is none in the image: refused there, not passed)
        assert [n for n in wanted if n not in env] == ["KIDX_VEC_PATH"], name


def test_the_files_to_index_are_mounted_where_the_roots_say(compose: dict[str, Any]) -> None:
    """KIDX_FILES__ROOTS was passed, but no host folder was mounted: every file and code item
    named a path the containers did not have."""
    for name in ("worker", "flower"):
        roots = service(compose, name)["environment"]["KIDX_FILES__ROOTS"]
        mounted = {m["target"]: m["mode"] for m in map(volume, service(compose, name)["volumes"])}
        assert roots in mounted and mounted[roots] == "ro", (name, roots, mounted)


def volume(spec: str) -> dict[str, str]:
    """A short-syntax volume: its source (a `${VAR:-default}` may hold colons), target and
    mode."""
    m = re.fullmatch(r"(?P<source>\$\{[^}]*\}|[^:]*):(?P<target>[^:]+)(?::(?P<mode>\w+))?", spec)
    assert m, spec
    return {k: v or "" for k, v in m.groupdict().items()}


def test_redis_never_evicts_and_the_broker_is_that_service(compose: dict[str, Any]) -> None:
    redis = service(compose, "redis")
    assert redis["image"].startswith("redis:7")
    command = " ".join(redis["command"])
    assert re.search(r"--maxmemory-policy[ =]noeviction", command)
    for name in ("worker", "beat", "flower"):
        assert service(compose, name)["environment"]["KIDX_BROKER_URL"].startswith("redis://redis:")


def test_flower_requires_its_credentials(compose: dict[str, Any]) -> None:
    env = service(compose, "flower")["environment"]
    for key in ("KIDX_FLOWER__USER", "KIDX_FLOWER__PASSWORD"):
        m = REF.fullmatch(str(env[key]))
        assert m and m["name"] == key and m["op"] == ":?", f"{key} must be ${{{key}:?...}}"
    assert any(str(p).endswith("5555:5555") for p in service(compose, "flower")["ports"])


def test_workers_scale_and_share_the_data_volume(compose: dict[str, Any]) -> None:
    assert "container_name" not in service(compose, "worker")
    for name in ("worker", "beat", "flower"):
        volumes = service(compose, name)["volumes"]
        assert any(
            volume(v)["target"] == "/data" and volume(v)["source"] in compose["volumes"]
            for v in volumes
        ), f"{name} does not mount the shared data volume"
        assert service(compose, name)["environment"]["KIDX_DB"] == "/data/kidx.db"
    mounts = {
        volume(v)["source"]
        for n in ("worker", "beat", "flower")
        for v in service(compose, n)["volumes"]
        if volume(v)["target"] == "/data"
    }
    assert len(mounts) == 1, "worker, beat and flower must share one data volume"


def test_dockerfile_pins_torch_and_runs_unprivileged() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert text.startswith("#") and "FROM python:3.11-slim" in text
    assert "torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
    assert text.index("torch==2.13.0") < text.index("'.[local]'")
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in {"root", "0"}
    assert re.search(r"HF_HUB_OFFLINE=1", text)


# -- ops/stack.py itself, cheaply --------------------------------------------------------------


def stack_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KIDX_", "FLOWER_"))}
    env.update(
        KIDX_DATA_DIR=str(tmp_path / "data"),
        KIDX_DB=str(tmp_path / "kidx.db"),
        KIDX_BROKER_URL=f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
        PYTHONPATH=str(ROOT),
    )
    env.update(extra)
    return env


def run_stack(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ops.stack", *args],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_status_with_nothing_started(tmp_path: Path) -> None:
    env = stack_env(tmp_path)
    run = tmp_path / "data" / "run"
    run.mkdir(parents=True)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (run / "worker.pid").write_text(f"{gone.pid}\n")  # a stale pid file: a process that ended
    (run / "beat.pid").write_text(f"{os.getpid()}\n")  # a live pid that is not a beat
    result = run_stack(env, "status")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for name in SERVICES:
        line = next((s for s in lines if s.split()[:1] == [name]), None)
        assert line is not None, f"no line for {name}: {result.stdout}"
        assert line.split()[1] == "stopped", line


def test_start_without_any_redis_says_what_to_do(tmp_path: Path) -> None:
    path = os.pathsep.join(
        d
        for d in os.environ.get("PATH", "").split(os.pathsep)
        if d and not (Path(d) / "redis-server").exists()
    )
    env = stack_env(tmp_path, PATH=path)
    result = run_stack(env, "start", "--demo")
    assert result.returncode != 0
    advice = [line for line in (result.stdout + result.stderr).splitlines() if line.strip()]
    assert len(advice) == 1, result.stdout + result.stderr
    assert "redis-server" in advice[0] and "KIDX_BROKER_URL" in advice[0]
    assert env["KIDX_BROKER_URL"] in advice[0]
    assert not list((tmp_path / "data" / "run").glob("*.pid")), "something was started"


def test_status_never_prints_the_broker_password(tmp_path: Path) -> None:
    url = f"redis://:hunter2secret@127.0.0.1:{free_port()}/0"  # nothing listens there
    result = run_stack(stack_env(tmp_path, KIDX_BROKER_URL=url), "status")
    assert result.returncode == 0, result.stderr
    assert "hunter2secret" not in result.stdout + result.stderr
    assert "redis://***@127.0.0.1" in result.stdout


def test_flower_refused_settings_are_one_line_not_a_traceback(tmp_path: Path) -> None:
    env = stack_env(tmp_path, KIDX_FLOWER__USER="kidx", KIDX_FLOWER__PASSWORD="Tr0ub4dor,horse")
    result = subprocess.run(
        [sys.executable, "-m", "ops.flower"],
        env=env,
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "KIDX_FLOWER__PASSWORD" in lines[0], result.stderr
    assert "horse" not in result.stderr


def test_make_clean_never_removes_the_default_database():
    """`make clean` is for caches: ./data holds the default database (and the demo's pid
    files that `make stack-stop` needs)."""
    recipe = subprocess.run(
        ["make", "-n", "clean"], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
    ).stdout
    assert "rm " in recipe and not re.search(r"(^|\s)\.?/?data(/|\s|$)", recipe)


def _seconds(duration: str) -> float:
    """A compose duration ("12m", "90s", "1m30s") in seconds."""
    import re

    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", duration)
    assert parts is not None and duration, duration
    h, m, s = (int(x or 0) for x in parts.groups())
    return h * 3600 + m * 60 + s


def test_workers_get_longer_than_the_hard_time_limit_to_stop(compose: dict[str, Any]) -> None:
    """2 minutes (and ops.stack's 60 s) against a 660 s hard limit: every stop or deploy killed
    runs that would have finished, their items `indexing` until the overrun sweep failed them."""
    from ops.stack import Stack, stop_wait
    from worker.settings import Settings

    limit = Settings().tasks.time_limit
    assert _seconds(compose["services"]["worker"]["stop_grace_period"]) > limit
    assert stop_wait(Stack(Settings()), "worker") > limit
    assert stop_wait(Stack(Settings()), "beat") < 60


def test_doctor_and_a_scraper_reach_flower_and_the_worker_across_containers(
    compose: dict[str, Any],
) -> None:
    """In a worker's container, `kidx doctor` looked for Flower at 127.0.0.1:5555 (its own
    loopback: never 0), and the worker's metrics listened on its loopback, unscrapable."""
    services = compose["services"]
    worker, flower = services["worker"]["environment"], services["flower"]["environment"]
    assert (worker["KIDX_FLOWER__ADDRESS"], worker["KIDX_FLOWER__PORT"]) == ("flower", "5555")
    assert flower["KIDX_FLOWER__ADDRESS"] == "0.0.0.0" and flower["KIDX_FLOWER__PORT"] == "5555"
    assert worker["KIDX_METRICS__ADDRESS"] == "${KIDX_METRICS__ADDRESS:-0.0.0.0}"
