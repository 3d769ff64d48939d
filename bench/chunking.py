"""Structural chunker versus LangChain's and semantic-text-splitter's, on the Rust Book.

    python bench/chunking.py [--corpus DIR] [--edits N] [--seed S] [--target T] [--json PATH]

Prints one table (and writes it as JSON): throughput (MB/s, best of seven, and the ratio of
kidx to each peer), chunk count, median size, chunks over 1500 and under 200 characters, chunks
with an unbalanced code fence (apart from parts of a fenced block that alone exceeds 1500), and
edit locality: the mean number of chunks whose embedding input is new after a one-paragraph edit
(a sentence appended, a paragraph inserted, a paragraph deleted, at seeded random places).
Chunks under 200 characters are counted in all, and apart from documents that are themselves
shorter than that.
kidx's chunker runs at its default target size (`TARGET_CHUNK_SIZE`) unless `--target` names
another, so that candidate targets can be compared for edit locality (the peers keep 1500).
Timings are measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from worker.chunking.base import TARGET_CHUNK_SIZE  # noqa: E402
from worker.chunking.markdown import scan  # noqa: E402
from worker.chunking.structure import chunk_structure  # noqa: E402

DEFAULT_CORPUS = ROOT.parent / "shared" / "corpus" / "rustbook"
WORDS = re.compile(r"[A-Za-z]{3,}")

# A chunker here: text, title -> list of (start, end, embedding input).
Chunker = Callable[[str, str], list[tuple[int, int, str]]]


def kidx_chunker(
    text: str, title: str, target: int = TARGET_CHUNK_SIZE
) -> list[tuple[int, int, str]]:
    return [(c.start, c.end, c.embedding_input("")) for c in chunk_structure(text, target=target)]


def langchain_chunker() -> Chunker:
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    splitter = RecursiveCharacterTextSplitter(
        chunk_size=1500, chunk_overlap=100, add_start_index=True
    )

    def run(text: str, title: str) -> list[tuple[int, int, str]]:
        docs = splitter.create_documents([text])
        out = []
        for d in docs:
            s = d.metadata["start_index"]
            out.append((s, s + len(d.page_content), d.page_content))
        return out

    return run


def sts_chunker() -> Chunker:
    from semantic_text_splitter import MarkdownSplitter

    splitter = MarkdownSplitter((200, 1500), overlap=100)

    def run(text: str, title: str) -> list[tuple[int, int, str]]:
        # chunk_indices gives character offsets into `text`.
        return [(s, s + len(c), c) for s, c in splitter.chunk_indices(text)]

    return run


def plain_chunkers(target: int = TARGET_CHUNK_SIZE) -> dict[str, Callable[[str], object]]:
    """The bare calls timed for throughput (no offsets or embedding inputs built)."""
    from langchain_text_splitters import RecursiveCharacterTextSplitter
    from semantic_text_splitter import MarkdownSplitter

    lc = RecursiveCharacterTextSplitter(chunk_size=1500, chunk_overlap=100)
    sts = MarkdownSplitter((200, 1500), overlap=100)
    return {
        "kidx structure": partial(chunk_structure, target=target),
        "langchain recursive": lc.split_text,
        "semantic-text-splitter": sts.chunks,
    }


def oversized_fences(text: str) -> list[tuple[int, int]]:
    return [(f.start, f.end) for f in scan(text).fences if f.end - f.start > 1500]


def unbalanced(text: str, chunks: list[tuple[int, int, str]]) -> int:
    """Chunks that open a fence they do not close, or close one they did not open (a stray
    fence line opens a block), apart from parts of a fence that alone exceeds 1500."""
    big = oversized_fences(text)
    count = 0
    for s, e, _ in chunks:
        if all(f.closed for f in scan(text[s:e]).fences):
            continue
        if any(fs < e and s < fe for fs, fe in big):
            continue
        count += 1
    return count


def paragraphs(text: str) -> list[tuple[int, int]]:
    """Prose paragraphs (not headings, fences, lists or tables) as (start, end)."""
    spans = []
    fences = [(f.start, f.end) for f in scan(text).fences]
    for m in re.finditer(r"(?:^|\n\n)([^\n][^\n]*(?:\n[^\n]+)*)", text):
        s, e = m.start(1), m.end(1)
        block = text[s:e]
        if block.lstrip()[:1] in "#`~|-*>{<[" or any(fs <= s < fe for fs, fe in fences):
            continue
        if len(block) >= 40:
            spans.append((s, e))
    return spans


def make_edit(text: str, rng: random.Random, kind: str) -> str | None:
    spans = paragraphs(text)
    if len(spans) < 2:
        return None
    s, e = rng.choice(spans)
    words = WORDS.findall(text)
    if kind == "append":
        sentence = " " + " ".join(rng.choice(words) for _ in range(12)).capitalize() + "."
        return text[:e] + sentence + text[e:]
    if kind == "insert":
        n = rng.randint(25, 60)
        para = " ".join(rng.choice(words) for _ in range(n)).capitalize() + "."
        return text[:e] + "\n\n" + para + text[e:]
    end = e + 2 if text[e : e + 2] == "\n\n" else e
    return text[:s] + text[end:]


def reembedded(chunker: Chunker, before: str, after: str, title: str) -> int:
    old = Counter(x for _, _, x in chunker(before, title))
    new = Counter(x for _, _, x in chunker(after, title))
    return sum((new - old).values())


def reembedded_with_previous(
    before: str, after: str, title: str, target: int = TARGET_CHUNK_SIZE
) -> int:
    """What the pipeline does: the new version is cut knowing the previous version's chunks."""
    first = chunk_structure(before, target=target)
    second = chunk_structure(after, previous=[(c.start, c.content) for c in first], target=target)
    old = Counter(c.embedding_input("") for c in first)
    new = Counter(c.embedding_input("") for c in second)
    return sum((new - old).values())


