"""Indexing throughput: kidx through its real stack beside LangChain's in-process pipeline.

    python bench/throughput.py [--corpus DIR] [--batch-size B] [--dimensions D]
        [--latency S] [--rounds R] [--profile DIR] [--json PATH]

One run, one stand-in (testkit/standin.py in a process of its own: an OpenAI-compatible
/v1/embeddings on 127.0.0.1 that counts requests and texts where they arrive), the same model
name, dimension and batch size for everyone:

* kidx: the corpus loaded as notes into a fresh SQLite file, a prefork worker
  (`celery -A worker.app worker --pool=prefork --concurrency=N`, N = 1 and 2) on Redis
  database 9, provider `openai` at the stand-in; timed from `send_batch` of every item until
  the batch row has counted every item's run.
* LangChain, in its own process (it uses Python's sqlite3; kidx uses apsw):
  RecursiveCharacterTextSplitter(1500, 100), OpenAIEmbeddings (chunk_size = the batch size),
  SQLiteVec.add_documents; timed from splitting to the last write. Also, with the stand-in
  answering at once, at kidx's structural target (650, overlap 100): about as many chunks as
  kidx makes, a row to read beside the goal's (which is against LangChain's own 1500). And
  kidx on two processes at LangChain's size (`KIDX_CHUNK__TARGET=1500`), no goal either.

First with the stand-in answering at once (chunks and corpus MB per second, and the ratios of
kidx's to LangChain's), then with every answer after `--latency` seconds (provider-bound: texts
embedded per second as a share of the ceiling `batch size x processes / latency`). Each
configuration runs `--rounds` times, interleaved, and the fastest round counts. The machine is
shared: each timed run waits (boundedly) for the machine to be quiet, and the load of other
processes during it is recorded (`background cores`). `--profile DIR` runs py-spy on the
worker's processes (it slows them: do not read the timings of such a run). Timings are measured
here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.peers import stack  # noqa: E402
from bench.peers.harness import (  # noqa: E402
    API_KEY,
    MODEL,
    StandInProcess,
    cpu_seconds,
    machine,
    machine_busy,
    run_peer,
    wait_quiet,
)
from worker.chunking.structure import chunk_structure  # noqa: E402

DEFAULT_CORPUS = ROOT.parent / "shared" / "corpus" / "rustbook"
# LangChain at its own size (1500, the goal's peer) and at kidx's structural target (650): the
# same corpus in about as many chunks as kidx makes, stand-in answering at once only.
SAME_SIZE = inspect.signature(chunk_structure).parameters["target"].default
# kidx at LangChain's own size too (KIDX_CHUNK__TARGET=1500; no goal): the goal's row compares
# kidx at its own 650 with LangChain at its 1500, a chunk count three times LangChain's.
PEER_SIZE = 1500
SYSTEMS = (
    "kidx c1",
    "kidx c2",
    "langchain",
    f"langchain {SAME_SIZE}",
    f"kidx c2 {PEER_SIZE}",
)
BOUND_SYSTEMS = SYSTEMS[:3]


def processes(name: str) -> int:
    """A system's processes: `kidx cN [size]` runs N, LangChain one."""
    return 1 if name.startswith("langchain") else int(name.split()[1][1:])


def title_of(text: str, path: Path) -> str:
    """As ops/scripts/load_corpus.py names a note: its first heading, else the file's stem."""
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return path.stem


def corpus_files(corpus: Path) -> list[tuple[Path, str]]:
    files = [(p, p.read_text(encoding="utf-8")) for p in sorted(corpus.glob("*.md"))]
    return [(p, t) for p, t in files if t.strip()]


def redis_pid() -> int | None:
    import redis

    client = redis.Redis.from_url(stack.BROKER)
    try:
        return int(client.info("server")["process_id"])
    finally:
        client.close()


