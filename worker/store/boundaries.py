"""The cache of LLM chunk boundaries (`chunk_boundaries`), keyed by model and window hash."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from worker.store.db import Database


class SqliteBoundaryCache:
    """`worker.chunking.llm.BoundaryCache` in the index's own database. `used`: the windows a
    chunking got or put, in order (what `keep_windows` links to its item)."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.used: list[tuple[str, str]] = []

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
        self.used.append((model, key))
        return result

    def put(self, model: str, key: str, value: list[tuple[int, int, str | None]]) -> None:
        self.used.append((model, key))
        with self.db.atomic():
            self.db.execute(
                "INSERT INTO chunk_boundaries(model, window_hash, boundaries) VALUES (?, ?, ?) "
                "ON CONFLICT(model, window_hash) DO UPDATE SET boundaries = excluded.boundaries",
                (model, key, json.dumps(value)),
            )


_USED = "SELECT value ->> 0, value ->> 1 FROM json_each(:used)"


def keep_windows(db: Database, item_id: int, used: Sequence[tuple[str, str]]) -> None:
    """The item's text is made of these windows now (its whole text chunked by the model):
    they are linked to it, and the windows it held before and no longer does are unlinked;
    a window no item's text holds goes from the cache. In the item's write transaction, once
    its claim held (an older run finishing late must not unlink the newer text's windows)."""
    args = {"item": item_id, "used": json.dumps(list(used))}
    db.execute(
        f"INSERT OR IGNORE INTO chunk_windows(item_id, model, window_hash) SELECT :item, * "
        f"FROM ({_USED})",
        args,
    )
    gone = (
        "SELECT w.model, w.window_hash FROM chunk_windows w WHERE w.item_id = :item "
        f"AND (w.model, w.window_hash) NOT IN ({_USED})"
    )
    db.execute(
        f"DELETE FROM chunk_boundaries WHERE (model, window_hash) IN ({gone} AND NOT EXISTS "
        "(SELECT 1 FROM chunk_windows o WHERE o.model = w.model "
        "AND o.window_hash = w.window_hash AND o.item_id IS NOT :item))",
        args,
    )
    db.execute(
        "DELETE FROM chunk_windows WHERE item_id = :item "
        f"AND (model, window_hash) NOT IN ({_USED})",
        args,
    )


def _whole(value: Any) -> bool:
    """A JSON whole number (true and false are not)."""
    return isinstance(value, int) and not isinstance(value, bool)
