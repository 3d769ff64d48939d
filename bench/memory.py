"""Peak resident memory of a worker's pool process while it indexes the Rust Book, and while it
indexes one 20 MB note; with the local model and with an HTTP provider (the stand-in).

    python bench/memory.py [--cases http,local] [--json PATH]

Each case starts a fresh worker (`celery -A worker.app worker --pool=prefork --concurrency=1`,
Redis database 8, its own SQLite file) and reads the pool process's VmHWM (its peak resident set,
kept by the kernel) from /proc after the work is done. Goals from the issue: under 600 MB with the
local model, under 200 MB with an HTTP provider; a 20 MB note must not cost more than a few times
its size.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import redis  # noqa: E402

from testkit.standin import StandIn  # noqa: E402

CORPUS = ROOT.parent / "shared" / "corpus" / "rustbook"
DB_NUMBER = 8
BROKER = f"redis://127.0.0.1:6379/{DB_NUMBER}"
MB = 1024 * 1024


def kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def run_case(provider: str, work: str, standin: StandIn, tmp: Path) -> dict[str, object]:
    redis.Redis.from_url(BROKER).flushdb()
    db_path = tmp / f"{provider}-{work}.db"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KIDX_")}
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(ROOT),
            "KIDX_DB": str(db_path),
            "KIDX_DATA_DIR": str(tmp / "data"),
            "KIDX_BROKER_URL": BROKER,
            "KIDX_METRICS__PORT": "0",
            "KIDX_LOG_LEVEL": "warning",
            "KIDX_EMBEDDING__BATCH_SIZE": "32",
        }
    )
    if provider == "http":
        env.update(
            {
                "KIDX_EMBEDDING__PROVIDER": "openai",
                "KIDX_EMBEDDING__MODEL": "standin-embed",
                "KIDX_EMBEDDING__BASE_URL": standin.base_url,
                "KIDX_EMBEDDING__DIMENSIONS": "384",
            }
        )
    else:
        env["KIDX_EMBEDDING__PROVIDER"] = "local"
    # The notes are written by a separate short process, so this one never loads kidx's SQLite.
    loader = "ops/scripts/load_corpus.py" if work == "corpus" else None
    if loader:
        subprocess.run(
            [sys.executable, loader, str(CORPUS)],
            env=env,
            check=True,
            cwd=ROOT,
            capture_output=True,
        )
    else:
        text = "\n\n".join(p.read_text() for p in sorted(CORPUS.glob("*.md")))
        big = (text * (20 * MB // len(text.encode()) + 1))[: 20 * MB]
        note = tmp / "big.md"
        note.write_text(big)
        subprocess.run(
            [sys.executable, "-m", "ops.cli", "add", "note", "--title", "Big", "--file", str(note)],
            env=env,
            check=True,
            cwd=ROOT,
            capture_output=True,
        )
    log = open(tmp / f"worker-{provider}-{work}.log", "wb")  # noqa: SIM115
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "worker.app",
            "worker",
            "--pool=prefork",
            "--concurrency=1",
            "--loglevel=WARNING",
            "-n",
            f"mem-{provider}@%h",
            "--without-gossip",
            "--without-mingle",
        ],
        env=env,
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    started = time.monotonic()
    try:
        subprocess.run(
            [sys.executable, "-m", "ops.cli", "reindex", "--all", "--wait", "--timeout", "1800"],
            env=env,
            check=False,
            cwd=ROOT,
            capture_output=True,
        )
        elapsed = time.monotonic() - started
        pool = children(worker.pid)
        peak = max((kb(p, "VmHWM") for p in pool), default=0)
        main_peak = kb(worker.pid, "VmHWM")
    finally:
        os.killpg(worker.pid, signal.SIGTERM)
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait(timeout=10)
        log.close()
    return {
        "provider": provider,
        "work": work,
        "pool_peak_mb": round(peak / 1024, 1),
        "main_peak_mb": round(main_peak / 1024, 1),
        "seconds": round(elapsed, 1),
        "goal_mb": 600 if provider == "local" else 200,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default="http,local")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "memory.json")
    args = ap.parse_args()
    rows = []
    with StandIn(dimensions=384) as standin, tempfile.TemporaryDirectory() as tmp:
        for provider in args.cases.split(","):
            for work in ("corpus", "20MB note"):
                rows.append(
                    run_case(
                        provider, work.split()[0] if work == "corpus" else "big", standin, Path(tmp)
                    )
                )
                rows[-1]["work"] = work
                print(rows[-1], flush=True)
    redis.Redis.from_url(BROKER).flushdb()
    print(f"\n{'provider':<9}{'work':<12}{'pool peak MB':>14}{'goal MB':>9}{'main MB':>9}{'s':>8}")
    for r in rows:
        print(
            f"{r['provider']:<9}{r['work']:<12}{r['pool_peak_mb']:>14}{r['goal_mb']:>9}"
            f"{r['main_peak_mb']:>9}{r['seconds']:>8}"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
