"""ops/stack.py's pid files: only a pid a component can have (an integer above 1) is ever
looked at or signalled. 0, -1 and 1 in a pid file are a process group, every process and init:
`os.kill(-1, SIGTERM)` signals every process there is.

No test here lets a signal reach -1, 0 or 1: `os.kill` and `os.killpg` are replaced by fakes
that record every call and pass on only signal 0 (an existence check) to a pid above 1.

Also what the stack and Flower need of KIDX_DATA_DIR and of Flower's address: a file where the
data directory should be is one line, and an IPv6 address is bracketed in Flower's URL."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from ops import stack as ops_stack
from ops.doctor import check_flower
from stack import ROOT, free_port
from worker.settings import FlowerSettings, Settings

BAD = ("-1", "0", "1", "-42", "", "worker", "1.5")  # never a component's pid
REAL_KILL = os.kill


class Signals:
    """What the code under test asked `os.kill`/`os.killpg`: passed on only when harmless."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def kill(self, pid: int, sig: int) -> None:
        self.calls.append(("kill", pid, sig))
        if pid > 1 and sig == 0:
            REAL_KILL(pid, 0)
        # anything else is not sent: os.kill(-1, 0), (0, 0), (1, 0) succeed for root

    def killpg(self, pgid: int, sig: int) -> None:
        self.calls.append(("killpg", pgid, sig))

    def at_or_below_1(self) -> list[tuple[str, int, int]]:
        return [c for c in self.calls if c[1] <= 1]


@pytest.fixture
def signals(monkeypatch: pytest.MonkeyPatch) -> Iterator[Signals]:
    fake = Signals()
    monkeypatch.setattr(os, "kill", fake.kill)
    monkeypatch.setattr(os, "killpg", fake.killpg)
    yield fake


def make_stack(tmp_path: Path) -> ops_stack.Stack:
    (tmp_path / "data" / "run").mkdir(parents=True)
    (tmp_path / "data" / "log").mkdir(parents=True)
    settings = Settings(
        data_dir=tmp_path / "data",
        db=tmp_path / "kidx.db",
        broker_url=f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
    )
    return ops_stack.Stack(settings)


def test_a_pid_file_of_0_negative_or_1_holds_no_pid(tmp_path: Path, signals: Signals) -> None:
    stack = make_stack(tmp_path)
    for pid in (-1, 0, 1, -42):
        assert not ops_stack.alive(pid, "worker.app"), pid
    for text in BAD:
        stack.pid_file("worker").write_text(f"{text}\n")
        assert stack.pid("worker") is None, text
        assert ops_stack.read_pid(stack.pid_file("worker")) is None, text
    assert signals.at_or_below_1() == []
    stack.pid_file("worker").write_text("4242\n")
    assert ops_stack.read_pid(stack.pid_file("worker")) == 4242


def test_status_says_stopped_for_a_pid_file_of_0_negative_or_1(
    tmp_path: Path, signals: Signals, capsys: pytest.CaptureFixture[str]
) -> None:
    """It printed "worker running (pid -1)"."""
    stack = make_stack(tmp_path)
    for name, text in zip(ops_stack.PROCESSES, ("-1", "0", "1"), strict=True):
        stack.pid_file(name).write_text(f"{text}\n")
    stack.pid_file("redis").write_text("-1\n")
    ops_stack.status(stack)
    out = capsys.readouterr().out
    for name in ops_stack.PROCESSES:
        line = next(s for s in out.splitlines() if s.split()[:1] == [name])
        assert line.split()[1] == "stopped", out
    assert "pid -1" not in out and "pid 0" not in out and "pid 1)" not in out
    assert signals.at_or_below_1() == []


def test_a_pid_that_has_no_proc_entry_is_not_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where /proc exists, a pid without /proc/<pid> is no process (it was trusted, as if
    there were no /proc at all). pid_max is never a pid; a fake `os.kill` says it exists."""
    if not Path("/proc/self").exists():
        pytest.skip("no /proc here")
    never = int(Path("/proc/sys/kernel/pid_max").read_text())
    asked: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: asked.append((pid, sig)))
    assert not ops_stack.alive(never, "worker.app")
    assert all(pid == never and sig == 0 for pid, sig in asked)


def test_stop_signals_nothing_for_a_pid_file_of_0_negative_or_1(
    tmp_path: Path, signals: Signals, capsys: pytest.CaptureFixture[str]
) -> None:
    """Such a pid file is stale: removed, and no signal is sent (not even to a fake)."""
    stack = make_stack(tmp_path)
    for name, text in zip((*ops_stack.PROCESSES, "redis"), ("-1", "0", "1", "-1"), strict=True):
        stack.pid_file(name).write_text(f"{text}\n")
    ops_stack.stop(stack)
    out = capsys.readouterr().out
    assert [c for c in signals.calls if c[2] != 0] == [], signals.calls
    assert signals.at_or_below_1() == []
    for name in (*ops_stack.PROCESSES, "redis"):
        line = next(s for s in out.splitlines() if s.split()[:1] == [name])
        assert "not running (stale pid file removed)" in line, out
        assert not stack.pid_file(name).exists()


def test_a_live_component_is_still_running_and_stopped(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The real thing, with real signals to a real pid: a child whose command line holds
    `worker.app`, in a session of its own (as `spawn` starts one), waiting on its stdin."""
    stack = make_stack(tmp_path)
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; print('up', flush=True); sys.stdin.read()",
            "worker.app",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        # Its command line is the new one only once it runs: read right after the fork, it
        # was still the test's, and the pid was taken for another process's (once in a run).
        assert child.stdout is not None and child.stdout.readline() == b"up\n"
        stack.pid_file("worker").write_text(f"{child.pid}\n")
        assert stack.pid("worker") == child.pid
        ops_stack.status(stack)
        assert f"worker  running (pid {child.pid})" in capsys.readouterr().out
        ops_stack.stop(stack)
        assert f"worker  stopped (pid {child.pid})" in capsys.readouterr().out
        assert child.wait(timeout=30) == -signal.SIGTERM
        assert not stack.pid_file("worker").exists()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=30)
        if child.stdin:
            child.stdin.close()
        if child.stdout:
            child.stdout.close()


