"""kidx vector search (two passes, exact vec0, the in-memory fallback) beside exact numpy.

    python bench/search.py [--sizes 10000,100000,1000000] [--dims 384] [--queries 50] [--k 10]
                           [--oversample 300] [--fallback-max 100000] [--json PATH]

Vectors are realistic (bench/vectors.py: a few thousand real chunks of ../shared/corpus embedded
with the local model, and synthetic ones drawn around them); queries are the Chroma questions.
For each (size, dims) they are written into a fresh kidx database as real rows (items,
`item_index_state`, `note_chunks`, `note_chunk_embeddings`, `vec_chunk_embeddings` and the bit
mirror `vec_chunk_bits`). The same queries go, interleaved, through:

- **numpy**: exact search over the matrix held in this process (`matrix @ q`, `argpartition`);
- **kidx two-pass**: `search_chunks(mode="vector")` with the bit mirror's first pass
  (`KIDX_SEARCH__EXACT_BELOW=0`, `--oversample`) and exact rescoring;
- **kidx vec0 exact**: the same call with two passes off: sqlite-vec's float KNN;
- **kidx fallback**: the same call on a connection without sqlite-vec (up to `--fallback-max`);
  it holds the vectors it read between queries (`KIDX_SEARCH__FALLBACK_HOLD_MB`).

Reported: median and p95 ms a query, x numpy's median (same run), recall@k and the share of
identical rankings against numpy's chunks, the database's size on disk, what each method keeps in
memory between queries, and the growth of each method's median from the smallest size to the
largest. The timed queries are a seeded sample of the questions (`--queries`, from every corpus);
the two-pass recall the goals are judged by is over every question. Two rows more: the
two-pass search and the fallback right after another connection committed a write (20 queries),
when what they hold between searches (the bit mirror, the vectors) is read again, as in a
`kidx search` process, which opens the file anew.
The query embedder returns the query's vector, so embedding costs nothing. Timings are
measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vectors import realistic  # noqa: E402  (bench/vectors.py, beside this file)

from worker import hamming, nearest  # noqa: E402
from worker.log import configure_logging  # noqa: E402
from worker.providers.base import EmbeddingModel  # noqa: E402
from worker.retrieval import search_chunks  # noqa: E402
from worker.settings import EmbeddingSettings, SearchSettings  # noqa: E402
from worker.store import connect  # noqa: E402
from worker.store.db import Database  # noqa: E402

try:
    from threadpoolctl import threadpool_limits
except ImportError:  # optional: only for the one-thread numpy column
    threadpool_limits = None

MODEL = "bench"
CHUNKS_PER_ITEM = 10
GOALS = (  # size, dims, kidx two-pass / numpy, recall@10 at least
    (1_000_000, 384, 1.5, 0.98),
    (250_000, 1536, 2.0, 0.98),
)
METHODS = ("numpy", "kidx two-pass", "kidx vec0 exact", "kidx fallback")


class QueryVectors(EmbeddingModel):
    """An embedder whose answer is whatever vector was set last: the query costs nothing."""

    model_id = MODEL
    batch_size = 1

    def __init__(self, dims: int) -> None:
        self.dimensions = dims
        self.vector = np.zeros((1, dims), dtype=np.float32)

    def embed_batch(self, texts: list[str]) -> np.ndarray:
        return self.vector


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
        # (as kidx's writer: a chunk or vector row written otherwise is a host's, which the
        # triggers of migration 16 drop, and the database was left without a vector)
        with db.atomic(), db.writing_index():
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
            db.execute(
                "INSERT INTO vec_chunk_bits(chunk_id, embedding) "
                "SELECT chunk_id, vec_quantize_binary(vector) FROM note_chunk_embeddings"
            )
        total = time.perf_counter() - t0
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        held = {
            t: db.scalar(f"SELECT count(*) FROM {t}")
            for t in ("note_chunk_embeddings", "vec_chunk_embeddings", "vec_chunk_bits")
        }
        if set(held.values()) != {n}:
            sys.exit(f"the benchmark's database holds {held}, not {n} vectors each")
    finally:
        db.close()
    return {
        "build_s": total,
        "relational_s": relational,
        "vec0_insert_s": total - relational,
        "db_mb": sum(f.stat().st_size for f in path.parent.glob(path.name + "*")) / 1e6,
    }


def numpy_search(matrix: np.ndarray, q: np.ndarray, k: int) -> list[int]:
    """Exact: the k nearest chunks, nearest first (chunk ids as kidx numbers them)."""
    scores = matrix @ q
    top = np.argpartition(-scores, k - 1)[:k]
    return (top[np.argsort(-scores[top], kind="stable")] + 1).tolist()


def held_mb(db: Database) -> float:
    """What the two-pass search keeps between queries (worker.hamming's cache)."""
    cached = hamming._CACHE.get(db, {})
    return sum(b.ids.nbytes + b.words.nbytes + b.valid.nbytes for b in cached.values()) / 1e6


def run_case(
    size: int, dims: int, queries: int, k: int, oversample: int, fallback_max: int, tmp: Path
) -> dict:
    matrix, asked = realistic(size, dims)
    # Timed: a seeded sample of the questions, from every corpus (the file's first fifty are
    # all of one speech); the first warms every path, untimed. Recall: every question.
    order = np.random.default_rng(0).permutation(len(asked))
    qs = asked[order[: queries + 1]]
    path = tmp / f"search-{size}-{dims}.db"
    built = build(path, matrix)
    settings = EmbeddingSettings(provider="openai", model=MODEL, dimensions=dims)
    with_vec = connect(path, embedding=settings, vec=True)
    without = connect(path, embedding=settings, vec=False)
    for db in (with_vec, without):
        db.map_for_reading()  # as `kidx search` opens its connection
    embedder = QueryVectors(dims)
    two = SearchSettings(exact_below=0, oversample=oversample)
    exact = SearchSettings(exact_below=10**9)  # (the setting's bound; above every size)
    vias: dict[str, set[str]] = {}

    def via_kidx(db: Database, name: str, tuning: SearchSettings) -> Callable:
        def run(q: np.ndarray) -> list[int]:
            embedder.vector = q[None, :]
            result = search_chunks(db, "q", embedder, k=k, mode="vector", tuning=tuning)
            vias.setdefault(name, set()).add(result.via)
            return [h.chunk_id for h in result.hits]

        return run

    methods: dict[str, Callable[[np.ndarray], list[int]]] = {
        "numpy": lambda q: numpy_search(matrix, q, k),
        "kidx two-pass": via_kidx(with_vec, "kidx two-pass", two),
        "kidx vec0 exact": via_kidx(with_vec, "kidx vec0 exact", exact),
    }
    if size <= fallback_max:
        methods["kidx fallback"] = via_kidx(without, "kidx fallback", exact)
    times: dict[str, list[float]] = {name: [] for name in methods}
    answers: dict[str, list[list[int]]] = {name: [] for name in methods}
    names = list(methods)
    try:
        for i, q in enumerate(qs):
            # Rotate the order, so that machine noise and cache effects hit all alike.
            for name in names[i % len(names) :] + names[: i % len(names)]:
                t0 = time.perf_counter()
                got = methods[name](q)
                elapsed = time.perf_counter() - t0
                if i == 0:
                    continue
                times[name].append(elapsed * 1000)
                answers[name].append(got)
        every = recall_of_every(matrix, asked, k, methods["kidx two-pass"])
        after_write = {
            f"{name}, first after a write": first_after_a_write(path, settings, qs[1:21], search)
            for name, search in methods.items()
            if name in ("kidx two-pass", "kidx fallback")
        }
        held = {
            "numpy": matrix.nbytes / 1e6,
            "kidx two-pass": held_mb(with_vec),
            "kidx fallback": sum(
                h.keys.nbytes + h.units.nbytes for h in nearest._HELD.get(without, {}).values()
            )
            / 1e6,
        }
    finally:
        with_vec.close()
        without.close()
    for name, seen in vias.items():
        expected = "fallback" if name == "kidx fallback" else "vec"
        if seen != {expected}:
            sys.exit(f"{name} was served via {sorted(seen)}, not {expected}")

    rows = {}
    base = statistics.median(times["numpy"])
    for name in METHODS:
        if name not in times:
            continue
        t = times[name]
        exact_answers = answers["numpy"]
        rows[name] = {
            "median_ms": statistics.median(t),
            "p95_ms": float(np.percentile(t, 95)),
            "ratio_to_numpy": statistics.median(t) / base,
            "recall_at_k": statistics.mean(
                len(set(a) & set(e)) / len(e)
                for a, e in zip(answers[name], exact_answers, strict=True)
            ),
            "same_order": statistics.mean(
                a == e for a, e in zip(answers[name], exact_answers, strict=True)
            ),
            "held_mb": held.get(name, 0.0),
        }
    rows["kidx two-pass"]["recall_all"], rows["kidx two-pass"]["same_order_all"] = every
    for name, t in after_write.items():
        rows[name] = {
            "median_ms": statistics.median(t),
            "p95_ms": float(np.percentile(t, 95)),
            "ratio_to_numpy": statistics.median(t) / base,
            "recall_at_k": float("nan"),
            "same_order": float("nan"),
            "held_mb": rows[name.split(",")[0]]["held_mb"],
        }
    for f in tmp.glob(path.name + "*"):
        f.unlink()
    return {"size": size, "dims": dims, "questions": len(asked), **built, "rows": rows}


def recall_of_every(
    matrix: np.ndarray, asked: np.ndarray, k: int, search: Callable[[np.ndarray], list[int]]
) -> tuple[float, float]:
    """Recall@k and the share of identical rankings of `search` against exact numpy, over
    every question (untimed): a sample of 30 of one corpus said 0.987 where they are 0.977."""
    recall, same = [], []
    for start in range(0, len(asked), 50):  # (a block of exact answers: n x 50 scores)
        block = asked[start : start + 50]
        scores = matrix @ block.T
        for j, q in enumerate(block):
            top = np.argpartition(-scores[:, j], k - 1)[:k]
            exact = (top[np.argsort(-scores[top, j], kind="stable")] + 1).tolist()
            got = search(q)
            recall.append(len(set(got) & set(exact)) / k)
            same.append(got == exact)
    return statistics.mean(recall), statistics.mean(same)


def first_after_a_write(
    path: Path,
    settings: EmbeddingSettings,
    qs: np.ndarray,
    search: Callable[[np.ndarray], list[int]],
) -> list[float]:
    """Milliseconds of each query's search right after another connection committed a write:
    the bit mirror held between searches (worker.hamming) is read again, as a `kidx search`
    process, which opens the file anew, reads it at every search."""
    other = connect(path, embedding=settings, vec=False)
    times = []
    try:
        for n, q in enumerate(qs):
            with other.atomic():
                other.execute(
                    "INSERT INTO index_meta(key, value) VALUES ('bench_write', ?) "
                    "ON CONFLICT(key) DO UPDATE SET value = excluded.value",
                    (str(n),),
                )
            t0 = time.perf_counter()
            search(q)
            times.append((time.perf_counter() - t0) * 1000)
    finally:
        other.close()
    return times


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
        f"oversample {result['oversample']}; realistic vectors (bench/vectors.py)"
    )
    header = (
        f"{'size x dims':<18}{'method':<35}{'p50 ms':>9}{'p95 ms':>9}{'x numpy':>9}"
        f"{'recall@k':>10}{'same order':>12}{'held MB':>9}"
    )
    print(header)
    print("-" * len(header))
    for case in result["cases"]:
        label = f"{case['size']:,} x {case['dims']}"
        for name, r in case["rows"].items():
            recall = "" if r["recall_at_k"] != r["recall_at_k"] else f"{r['recall_at_k']:.3f}"
            same = "" if r["same_order"] != r["same_order"] else f"{r['same_order']:.0%}"
            print(
                f"{label:<18}{name:<35}{r['median_ms']:>9.1f}{r['p95_ms']:>9.1f}"
                f"{r['ratio_to_numpy']:>9.2f}{recall:>10}{same:>12}{r['held_mb']:>9.0f}"
            )
            label = ""
        every = case["rows"]["kidx two-pass"]
        print(
            f"{'':<18}two-pass over all {case['questions']} questions: recall@k "
            f"{every['recall_all']:.3f}, same order {every['same_order_all']:.0%}"
        )
        print(f"{'':<18}(built in {case['build_s']:.0f} s; {case['db_mb']:,.0f} MB on disk)")
    for dims, growth in result["growth"].items():
        print(
            f"growth of the median from {growth['from']:,} to {growth['to']:,} x {dims}: "
            + ", ".join(f"{name} {g:.1f}x" for name, g in growth["methods"].items())
        )
    for goal in result["goals"]:
        verdict = "not run" if goal["met"] is None else ("met" if goal["met"] else "NOT met")
        shown = (
            "" if goal["met"] is None else f": {goal['ratio']:.2f}x, recall {goal['recall']:.3f}"
        )
        print(
            f"goal: two-pass within {goal['limit']}x numpy, recall >= {goal['min_recall']} at "
            f"{goal['size']:,} x {goal['dims']}{shown}, {verdict}"
        )
    print(f"peak resident memory of this process: {result['max_rss_mb']:.0f} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="10000,100000,1000000")
    ap.add_argument("--dims", default="384")
    ap.add_argument("--queries", type=int, default=100)
    ap.add_argument("--k", type=int, default=10)
    ap.add_argument("--oversample", type=int, default=SearchSettings().oversample)
    ap.add_argument("--fallback-max", type=int, default=100_000)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "search.json")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x.strip()]
    dims = [int(d) for d in args.dims.split(",") if d.strip()]
    if args.queries < 1 or args.k < 1 or any(x < args.k for x in sizes):
        sys.exit("need --queries >= 1, --k >= 1 and every size >= k")
    configure_logging(level="warning")
    t0 = time.perf_counter()
    cases = []
    with tempfile.TemporaryDirectory(prefix="kidx-bench-search-") as tmp:
        for d in dims:
            for size in sizes:
                print(f"{size:,} x {d} ...", file=sys.stderr, flush=True)
                cases.append(
                    run_case(
                        size,
                        d,
                        args.queries,
                        args.k,
                        args.oversample,
                        args.fallback_max,
                        Path(tmp),
                    )
                )
                gc.collect()  # the case's matrix and connections go before the next is built
    growth = {}
    for d in dims:
        mine = sorted((c for c in cases if c["dims"] == d), key=lambda c: c["size"])
        if len(mine) > 1:
            first, last = mine[0], mine[-1]
            growth[d] = {
                "from": first["size"],
                "to": last["size"],
                "methods": {
                    name: last["rows"][name]["median_ms"] / first["rows"][name]["median_ms"]
                    for name in last["rows"]
                    if name in first["rows"]
                },
            }
    goals = []
    for size, d, limit, min_recall in GOALS:
        case = next((c for c in cases if c["size"] == size and c["dims"] == d), None)
        row = case["rows"]["kidx two-pass"] if case else None
        goals.append(
            {
                "size": size,
                "dims": d,
                "limit": limit,
                "min_recall": min_recall,
                "ratio": row["ratio_to_numpy"] if row else None,
                "recall": row["recall_all"] if row else None,
                "met": None
                if row is None
                else row["ratio_to_numpy"] <= limit and row["recall_all"] >= min_recall,
            }
        )
    result = {
        "machine": machine(),
        "queries": args.queries,
        "k": args.k,
        "oversample": args.oversample,
        "run_s": time.perf_counter() - t0,
        "max_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "growth": growth,
        "goals": goals,
        "cases": cases,
    }
    print_table(result)
    print(f"run time {result['run_s']:.0f} s")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
