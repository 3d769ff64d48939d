"""Retrieval quality of chunkers on the chunking benchmark of Smith & Troynikov (Chroma, 2024).

    python bench/retrieval.py [--corpus DIR] [--targets 300,500,600,650,700,800,1500]
                              [--inputs chunk,kidx] [--no-peers] [--k 5] [--json PATH]

The five corpora and 472 questions of ../shared/corpus/chroma-chunking (read from there, never
copied) are chunked by each chunker; the chunks and the questions are embedded with kidx's local
model (all-MiniLM-L6-v2, offline); each question retrieves the top k chunks over all five
corpora together by exact cosine. Scored as the benchmark's README defines it, on character
spans: with R the union of a question's reference spans and C its retrieved chunks of the same
corpus, recall = |R ∩ ∪C| / |R|, precision = |R ∩ ∪C| / Σ|c| (all retrieved chunks, every
corpus), IoU = |R ∩ ∪C| / (Σ|c| + |R| − |R ∩ ∪C|), each averaged over the questions (×100);
and MRR: 1/rank of the first retrieved chunk that overlaps a reference span (0 when none does).

Rows:

- kidx's structural chunker at each `--targets` size (1500: the behaviour before there was a
  target), with each `--inputs` embedder input: `chunk` (the chunk's text alone, as the paper
  embeds) and `kidx` (what kidx embeds: title, heading path, then the text; the title is the
  file's name, as `kidx add file` gives it);
- LangChain's RecursiveCharacterTextSplitter (1500, 100) and (800, 0), spans found by locating
  each chunk in the text in order;
- the seed application's structural chunker, ported here from its rules (LESSONS.md, the seed
  document), not from the product: see `seed_chunker`.

Then kidx end to end (`kidx_rows`): the corpora added as notes to a fresh database, indexed by
the pipeline, queried through `search_chunks` in each mode (vector, keyword, hybrid). Also
printed: what each target does to the Rust book (chunk count, median size), without embedding;
and search latency per mode at 10k and 100k chunks as ratios to vector-only
(bench/search_modes.py). Embeddings are cached per (chunker, input) within the run only.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from worker.chunking.base import (  # noqa: E402
    MAX_CHUNK_SIZE,
    MIN_CHUNK_SIZE,
    OVERLAP_SIZE,
    TARGET_CHUNK_SIZE,
)
from worker.chunking.structure import chunk_structure  # noqa: E402
from worker.log import configure_logging  # noqa: E402
from worker.providers.base import EmbeddingModel  # noqa: E402
from worker.settings import LOCAL_DEFAULT_MODEL  # noqa: E402

DEFAULT_CORPUS = ROOT.parent / "shared" / "corpus" / "chroma-chunking"
RUSTBOOK = ROOT.parent / "shared" / "corpus" / "rustbook"
DEFAULT_TARGETS = (300, 500, 600, 650, 700, 800, MAX_CHUNK_SIZE)

# -- data --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Question:
    text: str
    corpus: str
    refs: tuple[tuple[int, int], ...]  # the union of its reference spans, merged, ascending


@dataclass
class Piece:
    """A chunk: where it is in its corpus, and the text the embedder is given for it."""

    corpus: str
    start: int
    end: int
    embed: str


def merge(spans: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """The union of spans as disjoint ascending spans."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        elif s < e:
            out.append((s, e))
    return tuple(out)


def load(corpus_dir: Path) -> tuple[dict[str, str], list[Question]]:
    """The corpora by id, read exactly (no newline translation: the spans are offsets), and the
    questions with their merged reference spans."""
    texts = {}
    for path in sorted((corpus_dir / "corpora").glob("*.md")):
        with path.open(encoding="utf-8", newline="") as f:
            texts[path.stem] = f.read()
    questions = []
    with (corpus_dir / "questions_df.csv").open(encoding="utf-8", newline="") as f:
        for row in csv.DictReader(f):
            refs = json.loads(row["references"])
            text = texts[row["corpus_id"]]
            for r in refs:  # the spans are what they say they are
                assert text[r["start_index"] : r["end_index"]] == r["content"]
            spans = merge([(int(r["start_index"]), int(r["end_index"])) for r in refs])
            questions.append(Question(row["question"], row["corpus_id"], spans))
    return texts, questions


# -- chunkers: (text, title) -> pieces of that text ------------------------------------------

Chunker = Callable[[str, str, str], list[Piece]]


