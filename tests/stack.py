"""Real processes for the queue tests: Celery workers (prefork) and Flower, against the real
Redis on 127.0.0.1:6379 in a database of their own, with a loopback stand-in as the provider.
Every wait is bounded; every process is stopped (its whole process group) at teardown."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import redis

ROOT = Path(__file__).resolve().parents[1]
CELERY = [sys.executable, "-m", "celery", "-A", "worker.app"]


def _slot() -> int:
    """Which test process this is: pytest-xdist's worker number (gw0, gw1, ...), else 0."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    slot = int(worker.removeprefix("gw") or 0)
    if slot > 3:
        raise RuntimeError("at most 4 test processes: each has two of Redis databases 1-8")
    return slot


# Each test process has two Redis databases of its own (tests use 1-9; 10-15 belong to other
# tools): modules run one after another within a process and flush theirs at both ends, so
# they share REDIS_DB; SPARE_DB is for a second stack started beside a module's own.
REDIS_DB = 1 + 2 * _slot()
SPARE_DB = REDIS_DB + 1
API_KEY = "sk-queue-secret-7777"


def wait_for(check: Callable[[], Any], timeout: float, what: str, every: float = 0.05) -> Any:
    """Poll `check` until it returns something true; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def broker_url(db: int = REDIS_DB) -> str:
    return f"redis://127.0.0.1:6379/{db}"


def flush(db: int = REDIS_DB) -> None:
    client = redis.Redis.from_url(broker_url(db))
    client.flushdb()
    client.close()


def queue_env(tmp_path: Path, standin_url: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KIDX_", "FLOWER_", "CELERY_"))}
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(ROOT),
            "KIDX_DB": str(tmp_path / "kidx.db"),
            "KIDX_DATA_DIR": str(tmp_path / "data"),
            "KIDX_BROKER_URL": broker_url(),
            "KIDX_EMBEDDING__PROVIDER": "openai",
            "KIDX_EMBEDDING__MODEL": "standin-embed",
            "KIDX_EMBEDDING__BASE_URL": standin_url,
            "KIDX_EMBEDDING__DIMENSIONS": "64",
            "KIDX_EMBEDDING__API_KEY": API_KEY,
            "KIDX_EMBEDDING__BATCH_SIZE": "4",
            "KIDX_EMBEDDING__MAX_RETRIES": "0",
            "KIDX_EMBEDDING__TIMEOUT": "10",
            "KIDX_TASKS__MAX_RETRIES": "1",
            "KIDX_TASKS__RETRY_BACKOFF": "0.5",
            "KIDX_TASKS__LOCK_TTL": "6",
            "KIDX_LOG_FORMAT": "json",
            "KIDX_METRICS__PORT": "0",
            "KIDX_FLOWER__USER": "ops",
            "KIDX_FLOWER__PASSWORD": "flower-pass-123",
        }
    )
    env.update(extra)
    return env


MARK = "KIDXTEST_PROC"  # (not KIDX_: kidx refuses a KIDX_ name that is no setting)


class Proc:
    """A started process with its log file; `stop()` ends it and every process it started.

    Those are found by a mark in their environment, not by the process group: once the leader
    was reaped, its number could be another process's, and a SIGKILL to the group of that
    number killed another test's child (a new session's group takes its leader's pid)."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: Path) -> None:
        self.cmd = cmd
        self.log_path = log
        self.mark = f"{MARK}={os.getpid()}-{time.monotonic_ns()}".encode()
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "ab")  # noqa: SIM115 - closed in stop()
        env = {**env, MARK: self.mark.decode().split("=", 1)[1]}
        self.popen = subprocess.Popen(
            cmd,
            env=env,
            cwd=str(ROOT),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 15) -> None:
        if self.alive():  # (not reaped: the group's number is still its own)
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
                self.popen.wait(timeout=timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        for pid in self.started():  # children too, whatever they do
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.popen.wait(timeout=5)
        self._log.close()

    def started(self) -> list[int]:
        """The live processes that carry this one's mark: it and what it started."""
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if self.mark in (entry / "environ").read_bytes().split(b"\0"):
                    found.append(int(entry.name))
        return found


def start_worker(
    env: dict[str, str], tmp_path: Path, app: Any, name: str = "w1", concurrency: int = 2
) -> Proc:
    data = tmp_path / "data"
    data.mkdir(parents=True, exist_ok=True)
    proc = Proc(
        [
            *CELERY,
            "worker",
            "--pool=prefork",
            f"--concurrency={concurrency}",
            "--loglevel=INFO",
            f"--statedb={data / f'{name}.state'}",
            "-n",
            f"{name}@%h",
            "--without-gossip",
            "--without-mingle",
        ],
        env,
        tmp_path / f"{name}.log",
    )

    def ready() -> bool:
        if not proc.alive():
            raise AssertionError(f"worker exited:\n{proc.log[-3000:]}")
        replies = app.control.ping(timeout=0.5) or []
        return any(name in key for reply in replies for key in reply)

    try:
        wait_for(ready, 60, "the worker to answer a ping", every=0.2)
    except BaseException:  # never left running to take another test's tasks
        proc.stop()
        raise
    return proc


def start_flower(env: dict[str, str], tmp_path: Path, port: int) -> Proc:
    proc = Proc(
        [sys.executable, "-m", "ops.flower"],
        {**env, "KIDX_FLOWER__PORT": str(port)},
        tmp_path / "flower.log",
    )

    def ready() -> bool:
        if not proc.alive():
            raise AssertionError(f"flower exited:\n{proc.log[-3000:]}")
        try:
            return httpx.get(f"http://127.0.0.1:{port}/healthcheck", timeout=1).status_code < 500
        except httpx.HTTPError:
            return False

    try:
        wait_for(ready, 60, "Flower to answer", every=0.2)
    except BaseException:
        proc.stop()
        raise
    return proc


def worker_pids(app: Any) -> dict[str, int]:
    """task id -> pid of the pool process running it, from the workers' own report."""
    active = app.control.inspect(timeout=1.0).active() or {}
    return {t["id"]: t["worker_pid"] for tasks in active.values() for t in tasks}


class Stack:
    """A worker on the queue tests' Redis database, a database file, the stand-in, and ways to
    reach them (the Celery app, a connection, the `kidx` command)."""

    def __init__(
        self,
        tmp: Path,
        standin: Any,
        worker: str = "w1",
        env: dict[str, str] | None = None,
        redis_db: int = REDIS_DB,
        db_path: Path | None = None,
    ) -> None:
        from worker.app import create_app
        from worker.settings import load_settings
        from worker.store import connect

        self.tmp = tmp
        self.standin = standin
        self.db_path = db_path or tmp / "kidx.db"
        self.env = queue_env(
            tmp,
            standin.base_url,
            **{
                "KIDX_BROKER_URL": broker_url(redis_db),
                "KIDX_DB": str(self.db_path),
                **(env or {}),
            },
        )
        self.settings = load_settings(
            db=self.db_path,
            broker_url=broker_url(redis_db),
            embedding={
                "provider": "openai",
                "model": "standin-embed",
                "base_url": standin.base_url,
                "dimensions": 64,
            },
        )
        self.app = create_app(self.settings)
        self.db = connect(self.db_path, embedding=self.settings.embedding)
        self.redis = redis.Redis.from_url(broker_url(redis_db))
        self.worker_name = worker
        self.worker = start_worker(self.env, tmp, self.app, name=worker)

    def kidx(
        self, *args: str, timeout: float = 60, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        exe = str(Path(sys.executable).parent / "kidx")
        return subprocess.run(
            [exe, *args],
            env={**self.env, **(env or {})},
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=str(self.tmp),
        )

    def note(self, title: str, text: str) -> int:
        from worker.store.items import add_item

        return add_item(self.db, kind="note", title=title, content=text)

    def state(self, item_id: int) -> dict[str, Any]:
        from worker.store.items import get_state

        return get_state(self.db, item_id)

    def restart_worker(self) -> None:
        self.worker.stop()
        self.worker = start_worker(self.env, self.tmp, self.app, name=self.worker_name)

    def close(self) -> None:
        self.worker.stop()
        self.db.close()
        self.redis.close()


@contextlib.contextmanager
def running_stack(tmp: Path, make: Callable[[Path, Any], Stack]) -> Iterator[Stack]:
    """A stack on a flushed database, flushed again afterwards, with nothing left running."""
    from testkit.standin import StandIn

    flush(REDIS_DB)
    with StandIn(dimensions=64) as standin:
        s = make(tmp, standin)
        try:
            yield s
        finally:
            s.close()
            flush(REDIS_DB)