class CpuMeter:
    """CPU seconds of the processes that take part (by component, `driver` being this one:
    send_batch and the polling) and of the whole machine, between start() and stop()."""

    def __init__(self, pids: dict[str, list[int]]) -> None:
        self.pids = pids
        self.before: dict[str, float] = {}

    def _snap(self) -> dict[str, float]:
        t = os.times()
        snap = {"driver": t.user + t.system, "machine": machine_busy()}
        for name, group in self.pids.items():
            snap[name] = sum(cpu_seconds(p) for p in group)
        return snap

    def start(self) -> None:
        self.before = self._snap()

    def stop(self, seconds: float, extra: dict[str, float] | None = None) -> dict[str, Any]:
        after = self._snap()
        used = {k: after[k] - self.before[k] for k in self.before if k != "machine"}
        used.update(extra or {})
        total = after["machine"] - self.before["machine"]
        ours = sum(used.values())
        return {
            "cpu_seconds": used,
            "cores_used": ours / seconds,
            "background_cores": max(0.0, total - ours) / seconds,
        }


# -- kidx through the stack ------------------------------------------------------------------


def kidx_run(
    files: list[tuple[Path, str]],
    standin: StandInProcess,
    *,
    concurrency: int,
    latency: float,
    batch_size: int,
    dimensions: int,
    tmp: Path,
    profile: Path | None = None,
    target: int | None = None,
) -> dict[str, Any]:
    from tasks.producer import send_batch
    from worker.app import create_app
    from worker.settings import load_settings
    from worker.store import connect
    from worker.store.items import add_item

    work = Path(tempfile.mkdtemp(prefix=f"kidx-c{concurrency}-", dir=tmp))
    stack.flush()
    embedding = {
        "provider": "openai",
        "model": MODEL,
        "base_url": standin.base_url,
        "dimensions": dimensions,
        "batch_size": batch_size,
    }
    settings = load_settings(db=work / "kidx.db", broker_url=stack.BROKER, embedding=embedding)
    app = create_app(settings)
    db = connect(work / "kidx.db", embedding=settings.embedding)
    ids = [
        add_item(db, kind="note", title=title_of(t, p), content=t, source=str(p.resolve()))
        for p, t in files
    ]
    env = stack.worker_env(
        work,
        standin.base_url,
        model=MODEL,
        dimensions=dimensions,
        batch_size=batch_size,
        api_key=API_KEY,
        concurrency=concurrency,
    )
    if target is not None:
        env["KIDX_CHUNK__TARGET"] = str(target)
    name = f"bench-c{concurrency}"
    worker = stack.start_worker(env, work, app, name=name, concurrency=concurrency)
    spies: list[subprocess.Popen[bytes]] = []
    batch_id = 0

    def finished() -> bool:
        row = db.one(
            "SELECT ok + failed + skipped, total FROM index_batches WHERE id = ?", (batch_id,)
        )
        return bool(row and row[0] >= row[1])

    try:
        if profile is not None:
            spies = start_spies(worker, profile, f"kidx-c{concurrency}-latency{latency:g}")
        pids = {
            "worker main": [worker.popen.pid],
            "pool": stack.pool_pids(worker),
            "standin": [standin.pid],
        }
        if (rpid := redis_pid()) is not None:
            pids["redis"] = [rpid]
        meter = CpuMeter(pids)
        quiet = wait_quiet()
        standin.reset(latency)
        meter.start()
        t0 = time.perf_counter()
        batch_id, _ = send_batch(db, ids, app=app)
        sent = time.perf_counter() - t0
        stack.wait_for(finished, 900, "every item of the batch", every=0.005)
        seconds = time.perf_counter() - t0
        cpu = meter.stop(seconds)
        counted = standin.count()
    finally:
        stop_spies(spies)
        worker.stop()
        app.close()
        stack.flush()
    statuses = dict(db.all("SELECT status, count(*) FROM item_index_state GROUP BY status"))
    chunks = db.scalar("SELECT count(*) FROM note_chunks")
    vec_rows = db.scalar("SELECT count(*) FROM vec_chunk_embeddings")
    # kidx's own records of each task run (a group's job rows are `<task id>:<item id>`): when
    # it started and ended, so that the time in tasks and outside them (send_batch, Celery's
    # dispatch, acknowledgements, results) can be told apart.
    runs = db.all(
        "SELECT substr(task_id, 1, 36), min(julianday(started_at)), max(julianday(finished_at)), "
        "count(*) FROM index_jobs WHERE batch_id = ? GROUP BY 1",
        (batch_id,),
    )
    db.close()
    shutil.rmtree(work, ignore_errors=True)
    in_tasks = sum((end - start) * 86400 for _, start, end, _ in runs)
    return {
        "seconds": seconds,
        "send_seconds": sent,
        "chunks": chunks,
        "vec_rows": vec_rows,
        "requests": counted["requests"],
        "texts": counted["texts"],
        "statuses": statuses,
        "quiet_before": quiet,
        **cpu,
        "tasks": len(runs),
        "items_per_task": len(ids) / max(1, len(runs)),
        # seconds of each process: in tasks, and the rest of the run (outside any task)
        "task_seconds": in_tasks / concurrency,
        "outside_seconds": seconds - in_tasks / concurrency,
    }


