"""kidx search() through vec0 and through its in-memory fallback, beside exact numpy search.

    python bench/search.py [--sizes 10000,100000] [--dims 384,1536] [--queries 50] [--k 10]
                           [--seed S] [--json PATH]

For each (size, dims): `size` seeded random unit float32 vectors are written into a fresh kidx
database (in a temp dir) as real rows: knowledge_items, item_index_state, note_chunks (10 per
item), note_chunk_embeddings and vec_chunk_embeddings, in one transaction. Then the same random
query vectors go, interleaved, through:

- **numpy**: exact search over the same matrix in this process (`matrix @ q`, `argpartition`,
  the top sorted), reduced to one hit per item like kidx (the top k x 10 chunks hold at least k
  items); with the default BLAS threads, and with one thread when threadpoolctl is there;
- **vec0 KNN**: the bare sqlite-vec query `search()` starts with (`k` = its first fetch), no
  joins, to tell sqlite-vec's own cost from kidx's around it;
- **kidx vec0**: `search()` on `connect(..., vec=True)`;
- **kidx fallback**: `search()` on `connect(..., vec=False)`;
both connections mapped for reading (`Database.map_for_reading()`), as `kidx search` opens its.

The query embedder returns the next query vector, so embedding costs nothing. Reported: median
and p95 milliseconds per query, the ratio of each median to numpy's (same run), and, for every
timed query, whether kidx returned the same items in the same order as numpy (recall@k and the
share of identical rankings): a fast wrong answer is worthless. The issue's goal is kidx vec0
within 3x of numpy at 100k x 384. Timings are measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from worker.log import configure_logging  # noqa: E402
from worker.providers.base import EmbeddingModel  # noqa: E402
from worker.retrieval import search  # noqa: E402
from worker.settings import EmbeddingSettings  # noqa: E402
from worker.store import connect  # noqa: E402
from worker.store.db import Database  # noqa: E402

try:
    from threadpoolctl import threadpool_limits
except ImportError:  # optional: only for the one-thread numpy column
    threadpool_limits = None

MODEL = "bench"
CHUNKS_PER_ITEM = 10
GOAL = (100_000, 384, 3.0)  # size, dims, kidx vec0 / numpy
METHODS = ("numpy", "numpy 1 thread", "vec0 KNN", "kidx vec0", "kidx fallback")


class QueryVectors(EmbeddingModel):
    """An embedder whose answer is whatever vector was set last: the query costs nothing."""

    model_id = MODEL
    batch_size = 1

    def __init__(self, dims: int) -> None:
        self.dimensions = dims
        self.vector = np.zeros((1, dims), dtype=np.float32)

    def embed_batch(self, texts: list[str]) -> np.ndarray:
        return self.vector


def unit_vectors(rng: np.random.Generator, n: int, dims: int) -> np.ndarray:
    m = rng.standard_normal((n, dims), dtype=np.float32)
    m /= np.linalg.norm(m, axis=1, keepdims=True)
    return m


def build(path: Path, matrix: np.ndarray) -> dict[str, float]:
    """Write the vectors as real kidx rows, chunk i of item i // 10 + 1, in one transaction."""
    n, dims = matrix.shape
    items = -(-n // CHUNKS_PER_ITEM)
    settings = EmbeddingSettings(provider="openai", model=MODEL, dimensions=dims)
    t0 = time.perf_counter()
    db = connect(path, embedding=settings, vec=True)
    try:
        if not db.vec_loaded:
            sys.exit(f"sqlite-vec did not load: {db.vec_error}")
        if db.dimensions != dims:
            sys.exit(f"connect() resolved {db.dimensions} dimensions, not {dims}")
        ex = db.conn.executemany
        with db.atomic():
            ex(
                "INSERT INTO knowledge_items(id, kind, title, content, content_hash) "
                "VALUES (?, 'note', ?, ?, ?)",
                ((i, f"Item {i}", f"Bench note {i}.", f"h{i}") for i in range(1, items + 1)),
            )
            ex(
                "INSERT INTO item_index_state(item_id, status, indexed_hash, chunk_method, "
                "chunk_count, model, dimensions) VALUES (?, 'indexed', ?, 'structure', ?, ?, ?)",
                (
                    (i, f"h{i}", min(CHUNKS_PER_ITEM, n - (i - 1) * CHUNKS_PER_ITEM), MODEL, dims)
                    for i in range(1, items + 1)
                ),
            )
            ex(
                "INSERT INTO note_chunks(id, item_id, chunk_index, content, method, "
                "start_offset, end_offset, embed_hash) VALUES (?, ?, ?, ?, 'structure', ?, ?, ?)",
                (
                    (
                        r + 1,
                        r // CHUNKS_PER_ITEM + 1,
                        r % CHUNKS_PER_ITEM,
                        f"Chunk {r % CHUNKS_PER_ITEM} of bench note {r // CHUNKS_PER_ITEM + 1}.",
                        (r % CHUNKS_PER_ITEM) * 40,
                        (r % CHUNKS_PER_ITEM) * 40 + 40,
                        f"e{r}",
                    )
                    for r in range(n)
                ),
            )
            ex(
                "INSERT INTO note_chunk_embeddings(chunk_id, model, dimensions, vector) "
                "VALUES (?, ?, ?, ?)",
                ((r + 1, MODEL, dims, matrix[r].astype("<f4").tobytes()) for r in range(n)),
            )
            relational = time.perf_counter() - t0
            db.execute(
                "INSERT INTO vec_chunk_embeddings(chunk_id, embedding) "
                "SELECT chunk_id, vector FROM note_chunk_embeddings"
            )
        total = time.perf_counter() - t0
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        db.close()
    return {
        "build_s": total,
        "relational_s": relational,
        "vec0_insert_s": total - relational,
        "db_mb": sum(f.stat().st_size for f in path.parent.glob(path.name + "*")) / 1e6,
    }


def numpy_search(matrix: np.ndarray, q: np.ndarray, k: int) -> list[int]:
    """Exact: the k items with the nearest chunk, nearest first (item ids as kidx numbers them)."""
    scores = matrix @ q
    m = min(k * CHUNKS_PER_ITEM, len(scores))
    top = np.argpartition(scores, len(scores) - m)[-m:]
    top = top[np.argsort(-scores[top], kind="stable")]
    out: list[int] = []
    for row in top.tolist():
        item = row // CHUNKS_PER_ITEM + 1
        if item not in out:
            out.append(item)
            if len(out) == k:
                break
    return out


def vec0_knn(db: Database, q: np.ndarray, fetch: int) -> list[int]:
    rows = db.all(
        "SELECT chunk_id, distance FROM vec_chunk_embeddings WHERE embedding MATCH ? AND k = ?",
        (q.astype("<f4").tobytes(), fetch),
    )
    return [r[0] for r in rows]


def run_case(size: int, dims: int, queries: int, k: int, seed: int, tmp: Path) -> dict:
    rng = np.random.default_rng([seed, size, dims])
    matrix = unit_vectors(rng, size, dims)
    qs = unit_vectors(rng, queries + 1, dims)  # the first one warms every path, untimed
    path = tmp / f"search-{size}-{dims}.db"
    built = build(path, matrix)
    settings = EmbeddingSettings(provider="openai", model=MODEL, dimensions=dims)
    with_vec = connect(path, embedding=settings, vec=True)
    without = connect(path, embedding=settings, vec=False)
    for db in (with_vec, without):
        db.map_for_reading()  # as `kidx search` opens its connection
    embedder = QueryVectors(dims)
    fetch = min(max(4 * k, 32), size)  # what _knn_vec asks vec0 for first
    vias: dict[str, set[str]] = {"kidx vec0": set(), "kidx fallback": set()}

    def via_kidx(db: Database, name: str) -> Callable[[np.ndarray], list[int]]:
        def run(q: np.ndarray) -> list[int]:
            embedder.vector = q[None, :]
            result = search(db, "bench query", embedder, k=k)
            vias[name].add(result.via)
            return [h.item_id for h in result.hits]

        return run

    def one_thread(q: np.ndarray) -> list[int]:
        return numpy_search(matrix, q, k)

    methods: dict[str, Callable[[np.ndarray], list[int]]] = {
        "numpy": lambda q: numpy_search(matrix, q, k),
        "vec0 KNN": lambda q: vec0_knn(with_vec, q, fetch),
        "kidx vec0": via_kidx(with_vec, "kidx vec0"),
        "kidx fallback": via_kidx(without, "kidx fallback"),
    }
    if threadpool_limits is not None:
        methods["numpy 1 thread"] = one_thread
    times: dict[str, list[float]] = {name: [] for name in methods}
    answers: dict[str, list[list[int]]] = {name: [] for name in methods}
    names = list(methods)
    try:
        for i, q in enumerate(qs):
            # Rotate the order, so that machine noise and cache effects hit all alike.
            for name in names[i % len(names) :] + names[: i % len(names)]:
                limit = threadpool_limits(1) if name == "numpy 1 thread" else None
                t0 = time.perf_counter()
                got = methods[name](q)
                elapsed = time.perf_counter() - t0
                if limit is not None:
                    limit.restore_original_limits()
                if i == 0:
                    continue
                times[name].append(elapsed * 1000)
                answers[name].append(got)
    finally:
        with_vec.close()
        without.close()
    for name, seen in vias.items():
        expected = "vec" if name == "kidx vec0" else "fallback"
        if seen != {expected}:
            sys.exit(f"{name} was served via {sorted(seen)}, not {expected}")

    rows = {}
    base = statistics.median(times["numpy"])
    for name in METHODS:
        if name not in times:
            continue
        t = times[name]
        row = {
            "median_ms": statistics.median(t),
            "p95_ms": float(np.percentile(t, 95)),
            "ratio_to_numpy": statistics.median(t) / base,
        }
        if name.startswith("kidx"):
            exact = answers["numpy"]
            row["recall_at_k"] = statistics.mean(
                len(set(a) & set(e)) / len(e) for a, e in zip(answers[name], exact, strict=True)
            )
            row["same_order"] = statistics.mean(
                a == e for a, e in zip(answers[name], exact, strict=True)
            )
        rows[name] = row
    if "numpy 1 thread" in answers:
        assert answers["numpy 1 thread"] == answers["numpy"]
    # vec0's bare answer, as items, against numpy's (the first k distinct items of its fetch)
    bare = [
        list(dict.fromkeys((c - 1) // CHUNKS_PER_ITEM + 1 for c in chunks))[:k]
        for chunks in answers["vec0 KNN"]
    ]
    rows["vec0 KNN"]["same_order"] = statistics.mean(
        a == e for a, e in zip(bare, answers["numpy"], strict=True)
    )
    for f in tmp.glob(path.name + "*"):
        f.unlink()
    return {
        "size": size,
        "dims": dims,
        "items": -(-size // CHUNKS_PER_ITEM),
        "vec0_fetch": fetch,
        **built,
        "rows": rows,
    }


def machine() -> dict[str, object]:
    model = ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
            break
    mem = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            mem = int(line.split()[1]) // 1024
    info: dict[str, object] = {
        "nproc": os.cpu_count(),
        "cpu": model,
        "mem_mb": mem,
        "python": platform.python_version(),
        "numpy": np.__version__,
    }
    if threadpool_limits is not None:
        from threadpoolctl import threadpool_info

        info["blas"] = [
            f"{p['internal_api']} {p['num_threads']} threads" for p in threadpool_info()
        ]
    return info


def print_table(result: dict) -> None:
    m = result["machine"]
    print(
        f"{m['nproc']} CPUs ({m['cpu']}), {m['mem_mb']} MB; numpy {m['numpy']} "
        f"({', '.join(m.get('blas', []))}); {result['queries']} queries, k={result['k']}, "
        f"seed {result['seed']}"
    )
    header = (
        f"{'size x dims':<16}{'method':<16}{'median ms':>11}{'p95 ms':>10}{'x numpy':>9}"
        f"{'recall@k':>10}{'same order':>12}"
    )
    print(header)
    print("-" * len(header))
    for case in result["cases"]:
        label = f"{case['size']:,} x {case['dims']}"
        for name, r in case["rows"].items():
            recall = f"{r['recall_at_k']:.3f}" if "recall_at_k" in r else ""
            order = f"{r['same_order']:.0%}" if "same_order" in r else ""
            print(
                f"{label:<16}{name:<16}{r['median_ms']:>11.2f}{r['p95_ms']:>10.2f}"
                f"{r['ratio_to_numpy']:>9.2f}{recall:>10}{order:>12}"
            )
            label = ""
        print(
            f"{'':<16}(built in {case['build_s']:.1f} s: relational {case['relational_s']:.1f} s, "
            f"vec0 {case['vec0_insert_s']:.1f} s; {case['db_mb']:.0f} MB on disk)"
        )
    goal = result["goal"]
    if goal["ratio"] is None:
        print(f"goal (kidx vec0 within {goal['limit']:.0f}x of numpy at 100,000 x 384): not run")
    else:
        verdict = "met" if goal["met"] else "NOT met"
        print(
            f"goal: kidx vec0 within {goal['limit']:.0f}x of numpy at 100,000 x 384: "
            f"{goal['ratio']:.2f}x, {verdict}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000")
    ap.add_argument("--dims", default="384,1536")
    ap.add_argument("--queries", type=int, default=50)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "search.json")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",") if s.strip()]
    dims = [int(d) for d in args.dims.split(",") if d.strip()]
    if args.queries < 1 or args.k < 1 or any(s < args.k * CHUNKS_PER_ITEM for s in sizes):
        sys.exit("need --queries >= 1, --k >= 1 and every size >= 10 x k")
    configure_logging(level="warning")
    t0 = time.perf_counter()
    cases = []
    with tempfile.TemporaryDirectory(prefix="kidx-bench-search-") as tmp:
        for size in sizes:
            for d in dims:
                print(f"{size:,} x {d} ...", file=sys.stderr, flush=True)
                cases.append(run_case(size, d, args.queries, args.k, args.seed, Path(tmp)))
                gc.collect()  # the case's matrix and connections go before the next is built
    size, d, limit = GOAL
    ratio = next(
        (
            c["rows"]["kidx vec0"]["ratio_to_numpy"]
            for c in cases
            if c["size"] == size and c["dims"] == d
        ),
        None,
    )
    result = {
        "machine": machine(),
        "queries": args.queries,
        "k": args.k,
        "seed": args.seed,
        "chunks_per_item": CHUNKS_PER_ITEM,
        "run_s": time.perf_counter() - t0,
        "goal": {
            "size": size,
            "dims": d,
            "limit": limit,
            "ratio": ratio,
            "met": None if ratio is None else ratio <= limit,
        },
        "cases": cases,
    }
    print_table(result)
    print(f"run time {result['run_s']:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
