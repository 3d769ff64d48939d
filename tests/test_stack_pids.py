"""ops/stack.py's pid files: only a pid a component can have (an integer above 1) is ever
looked at or signalled. 0, -1 and 1 in a pid file are a process group, every process and init:
`os.kill(-1, SIGTERM)` signals every process there is.

No test here lets a signal reach -1, 0 or 1: `os.kill` and `os.killpg` are replaced by fakes
that record every call and pass on only signal 0 (an existence check) to a pid above 1."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ops import stack as ops_stack
from stack import free_port
from worker.settings import Settings

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
        [sys.executable, "-c", "import sys; sys.stdin.read()", "worker.app"],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )
    try:
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
