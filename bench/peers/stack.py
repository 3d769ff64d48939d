"""The real kidx stack for benchmarks: a prefork Celery worker on Redis database 9 (flushed
before and after, and only that one), its own SQLite file, the stand-in as its provider.
The processes are started and stopped by tests/stack.py's helpers: every wait is bounded, every
process is stopped with its whole process group."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.stack import Proc, start_worker, wait_for  # noqa: E402, F401 - the benchmarks' too

REDIS_DB = 9  # the benchmarks' own database
BROKER = f"redis://127.0.0.1:6379/{REDIS_DB}"


def flush() -> None:
    import redis

    client = redis.Redis.from_url(BROKER)
    client.flushdb()
    client.close()


def worker_env(
    work: Path,
    base_url: str,
    *,
    model: str,
    dimensions: int,
    batch_size: int,
    api_key: str,
    concurrency: int,
    **extra: str,
) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KIDX_", "FLOWER_", "CELERY_"))}
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(ROOT),
            "KIDX_DB": str(work / "kidx.db"),
            "KIDX_DATA_DIR": str(work / "data"),
            "KIDX_BROKER_URL": BROKER,
            "KIDX_EMBEDDING__PROVIDER": "openai",
            "KIDX_EMBEDDING__MODEL": model,
            "KIDX_EMBEDDING__BASE_URL": base_url,
            "KIDX_EMBEDDING__DIMENSIONS": str(dimensions),
            "KIDX_EMBEDDING__API_KEY": api_key,
            "KIDX_EMBEDDING__BATCH_SIZE": str(batch_size),
            "KIDX_EMBEDDING__MAX_RETRIES": "0",
            "KIDX_TASKS__CONCURRENCY": str(concurrency),
            "KIDX_LOG_FORMAT": "json",
            "KIDX_METRICS__PORT": "0",
        }
    )
    env.update(extra)
    return env


def pool_pids(worker: Proc) -> list[int]:
    """The worker's pool processes (children of the main process), for py-spy."""
    out = subprocess.run(
        ["ps", "-o", "pid=", "--ppid", str(worker.popen.pid)], capture_output=True, text=True
    ).stdout
    return [int(p) for p in out.split()]
