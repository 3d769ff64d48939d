"""search(): KNN over the vec0 tables, or in-memory cosine over the relational vectors when
sqlite-vec, a vec table or the right dimension is missing. Same result shape either way, and
the result says which path served it.

One hit per item (its best chunk, or its whole-item vector), ordered by distance: listing note
hits before chunk hits shows one note twice and ignores the distance.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from worker.errors import InvalidInput
from worker.nearest import exact_scan
from worker.providers.base import EmbeddingModel
from worker.store.db import Database
from worker.store.text import shown
from worker.store.vec import vec_table_dimensions

SNIPPET = 160


@dataclass
class Hit:
    item_id: int
    title: str
    kind: str
    chunk_index: int
    score: float  # cosine similarity
    snippet: str
    via: str  # "vec" or "fallback"

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class SearchResult:
    hits: list[Hit]
    via: str
    reason: str | None = None  # why the fallback served, when it did


def _vec_unavailable(db: Database, dims: int) -> str | None:
    if not db.vec_loaded:
        return f"sqlite-vec is not loaded ({db.vec_error or 'unknown reason'})"
    tables = vec_table_dimensions(db)
    for name in ("vec_chunk_embeddings", "vec_note_embeddings"):
        if tables[name] is None:
            return f"{name} is missing"
        if tables[name] != dims:
            return f"{name} has {tables[name]} dimensions, the query has {dims}"
    return None


def search(db: Database, query: str, embedder: EmbeddingModel, *, k: int = 10) -> SearchResult:
    """The k items nearest to `query`, each by its best chunk."""
    if not query.strip():
        raise InvalidInput("the query is empty")
    if k < 1:
        raise InvalidInput("k must be at least 1")
    vector = embedder.embed([query])[0]
    reason = _vec_unavailable(db, len(vector))
    best = _knn_vec(db, vector, k, embedder.model_id) if reason is None else None
    via = "vec"
    if best is None:
        reason = reason or f"the best {k} items need more than {KNN_MAX} nearest chunks"
        best = _knn_fallback(db, vector, k, embedder.model_id)
        via = "fallback"
    behind = _not_on(db, embedder.model_id, len(vector))
    if behind:  # during a model switch: say what the answer cannot include yet
        note = f"{behind} items are not indexed with {embedder.model_id} yet and are not searched"
        reason = f"{reason}; {note}" if reason else note
    return SearchResult(_hits(db, best, via, k), via, reason)


def _not_on(db: Database, model: str, dims: int) -> int:
    """Items whose index was built with another model or dimension (one row per item: cheap)."""
    return int(
        db.scalar(
            "SELECT count(*) FROM item_index_state WHERE chunk_count > 0 "
            "AND (model IS NOT ? OR dimensions IS NOT ?)",
            (model, dims),
        )
        or 0
    )


# (item_id -> (distance, chunk_index)) for the best chunk of each item
Best = dict[int, tuple[float, int]]


def _merge(best: Best, item_id: int, distance: float, chunk_index: int) -> None:
    if item_id not in best or distance < best[item_id][0]:
        best[item_id] = (distance, chunk_index)


KNN_MAX = 4096  # sqlite-vec 0.1's limit on k


def _knn_vec(db: Database, vector: np.ndarray, k: int, model: str) -> Best | None:
    """The best chunk of each item among the nearest vec rows, asking for more rows until k
    items are found or the table has no more; None when more than sqlite-vec's k limit would
    be needed (the caller scans exactly). Rows that no live item reaches (what a host's
    plain-SQL delete leaves until the sweep) are passed over, never returned."""
    blob = np.asarray(vector, dtype="<f4").tobytes()
    fetch = min(max(4 * k, 32), KNN_MAX)
    while True:
        best: Best = {}
        rows = db.all(
            "SELECT c.item_id, c.chunk_index, v.distance, i.id IS NOT NULL AND e.chunk_id "
            "IS NOT NULL FROM (SELECT chunk_id, distance FROM vec_chunk_embeddings "
            "WHERE embedding MATCH ? AND k = ?) v "
            "LEFT JOIN note_chunks c ON c.id = v.chunk_id "
            "LEFT JOIN note_chunk_embeddings e ON e.chunk_id = v.chunk_id AND e.model = ? "
            "LEFT JOIN knowledge_items i ON i.id = c.item_id",
            (blob, fetch, model),
        )
        for item_id, chunk_index, distance, live in rows:
            if live:
                _merge(best, item_id, distance, chunk_index)
        if len(best) >= k or len(rows) < fetch:
            break
        if fetch == KNN_MAX:
            return None
        fetch = min(fetch * 4, KNN_MAX)
    for item_id, distance in db.all(
        "SELECT v.item_id, v.distance FROM "
        "(SELECT item_id, distance FROM vec_note_embeddings WHERE embedding MATCH ? AND k = ?) v "
        "JOIN note_embeddings e ON e.item_id = v.item_id AND e.model = ? "
        "JOIN knowledge_items i ON i.id = v.item_id",
        (blob, min(fetch, KNN_MAX), model),
    ):
        _merge(best, item_id, distance, 0)
    return best


def _knn_fallback(db: Database, vector: np.ndarray, k: int, model: str) -> Best:
    """Exact cosine in memory over the relational vectors of the current model and dimension
    (of live items only), the chunks' and the whole items'."""
    best: Best = {}
    for sql in (
        "SELECT c.item_id, c.chunk_index, r.vector FROM note_chunk_embeddings r "
        "JOIN note_chunks c ON c.id = r.chunk_id JOIN knowledge_items i ON i.id = c.item_id "
        "WHERE r.model = ? AND r.dimensions = ? AND r.rowid > ? ORDER BY r.rowid LIMIT ?",
        "SELECT r.item_id, 0, r.vector FROM note_embeddings r "
        "JOIN knowledge_items i ON i.id = r.item_id "
        "WHERE r.model = ? AND r.dimensions = ? AND r.rowid > ? ORDER BY r.rowid LIMIT ?",
    ):
        for (item_id, chunk_index), distance in exact_scan(db, sql, model, vector):
            _merge(best, item_id, distance, chunk_index)
    return best


def _hits(db: Database, best: Best, via: str, k: int) -> list[Hit]:
    ranked = sorted(best.items(), key=lambda kv: (kv[1][0], kv[0]))[:k]
    hits = []
    for item_id, (distance, chunk_index) in ranked:
        row = db.one(
            "SELECT CAST(i.title AS BLOB), i.kind, c.content FROM knowledge_items i "
            "LEFT JOIN note_chunks c ON c.item_id = i.id AND c.chunk_index = ? WHERE i.id = ?",
            (chunk_index, item_id),
        )
        if row is None:
            continue
        title, kind, content = shown(row[0]), row[1], row[2]  # a host's bytes never raise
        snippet = " ".join((content or "").split())[:SNIPPET]
        hits.append(Hit(item_id, title, kind, chunk_index, round(1.0 - distance, 6), snippet, via))
    return hits
