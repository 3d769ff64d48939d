"""Re-indexing after small edits: kidx beside LangChain's index() and LlamaIndex's pipeline.

    python bench/incremental.py [--corpus DIR] [--edits N] [--seed S] [--batch-size B]
        [--dimensions D] [--json PATH]

One run, one stand-in (testkit/standin.py in a process of its own, counting requests and texts
where they arrive), the same model name, dimension and batch size for everyone. `--edits`
chapters (20) each get a one-paragraph edit: a sentence appended to a seeded random prose
paragraph (`make_edit` of bench/chunking.py). Each system, in its own process, indexes every
chapter, then is given the edited chapters:

* kidx: the pipeline in-process (`index_item` over each edited note, after `update_content`),
  as single tasks run edits that arrive one by one. `kidx batch`: the edited notes in one
  `index_items` run, as a batch or a sweep runs them (their texts share requests).
* LangChain: `index(docs, SQLRecordManager, InMemoryVectorStore, cleanup="incremental",
  source_id_key="source")`, RecursiveCharacterTextSplitter(1500, 100). Whether SQLiteVec could
  serve instead (it implements no delete) is asked of LangChain and reported.
* LlamaIndex: IngestionPipeline([SentenceSplitter(1500, 100 characters), OpenAIEmbedding]) with
  a SimpleDocumentStore docstore, upserts (over a SimpleVectorStore); the goal is judged
  against it. `llamaindex default`: the same with SentenceSplitter() as it comes (1024 tokens,
  200 overlapping): larger chunks, so fewer texts per edited chapter.

Counted for the edit: embedding requests, texts embedded, wall time; and the ratios kidx ÷
LangChain and kidx ÷ LlamaIndex. Timings are measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.chunking import make_edit  # noqa: E402
from bench.peers.harness import MODEL, StandInProcess, machine, run_peer  # noqa: E402

DEFAULT_CORPUS = ROOT.parent / "shared" / "corpus" / "rustbook"
# name -> (peer script, its extra arguments)
PEERS = {
    "kidx": ("kidx_incremental.py", []),
    "kidx batch": ("kidx_incremental.py", ["--batch"]),
    "langchain": ("langchain_incremental.py", []),
    "llamaindex": ("llamaindex_incremental.py", ["--splitter", "chars"]),
    "llamaindex default": ("llamaindex_incremental.py", ["--splitter", "default"]),
}


def write_versions(corpus: Path, out: Path, edits: int, seed: int) -> list[str]:
    """`out/before` (the corpus) and `out/after` (with `edits` chapters edited); the names."""
    files = sorted(p for p in corpus.glob("*.md") if p.read_text(encoding="utf-8").strip())
    (out / "before").mkdir(parents=True)
    (out / "after").mkdir()
    texts = {p.name: p.read_text(encoding="utf-8") for p in files}
    rng = random.Random(seed)
    order = list(texts)
    rng.shuffle(order)
    edited: dict[str, str] = {}
    for name in order:
        if len(edited) == edits:
            break
        after = make_edit(texts[name], rng, "append")
        if after is not None and after != texts[name]:
            edited[name] = after
    for name, text in texts.items():
        (out / "before" / name).write_text(text, encoding="utf-8")
        (out / "after" / name).write_text(edited.get(name, text), encoding="utf-8")
    return sorted(edited)


def run_system(
    name: str,
    standin: StandInProcess,
    versions: Path,
    tmp: Path,
    batch_size: int,
    dimensions: int,
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=tmp))
    phases: dict[str, dict[str, Any]] = {}

    def on_phase(phase: str, info: dict[str, Any]) -> None:
        phases[phase] = {**info, **standin.count()}  # counts since the previous phase
        standin.reset(0.0)

    args = [
        "--before",
        str(versions / "before"),
        "--after",
        str(versions / "after"),
        "--base-url",
        standin.base_url,
        "--work",
        str(work),
        "--batch-size",
        str(batch_size),
        "--dimensions",
        str(dimensions),
    ]
    standin.reset(0.0)
    script, extra = PEERS[name]
    final = run_peer(script, args + extra, on_phase, log=tmp / f"{name.replace(' ', '-')}.log")
    counted = standin.count()
    shutil.rmtree(work, ignore_errors=True)
    full = phases["full"]
    return {
        "full": {
            "requests": full["requests"],
            "texts": full["texts"],
            "seconds": full["seconds"],
            "chunks": full["chunks"],
        },
        "setup": phases["setup"],
        "requests": counted["requests"],
        "texts": counted["texts"],
        **final,
    }


def run(corpus: Path, edits: int, seed: int, batch_size: int, dimensions: int) -> dict[str, Any]:
    started = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="kidx-bench-incremental-"))
    rows: dict[str, dict[str, Any]] = {}
    try:
        edited = write_versions(corpus, tmp / "versions", edits, seed)
        with StandInProcess(dimensions, log=tmp / "standin.log") as standin:
            for name in PEERS:
                rows[name] = run_system(
                    name, standin, tmp / "versions", tmp, batch_size, dimensions
                )
                print(
                    f"  {name}: {rows[name]['texts']} texts, {rows[name]['seconds']:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    kidx = rows["kidx"]
    ratios = {}
    for peer in ("langchain", "llamaindex", "llamaindex default"):
        for key in ("requests", "texts", "seconds"):
            other = rows[peer][key]
            ratios[f"{key}_vs_{peer.replace(' ', '_')}"] = kidx[key] / other if other else None
    sqlitevec = rows["langchain"]["setup"].get("sqlitevec")
    return {
        "corpus": str(corpus),
        "edits": len(edited),
        "edited": edited,
        "seed": seed,
        "edit": "a sentence of 12 corpus words appended to a prose paragraph",
        "batch_size": batch_size,
        "dimensions": dimensions,
        "model": MODEL,
        "machine": machine(),
        "wall_seconds": time.perf_counter() - started,
        "rows": rows,
        "ratios": ratios,
        "langchain_sqlitevec": sqlitevec,
        "goals": {
            "texts_vs_langchain": ratios["texts_vs_langchain"],
            "at_most_half_of_langchain": ratios["texts_vs_langchain"] <= 0.5,
            "texts_vs_llamaindex": ratios["texts_vs_llamaindex"],
            "at_most_a_tenth_of_llamaindex": ratios["texts_vs_llamaindex"] <= 0.1,
            "texts_vs_llamaindex_default": ratios["texts_vs_llamaindex_default"],
        },
    }


def print_table(result: dict[str, Any]) -> None:
    m = result["machine"]
    print(
        f"corpus {result['corpus']}; {result['edits']} chapters edited ({result['edit']}), "
        f"seed {result['seed']}; batch size {result['batch_size']}, {result['dimensions']} "
        f"dimensions, model {result['model']}; {m['nproc']} CPUs ({m['cpu']}), "
        f"{m['memory_gib']} GiB"
    )
    header = (
        f"{'system':<20}{'full chunks':>12}{'full texts':>12}{'edit reqs':>12}"
        f"{'edit texts':>12}{'edit s':>10}{'kidx ÷ x':>10}"
    )
    print(header)
    print("-" * len(header))
    kidx = result["rows"]["kidx"]["texts"]
    for name, r in result["rows"].items():
        ratio = kidx / r["texts"] if r["texts"] else float("nan")
        print(
            f"{name:<20}{r['full']['chunks']:>12}{r['full']['texts']:>12}{r['requests']:>12}"
            f"{r['texts']:>12}{r['seconds']:>10.3f}{ratio:>10.3f}"
        )
    k = result["rows"]["kidx"]
    print(
        f"\nkidx: {k['chunks']} chunks in the edited notes, {k['reused']} reused, "
        f"{k['embedded']} embedded"
    )
    lc = result["rows"]["langchain"]["index"]
    print(f"LangChain index(): {lc}")
    sv = result["langchain_sqlitevec"]
    if sv:
        print(
            f"LangChain SQLiteVec implements delete: {sv['implements_delete']}; "
            f"index(cleanup='incremental') over it: {sv['index_incremental']}"
        )
    g = result["goals"]
    print(
        f"\ngoal: at most half of LangChain's texts: {g['texts_vs_langchain']:.3f}, "
        f"{'met' if g['at_most_half_of_langchain'] else 'not met'}"
    )
    print(
        f"goal: at most a tenth of LlamaIndex's texts: {g['texts_vs_llamaindex']:.3f}, "
        f"{'met' if g['at_most_a_tenth_of_llamaindex'] else 'not met'} (with its splitter's "
        f"defaults: {g['texts_vs_llamaindex_default']:.3f})"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--edits", type=int, default=20)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--dimensions", type=int, default=384)
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "incremental.json")
    args = ap.parse_args()
    if not args.corpus.is_dir():
        sys.exit(f"corpus not found: {args.corpus}")
    result = run(args.corpus, args.edits, args.seed, args.batch_size, args.dimensions)
    print_table(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
