"""A local kidx stack on loopback: Redis (only when none answers), a worker, beat and Flower.

    python -m ops.stack start [--demo]   idempotent; waits until the worker and Flower answer
    python -m ops.stack status           each component's state
    python -m ops.stack stop             SIGTERM, a bounded wait, then SIGKILL of the group

Pid files are in <KIDX_DATA_DIR>/run, logs in <KIDX_DATA_DIR>/log. Redis is started (and
stopped) here only when nothing answers at KIDX_BROKER_URL and `redis-server` is installed. The
commands are the ones docker-compose.yml and the tests run: `worker_args()`, `beat_args()` and
`flower_args()` return them without the paths under the data directory.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn
from urllib.parse import urlsplit

import httpx
import redis

from tasks.redis_at import redis_at
from worker.errors import ConfigError
from worker.regular import read_regular
from worker.settings import Settings, load_settings
from worker.sources.urls import safe_url

CELERY = ["-m", "celery", "-A", "worker.app"]
NODE = "kidx@%h"
PROCESSES = ("worker", "beat", "flower")  # started in this order, stopped in reverse
# What tells a component's process (`runs`): a dotted name is a Python app or module, one
# whole argument of its command line (`-A worker.app` in `worker_args()` and `beat_args()`,
# `-m ops.flower` in `flower_args()`: that process runs Flower itself); any other is the name
# of the program it executes (redis-server, as `start_redis` runs it).
MARKS = {
    "redis": "redis-server",
    "worker": "worker.app",
    "beat": "worker.app",
    "flower": "ops.flower",
}
# (a worker's: past the tasks' hard time limit, `stop_wait`)
STOP_WAIT = {"worker": 15.0, "beat": 15.0, "flower": 15.0, "redis": 15.0}
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def worker_args(concurrency: int) -> list[str]:
    """The worker's arguments after the interpreter, without paths under the data directory."""
    return [
        *CELERY,
        "worker",
        "--pool=prefork",
        f"--concurrency={concurrency}",
        "--loglevel=INFO",
        "-n",
        NODE,
    ]


def beat_args() -> list[str]:
    return [*CELERY, "beat", "--loglevel=INFO"]


def flower_args(demo: bool = False) -> list[str]:
    return ["-m", "ops.flower", *(["--demo"] if demo else [])]


def commands(settings: Settings, data: Path, demo: bool = False) -> dict[str, list[str]]:
    """The full command of each process, as `start` runs it."""
    log = data / "log"
    return {
        "worker": [
            sys.executable,
            *worker_args(settings.tasks.concurrency),
            f"--statedb={data / 'worker-%h.state'}",
            f"--logfile={log / 'worker.log'}",
        ],
        "beat": [
            sys.executable,
            *beat_args(),
            f"--schedule={data / 'beat-schedule'}",
            f"--logfile={log / 'beat.log'}",
        ],
        "flower": [sys.executable, *flower_args(demo)],
    }


class Stack:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.data = Path(settings.data_dir).resolve()
        self.url = settings.broker_url

    def pid_file(self, name: str) -> Path:
        return self.data / "run" / f"{name}.pid"

    def log_file(self, name: str) -> Path:
        return self.data / "log" / f"{name}.log"

    def pid(self, name: str) -> int | None:
        """The pid in the component's pid file, if that process still runs."""
        pid = read_pid(self.pid_file(name))
        return pid if pid is not None and alive(pid, MARKS[name]) else None

    def tail(self, name: str, lines: int = 30) -> str:
        try:
            text = self.log_file(name).read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(f"    {line}" for line in text[-lines:])

    def flower_url(self) -> str:
        # --demo binds loopback, whatever KIDX_FLOWER__ADDRESS says: a Flower started so with
        # a password set was looked for at the address (60 s, then "did not answer")
        demo = not self.settings.flower.password or self._flower_demo()
        return f"http://{url_host('' if demo else self.settings.flower.address)}:" + (
            f"{self.settings.flower.port}/"
        )

    def _flower_demo(self) -> bool:
        """Whether the running Flower was started with --demo (its command line)."""
        pid = self.pid("flower")
        if pid is None:
            return False
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            return False
        return b"--demo" in args

    def demo_line(self) -> str | None:
        """The credentials line `python -m ops.flower --demo` printed at this start, if any."""
        with contextlib.suppress(OSError):
            lines = self.log_file("flower").read_text(errors="replace").splitlines()
            return next((s for s in reversed(lines) if s.startswith("Flower: http")), None)
        return None


