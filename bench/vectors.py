"""Realistic vectors for the search benchmarks, from real chunks embedded once.

Uniform random unit vectors are the worst case for quantization and say nothing about recall
on real data. Here: the Rust book and the Chroma corpora, chunked by kidx, embedded with the
local model (all-MiniLM-L6-v2, 384 dimensions) once and cached in `bench/.cache/` (not in git);
the 472 Chroma questions embedded the same way are the queries. A set of any size is the real
vectors followed by synthetic ones, each a normalised mix of two or three real vectors plus
noise, so that the set keeps the real vectors' anisotropy (real embeddings share a mean
direction and a few strong axes; uniform vectors have neither). 1536 dimensions: the same
vectors through one fixed random linear map (a model of that width is not on this machine),
which keeps their geometry up to noise.

    python bench/vectors.py      # embed and cache (about two minutes the first time)
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
CORPUS = ROOT.parent / "shared" / "corpus"
CACHE = ROOT / "bench" / ".cache"
REAL = CACHE / "real-chunks-384.npy"
QUESTIONS = CACHE / "questions-384.npy"
NOISE = 0.35  # of a unit vector, per synthetic vector: neighbours are close, not copies


def _texts() -> tuple[list[str], list[str]]:
    from worker.chunking import chunk_structure

    chunks: list[str] = []
    paths = sorted((CORPUS / "rustbook").glob("*.md"))
    paths += sorted((CORPUS / "chroma-chunking" / "corpora").glob("*.md"))
    for path in paths:
        text = path.read_text(encoding="utf-8")
        chunks += [c.content for c in chunk_structure(text)]
    with (CORPUS / "chroma-chunking" / "questions_df.csv").open(encoding="utf-8") as f:
        questions = [row["question"] for row in csv.DictReader(f)]
    return chunks, questions


def embed_cache() -> tuple[np.ndarray, np.ndarray]:
    """The real chunk vectors and the question vectors (unit length, float32), cached."""
    if REAL.exists() and QUESTIONS.exists():
        return np.load(REAL), np.load(QUESTIONS)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from worker.providers import build_embedder
    from worker.settings import EmbeddingSettings

    model = build_embedder(EmbeddingSettings(provider="local"), dimensions=384)
    assert model is not None
    chunks, questions = _texts()
    real = np.asarray(model.embed(chunks), dtype=np.float32)
    asked = np.asarray(model.embed(questions), dtype=np.float32)
    CACHE.mkdir(parents=True, exist_ok=True)
    np.save(REAL, _unit(real))
    np.save(QUESTIONS, _unit(asked))
    return np.load(REAL), np.load(QUESTIONS)


def _unit(m: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(m, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return (m / norms).astype(np.float32)


def _widen(m: np.ndarray, dims: int) -> np.ndarray:
    if dims == m.shape[1]:
        return m
    rng = np.random.default_rng(1536)
    projection = rng.standard_normal((m.shape[1], dims), dtype=np.float32)
    return _unit(m @ projection)


def realistic(n: int, dims: int = 384, seed: int = 7) -> tuple[np.ndarray, np.ndarray]:
    """`n` base vectors (the real ones first, then synthetic) and the query vectors."""
    real, asked = embed_cache()
    rng = np.random.default_rng([seed, n, dims])
    base = real[:n]
    out = [base]
    made = len(base)
    while made < n:
        block = min(200_000, n - made)
        picks = rng.integers(0, len(real), size=(block, 3))
        weights = rng.dirichlet([1.0, 1.0, 0.5], size=block).astype(np.float32)
        mix = np.einsum("bk,bkd->bd", weights, real[picks])
        mix = _unit(mix)
        mix += rng.standard_normal(mix.shape, dtype=np.float32) * (NOISE / np.sqrt(384))
        out.append(_unit(mix))
        made += block
    matrix = np.concatenate(out)[:n]
    return _widen(matrix, dims), _widen(asked, dims)


if __name__ == "__main__":
    real, asked = embed_cache()
    print(f"{len(real)} real chunk vectors, {len(asked)} questions, cached in {CACHE}")
