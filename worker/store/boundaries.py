"""The cache of LLM chunk boundaries (`chunk_boundaries`), keyed by model and window hash."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from worker.store.db import Database


class SqliteBoundaryCache:
    """`worker.chunking.llm.BoundaryCache` in the index's own database, for one item's
    chunking (`item_id`): a window it caches is linked to the item at once (`chunk_windows`),
    so that it goes with the item whatever becomes of the run (a deleted note's model
    summaries stayed in the file for good). `used`: the windows it got or put, in order, with
    their boundaries as stored (what `keep_windows` keeps for the item's text)."""

    def __init__(self, db: Database, item_id: int | None = None) -> None:
        self.db = db
        self.item_id = item_id
        self.used: list[tuple[str, str, str]] = []  # (model, window hash, boundaries JSON)

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
            text = bytes(raw).decode("utf-8")
            rows = json.loads(text)
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
        self.used.append((model, key, text))
        return result

    def put(self, model: str, key: str, value: list[tuple[int, int, str | None]]) -> None:
        text = json.dumps(value)
        self.used.append((model, key, text))
        with self.db.atomic():
            if self.item_id is not None:
                there = self.db.scalar(
                    "SELECT 1 FROM knowledge_items WHERE id = ?", (self.item_id,)
                )
                if not there:  # deleted meanwhile: nothing kept for it
                    return
                self.db.execute(
                    "INSERT OR IGNORE INTO chunk_windows(item_id, model, window_hash) "
                    "VALUES (?, ?, ?)",
                    (self.item_id, model, key),
                )
            self.db.execute(
                "INSERT INTO chunk_boundaries(model, window_hash, boundaries) VALUES (?, ?, ?) "
                "ON CONFLICT(model, window_hash) DO UPDATE SET boundaries = excluded.boundaries",
                (model, key, text),
            )


_USED = "SELECT value ->> 0, value ->> 1 FROM json_each(:used)"


def keep_windows(db: Database, item_id: int, used: Sequence[tuple[str, str, str]]) -> None:
    """The item's text is made of these windows now (its whole text chunked by the model):
    they are linked to it, and cached again if another item's write let one go meanwhile;
    the windows it held before and no longer does are unlinked, and a window no item's text
    holds goes from the cache. In the item's write transaction, once its claim held (an older
    run finishing late must not unlink the newer text's windows)."""
    args = {"item": item_id, "used": json.dumps([[m, k] for m, k, _ in used])}
    db.executemany(
        "INSERT OR IGNORE INTO chunk_boundaries(model, window_hash, boundaries) VALUES (?, ?, ?)",
        list(used),
    )
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