def kidx_chunker(target: int, embed_input: str) -> Chunker:
    """kidx's structural chunker at `target`; `embed_input` is `chunk` (the text alone) or
    `kidx` (Chunk.embedding_input: the heading path before the text, as the pipeline embeds
    it; no title, since 2026-12-07, so that a rename re-embeds nothing)."""

    def run(corpus: str, text: str, title: str) -> list[Piece]:
        chunks = chunk_structure(text, target=target)
        if embed_input == "kidx":
            return [Piece(corpus, c.start, c.end, c.embedding_input("")) for c in chunks]
        return [Piece(corpus, c.start, c.end, c.content) for c in chunks]

    return run


def locate(text: str, chunks: Sequence[str]) -> list[tuple[int, int]]:
    """Spans of chunks cut from `text` in order (each an exact substring): each is looked for
    from just after the previous one's start."""
    spans, cursor = [], 0
    for c in chunks:
        at = text.find(c, cursor)
        if at < 0:
            at = text.find(c)
        if at < 0:
            raise ValueError(f"chunk not found in its text: {c[:60]!r}")
        spans.append((at, at + len(c)))
        cursor = at + 1
    return spans


def langchain_chunker(size: int, overlap: int) -> Chunker:
    from langchain_text_splitters import RecursiveCharacterTextSplitter

    splitter = RecursiveCharacterTextSplitter(chunk_size=size, chunk_overlap=overlap)

    def run(corpus: str, text: str, title: str) -> list[Piece]:
        chunks = splitter.split_text(text)
        return [Piece(corpus, s, e, text[s:e]) for s, e in locate(text, chunks)]

    return run


_SEED_HEADING = re.compile(r"^#", re.M)
_SEED_PARAGRAPH = re.compile(r"\n[ \t]*\n")
_SEED_SENTENCE = re.compile(r"(?<=[.!?])\s+")


def seed_chunker(corpus: str, text: str, title: str) -> list[Piece]:
    """The seed application's structural chunker, as its rules read (LESSONS.md, the seed's
    chunking document), with its faults, since those are what is compared:

    - sections start at every line beginning with `#`, fenced code or not;
    - a section within MaxChunkSize (1500) is one chunk; a longer one is cut at blank lines,
      one chunk a paragraph, a paragraph under MinChunkSize (200) joined to the next while the
      two stay within the maximum;
    - a paragraph over the maximum is cut into sentences (at `.`, `!`, `?` and the white space
      after), the white space dropped and the sentences glued ("lit .Valkyria"), packed up to
      the maximum, each next chunk starting with the last OverlapSize (100) characters of the
      one before; a single sentence over the maximum is never cut.

    What a chunk covers in its corpus is from its first sentence's start (or where its overlap
    came from) to its last sentence's end; what is embedded is its glued text, chunk alone.
    The seed's own code is not public here: where the rules leave a choice open, the simplest
    reading was taken (paragraph chunks, as the benchmark README's chunk count for the seed,
    2220, shows it does not pack paragraphs up to the maximum)."""
    heads = [m.start() for m in _SEED_HEADING.finditer(text)]
    bounds = sorted({0, *heads, len(text)})
    pieces: list[Piece] = []
    for a, c in itertools.pairwise(bounds):
        section = _strip(text, a, c)
        if section is None:
            continue
        s, e = section
        if e - s <= MAX_CHUNK_SIZE:
            pieces.append(Piece(corpus, s, e, text[s:e]))
            continue
        paras: list[tuple[int, int]] = []
        at = s
        for m in [*_SEED_PARAGRAPH.finditer(text, s, e), None]:
            stop = m.start() if m else e
            p = _strip(text, at, stop)
            if p:
                paras.append(p)
            if m:
                at = m.end()
        merged: list[tuple[int, int]] = []
        for p in paras:
            last = merged[-1] if merged else None
            if last and last[1] - last[0] < MIN_CHUNK_SIZE and p[1] - last[0] <= MAX_CHUNK_SIZE:
                merged[-1] = (last[0], p[1])
                continue
            merged.append(p)
        for ps, pe in merged:
            if pe - ps <= MAX_CHUNK_SIZE:
                pieces.append(Piece(corpus, ps, pe, text[ps:pe]))
            else:
                pieces.extend(_seed_sentences(corpus, text, ps, pe))
    return pieces


def _strip(text: str, a: int, c: int) -> tuple[int, int] | None:
    body = text[a:c]
    if not body.strip():
        return None
    return a + len(body) - len(body.lstrip()), c - len(body) + len(body.rstrip())


