"""The pipeline's own Prometheus metrics, served by the worker on KIDX_METRICS__PORT.

Prefork pool processes each count; prometheus-client's multiprocess mode adds them up: each
process writes to files in one folder per worker, and the worker's main process serves their
sum. Flower serves its own `/metrics` (tasks by state and worker) beside these.

The metrics are made when the worker starts (`worker_init`), not at import: the `celery`
command imports prometheus-client (through Flower's command plugin) before this module, so the
multiprocess values are switched on here, explicitly; and a process that only imports the tasks
(the CLI, tests) writes nothing.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from celery.signals import worker_init, worker_process_shutdown

from worker.log import get_logger

log = get_logger("kidx.metrics")

_m: SimpleNamespace | None = None  # the metrics, once the worker has started


def _make(folder: Path) -> SimpleNamespace:
    from prometheus_client import Counter, Histogram, values

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(folder)
    values.ValueClass = values.MultiProcessValue()
    return SimpleNamespace(
        runs=Counter("kidx_item_runs", "Task runs by outcome", ["task", "outcome"]),
        chunks=Counter("kidx_chunks", "Chunks written, by where the vector came from", ["source"]),
        failures=Counter("kidx_failures", "Failed runs by reason", ["reason"]),
        run_seconds=Histogram(
            "kidx_run_seconds",
            "Duration of pipeline runs",
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 300),
        ),
        provider_seconds=Histogram(
            "kidx_provider_seconds",
            "Duration of provider calls",
            ["provider"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30),
        ),
    )


def run(task: str, outcome: str, failure: str | None = None) -> None:
    if _m is not None:
        _m.runs.labels(task, outcome).inc()
        if failure:
            _m.failures.labels(failure).inc()


def record_chunks(result: dict[str, Any]) -> None:
    """A successful run's chunks (reused, embedded, without a vector) and its duration."""
    if _m is None:
        return
    for source in ("reused", "embedded", "failed"):
        _m.chunks.labels(source).inc(int(result.get(source) or 0))
    if result.get("duration_ms"):
        _m.run_seconds.observe(result["duration_ms"] / 1000)


def observe_provider(provider: str, seconds: float) -> None:
    """A provider call's time (`Hooks.observe`), into kidx_provider_seconds."""
    if _m is not None:
        _m.provider_seconds.labels(provider).observe(seconds)


@worker_init.connect
def _start(sender: Any = None, **_: Any) -> None:
    """In the worker's main process, before the pool forks: the folder, the metrics, and the
    endpoint that sums what the pool processes write (the settings are the worker's app's)."""
    global _m
    settings = getattr(getattr(sender, "app", None), "kidx_settings", None)
    if settings is None:
        return
    port = settings.metrics.port
    if not port:
        return
    from prometheus_client import CollectorRegistry, multiprocess, start_http_server

    # by host too: containers sharing one data volume each have their main process at pid 1,
    # and each cleared the others' figures as it started
    folder = Path(settings.data_dir).resolve() / "metrics" / f"{socket.gethostname()}-{os.getpid()}"
    _clear_dead(folder.parent)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    _m = _make(folder)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(folder))
    address = settings.metrics.address or "0.0.0.0"  # (empty: every interface, as Flower's)
    try:
        start_http_server(port, addr=address, registry=registry)
    except OSError as e:  # another worker on this host has the port: metrics from that one
        log.warning("metrics endpoint not started", port=port, reason=str(e))
        return
    log.info("metrics endpoint", url=f"http://{address}:{port}/metrics")


def _clear_dead(metrics: Path) -> None:
    """Remove the folders of this host's workers that no longer run: each start made one,
    and none was ever removed (a worker stopped or killed leaves its files: a folder a start,
    for good). Another host's are left alone: whether they run cannot be seen from here."""
    prefix = f"{socket.gethostname()}-"
    try:
        names = [e.name for e in os.scandir(metrics)]
    except OSError:  # (none yet)
        return
    for name in names:
        pid = name[len(prefix) :]
        if not name.startswith(prefix) or not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(metrics / name, ignore_errors=True)
        except (OSError, OverflowError):
            pass  # alive (another user's), or no pid at all: left as it is


@worker_process_shutdown.connect
def _dead(pid: int | None = None, **_: Any) -> None:
    if _m is not None:
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid or os.getpid())
