"""The write path alone: a corpus through `index_items` in this process, with an embedder that
costs nothing, so that what is timed is reading, chunking, planning and writing every row
(chunks, vectors, vec and bit rows, keyword rows, states).

    python bench/write_path.py [--corpus DIR] [--rounds R] [--dimensions D]

Each round indexes the corpus into a fresh SQLite file; the table gives every round and the
fastest. No peer runs here: bench/throughput.py compares kidx's whole stack with LangChain's;
this one is for comparing two versions of kidx's write path on the same machine, run in turn
(the speed of these shared machines drifts by half within minutes: compare rounds run close
together, or interleave two checkouts with `--root`). Timings are measured here, never asserted
in tests.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

DEFAULT_CORPUS = Path(__file__).resolve().parents[2] / "shared" / "corpus" / "rustbook"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dimensions", type=int, default=384)
    ap.add_argument(
        "--root", type=Path, default=Path(__file__).resolve().parents[1], help="a kidx checkout"
    )
    args = ap.parse_args()
    sys.path.insert(0, str(args.root))

    import numpy as np

    from worker.bulk import index_items
    from worker.log import configure_logging
    from worker.providers.base import EmbeddingModel
    from worker.settings import EmbeddingSettings
    from worker.store import connect
    from worker.store.items import add_item

    class Free(EmbeddingModel):
        """Unit vectors from one generator: no provider cost, no call recorded."""

        model_id = "free"
        batch_size = 64

        def __init__(self, dimensions: int) -> None:
            self.dimensions = dimensions
            self.rng = np.random.default_rng(0)

        def embed_batch(self, texts: list[str]) -> np.ndarray:
            v = self.rng.standard_normal((len(texts), self.dimensions)).astype(np.float32)
            return v / np.linalg.norm(v, axis=1, keepdims=True)

    configure_logging(stream_level="warning")
    files = [(p, p.read_text(encoding="utf-8")) for p in sorted(args.corpus.glob("*.md"))]
    files = [(p, t) for p, t in files if t.strip()]
    megabytes = sum(len(t.encode()) for _, t in files) / 1e6
    settings = EmbeddingSettings(provider="openai", model="free", dimensions=args.dimensions)
    print(f"{args.corpus} ({len(files)} files, {megabytes:.2f} MB), kidx at {args.root}")
    print(f"{'round':>5} {'seconds':>9} {'MB/s':>7} {'chunks':>7}")
    best = float("inf")
    for r in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="kidx-write-path-") as tmp:
            db = connect(Path(tmp) / "kidx.db", embedding=settings)
            ids = [
                add_item(db, kind="note", title=p.stem, content=t, source=str(p)) for p, t in files
            ]
            t0 = time.perf_counter()
            index_items(db, ids, embedder=Free(args.dimensions))
            seconds = time.perf_counter() - t0
            chunks = db.scalar("SELECT count(*) FROM note_chunks")
            db.close()
        best = min(best, seconds)
        print(f"{r:>5} {seconds:>9.3f} {megabytes / seconds:>7.2f} {chunks:>7}")
    print(f"fastest {best:.3f} s, {megabytes / best:.2f} MB/s")


if __name__ == "__main__":
    main()
