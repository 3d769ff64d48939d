"""Nearest vectors in one vec0 table, or by exact cosine over its relational mirror when
sqlite-vec, the table or its dimension is missing: for memories and code, which are searched
each on their own (note search, with its one-hit-per-item merge, is `worker.retrieval`)."""

from __future__ import annotations

import numpy as np

from worker.store.db import Database
from worker.store.vec import VecTable, vec_table_dimensions

BLOCK = 20_000


def unavailable(db: Database, table: VecTable, dims: int) -> str | None:
    """Why the vec0 path cannot serve this table now, or None."""
    if not db.vec_loaded:
        return f"sqlite-vec is not loaded ({db.vec_error or 'unknown reason'})"
    have = vec_table_dimensions(db)[table.name]
    if have is None:
        return f"{table.name} is missing"
    if have != dims:
        return f"{table.name} has {have} dimensions, the query has {dims}"
    return None


def nearest(
    db: Database, table: VecTable, vector: np.ndarray, k: int, model: str
) -> tuple[list[tuple[int, float]], str, str | None]:
    """The k nearest (key, cosine distance) of `model`'s vectors; which path served; why."""
    q = np.asarray(vector, dtype="<f4")
    reason = unavailable(db, table, len(q))
    if reason is None:
        rows = db.all(
            f"SELECT v.{table.key}, v.distance FROM (SELECT {table.key}, distance FROM "
            f"{table.name} WHERE embedding MATCH ? AND k = ?) v JOIN {table.source} r "
            f"ON r.{table.source_key} = v.{table.key} AND r.model = ? ORDER BY v.distance",
            (q.tobytes(), k, model),
        )
        return [(int(key), float(d)) for key, d in rows], "vec", None
    unit = q / (np.linalg.norm(q) or 1.0)
    scored: list[tuple[float, int]] = []
    last = -1
    while True:
        rows = db.all(
            f"SELECT rowid, {table.source_key}, vector FROM {table.source} WHERE model = ? "
            "AND dimensions = ? AND rowid > ? ORDER BY rowid LIMIT ?",
            (model, len(q), last, BLOCK),
        )
        if not rows:
            break
        last = rows[-1][0]
        matrix = np.frombuffer(b"".join(r[2] for r in rows), dtype="<f4").reshape(-1, len(q))
        norms = np.linalg.norm(matrix, axis=1)
        norms[norms == 0] = 1.0
        distances = 1.0 - (matrix @ unit) / norms
        scored.extend((float(d), int(r[1])) for r, d in zip(rows, distances, strict=True))
    scored.sort()
    return [(key, d) for d, key in scored[:k]], "fallback", reason