def url_host(address: str) -> str:
    """The host of a URL to a server listening on `address`: loopback for every address (or
    none), and an IPv6 address in brackets ([::1], not ::1, which no URL parser takes)."""
    if address in {"", "0.0.0.0", "::"}:
        return "127.0.0.1"
    if ":" in address and not address.startswith("["):
        return f"[{address.replace('%', '%25')}]"
    return address


PID_FILE_MAX = 32  # bytes: a pid and a line end; a larger file is no pid file of ours


def read_pid(path: Path) -> int | None:
    """The pid a pid file holds, if it is one a component can have: an integer above 1. Any
    other content is a stale or damaged pid file: 0, -1 and 1 are not a process of ours but a
    process group, every process and init, which `os.kill` would signal. Only a regular file
    is read, never blocking: a FIFO there hung `status`, a directory crashed `stop`."""
    try:
        data = read_regular(path, PID_FILE_MAX + 1)
    except OSError:
        return None
    if data is None:
        return None
    try:
        pid = int(data.split()[0]) if len(data) <= PID_FILE_MAX else 0
    except (ValueError, IndexError):
        return None
    return pid if pid > 1 else None


def remove_pid_file(path: Path) -> str | None:
    """Remove a pid file (it may be anything: an empty directory goes too, one with files is
    left); why it could not be, if it could not, rather than a traceback in `stop`."""
    try:
        if stat.S_ISDIR(path.lstat().st_mode):
            path.rmdir()
        else:
            path.unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        return f"{path} is no pid file and cannot be removed ({e.strerror or e}): remove it"
    return None


def clear_odd_pid_file(path: Path) -> None:
    """Remove what is no regular file where a pid file goes (a directory, a FIFO, a symbolic
    link, which `read_pid` never reads): else the pid written there at start was never read
    back (a component started again at each start) or the write hung on a FIFO."""
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISREG(path.lstat().st_mode) and (problem := remove_pid_file(path)):
            fail(f"error: {problem}")


def runs(cmdline: bytes, mark: str) -> bool:
    """Whether a /proc cmdline is the one `mark` names (MARKS): a dotted mark equal to one of
    its arguments, another equal to its program's base name. Not merely mentioned: `tail -f
    flower.log`, whose pid a stale pid file held, was reported running and stopped. A program
    that rewrote its title as one string (redis-server: `/usr/bin/redis-server 127.0.0.1:6379`;
    Celery, with setproctitle installed) is taken word by word."""
    args = [a.decode("utf-8", "surrogateescape") for a in cmdline.split(b"\0") if a]
    if len(args) == 1:
        args = args[0].split()
    if not args:
        return False
    return mark in args[1:] if "." in mark else os.path.basename(args[0]) == mark


def alive(pid: int, mark: str) -> bool:
    """Whether `pid` runs and is still the program `mark` names (not a reused pid, no zombie)."""
    if pid <= 1:
        return False  # a process group, every process, init: never a component
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, PermissionError, OverflowError):
        return False
    try:
        fields = _stat_fields(pid)
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return not Path("/proc/self").exists()  # no /proc here: trust the pid; else it ended
    if fields[:1] == ["Z"]:
        return False
    return runs(cmdline, mark)


def _stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/<pid>/stat after the program's name (which may hold `)`): its
    state, parent, process group, ...; none when it does not parse. OSError when it ended."""
    _, name_end, rest = Path(f"/proc/{pid}/stat").read_text().rpartition(")")
    return rest.split() if name_end else []


def group_members(pgid: int) -> list[int] | None:
    """The pids in process group `pgid`; None where there is no /proc to tell."""
    if not Path("/proc/self").exists():
        return None
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = _stat_fields(entry.name)
        except OSError:
            continue  # it ended while we looked
        if len(fields) > 2 and fields[2] == str(pgid):
            members.append(int(entry.name))
    return members


def kill_group(pgid: int, mark: str) -> None:
    """SIGKILL to what is left of a component's process group, if a member still runs the
    component's program: once the leader and every member have ended, the number is free and
    may be another program's group by the time we signal it."""
    if pgid <= 1:
        return  # our own group, every process, init: never a component's
    members = group_members(pgid)
    if members is not None and not any(alive(pid, mark) for pid in members):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def wait_until(check: Callable[[], bool], timeout: float, every: float = 0.25) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(every)
    return check()


