"""kidx's pipeline in-process over two versions of a corpus, for bench/incremental.py.

    python bench/peers/kidx_incremental.py --before DIR --after DIR --base-url URL --work DIR
        [--batch-size B] [--dimensions D]

Phases: `setup` (a fresh database, every file of `before/` added as a note), `full` (index_item
over every note), then the edit: each changed file's note updated (what a host application
does) and index_item run over each edited note, as single tasks would; with `--batch`, the
edited notes in one index_items run, as a batch or a sweep would (their texts share requests).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.peers.corpus_pair import read_pair, source_of
from bench.peers.harness import API_KEY, MODEL, done, phase


def title_of(text: str, name: str) -> str:
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return Path(name).stem


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, required=True)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--dimensions", type=int, default=384)
    ap.add_argument("--batch", action="store_true", help="the edited notes as one bulk run")
    args = ap.parse_args()

    from worker.bulk import index_item, index_items
    from worker.log import configure_logging
    from worker.providers import build_embedder
    from worker.settings import load_settings
    from worker.store import connect
    from worker.store.items import add_item, update_content

    configure_logging(level="warning")
    old, new, changed = read_pair(args.before, args.after)
    settings = load_settings(
        db=args.work / "kidx.db",
        embedding={
            "provider": "openai",
            "model": MODEL,
            "base_url": args.base_url,
            "api_key": API_KEY,
            "dimensions": args.dimensions,
            "batch_size": args.batch_size,
            "max_retries": 0,
        },
    )
    db = connect(settings.db, embedding=settings.embedding)
    embedder = build_embedder(settings.embedding, dimensions=db.dimensions)
    ids = {
        name: add_item(
            db, kind="note", title=title_of(text, name), content=text, source=source_of(name)
        )
        for name, text in old.items()
    }
    phase("setup", files=len(ids), changed=len(changed))

    t0 = time.perf_counter()
    results = [index_item(db, i, embedder=embedder) for i in ids.values()]
    full_s = time.perf_counter() - t0
    phase(
        "full",
        seconds=full_s,
        chunks=sum(r.chunks for r in results),
        embedded=sum(r.embedded for r in results),
    )

    t0 = time.perf_counter()
    results = []
    if args.batch:  # as a batch or a sweep runs them: one group, texts sharing requests
        for name in changed:
            update_content(db, ids[name], new[name])
        outcomes = index_items(db, [ids[name] for name in changed], embedder=embedder)
        results = [outcomes[ids[name]] for name in changed]
    else:  # as single edits arrive: one task, one run an item
        for name in changed:
            update_content(db, ids[name], new[name])
            results.append(index_item(db, ids[name], embedder=embedder))
    seconds = time.perf_counter() - t0
    done(
        seconds=seconds,
        documents=len(changed),
        chunks=sum(r.chunks for r in results),
        reused=sum(r.reused for r in results),
        embedded=sum(r.embedded for r in results),
        statuses=sorted({r.status for r in results}),
        embedded_per_document=dict(zip(changed, (r.embedded for r in results), strict=True)),
    )
    embedder.close()
    db.close()


if __name__ == "__main__":
    main()
