"""The indexers, one per kind of text (`base.Indexer`: plan, write, search), and which serves
each kind of item (memories, not items, use theirs directly: `worker.indexers.memories`).

    prose      notes, files, URLs   note_chunks / vec_chunk_embeddings   worker.retrieval
    code       code                 code_chunks / vec_work_code_chunks   search_code
    memories   (not items)          memories / vec_memories              search_memories
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.errors import InvalidInput
from worker.indexers.base import Indexer, IndexOptions, Planned, plan_vectors
from worker.indexers.code import Code
from worker.indexers.prose import Prose
from worker.store.items import Item

__all__ = ["KINDS", "IndexOptions", "Indexer", "Kind", "Planned", "kind_of", "plan_vectors"]


@dataclass(frozen=True)
class Kind:
    """A kind of item: its indexer, and where its text lives."""

    indexer: Indexer
    # The text is the row's `content` (a note): loaded where it is chunked, never rewritten.
    # Otherwise it is read from the source each run, and the text last extracted is stored in
    # `content`, for a host to read.
    text_in_row: bool = False


PROSE, CODE = Prose(), Code()
KINDS: dict[str, Kind] = {
    "note": Kind(PROSE, text_in_row=True),
    "file": Kind(PROSE),
    "url": Kind(PROSE),
    "code": Kind(CODE),
}


def kind_of(item: Item) -> Kind:
    try:
        return KINDS[item.kind]
    except KeyError:
        raise InvalidInput(f"item {item.id} has an unknown kind {item.kind!r}") from None