def redis_answers(url: str) -> bool:
    try:
        client = redis_at(url, 1)
    except ValueError:
        return False
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def fail(message: str, code: int = 1) -> NoReturn:
    sys.stdout.flush()
    print(message, file=sys.stderr, flush=True)
    sys.exit(code)


def in_the_way(path: Path) -> Path | None:
    """What stands where the folder `path` (or one of its parents) should be, if anything does:
    a file, a device, a dangling symbolic link."""
    for p in (path, *path.parents):
        if p.is_dir():
            return None
        if p.exists() or p.is_symlink():
            return p
    return None


def data_dirs(setting: str | Path, *paths: Path, create: bool = True) -> None:
    """Make the folders `paths` under KIDX_DATA_DIR (`setting`), or with create=False only
    check that nothing is in their way: what is, or a folder that cannot be made, is one line
    and exit status 2, as for every other configuration error."""
    for path in paths:
        blocker = in_the_way(path)
        if blocker is not None:
            fail(f"error: KIDX_DATA_DIR={setting}: {blocker} is not a directory", 2)
        if create:
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                fail(f"error: KIDX_DATA_DIR={setting}: cannot create {path}: {e.strerror or e}", 2)


def redis_bind(host: str | None) -> list[str]:
    """The addresses a Redis started for a loopback URL listens on: the URL's own (it bound
    127.0.0.1 whatever the URL said, so `redis://[::1]:port` never answered); `localhost`
    may resolve to either, so both (`-`: ::1 only where this host has IPv6)."""
    if host == "::1":
        return ["::1"]
    if host == "localhost":
        return ["127.0.0.1", "-::1"]
    return ["127.0.0.1"]


def start_redis(stack: Stack) -> None:
    if redis_answers(stack.url):
        mine = stack.pid("redis")
        print(f"redis   running at {safe_url(stack.url)}" + (f" (pid {mine})" if mine else ""))
        return
    parts = urlsplit(stack.url)
    binary = shutil.which("redis-server")
    if parts.scheme != "redis" or parts.hostname not in LOOPBACK or binary is None:
        todo = (
            "no redis-server is installed here: install it (apt-get install redis-server)"
            if binary is None
            else "it is not a local redis:// URL: start that Redis"
        )
        fail(
            f"error: no Redis answers at KIDX_BROKER_URL={safe_url(stack.url)} and {todo}, or "
            "point KIDX_BROKER_URL at a running Redis"
        )
    data_dirs(stack.settings.data_dir, stack.data / "redis")
    subprocess.run(
        [
            binary,
            "--daemonize",
            "yes",
            "--bind",
            *redis_bind(parts.hostname),
            "--port",
            str(parts.port or 6379),
            "--save",
            "",
            "--appendonly",
            "no",
            "--maxmemory-policy",
            "noeviction",
            "--dir",
            str(stack.data / "redis"),
            "--pidfile",
            str(stack.pid_file("redis")),
            "--logfile",
            str(stack.log_file("redis")),
        ],
        check=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    if not wait_until(lambda: redis_answers(stack.url), 10):
        stop_one(stack, "redis")  # a daemon nobody can reach is not left behind
        fail(f"error: redis-server did not answer within 10 s:\n{stack.tail('redis')}")
    print(f"redis   started at {safe_url(stack.url)} (pid {stack.pid('redis')})")


def spawn(stack: Stack, name: str, cmd: list[str]) -> int:
    """Start `cmd` detached (a new session: its pid is its process group), output to its log."""
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if name == "flower" else os.O_APPEND)
    fd = os.open(stack.log_file(name), flags, 0o600)  # Flower's holds the demo password
    try:
        proc = subprocess.Popen(
            cmd, stdin=subprocess.DEVNULL, stdout=fd, stderr=fd, start_new_session=True
        )
    finally:
        os.close(fd)
    stack.pid_file(name).write_text(f"{proc.pid}\n")
    return proc.pid


