"""The text of an item. Notes carry it in their row; files, URLs and code are read by the
source modules that follow (DESIGN.md §1)."""

from __future__ import annotations

from worker.errors import InvalidInput
from worker.store.items import Item


def item_text(item: Item) -> str:
    """The text to index for this item."""
    if item.kind == "note":
        return item.content
    raise InvalidInput(f"item {item.id} is a {item.kind}; reading {item.kind}s is not built yet")