LEADER_AND_CHILD = """
import os, sys
child = os.fork()
if child == 0:
    import signal, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a pool process that outlives its leader
    while True:
        time.sleep(60)
print(child, flush=True)
sys.stdin.read()  # the leader, until SIGTERM
"""


def test_stop_kills_a_pool_child_left_in_the_components_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The leader ends on SIGTERM; its child (a pool process: forked, the same command line)
    does not, and goes with the SIGKILL to the group."""
    if not Path("/proc/self").exists():
        pytest.skip("no /proc here")
    stack = make_stack(tmp_path)
    leader = subprocess.Popen(
        [sys.executable, "-c", LEADER_AND_CHILD, "worker.app"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    child = 0
    try:
        assert leader.stdout is not None
        child = int(leader.stdout.readline())
        stack.pid_file("worker").write_text(f"{leader.pid}\n")
        assert ops_stack.group_members(leader.pid) == sorted([leader.pid, child])
        ops_stack.stop(stack)
        assert leader.wait(timeout=30) == -signal.SIGTERM
        assert ops_stack.wait_until(lambda: not ops_stack.alive(child, "worker.app"), 30)
    finally:
        for pid in (leader.pid, child):
            if pid and ops_stack.alive(pid, "worker.app"):
                os.kill(pid, signal.SIGKILL)
        if leader.poll() is None:
            leader.wait(timeout=30)
        for f in (leader.stdin, leader.stdout):
            if f:
                f.close()


def test_a_group_no_member_of_which_runs_the_component_is_not_signalled() -> None:
    """Once a component's leader and its pool have ended, its pid may be another program's
    session by the time `stop` sends SIGKILL to the group: that group is left alone."""
    if not Path("/proc/self").exists():
        pytest.skip("no /proc here")
    other = subprocess.Popen(
        [sys.executable, "-c", "import sys; print('up', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert other.stdout is not None and other.stdout.readline() == b"up\n"
        assert ops_stack.group_members(other.pid) == [other.pid]
        ops_stack.kill_group(other.pid, "worker.app")
        ops_stack.kill_group(other.pid, "flower")
        assert other.poll() is None
        program = os.path.basename(sys.executable)
        ops_stack.kill_group(other.pid, program)  # a member that does run it: signalled
        assert other.wait(timeout=30) == -signal.SIGKILL
    finally:
        if other.poll() is None:
            other.kill()
            other.wait(timeout=30)
        for f in (other.stdin, other.stdout):
            if f:
                f.close()


# -- KIDX_DATA_DIR that is a file ---------------------------------------------------------------


def run_module(tmp_path: Path, data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KIDX_", "FLOWER_"))}
    env.update(
        KIDX_DATA_DIR=str(data_dir),
        KIDX_DB=str(tmp_path / "kidx.db"),
        KIDX_BROKER_URL=f"redis://127.0.0.1:{free_port()}/0",  # nothing listens there
        KIDX_FLOWER__PORT=str(free_port()),
        PYTHONPATH=str(ROOT),
    )
    return subprocess.run(
        [sys.executable, "-m", *args],
        env=env,
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
    )


def one_config_error(result: subprocess.CompletedProcess[str], data_dir: Path) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert f"KIDX_DATA_DIR={data_dir}" in lines[0]
    return lines[0]


def test_start_and_stop_with_a_data_dir_that_is_a_file_say_so_in_one_line(tmp_path: Path):
    """They crashed with a NotADirectoryError traceback; now one line naming the variable and
    the file, exit status 2 (a configuration error), and the file is left as it was."""
    file = tmp_path / "data"
    file.write_text("not a directory")
    for data_dir in (file, file / "below"):
        for action in ("start", "stop"):
            extra = ("--demo",) if action == "start" else ()
            result = run_module(tmp_path, data_dir, "ops.stack", action, *extra)
            line = settings_error(result)
            assert "KIDX_DATA_DIR" in line and f"{file} is not a directory" in line
    assert file.read_text() == "not a directory"


def settings_error(result: subprocess.CompletedProcess[str]) -> str:
    """The one line of a setting refused as the settings are built (exit status 2)."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: invalid settings: "), result.stderr
    return lines[0]