def start_spies(worker: stack.Proc, out: Path, label: str) -> list[subprocess.Popen[bytes]]:
    """py-spy on the worker's main process and on each pool process (collapsed stacks, idle
    time included, one file each: `LABEL-main-PID.txt`, `LABEL-pool-PID.txt`), until stopped."""
    out.mkdir(parents=True, exist_ok=True)
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    procs = []
    targets = [("main", worker.popen.pid)] + [("pool", p) for p in stack.pool_pids(worker)]
    for role, pid in targets:
        cmd = [
            spy,
            "record",
            "--pid",
            str(pid),
            "--rate",
            "250",
            "--format",
            "raw",
            "--idle",
            "--threads",
            "--output",
            str(out / f"{label}-{role}-{pid}.txt"),
        ]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)  # py-spy attaches
    return procs


def stop_spies(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


# -- LangChain in its own process ------------------------------------------------------------


def langchain_run(
    corpus: Path,
    standin: StandInProcess,
    *,
    latency: float,
    batch_size: int,
    dimensions: int,
    tmp: Path,
    chunk_size: int = 1500,
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="langchain-", dir=tmp))
    pids = {"standin": [standin.pid]}
    if (rpid := redis_pid()) is not None:
        pids["redis"] = [rpid]
    meter = CpuMeter(pids)
    quiet: list[float] = []
    timed: dict[str, Any] = {}
    t0 = 0.0

    def on_phase(name: str, info: dict[str, Any]) -> None:
        nonlocal t0
        if name == "setup":
            quiet.append(wait_quiet())
            standin.reset(latency)  # the dummy text SQLiteVec embeds for the dimension: uncounted
            meter.start()
            t0 = time.perf_counter()
        elif name == "run":  # the timed part is over; the meter's window is the driver's
            cpu = meter.stop(time.perf_counter() - t0, {"langchain": info.pop("cpu_seconds")})
            counted = standin.count()
            timed.update(info, **cpu, requests=counted["requests"], texts=counted["texts"])

    args = [
        "--corpus",
        str(corpus),
        "--base-url",
        standin.base_url,
        "--db",
        str(work / "langchain.db"),
        "--batch-size",
        str(batch_size),
        "--dimensions",
        str(dimensions),
        "--chunk-size",
        str(chunk_size),
    ]
    result = run_peer("langchain_throughput.py", args, on_phase, log=tmp / "langchain.log")
    shutil.rmtree(work, ignore_errors=True)
    return {**result, **timed, "quiet_before": quiet[0]}


# -- the run ---------------------------------------------------------------------------------


