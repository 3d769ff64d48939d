"""What indexing a kind of text takes, behind one small interface, and the options of a run.

An `Indexer` plans what to embed (the chunks, and which of them keep a vector made before),
writes what was embedded (chunks, vectors, mirror rows, in the caller's transaction), and
searches it. The pipeline (`worker.pipeline`, `worker.bulk`) runs every kind of item the same
way through its indexer; what differs between notes, files, URLs and code lives in the
indexers and in `worker.indexers.KINDS`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import apsw

from worker.chunking import ChunkMethod, text_hash
from worker.chunking.base import CONTEXT_CHARS, TARGET_CHUNK_SIZE
from worker.chunking.llm import ChatModelLike
from worker.embedding import CancelCheck, FailureCounter, Plan, Streak
from worker.providers.base import EmbeddingModel
from worker.sources import Reader
from worker.store.db import Database
from worker.store.items import Item
from worker.store.text import shown
from worker.store.vec import sound, vec_delete, vec_insert, vec_replace

MAX_CONSECUTIVE_FAILURES = 3


@dataclass(frozen=True)
class IndexOptions:
    """How a run indexes, the same for each of its items."""

    chat: ChatModelLike | None = None  # the chunk model (LLM chunking; structure without)
    reader: Reader = field(default_factory=Reader)  # files, URLs and code: roots and limits
    chunk_window: int = 6000  # characters the chunk model is shown a request
    chunk_deadline: float | None = None  # seconds LLM chunking of an item may take in all
    chunk_target: int = TARGET_CHUNK_SIZE  # the size structural chunking aims at
    structure_only: bool = False  # no chunk model for this run
    cancel: CancelCheck | None = None  # true once the run is cancelled
    task_id: str | None = None  # recorded with the item's state
    max_consecutive_failures: int = MAX_CONSECUTIVE_FAILURES  # vector failures that abort
    streak: Streak | None = None  # failed provider requests, shared by a batch's runs
    context_chars: int = CONTEXT_CHARS  # title and heading path before each chunk


@dataclass
class Planned:
    """An item's chunks with their vectors planned (reused or to embed), and how it was cut."""

    plan: Plan
    method: ChunkMethod = ChunkMethod.STRUCTURE
    fallback: str | None = None  # why LLM chunking was not used, when it was wanted
    asked: bool = False  # whether the chunk model was asked (`Chunking.asked`)
    # Each chunk's `fts.chunk_parts`, made with the plan (out of the write lock) for a new
    # item's keyword rows; empty when its writer makes them.
    keyword_parts: tuple[str, ...] = ()
    target: int | None = None  # the structural target the chunks were cut at (prose only)
    # The cached LLM windows the item's whole text was chunked from, (model, window hash,
    # boundaries) each (None: not chunked whole by the model), kept for it by its write
    # (`keep_windows`).
    windows: tuple[tuple[str, str, str], ...] | None = None

    @property
    def chunk_count(self) -> int:
        return len(self.plan.chunks)


class Indexer(ABC):
    """One kind of indexed text: how it is planned, written and searched."""

    @abstractmethod
    def plan(
        self, db: Database, item: Item, text: str, model: str, options: IndexOptions, ilog: Any
    ) -> Planned:
        """Chunk the text and match the chunks to vectors made before; no embedding call
        (the chunk model's only)."""

    @abstractmethod
    def write(
        self,
        db: Database,
        item: Item,
        planned: Planned,
        model: str,
        options: IndexOptions,
        ilog: Any,
        *,
        orphans: bool,
    ) -> tuple[int, int]:
        """Write the chunks and vectors in the caller's transaction, repairing the item's
        mirror (`orphans`: and looking for orphan vec rows); (rows repaired, vec writes that
        failed). Why each failed goes in `plan.unmirrored`, for the item's state and result."""

    def write_new(
        self, db: Database, items: Sequence[tuple[Item, Planned]], model: str
    ) -> list[int]:
        """Items indexed for the first time, every chunk with its vector, written together in
        the caller's transaction (a statement per table for all, where `write` takes several
        an item): the ids written. Those that are not new are left out, for `write`. An
        error leaves the caller's savepoint to roll back. By default nothing is written so."""
        return []

    @abstractmethod
    def search(self, db: Database, query: str, embedder: EmbeddingModel, *, k: int) -> Any:
        """The k best matches of `query` among the texts of this kind."""


