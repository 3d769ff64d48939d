"""The worker's Prometheus endpoint: the pool processes' counts, summed by the main process."""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import corpus_text
from stack import Stack, free_port, running_stack, wait_for
from tasks.producer import enqueue

# Real worker processes (not in make test-quick); one xdist worker runs the whole module, so
# its module-scoped stack starts once.
pytestmark = [pytest.mark.stack]

PORT = free_port()


def _gone_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


class MetricsStack(Stack):
    def __init__(self, tmp: Path, standin: object) -> None:
        # what earlier workers of this host left: one that ended, one that runs (this one)
        host = socket.gethostname()
        self.planted = {
            "gone": tmp / "data" / "metrics" / f"{host}-{_gone_pid()}",
            "running": tmp / "data" / "metrics" / f"{host}-{os.getpid()}",
            "other host": tmp / "data" / "metrics" / f"{host}.elsewhere-1",
        }
        for folder in self.planted.values():
            folder.mkdir(parents=True)
            (folder / "counter_1.db").write_bytes(b"\0" * 16)
        super().__init__(tmp, standin, worker="metered", env={"KIDX_METRICS__PORT": str(PORT)})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MetricsStack]:
    with running_stack(tmp_path_factory.mktemp("metrics"), MetricsStack) as s:
        yield s


def value(text: str, pattern: str) -> float:
    m = re.search(rf"^{pattern} ([0-9.e+]+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_runs_chunks_provider_latency_and_failures_are_counted(stack):
    url = f"http://127.0.0.1:{PORT}/metrics"
    item = stack.note("Metered", corpus_text("ch04-03-slices.md"))
    result = stack.app.AsyncResult(enqueue(stack.db, item, app=stack.app)).get(timeout=60)
    again = stack.app.AsyncResult(enqueue(stack.db, item, app=stack.app)).get(timeout=60)
    missing = stack.app.send_task("GenerateEmbedding", args=[987654])
    with pytest.raises(Exception, match="no item"):
        missing.get(timeout=60)

    def scraped() -> str | None:
        text = httpx.get(url, timeout=2).text
        done = value(text, r'kidx_item_runs_total\{outcome="success",task="GenerateEmbedding"\}')
        return text if done >= 2 else None

    text = wait_for(scraped, 20, "the endpoint to count both runs", every=0.2)
    assert value(text, r'kidx_chunks_total\{source="embedded"\}') >= result["embedded"] > 0
    assert value(text, r'kidx_chunks_total\{source="reused"\}') >= again["reused"] > 0
    assert value(text, r'kidx_provider_seconds_count\{provider="embedding"\}') >= 1
    assert value(text, r'kidx_failures_total\{reason="bad_input"\}') >= 1
    assert value(text, r"kidx_run_seconds_count") >= 2
    # a folder by host and pid: containers on one data volume each have their pid 1
    folders = [f.name for f in (stack.tmp / "data" / "metrics").iterdir()]
    assert folders and all(f.startswith(f"{socket.gethostname()}") for f in folders), folders


def test_the_folders_of_this_host_s_workers_that_ended_are_removed_at_start(stack):
    """Each start made a folder and none was removed: a folder a restart, for good."""
    assert not stack.planted["gone"].exists()
    assert stack.planted["running"].exists() and stack.planted["other host"].exists()
