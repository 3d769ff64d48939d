"""sqlite-vec 0.1.10's own ANN indexes (`rescore`, `diskann`) on the vectors bench/search.py uses.

A pre-release: it goes into an environment of its own, never kidx's.

    python3 -m venv bench/.venv-ann
    bench/.venv-ann/bin/pip install "sqlite-vec==0.1.10a4" apsw numpy
    bench/.venv-ann/bin/python bench/ann.py [--sizes 100000] [--queries 30] [--k 10]

Each index is a bare vec0 table (no kidx rows around it) filled with the realistic vectors of
bench/vectors.py (its cache must exist: run bench/search.py or bench/vectors.py once with kidx's
environment). Reported per index: build seconds, p50 and p95 ms a query, x numpy (exact, same
run), recall@k against numpy. Compare with bench/search.py's two-pass row of the same size.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import apsw
import numpy as np
import sqlite_vec

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vectors import realistic

INDEXES = {
    "flat (brute force)": "",
    "rescore bit x8": " indexed by rescore(quantizer=bit, oversample=8)",
    "rescore bit x64": " indexed by rescore(quantizer=bit, oversample=64)",
    "diskann binary": " indexed by diskann(neighbor_quantizer=binary)",
}


def run(size: int, dims: int, queries: int, k: int) -> None:
    matrix, asked = realistic(size, dims)
    qs = asked[: queries + 1]
    exact = []
    numpy_ms = []
    for q in qs[1:]:
        t0 = time.perf_counter()
        scores = matrix @ q
        top = np.argpartition(-scores, k - 1)[:k]
        exact.append(set((top + 1).tolist()))
        numpy_ms.append((time.perf_counter() - t0) * 1000)
    base = statistics.median(numpy_ms)
    print(f"{size:,} x {dims}: numpy p50 {base:.1f} ms")
    with tempfile.TemporaryDirectory() as tmp:
        con = apsw.Connection(str(Path(tmp) / "ann.db"))
        con.enable_load_extension(True)
        con.load_extension(sqlite_vec.loadable_path())
        for name, index in INDEXES.items():
            metric = "" if "diskann" in index else " distance_metric=cosine"
            table = f"t{abs(hash(name)) % 10**8}"
            try:
                con.execute(
                    f"CREATE VIRTUAL TABLE {table} USING vec0(id INTEGER PRIMARY KEY, "
                    f"e float[{dims}]{metric}{index})"
                )
            except apsw.Error as e:
                print(f"  {name:<20} not available: {e}")
                continue
            t0 = time.perf_counter()
            with con:
                con.executemany(
                    f"INSERT INTO {table}(id, e) VALUES (?, ?)",
                    ((i + 1, matrix[i].tobytes()) for i in range(size)),
                )
            built = time.perf_counter() - t0
            times, recall = [], []
            for i, q in enumerate(qs):
                t0 = time.perf_counter()
                got = [
                    r[0]
                    for r in con.execute(
                        f"SELECT id FROM {table} WHERE e MATCH ? AND k = ?", (q.tobytes(), k)
                    )
                ]
                if i:
                    times.append((time.perf_counter() - t0) * 1000)
                    recall.append(len(set(got) & exact[i - 1]) / k)
            p50 = statistics.median(times)
            print(
                f"  {name:<20} built {built:7.1f} s  p50 {p50:8.1f} ms  "
                f"p95 {float(np.percentile(times, 95)):8.1f} ms  x numpy {p50 / base:6.2f}  "
                f"recall@{k} {statistics.mean(recall):.3f}",
                flush=True,
            )
            con.execute(f"DROP TABLE {table}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="100000")
    ap.add_argument("--dims", type=int, default=384)
    ap.add_argument("--queries", type=int, default=30)
    ap.add_argument("--k", type=int, default=10)
    args = ap.parse_args()
    print(f"sqlite-vec {sqlite_vec.__version__ if hasattr(sqlite_vec, '__version__') else '?'}")
    for size in (int(s) for s in args.sizes.split(",")):
        run(size, args.dims, args.queries, args.k)


if __name__ == "__main__":
    main()
