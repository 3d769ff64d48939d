"""Running a benchmark's systems in their own processes, in step with the driver.

A peer (a script in this folder) prints one JSON line per phase, ``{"phase": NAME, ...}``, and
waits for ``go`` on its standard input before the next one; its last line is
``{"phase": "done", ...}``. The driver, which serves the embedding stand-in, reads the stand-in's
counters at every phase line, so that each phase's requests and texts are counted where they
arrive, whatever the client. Nothing here imports kidx or a peer library: peers that load
LangChain or LlamaIndex (Python's sqlite3) must never share a process with kidx (apsw).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PEERS = Path(__file__).resolve().parent
API_KEY = "sk-bench-standin"
MODEL = "standin-embed"


# -- the peer's side -------------------------------------------------------------------------


def phase(name: str, **info: Any) -> None:
    """Report a phase's end to the driver and wait for it to say go."""
    print(json.dumps({"phase": name, **info}), flush=True)
    answer = sys.stdin.readline().strip()
    if answer != "go":
        sys.exit(f"driver said {answer!r}, not go")


def done(**info: Any) -> None:
    print(json.dumps({"phase": "done", **info}), flush=True)


# -- the driver's side -----------------------------------------------------------------------


def peer_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KIDX_", "OPENAI_"))}
    env.update(
        {
            "PYTHONPATH": str(ROOT),
            "HF_HUB_OFFLINE": "1",
            "OPENAI_API_KEY": API_KEY,
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    env.update(extra)
    return env


def run_peer(
    script: str,
    args: list[str],
    on_phase: Callable[[str, dict[str, Any]], None],
    *,
    log: Path,
    timeout: float = 600,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run `script` (a file of this folder) to its end; `on_phase(name, info)` runs at every
    phase line before the peer is told to go on. Returns the `done` line. The peer is killed
    (its whole process group) after `timeout` seconds or when it fails."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as err:
        proc = subprocess.Popen(
            [sys.executable, str(PEERS / script), *args],
            env=env or peer_env(),
            cwd=str(ROOT),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
        timer = threading.Timer(timeout, _kill, (proc,))
        timer.start()
        final: dict[str, Any] | None = None
        try:
            assert proc.stdout is not None and proc.stdin is not None
            for line in proc.stdout:
                if not line.startswith('{"phase"'):
                    continue
                info = json.loads(line)
                name = info.pop("phase")
                if name == "done":
                    final = info
                    break
                on_phase(name, info)
                proc.stdin.write("go\n")
                proc.stdin.flush()
            proc.wait(timeout=30)
        finally:
            timer.cancel()
            _kill(proc)
    if final is None or proc.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{script} failed (exit {proc.returncode}):\n{tail}")
    return final


def _kill(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


class StandInProcess:
    """bench/peers/standin_server.py, started and driven from the driver: `base_url`,
    `reset(delay)`, `count()`; a context manager that leaves nothing running."""

    def __init__(self, dimensions: int, log: Path) -> None:
        self.dimensions = dimensions
        self.log = log
        self.base_url = ""
        self._proc: subprocess.Popen[str] | None = None

    def __enter__(self) -> StandInProcess:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as err:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    str(PEERS / "standin_server.py"),
                    "--dimensions",
                    str(self.dimensions),
                ],
                env=peer_env(),
                cwd=str(ROOT),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
            )
        self.base_url = self._line(timeout=60)
        if not self.base_url.startswith("http://127.0.0.1:"):
            raise RuntimeError(f"the stand-in did not start: {self.base_url!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        proc = self._proc
        if proc is None:
            return
        self._proc = None
        try:
            assert proc.stdin is not None
            proc.stdin.write("quit\n")
            proc.stdin.flush()
            proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        _kill(proc)

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def _line(self, timeout: float = 30) -> str:
        assert self._proc is not None and self._proc.stdout is not None
        timer = threading.Timer(timeout, _kill, (self._proc,))
        timer.start()
        try:
            return self._proc.stdout.readline().strip()
        finally:
            timer.cancel()

    def _ask(self, command: str) -> str:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(command + "\n")
        self._proc.stdin.flush()
        return self._line()

    def reset(self, delay: float = 0.0) -> None:
        """Counters to zero, the vector cache emptied, every answer after `delay` seconds."""
        if self._ask(f"reset {delay!r}") != "ok":
            raise RuntimeError("the stand-in did not reset")

    def count(self) -> dict[str, Any]:
        """{"requests", "texts", "cpu_seconds"} so far (since the last reset, CPU since start)."""
        return json.loads(self._ask("count"))


# -- the machine -----------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """nproc, CPU model, memory, Python."""
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem_kb = next(
        int(line.split()[1])
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.startswith("MemTotal")
    )
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "memory_gib": round(mem_kb / 2**20, 1),
        "python": sys.version.split()[0],
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far; 0 when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy (every process, every core) so far."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]  # idle, iowait
    return (sum(values[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_quiet(threshold: float = 0.3, window: float = 0.5, max_wait: float = 60) -> float:
    """Wait (at most `max_wait` s) until the machine is busy less than `threshold` cores over a
    `window`: this machine is shared, and another job's load would be counted against whoever
    runs during it. Returns the last load measured, in cores."""
    deadline = time.monotonic() + max_wait
    while True:
        before = machine_busy()
        time.sleep(window)
        load = (machine_busy() - before) / window
        if load < threshold or time.monotonic() > deadline:
            return load