def start(stack: Stack, demo: bool) -> None:
    f = stack.settings.flower
    if not demo and not (f.user and f.password) and stack.pid("flower") is None:
        fail("error: Flower needs KIDX_FLOWER__USER and KIDX_FLOWER__PASSWORD (or start --demo)", 2)
    data_dirs(stack.settings.data_dir, stack.data / "run", stack.data / "log")
    for name in ("redis", *PROCESSES):
        clear_odd_pid_file(stack.pid_file(name))
    start_redis(stack)
    for name, cmd in commands(stack.settings, stack.data, demo).items():
        pid = stack.pid(name)
        state = "already running" if pid else "started"
        pid = pid or spawn(stack, name, cmd)
        print(f"{name:<7} {state} (pid {pid}), log {stack.log_file(name)}")

    from celery.utils.nodenames import gethostname

    from worker.app import create_app

    app, node = create_app(stack.settings), f"kidx@{gethostname()}"

    def worker_ready() -> bool:
        try:
            return any(node in r for r in app.control.ping([node], timeout=1.0) or [])
        except Exception:
            return False

    def flower_ready() -> bool:
        try:
            return httpx.get(stack.flower_url() + "healthcheck", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    for name, ready, timeout in (("worker", worker_ready, 90.0), ("flower", flower_ready, 60.0)):

        def up(name: str = name, ready: Callable[[], bool] = ready) -> bool:
            return stack.pid(name) is None or ready()

        if not wait_until(up, timeout) or stack.pid(name) is None:
            what = "exited" if stack.pid(name) is None else f"did not answer in {timeout:.0f} s"
            fail(
                f"error: the {name} {what}; the end of "
                f"{stack.log_file(name)}:\n{stack.tail(name)}\n"
                "(python -m ops.stack stop ends what did start)"
            )
    print(f"worker  {node} answers a ping")
    print(f"flower  {stack.flower_url()} answers")
    line = stack.demo_line()
    if line:
        print(line)


def stop_wait(stack: Stack, name: str) -> float:
    """How long a component has to end after SIGTERM: a worker's warm shutdown lets running
    tasks finish, which may take the hard time limit (killed at 60 s, a run left its item
    `indexing` until the overrun sweep failed it, an attempt spent)."""
    if name == "worker":
        return stack.settings.tasks.time_limit + STOP_WAIT[name]
    return STOP_WAIT[name]


def stop_one(stack: Stack, name: str) -> str:
    pid = stack.pid(name)
    path = stack.pid_file(name)
    if pid is None:
        had = os.path.lexists(path)
        problem = remove_pid_file(path)
        return "not running" + (f" ({problem or 'stale pid file removed'})" if had else "")
    os.kill(pid, signal.SIGTERM)
    graceful = wait_until(lambda: not alive(pid, MARKS[name]), stop_wait(stack, name))
    kill_group(pid, MARKS[name])  # what is left of its group (pool processes, too)
    wait_until(lambda: not alive(pid, MARKS[name]), 5)
    problem = remove_pid_file(path)
    return (
        f"stopped (pid {pid})"
        + ("" if graceful else ", killed after the wait")
        + (f"; {problem}" if problem else "")
    )


def stop(stack: Stack) -> None:
    data_dirs(stack.settings.data_dir, stack.data / "run", create=False)
    for name in (*reversed(PROCESSES), "redis"):
        if name == "redis" and not os.path.lexists(stack.pid_file(name)):
            print(f"redis   left alone at {safe_url(stack.url)} (not started here)")
            continue
        print(f"{name:<7} {stop_one(stack, name)}")


def status(stack: Stack) -> None:
    mine = stack.pid("redis")
    if redis_answers(stack.url):
        owner = f"pid {mine}, started here" if mine else "not started here"
        print(f"redis   running at {safe_url(stack.url)} ({owner})")
    else:
        print(f"redis   stopped (nothing answers at {safe_url(stack.url)})")
    for name in PROCESSES:
        pid = stack.pid(name)
        where = f", {stack.flower_url()}" if name == "flower" else ""
        print(f"{name:<7} " + (f"running (pid {pid}){where}" if pid else "stopped"))
    line = stack.demo_line() if stack.pid("flower") else None
    if line:
        print(line)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("action", choices=["start", "stop", "status"])
    ap.add_argument("--demo", action="store_true", help="Flower with generated credentials")
    args = ap.parse_args(argv)
    try:
        stack = Stack(load_settings())
    except ConfigError as e:
        fail(f"error: {e}", 2)
    if args.action == "start":
        start(stack, args.demo)
    elif args.action == "stop":
        stop(stack)
    else:
        status(stack)


if __name__ == "__main__":
    main()