def plan_vectors(
    db: Database,
    item: Item,
    chunks: Sequence[Any],
    model: str,
    options: IndexOptions,
    *,
    chunks_table: str,
    vectors_table: str,
    key: Callable[[Any], str] | None = None,
    older_key: Callable[[Any], str] | None = None,
    label: str | None = None,
) -> Plan:
    """The chunks' embedder inputs (each chunk's `embedding_input(label, context)`, `label` the
    item's title unless given) and, for each, a vector made before for the same input and
    model, wherever that chunk was (the item's rows of `chunks_table` / `vectors_table`). An
    inserted paragraph moves every later chunk: keyed on the position, all of them would be
    embedded again. `key`: what a chunk's vector is kept under (default: the hash of its
    input); `older_key`: what an earlier version kept it under, looked up when `key` finds
    nothing."""
    title, context = item.title if label is None else label, options.context_chars
    plan = Plan(
        chunks,
        lambda i: chunks[i].embedding_input(title, context),
        [key(c) if key else text_hash(c.embedding_input(title, context)) for c in chunks],
        item_id=item.id,
    )
    pool: dict[str, list[tuple[int, bytes]]] = defaultdict(list)
    for chunk_id, embed_hash, vector in db.all(
        # as bytes: a host's TEXT there that is not UTF-8 failed every run of the item (apsw
        # cannot read it); shown, it matches no hash and the chunk is embedded again
        f"SELECT c.id, CAST(c.embed_hash AS BLOB), e.vector FROM {chunks_table} c "
        f"JOIN {vectors_table} e "
        f"ON e.chunk_id = c.id AND e.model = ? AND e.dimensions = ? AND {sound('e')} "
        "WHERE c.item_id = ? "
        "ORDER BY c.chunk_index",
        (model, db.dimensions, item.id),
    ):
        pool[shown(embed_hash)].append((chunk_id, vector))
    for i, h in enumerate(plan.hashes):
        found = pool.get(h) or (pool.get(older_key(chunks[i])) if older_key else None)
        if found:
            plan.reuse[i] = found.pop(0)
            plan.vectors[i] = plan.reuse[i][1]
    return plan


def mirror_chunks(
    db: Database,
    table: str,
    rows: list[tuple[int, int, bytes]],
    plan: Plan,
    counter: FailureCounter,
) -> dict[int, str]:
    """New chunks' vec rows, (position in the plan, chunk id, vector) each, in `table` (DELETE +
    INSERT: a stray row may hold an id), all at once; when that fails, row by row, each failure
    counted (three in a row abort). Returns the rows that failed, by position, with why: the
    item's state and result name the cause, as they do an embedding's. A host's stray row
    under a new chunk's id, which vec0 can neither replace nor delete, fails that row only."""
    try:
        with db.atomic():
            vec_delete(db, table, [chunk_id for _, chunk_id, _ in rows])
            vec_insert(db, table, [(chunk_id, vector) for _, chunk_id, vector in rows])
        counter.ok()
        return {}
    except apsw.Error:
        pass
    failed: dict[int, str] = {}
    for i, chunk_id, vector in rows:
        try:
            with db.atomic():
                vec_replace(db, table, chunk_id, vector)
        except apsw.Error as e:
            failed[i] = f"vec write: {e}"
            counter.fail(plan.chunks[i].index, failed[i])
        else:
            counter.ok()
    return failed
