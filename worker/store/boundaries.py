"""The cache of LLM chunk boundaries (`chunk_boundaries`), keyed by model and window hash."""

from __future__ import annotations

import json

from worker.store.db import Database


class SqliteBoundaryCache:
    """`worker.chunking.llm.BoundaryCache` in the index's own database."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def get(self, model: str, key: str) -> list[tuple[int, int, str | None]] | None:
        raw = self.db.scalar(
            "SELECT boundaries FROM chunk_boundaries WHERE model = ? AND window_hash = ?",
            (model, key),
        )
        if raw is None:
            return None
        return [(int(s), int(e), summary) for s, e, summary in json.loads(raw)]

    def put(self, model: str, key: str, value: list[tuple[int, int, str | None]]) -> None:
        with self.db.atomic():
            self.db.execute(
                "INSERT INTO chunk_boundaries(model, window_hash, boundaries) VALUES (?, ?, ?) "
                "ON CONFLICT(model, window_hash) DO UPDATE SET boundaries = excluded.boundaries",
                (model, key, json.dumps(value)),
            )