def run(
    corpus: Path,
    batch_size: int,
    dimensions: int,
    latency: float,
    rounds: int,
    profile: Path | None,
) -> dict[str, Any]:
    from worker.log import configure_logging

    configure_logging(level="warning")  # not the store's info lines between the results
    files = corpus_files(corpus)
    megabytes = sum(len(t.encode()) for _, t in files) / 1e6
    started = time.perf_counter()
    instant: dict[str, list[dict[str, Any]]] = {name: [] for name in SYSTEMS}
    bound: dict[str, list[dict[str, Any]]] = {name: [] for name in BOUND_SYSTEMS}
    tmp = Path(tempfile.mkdtemp(prefix="kidx-bench-throughput-"))
    try:
        with StandInProcess(dimensions, log=tmp / "standin.log") as standin:
            plan = [
                (t, d, name)
                for t, d in ((instant, 0.0), (bound, latency))
                for _ in range(rounds)
                for name in t
            ]
            for table, delay, name in plan:
                common = {
                    "latency": delay,
                    "batch_size": batch_size,
                    "dimensions": dimensions,
                    "tmp": tmp,
                }
                if name.startswith("langchain"):
                    size = SAME_SIZE if name != "langchain" else 1500
                    r = langchain_run(corpus, standin, chunk_size=size, **common)
                else:
                    size = int(name.split()[2]) if len(name.split()) > 2 else None
                    r = kidx_run(
                        files,
                        standin,
                        concurrency=processes(name),
                        profile=profile,
                        target=size,
                        **common,
                    )
                table[name].append(r)
                print(
                    f"  {'bound' if delay else 'instant'} {name}: {r['seconds']:.2f} s, "
                    f"background {r['background_cores']:.2f} cores",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    def best(runs: list[dict[str, Any]]) -> dict[str, Any]:
        fastest = min(runs, key=lambda r: r["seconds"])
        return {**fastest, "all_seconds": [r["seconds"] for r in runs]}

    rows: dict[str, dict[str, Any]] = {}
    for name, runs in instant.items():
        r = best(runs)
        r["processes"] = processes(name)
        r["chunks_per_s"] = r["chunks"] / r["seconds"]
        r["mb_per_s"] = megabytes / r["seconds"]
        r["texts_per_request"] = r["texts"] / max(1, r["requests"])
        rows[name] = r
    # The goal is by corpus MB/s: chunks/s flatters the chunker that makes more chunks.
    for r in rows.values():
        r["vs_langchain"] = r["chunks_per_s"] / rows["langchain"]["chunks_per_s"]
        r["mb_vs_langchain"] = r["mb_per_s"] / rows["langchain"]["mb_per_s"]
    bound_rows: dict[str, dict[str, Any]] = {}
    for name, runs in bound.items():
        r = best(runs)
        n = processes(name)  # LangChain's client is sequential
        r["processes"] = n
        r["texts_per_s"] = r["texts"] / r["seconds"]
        r["ceiling_texts_per_s"] = batch_size * n / latency
        r["share_of_ceiling"] = r["texts_per_s"] / r["ceiling_texts_per_s"]
        r["texts_per_request"] = r["texts"] / max(1, r["requests"])
        r["latency_floor_s"] = r["requests"] * latency / n  # the latency alone, its requests
        r["share_of_floor"] = r["latency_floor_s"] / r["seconds"]
        bound_rows[name] = r
    result: dict[str, Any] = {
        "corpus": str(corpus),
        "files": len(files),
        "megabytes": megabytes,
        "batch_size": batch_size,
        "dimensions": dimensions,
        "model": MODEL,
        "latency": latency,
        "rounds": rounds,
        "machine": machine(),
        "wall_seconds": time.perf_counter() - started,
        "instant": rows,
        "provider_bound": bound_rows,
    }
    result["goals"] = {
        "kidx_c2_vs_langchain_mb": rows["kidx c2"]["mb_vs_langchain"],
        "kidx_c2_at_least_1_1x_langchain_mb": rows["kidx c2"]["mb_vs_langchain"] >= 1.1,
        "kidx_c2_vs_langchain_same_size_mb": (
            rows["kidx c2"]["mb_per_s"] / rows[f"langchain {SAME_SIZE}"]["mb_per_s"]
        ),
        "kidx_c2_at_peer_size_vs_langchain_mb": rows[f"kidx c2 {PEER_SIZE}"]["mb_vs_langchain"],
        "kidx_c1_share_of_ceiling": bound_rows["kidx c1"]["share_of_ceiling"],
        "kidx_c2_share_of_ceiling": bound_rows["kidx c2"]["share_of_ceiling"],
        "kidx_at_least_90pct_of_ceiling": all(
            bound_rows[k]["share_of_ceiling"] >= 0.9 for k in ("kidx c1", "kidx c2")
        ),
    }
    return result


def print_tables(result: dict[str, Any]) -> None:
    m = result["machine"]
    print(
        f"corpus {result['corpus']} ({result['files']} files, {result['megabytes']:.2f} MB); "
        f"batch size {result['batch_size']}, {result['dimensions']} dimensions, model "
        f"{result['model']}; fastest of {result['rounds']}; {m['nproc']} CPUs ({m['cpu']}), "
        f"{m['memory_gib']} GiB"
    )
    print("\nstand-in answering at once")
    _table(
        result["instant"],
        [
            ("procs", "processes", "{}"),
            ("chunks", "chunks", "{}"),
            ("seconds", "seconds", "{:.2f}"),
            ("chunks/s", "chunks_per_s", "{:.0f}"),
            ("MB/s", "mb_per_s", "{:.3f}"),
            ("requests", "requests", "{}"),
            ("texts/req", "texts_per_request", "{:.1f}"),
            ("÷LC chunks", "vs_langchain", "{:.2f}"),
            ("÷LC MB/s", "mb_vs_langchain", "{:.2f}"),
            ("cores used", "cores_used", "{:.2f}"),
            ("background", "background_cores", "{:.2f}"),
        ],
    )
    print(
        f"\nprovider-bound: every answer after {result['latency'] * 1000:.0f} ms; ceiling = "
        f"batch size {result['batch_size']} x processes / latency; `latency s` = requests x "
        f"latency / processes"
    )
    _table(
        result["provider_bound"],
        [
            ("procs", "processes", "{}"),
            ("texts", "texts", "{}"),
            ("requests", "requests", "{}"),
            ("texts/req", "texts_per_request", "{:.1f}"),
            ("seconds", "seconds", "{:.2f}"),
            ("texts/s", "texts_per_s", "{:.0f}"),
            ("ceiling", "ceiling_texts_per_s", "{:.0f}"),
            ("of ceiling", "share_of_ceiling", "{:.1%}"),
            ("latency s", "latency_floor_s", "{:.2f}"),
            ("of latency", "share_of_floor", "{:.1%}"),
            ("background", "background_cores", "{:.2f}"),
        ],
    )
    print(
        "\nkidx's tasks (groups of items): seconds of a pool process in tasks, and the rest of "
        "the run (send_batch, Celery's dispatch and results, waiting for the last process)"
    )
    tables = (("now", "instant"), ("50ms", "provider_bound"))
    kidx_rows = {
        f"{k} {label}": r
        for label, table in tables
        for k, r in result[table].items()
        if not k.startswith("langchain")
    }
    _table(
        kidx_rows,
        [
            ("tasks", "tasks", "{}"),
            ("items/task", "items_per_task", "{:.0f}"),
            ("seconds", "seconds", "{:.3f}"),
            ("in tasks", "task_seconds", "{:.3f}"),
            ("outside", "outside_seconds", "{:.3f}"),
            ("send s", "send_seconds", "{:.3f}"),
        ],
        width=18,
    )
    g = result["goals"]
    print(
        f"\ngoal: kidx (2 processes) >= 1.1x LangChain by corpus MB/s: "
        f"{g['kidx_c2_vs_langchain_mb']:.2f}x, "
        f"{'met' if g['kidx_c2_at_least_1_1x_langchain_mb'] else 'not met'}"
    )
    print(
        f"beside LangChain at kidx's chunk size ({SAME_SIZE} characters, no goal): kidx (2 "
        f"processes) {g['kidx_c2_vs_langchain_same_size_mb']:.2f}x by corpus MB/s"
    )
    print(
        f"beside LangChain at its own chunk size ({PEER_SIZE} characters, KIDX_CHUNK__TARGET, no "
        f"goal): kidx (2 processes) {g['kidx_c2_at_peer_size_vs_langchain_mb']:.2f}x by corpus MB/s"
    )
    print(
        f"goal: >= 90% of the provider-bound ceiling: 1 process "
        f"{g['kidx_c1_share_of_ceiling']:.1%}, 2 processes {g['kidx_c2_share_of_ceiling']:.1%}, "
        f"{'met' if g['kidx_at_least_90pct_of_ceiling'] else 'not met'}"
    )


def _table(
    rows: dict[str, dict[str, Any]], cols: list[tuple[str, str, str]], width: int = 14
) -> None:
    header = f"{'system':<{width}}" + "".join(f"{c[0]:>12}" for c in cols)
    print(header)
    print("-" * len(header))
    for name, r in rows.items():
        print(f"{name:<{width}}" + "".join(f"{fmt.format(r[key]):>12}" for _, key, fmt in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--dimensions", type=int, default=384)
    ap.add_argument("--latency", type=float, default=0.05)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", type=Path, help="py-spy the worker's processes into this folder")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "throughput.json")
    args = ap.parse_args()
    if not args.corpus.is_dir():
        sys.exit(f"corpus not found: {args.corpus}")
    result = run(
        args.corpus, args.batch_size, args.dimensions, args.latency, args.rounds, args.profile
    )
    print_tables(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
