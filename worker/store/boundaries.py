"""The cache of LLM chunk boundaries (`chunk_boundaries`), keyed by model and window hash."""

from __future__ import annotations

import json
from typing import Any

from worker.store.db import Database


class SqliteBoundaryCache:
    """`worker.chunking.llm.BoundaryCache` in the index's own database, for one item's
    chunking: the rows it writes name the item (deleted with it), and `prune` drops the
    item's rows this chunking did not use (the windows of its earlier texts)."""

    def __init__(self, db: Database, item_id: int | None = None) -> None:
        self.db = db
        self.item_id = item_id
        self.used: list[tuple[str, str]] = []  # (model, window hash) got or put

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
        self.used.append((model, key))
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
        self.used.append((model, key))
        with self.db.atomic():
            self.db.execute(
                "INSERT INTO chunk_boundaries(model, window_hash, boundaries, item_id) "
                "VALUES (?, ?, ?, ?) ON CONFLICT(model, window_hash) DO UPDATE SET "
                "boundaries = excluded.boundaries, item_id = excluded.item_id",
                (model, key, json.dumps(value), self.item_id),
            )

    def prune(self) -> int:
        """Once the item's whole text was chunked from this cache: its rows this chunking did
        not use go, and the rows it used that name no item (written before items were named,
        or by a host) become its own. How many rows went."""
        if self.item_id is None:
            return 0
        used = json.dumps(self.used)
        with self.db.atomic():
            self.db.execute(
                "UPDATE chunk_boundaries SET item_id = ?1 WHERE item_id IS NULL "
                "AND (model, window_hash) IN (SELECT value ->> 0, value ->> 1 FROM json_each(?2))",
                (self.item_id, used),
            )
            self.db.execute(
                "DELETE FROM chunk_boundaries WHERE item_id = ?1 AND (model, window_hash) "
                "NOT IN (SELECT value ->> 0, value ->> 1 FROM json_each(?2))",
                (self.item_id, used),
            )
            return self.db.conn.changes()


def _whole(value: Any) -> bool:
    """A JSON whole number (true and false are not)."""
    return isinstance(value, int) and not isinstance(value, bool)