def _seed_sentences(corpus: str, text: str, s: int, e: int) -> list[Piece]:
    sentences, at = [], s
    for m in [*_SEED_SENTENCE.finditer(text, s, e), None]:
        stop = m.start() if m else e
        if stop > at:
            sentences.append((at, stop))
        if m:
            at = m.end()
    out: list[Piece] = []
    buf, start, end = "", -1, -1
    for a, c in sentences:
        sentence = text[a:c]
        if buf and len(buf) + len(sentence) > MAX_CHUNK_SIZE:
            out.append(Piece(corpus, start, end, buf))
            tail = buf[-OVERLAP_SIZE:]
            buf, start = tail, max(s, end - len(tail))
        if not buf:
            start = a
        buf += sentence
        end = c
    if buf:
        out.append(Piece(corpus, start, end, buf))
    return out


# -- embedding, search, scores ---------------------------------------------------------------


class Embedder:
    """kidx's local model (worker.providers.local: the same loading and pooling as
    LocalEmbeddings), with the vectors of each (chunker, input) kept for the run."""

    def __init__(self, model: str = LOCAL_DEFAULT_MODEL) -> None:
        from worker.providers.local import load_model

        self.model = load_model(model)
        self.cache: dict[tuple[str, str], np.ndarray] = {}
        self.seconds = 0.0

    def embed(self, texts: list[str]) -> np.ndarray:
        from worker.providers.local import encode

        t0 = time.perf_counter()
        out = encode(self.model, texts)  # the product's batching (4 a pass was fastest here)
        self.seconds += time.perf_counter() - t0
        return out

    def cached(self, key: tuple[str, str], texts: list[str]) -> np.ndarray:
        if key not in self.cache:
            self.cache[key] = self.embed(texts)
        return self.cache[key]


Span = tuple[str, int, int]  # corpus, start, end