def test_flower_with_a_data_dir_that_is_a_file_says_so_in_one_line(tmp_path: Path):
    """Before any credentials are printed (--demo makes a password up): Flower never starts."""
    file = tmp_path / "data"
    file.write_text("not a directory")
    result = run_module(tmp_path, file, "ops.flower", "--demo")
    line = settings_error(result)
    assert "KIDX_DATA_DIR" in line and f"{file} is not a directory" in line
    assert "password" not in result.stdout
    assert file.read_text() == "not a directory"


def test_flower_without_credentials_or_with_a_bad_setting_is_a_configuration_error(tmp_path):
    """Status 2 and one line, as `kidx` and `ops.stack` say a configuration error: ops.flower
    ended with status 1, the status of a failure at run time."""
    data_dir = tmp_path / "data"
    result = run_module(tmp_path, data_dir, "ops.flower")  # no KIDX_FLOWER__USER/PASSWORD
    assert "Traceback" not in result.stderr and result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        "error: Flower needs KIDX_FLOWER__USER and KIDX_FLOWER__PASSWORD "
        "(or --demo, for a local demo on 127.0.0.1)"
    )
    (tmp_path / ".env").write_text("KIDX_LOG_LEVEL=loud\n")  # read from the cwd
    result = run_module(tmp_path, data_dir, "ops.flower", "--demo")
    assert "Traceback" not in result.stderr and result.returncode == 2, result.stderr
    [line] = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and "KIDX_LOG_LEVEL" in line, line
    assert "password" not in result.stdout


# -- Flower's URL on IPv6 -------------------------------------------------------------------------


class Healthcheck(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/healthcheck" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


class IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def test_flower_url_brackets_an_ipv6_address(tmp_path: Path):
    """KIDX_FLOWER__ADDRESS=::1 made http://::1:5555/, which httpx refuses (InvalidURL, not an
    HTTPError: `start` crashed waiting for Flower); the URL is http://[::1]:PORT/ and reaches
    a server on ::1."""
    if not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    try:
        server = IPv6Server(("::1", 0), Healthcheck)
    except OSError as e:
        pytest.skip(f"cannot listen on ::1: {e}")
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05})
    thread.start()
    try:
        stack = make_stack(tmp_path)
        flower = FlowerSettings(
            address="::1", port=server.server_address[1], user="kidx", password="horse-staple"
        )
        stack.settings = stack.settings.model_copy(update={"flower": flower})
        url = stack.flower_url()
        assert url == f"http://[::1]:{server.server_address[1]}/"
        assert httpx.get(url + "healthcheck", timeout=5).status_code == 200
        assert check_flower(stack.settings, 5) == url + "healthcheck"  # kidx doctor's check
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
    assert not thread.is_alive()


# -- a Redis started for an IPv6 loopback URL -----------------------------------------------------


@pytest.mark.parametrize("host", ["[::1]", "localhost", "127.0.0.1"])
def test_a_redis_started_for_a_loopback_url_answers_at_that_url(tmp_path: Path, host: str):
    """`start` bound 127.0.0.1 whatever the URL named: for `redis://[::1]:port` it waited 10 s
    for a Redis nobody could reach, failed, and left that daemon running. Each loopback URL now
    gets a Redis that answers at it, and `stop` stops it."""
    import redis

    if host != "127.0.0.1" and not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    port = free_port()
    for sub in ("run", "log"):
        (tmp_path / "data" / sub).mkdir(parents=True, exist_ok=True)
    settings = Settings(
        data_dir=tmp_path / "data", db=tmp_path / "kidx.db", broker_url=f"redis://{host}:{port}/0"
    )
    stack = ops_stack.Stack(settings)
    try:
        ops_stack.start_redis(stack)
        assert stack.pid("redis") is not None
        for address in ("::1", "127.0.0.1") if host == "localhost" else (host.strip("[]"),):
            client = redis.Redis(host=address, port=port, socket_timeout=5)
            assert client.ping()
            client.close()
    finally:
        ops_stack.stop_one(stack, "redis")
    assert stack.pid("redis") is None


@pytest.mark.parametrize("demo", [True, False])
def test_a_flower_started_with_demo_is_looked_for_on_loopback(tmp_path: Path, demo: bool):
    """--demo binds 127.0.0.1 whatever KIDX_FLOWER__ADDRESS says; with a password set, the
    stack looked for it at that address, and `start` failed after 60 s."""
    stack = make_stack(tmp_path)
    flower = FlowerSettings(address="10.1.2.3", port=5555, user="kidx", password="horse-staple")
    stack.settings = stack.settings.model_copy(update={"flower": flower})
    # a process that the stack takes for Flower: its command line names ops.flower
    args = ["ops.flower", *(["--demo"] if demo else [])]
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args])
    try:
        stack.pid_file("flower").write_text(str(process.pid))
        expected = "127.0.0.1" if demo else "10.1.2.3"
        assert stack.flower_url() == f"http://{expected}:5555/"
    finally:
        process.kill()
        process.wait(timeout=10)
