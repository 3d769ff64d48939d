"""Search latency per mode (`search_chunks`: vector, keyword, hybrid) at 10k and 100k chunks, as
ratios to vector-only in the same run. Also run by bench/retrieval.py, whose table it ends.

    python bench/search_modes.py [--sizes 10000,100000] [--dims 384] [--queries 40] [--k 5]

The database is bench/search.py's (seeded random unit vectors written as real kidx rows, ten
chunks an item), with real text in every chunk: paragraphs of the Chroma benchmark's corpora
and the Rust book, cut to 200-800 characters, so that the keyword index has a real vocabulary;
the keyword rows are written by the product's own `sync_fts`. The queries are the benchmark's
questions; the query embedder returns a seeded random vector (embedding costs nothing), so
vector search costs what sqlite-vec and kidx's code around it cost. The modes are interleaved
query by query; one untimed warm-up first. Timings are measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BENCH))

from search import QueryVectors, build  # noqa: E402  (bench/search.py)

from worker.log import configure_logging  # noqa: E402
from worker.retrieval import search_chunks  # noqa: E402
from worker.settings import EmbeddingSettings  # noqa: E402
from worker.store import connect  # noqa: E402
from worker.store.fts import sync_fts  # noqa: E402

SHARED = ROOT.parent / "shared" / "corpus"
MODES = ("vector", "keyword", "hybrid")


def unit_vectors(rng: np.random.Generator, n: int, dims: int) -> np.ndarray:
    """Uniform random unit vectors: the modes' cost does not depend on where vectors lie."""
    m = rng.standard_normal((n, dims), dtype=np.float32)
    m /= np.linalg.norm(m, axis=1, keepdims=True)
    return m


def paragraphs() -> list[str]:
    """Real paragraphs, 200-800 characters (longer ones cut at a space)."""
    out = []
    files = sorted((SHARED / "chroma-chunking" / "corpora").glob("*.md"))
    files += sorted((SHARED / "rustbook").glob("*.md"))
    for path in files:
        for para in path.read_text(encoding="utf-8").split("\n\n"):
            para = " ".join(para.split())
            if len(para) >= 200:
                out.append(para[:800].rsplit(" ", 1)[0] if len(para) > 800 else para)
    if not out:
        sys.exit(f"no corpus under {SHARED}: ../shared must be beside the checkout")
    return out


def questions(n: int) -> list[str]:
    with open(SHARED / "chroma-chunking" / "questions_df.csv", newline="", encoding="utf-8") as f:
        return [row["question"] for row in csv.DictReader(f)][:n]


def make_db(path: Path, size: int, dims: int, rng: np.random.Generator, texts: list[str]) -> float:
    """bench/search.py's database with real text in its chunks and their keyword rows; the
    seconds `sync_fts` took to index them."""
    build(path, unit_vectors(rng, size, dims))
    settings = EmbeddingSettings(provider="openai", model="bench", dimensions=dims)
    db = connect(path, embedding=settings)
    try:
        picks = rng.integers(0, len(texts), size)
        with db.atomic(), db.writing_index():  # (as kidx's writer: a host's drops the vector)
            db.executemany(
                "UPDATE note_chunks SET content = ?, end_offset = start_offset + ? WHERE id = ?",
                ((texts[p], len(texts[p]), i + 1) for i, p in enumerate(picks)),
            )
        vectors = db.scalar("SELECT count(*) FROM vec_chunk_embeddings")
        if vectors != size:
            sys.exit(f"the benchmark's database holds {vectors} vectors, not {size}")
        db.execute("DELETE FROM note_chunks_fts")
        t0 = time.perf_counter()
        sync_fts(db)
        return time.perf_counter() - t0
    finally:
        db.close()


def measure(size: int, dims: int, n_queries: int, k: int, seed: int) -> list[dict[str, object]]:
    rng = np.random.default_rng(seed)
    texts = paragraphs()
    qs = questions(n_queries)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "modes.db"
        fts_seconds = make_db(path, size, dims, rng, texts)
        settings = EmbeddingSettings(provider="openai", model="bench", dimensions=dims)
        db = connect(path, embedding=settings)
        db.map_for_reading()
        embedder = QueryVectors(dims)
        times: dict[str, list[float]] = {m: [] for m in MODES}
        vectors = unit_vectors(rng, len(qs) + 1, dims)
        for n, q in enumerate(["warm-up", *qs]):
            embedder.vector = vectors[n : n + 1]
            for mode in MODES:
                t0 = time.perf_counter()
                search_chunks(db, q, embedder, k=k, mode=mode)
                if n:
                    times[mode].append((time.perf_counter() - t0) * 1000)
        db.close()
    base = statistics.median(times["vector"])
    return [
        {
            "chunks": size,
            "dims": dims,
            "mode": mode,
            "median_ms": round(statistics.median(times[mode]), 2),
            "p95_ms": round(sorted(times[mode])[int(0.95 * (len(times[mode]) - 1))], 2),
            "x_vector": round(statistics.median(times[mode]) / base, 2),
            "fts_build_s": round(fts_seconds, 1),
        }
        for mode in MODES
    ]


def print_table(rows: list[dict[str, object]]) -> None:
    cols = ("chunks", "dims", "mode", "median_ms", "p95_ms", "x_vector", "fts_build_s")
    print(" ".join(f"{c:>12}" for c in cols))
    print("-" * 13 * len(cols))
    for r in rows:
        print(" ".join(f"{r[c]!s:>12}" for c in cols))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--sizes", default="10000,100000")
    p.add_argument("--dims", type=int, default=384)
    p.add_argument("--queries", type=int, default=40)
    p.add_argument("--k", type=int, default=5)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    configure_logging(level="warning")
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        rows += measure(size, args.dims, args.queries, args.k, args.seed)
    print_table(rows)


if __name__ == "__main__":
    main()