def top_k(chunk_vectors: np.ndarray, query_vectors: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k most similar chunks per query, best first (exact cosine: both sides
    are normalised by the model's own Normalize module)."""
    scores = query_vectors @ chunk_vectors.T
    k = min(k, scores.shape[1])
    part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
    order = np.take_along_axis(scores, part, axis=1).argsort(axis=1)[:, ::-1]
    return np.take_along_axis(part, order, axis=1)


def _overlap(a: Sequence[tuple[int, int]], b: Sequence[tuple[int, int]]) -> int:
    """|∪a ∩ ∪b| for two lists of disjoint ascending spans."""
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def evaluate(questions: Sequence[Question], retrieved: Sequence[Sequence[Span]]) -> dict:
    """Recall, precision, IoU (×100, the README's definitions) and MRR, averaged over the
    questions; `retrieved[q]` is question q's chunks, best first."""
    recall, precision, iou, rr = [], [], [], []
    for q, hits in zip(questions, retrieved, strict=True):
        ref_len = sum(e - s for s, e in q.refs)
        same = merge([(s, e) for c, s, e in hits if c == q.corpus])
        inter = _overlap(q.refs, same)
        total = sum(e - s for _, s, e in hits)
        recall.append(inter / ref_len)
        precision.append(inter / total if total else 0.0)
        iou.append(inter / (total + ref_len - inter))
        rank = next(
            (
                r
                for r, (c, s, e) in enumerate(hits, 1)
                if c == q.corpus and _overlap(q.refs, [(s, e)])
            ),
            None,
        )
        rr.append(1 / rank if rank else 0.0)
    return {
        "recall": 100 * statistics.fmean(recall),
        "precision": 100 * statistics.fmean(precision),
        "iou": 100 * statistics.fmean(iou),
        "mrr": statistics.fmean(rr),
    }


@dataclass
class Bench:
    texts: dict[str, str]
    questions: list[Question]
    embedder: Embedder
    k: int
    rows: dict[str, dict] = field(default_factory=dict)
    _queries: np.ndarray | None = None

    def queries(self) -> np.ndarray:
        if self._queries is None:
            self._queries = self.embedder.embed([q.text for q in self.questions])
        return self._queries

    def chunker_row(self, name: str, embed_input: str, chunker: Chunker) -> dict:
        """Chunk every corpus, embed (cached per name and input), retrieve, score."""
        pieces = [p for cid, text in self.texts.items() for p in chunker(cid, text, f"{cid}.md")]
        t0 = self.embedder.seconds
        vectors = self.embedder.cached((name, embed_input), [p.embed for p in pieces])
        idx = top_k(vectors, self.queries(), self.k)
        retrieved = [
            [(pieces[i].corpus, pieces[i].start, pieces[i].end) for i in row] for row in idx
        ]
        sizes = [p.end - p.start for p in pieces]
        row = {
            "chunker": name,
            "input": embed_input,
            "chunks": len(pieces),
            "median": statistics.median(sizes),
            **evaluate(self.questions, retrieved),
            "embed_s": self.embedder.seconds - t0,
        }
        self.rows[f"{name} / {embed_input}"] = row
        print_row(row, flush=True)
        return row


class _Vectors(EmbeddingModel):
    """The pipeline's embedder for the end-to-end rows: kidx's local model through the bench's
    Embedder, each text's vector kept for the run (the same chunks as the `kidx` input row at
    the default target, and the questions, are not embedded twice)."""

    model_id = LOCAL_DEFAULT_MODEL
    batch_size = 64

    def __init__(self, embedder: Embedder, known: dict[str, np.ndarray]) -> None:
        self.embedder, self.known, self.dimensions = embedder, known, 384

    def embed_batch(self, texts: list[str]) -> np.ndarray:
        missing = [t for t in dict.fromkeys(texts) if t not in self.known]
        if missing:
            self.known.update(zip(missing, self.embedder.embed(missing), strict=True))
        return np.stack([self.known[t] for t in texts])


def kidx_rows(bench: Bench) -> dict[str, dict]:
    """kidx end to end: the five corpora added as notes to a fresh database, indexed by the
    pipeline with the local model (its own embedder input, its default target), queried
    through `search_chunks` in each mode, top k chunks, scored by `evaluate` on the hits'
    (corpus, start_offset, end_offset)."""
    from worker.bulk import index_item
    from worker.retrieval import Mode, search_chunks
    from worker.settings import EmbeddingSettings
    from worker.store import connect
    from worker.store.items import add_item

    name = f"kidx structure target {TARGET_CHUNK_SIZE}"
    pieces = [
        p
        for cid, text in bench.texts.items()
        for p in kidx_chunker(TARGET_CHUNK_SIZE, "kidx")(cid, text, f"{cid}.md")
    ]
    known = dict(
        zip(
            [p.embed for p in pieces],
            bench.embedder.cached((name, "kidx"), [p.embed for p in pieces]),
            strict=True,
        )
    )
    known.update(zip([q.text for q in bench.questions], bench.queries(), strict=True))
    model = _Vectors(bench.embedder, known)
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        db = connect(Path(tmp) / "bench.db", embedding=EmbeddingSettings(provider="local"))
        corpus_of = {}
        for cid, text in bench.texts.items():
            item = add_item(db, kind="note", title=f"{cid}.md", content=text)
            corpus_of[item] = cid
            if index_item(db, item, embedder=model).status != "indexed":
                sys.exit(f"kidx did not index {cid}")
        sizes = [r[0] for r in db.all("SELECT end_offset - start_offset FROM note_chunks")]
        for mode in Mode:
            t0 = time.perf_counter()
            retrieved = [
                [
                    (corpus_of[h.item_id], h.start_offset, h.end_offset)
                    for h in search_chunks(db, q.text, model, k=bench.k, mode=mode).hits
                ]
                for q in bench.questions
            ]
            row = {
                "chunker": f"kidx search_chunks, {mode}" + (" (default)" * (mode == Mode.HYBRID)),
                "input": "kidx",
                "chunks": len(sizes),
                "median": statistics.median(sizes),
                **evaluate(bench.questions, retrieved),
                "embed_s": 0.0,
                "query_ms": (time.perf_counter() - t0) * 1000 / len(bench.questions),
            }
            rows[row["chunker"]] = row
            print_row(row, flush=True)
        db.close()
    return rows


# -- the Rust book: what a target does to its chunks ------------------------------------------


def rustbook_sizes(corpus: Path, targets: Sequence[int]) -> dict[str, dict]:
    """Chunk count, median and tenth/ninetieth percentile sizes per target (no embedding)."""
    docs = [p.read_text(encoding="utf-8") for p in sorted(corpus.glob("*.md"))]
    out = {}
    for t in targets:
        sizes = [len(c.content) for d in docs for c in chunk_structure(d, target=t)]
        deciles = statistics.quantiles(sizes, n=10)
        out[str(t)] = {
            "chunks": len(sizes),
            "median": statistics.median(sizes),
            "p10": deciles[0],
            "p90": deciles[-1],
            "max": max(sizes),
            "under_200": sum(1 for x in sizes if x < MIN_CHUNK_SIZE),
        }
    return out


# -- output ----------------------------------------------------------------------------------

COLS = [
    ("chunks", "chunks", "{}"),
    ("median", "median", "{:.0f}"),
    ("recall", "recall", "{:.1f}"),
    ("precision", "precision", "{:.2f}"),
    ("IoU", "iou", "{:.2f}"),
    ("MRR", "mrr", "{:.3f}"),
    ("embed s", "embed_s", "{:.0f}"),
]


def header() -> None:
    line = f"{'chunker':<34}{'input':>7}" + "".join(f"{c[0]:>11}" for c in COLS)
    print(line)
    print("-" * len(line))


def print_row(row: dict, *, flush: bool = False) -> None:
    cells = "".join(f"{fmt.format(row[key]):>11}" for _, key, fmt in COLS)
    print(f"{row['chunker']:<34}{row['input']:>7}" + cells, flush=flush)


def print_rustbook(sizes: dict[str, dict]) -> None:
    print("\nthe Rust book, kidx structural chunker (chunk text sizes, characters)")
    line = f"{'target':>8}" + "".join(
        f"{c:>10}" for c in ("chunks", "median", "p10", "p90", "max", "<200")
    )
    print(line)
    print("-" * len(line))
    for t, r in sizes.items():
        cells = (r["chunks"], r["median"], r["p10"], r["p90"], r["max"], r["under_200"])
        print(f"{t:>8}" + "".join(f"{x:>10.0f}" for x in cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS)
    ap.add_argument("--rustbook", type=Path, default=RUSTBOOK)
    ap.add_argument(
        "--targets",
        default=",".join(map(str, DEFAULT_TARGETS)),
        help=f"kidx target sizes (the default target is {TARGET_CHUNK_SIZE})",
    )
    ap.add_argument("--inputs", default="chunk,kidx", help="embedder inputs for kidx rows")
    ap.add_argument("--no-peers", action="store_true", help="kidx rows only")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument(
        "--latency-sizes",
        default="10000,100000",
        help="chunk counts for the latency table ('' for none)",
    )
    ap.add_argument("--no-e2e", action="store_true", help="no rows through kidx's own search")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "retrieval.json")
    args = ap.parse_args()
    if not (args.corpus / "questions_df.csv").is_file():
        sys.exit(f"benchmark not found: {args.corpus}")
    targets = [int(t) for t in args.targets.split(",") if t]
    inputs = [i for i in args.inputs.split(",") if i]
    if any(i not in ("chunk", "kidx") for i in inputs):
        sys.exit("--inputs: chunk, kidx")

    configure_logging(level="warning")  # the pipeline's info lines would break the table
    texts, questions = load(args.corpus)
    bench = Bench(texts, questions, Embedder(), args.k)
    print(
        f"{len(texts)} corpora ({sum(map(len, texts.values())) / 1e6:.2f} M characters), "
        f"{len(questions)} questions, {LOCAL_DEFAULT_MODEL}, top {args.k}, exact cosine"
    )
    header()
    if not args.no_peers:
        bench.chunker_row("langchain recursive 1500/100", "chunk", langchain_chunker(1500, 100))
        bench.chunker_row("langchain recursive 800/0", "chunk", langchain_chunker(800, 0))
        bench.chunker_row("seed structural 1500/200/100", "chunk", seed_chunker)
    for t in targets:
        for i in inputs:
            bench.chunker_row(f"kidx structure target {t}", i, kidx_chunker(t, i))
    if not args.no_e2e:
        bench.rows.update(kidx_rows(bench))
    sizes = rustbook_sizes(args.rustbook, targets) if args.rustbook.is_dir() else {}
    if sizes:
        print_rustbook(sizes)
    latency = []
    if args.latency_sizes:
        from search_modes import measure, print_table  # bench/search_modes.py

        print("\nsearch latency per mode (bench/search_modes.py), k = 5")
        for size in (int(x) for x in args.latency_sizes.split(",")):
            latency += measure(size, 384, 40, 5, 7)
        print_table(latency)
    result = {
        "corpus": str(args.corpus),
        "model": LOCAL_DEFAULT_MODEL,
        "k": args.k,
        "questions": len(questions),
        "default_target": TARGET_CHUNK_SIZE,
        "rows": bench.rows,
        "rustbook": sizes,
        "latency": latency,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