def run(
    corpus: Path, edits: int, seed: int, rounds: int = 7, target: int = TARGET_CHUNK_SIZE
) -> dict:
    files = sorted(corpus.glob("*.md"))
    docs = [(f.stem, f.read_text(encoding="utf-8")) for f in files]
    megabytes = sum(len(t.encode()) for _, t in docs) / 1e6
    chunkers: dict[str, Chunker] = {
        "kidx structure": partial(kidx_chunker, target=target),
        "langchain recursive": langchain_chunker(),
        "semantic-text-splitter": sts_chunker(),
    }
    plain = plain_chunkers(target)
    rng = random.Random(seed)
    edit_plan = []
    kinds = ("append", "insert", "delete")
    while len(edit_plan) < edits:
        title, text = rng.choice(docs)
        kind = kinds[len(edit_plan) % 3]
        edited = make_edit(text, rng, kind)
        if edited is not None:
            edit_plan.append((title, text, edited))

    # Throughput: best of `rounds`, the chunkers interleaved so that machine noise hits all alike.
    best = dict.fromkeys(chunkers, float("inf"))
    for _ in range(rounds):
        for name in chunkers:
            fn = plain[name]
            t0 = time.perf_counter()
            for _, text in docs:
                fn(text)
            best[name] = min(best[name], time.perf_counter() - t0)
    rows = {}
    for name, chunker in chunkers.items():
        all_chunks = [(t, chunker(t, title)) for title, t in docs]
        sizes = [e - s for _, cs in all_chunks for s, e, _ in cs]
        # Chunks under 200 characters of documents that are longer than that themselves.
        short_in_long = sum(
            1 for t, cs in all_chunks if len(t.strip()) >= 200 for s, e, _ in cs if e - s < 200
        )
        rows[name] = {
            "mb_per_s": megabytes / best[name],
            "chunks": len(sizes),
            "median": statistics.median(sizes),
            "over_1500": sum(1 for x in sizes if x > 1500),
            "under_200": sum(1 for x in sizes if x < 200),
            "under_200_in_longer_docs": short_in_long,
            "unbalanced_fences": sum(unbalanced(t, cs) for t, cs in all_chunks),
            "reembedded_per_edit": statistics.mean(
                reembedded(chunker, b, a, title) for title, b, a in edit_plan
            ),
        }
    # The pipeline's own use: same chunks for a first version, the previous cuts kept after.
    rows["kidx + previous chunks"] = dict(rows["kidx structure"])
    rows["kidx + previous chunks"]["reembedded_per_edit"] = statistics.mean(
        reembedded_with_previous(b, a, title, target) for title, b, a in edit_plan
    )
    base = rows["kidx structure"]["mb_per_s"]
    for r in rows.values():
        r["kidx_speed_ratio"] = base / r["mb_per_s"]
    return {
        "corpus": str(corpus),
        "megabytes": megabytes,
        "edits": edits,
        "seed": seed,
        "target": target,
        "rows": rows,
    }


def print_table(result: dict) -> None:
    cols = [
        ("MB/s", "mb_per_s", "{:.1f}"),
        ("kidx/x", "kidx_speed_ratio", "{:.2f}"),
        ("chunks", "chunks", "{}"),
        ("median", "median", "{:.0f}"),
        (">1500", "over_1500", "{}"),
        ("<200", "under_200", "{}"),
        ("<200 long doc", "under_200_in_longer_docs", "{}"),
        ("unbal.fence", "unbalanced_fences", "{}"),
        ("re-emb/edit", "reembedded_per_edit", "{:.2f}"),
    ]
    print(
        f"corpus {result['corpus']} ({result['megabytes']:.2f} MB), "
        f"{result['edits']} edits, seed {result['seed']}, kidx target {result['target']}"
    )
    header = f"{'chunker':<24}" + "".join(f"{c[0]:>14}" for c in cols)
    print(header)
    print("-" * len(header))
    for name, r in result["rows"].items():
        print(f"{name:<24}" + "".join(f"{fmt.format(r[key]):>14}" for _, key, fmt in cols))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--edits", type=int, default=300)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--target", type=int, default=TARGET_CHUNK_SIZE, help="kidx's target size")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "chunking.json")
    args = ap.parse_args()
    if not args.corpus.is_dir():
        sys.exit(f"corpus not found: {args.corpus}")
    result = run(args.corpus, args.edits, args.seed, target=args.target)
    print_table(result)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
