"""The cache of LLM chunk boundaries (`chunk_boundaries`), keyed by model and window hash."""

from __future__ import annotations

import json
from typing import Any

from worker.store.db import Database


class SqliteBoundaryCache:
    """`worker.chunking.llm.BoundaryCache` in the index's own database."""

    def __init__(self, db: Database) -> None:
        self.db = db

    def get(self, model: str, key: str) -> list[tuple[int, int, str | None]] | None:
        """The cached boundaries, or None (a miss) for a row that is not a JSON list of
        [start, end, summary]: a host or an older version may have written anything here,
        and a junk row must cost a fresh answer, not the item. Whether the units are in range
        and cover the window is checked by the chunker, which knows the window."""
        raw = self.db.scalar(  # as bytes: apsw raises on a TEXT value that is not UTF-8
            "SELECT CAST(boundaries AS BLOB) FROM chunk_boundaries "
            "WHERE model = ? AND window_hash = ?",
            (model, key),
        )
        if raw is None:
            return None
        try:
            rows = json.loads(bytes(raw).decode("utf-8"))
        except (ValueError, RecursionError):  # not UTF-8, not JSON, nested too deep
            return None
        if not isinstance(rows, list):
            return None
        result: list[tuple[int, int, str | None]] = []
        for row in rows:
            if not (isinstance(row, list) and len(row) == 3):
                return None
            start, end, summary = row
            if not (
                _whole(start) and _whole(end) and (summary is None or isinstance(summary, str))
            ):
                return None
            result.append((start, end, summary))
        return result

    def put(self, model: str, key: str, value: list[tuple[int, int, str | None]]) -> None:
        with self.db.atomic():
            self.db.execute(
                "INSERT INTO chunk_boundaries(model, window_hash, boundaries) VALUES (?, ?, ?) "
                "ON CONFLICT(model, window_hash) DO UPDATE SET boundaries = excluded.boundaries",
                (model, key, json.dumps(value)),
            )


def _whole(value: Any) -> bool:
    """A JSON whole number (true and false are not)."""
    return isinstance(value, int) and not isinstance(value, bool)
