"""index_item(): one item's chunk -> embed -> write, with reuse, repair and failure counting.

The rules (DESIGN.md §3, the seed):

* No provider: the item is `skipped`, nothing else is written.
* Reuse: a chunk whose embedding input (title, heading path, summary, content) and model are
  unchanged keeps its vector wherever it moved; only new or changed chunks are embedded.
* Embedding happens outside any transaction; the write is one short transaction: chunks,
  relational vectors, vec rows (DELETE + INSERT), the whole-item vector for single-chunk content
  (removed when the content grows), repair of the mirror, the index state.
* A failing vector is logged and counted; three in a row abort the item with its previous index
  intact. An isolated failure leaves that chunk without a vector and the item `partial`.
* Cancellation rolls back, leaves the previous index, marks the item `cancelled`, propagates.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass

import apsw

from worker.chunking import Chunk, ChunkMethod, LLMChunker, chunk, text_hash
from worker.chunking.llm import ChatModelLike
from worker.embedding import CancelCheck, FailureCounter, Plan, check, embed_missing
from worker.errors import (
    Cancelled,
    IndexAborted,
    PermanentProviderError,
)
from worker.log import CHUNK, KI_EMBED, get_logger
from worker.providers.base import EmbeddingModel
from worker.sources import item_text
from worker.store.boundaries import SqliteBoundaryCache
from worker.store.db import Database
from worker.store.items import NOW, Status, get_item, set_state
from worker.store.repair import repair_vectors
from worker.store.vec import vec_delete, vec_ready, vec_replace

log = get_logger("kidx.pipeline")

MAX_CONSECUTIVE_FAILURES = 3
NO_PROVIDER = "no embedding provider configured (KIDX_EMBEDDING__PROVIDER=none)"


@dataclass
class IndexResult:
    """What one run did: the task's JSON result (DESIGN.md §4)."""

    item_id: int
    status: str
    chunk_method: str | None = None
    chunks: int = 0
    reused: int = 0
    embedded: int = 0
    failed: int = 0
    dimensions: int | None = None
    model: str | None = None
    duration_ms: int = 0
    repaired: int = 0
    error: str | None = None
    fallback: str | None = None  # why LLM chunking was not used, when it was wanted

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def index_item(
    db: Database,
    item_id: int,
    *,
    embedder: EmbeddingModel | None,
    chat: ChatModelLike | None = None,
    chunk_window: int = 6000,
    structure_only: bool = False,
    cancel: CancelCheck | None = None,
    task_id: str | None = None,
    max_consecutive_failures: int = MAX_CONSECUTIVE_FAILURES,
) -> IndexResult:
    """Index one item (see the module docstring). Raises IndexAborted, Cancelled, KidxError.

    `chat`: the chunk model, for LLM chunking (falls back to structural chunking when it fails);
    `structure_only` skips it for this run.
    """
    started = time.monotonic()
    ilog = log.bind(item_id=item_id, task_id=task_id)

    def elapsed() -> int:
        return int((time.monotonic() - started) * 1000)

    item = get_item(db, item_id)
    if embedder is None:
        set_state(
            db,
            item_id,
            status=Status.SKIPPED,
            last_error=NO_PROVIDER,
            last_task_id=task_id,
            duration_ms=elapsed(),
        )
        ilog.info(f"{KI_EMBED} skipped", reason=NO_PROVIDER)
        return IndexResult(item_id, str(Status.SKIPPED), error=NO_PROVIDER, duration_ms=elapsed())

    dims = db.dimensions
    model = embedder.model_id
    try:
        check(cancel)
        text = item_text(item)
        content_hash = text_hash(text)
        set_state(db, item_id, status=Status.INDEXING, last_task_id=task_id)
        previous = db.all(
            "SELECT start_offset, content FROM note_chunks WHERE item_id = ? ORDER BY chunk_index",
            (item_id,),
        )
        llm = None
        if chat is not None and not structure_only:
            llm = LLMChunker(chat, SqliteBoundaryCache(db), chunk_window, cancel)
        outcome = chunk(text, previous, llm=llm)
        chunks, method = outcome.chunks, outcome.method
        if outcome.fallback:
            ilog.warning(f"{CHUNK} LLM chunking fell back to structure", reason=outcome.fallback)
        ilog.info(
            f"{CHUNK} chunked", chunk_method=str(method), chunk_count=len(chunks), dimensions=dims,
            chat_calls=llm.calls if llm else 0,
        )  # fmt: skip
        plan = _plan(db, item.id, item.title, chunks, model, dims)
        embed_missing(plan, embedder, cancel, FailureCounter(max_consecutive_failures, ilog))
        check(cancel)
        repaired, vec_failed = _write(
            db, item.id, plan, model, dims, content_hash, task_id, elapsed,
            max_consecutive_failures, ilog, method, outcome.fallback,
        )  # fmt: skip
    except Cancelled:
        set_state(db, item_id, status=Status.CANCELLED, last_task_id=task_id, duration_ms=elapsed())
        ilog.info(f"{KI_EMBED} cancelled; the previous index is intact", duration_ms=elapsed())
        raise
    except IndexAborted as e:
        _fail(db, item_id, f"aborted: {e}", task_id, elapsed())
        ilog.error(
            f"{KI_EMBED} aborted; the previous index is intact",
            reason=str(e),
            duration_ms=elapsed(),
        )
        raise
    except PermanentProviderError as e:
        _fail(db, item_id, str(e), task_id, elapsed())
        ilog.error(f"{KI_EMBED} failed", reason=str(e), duration_ms=elapsed())
        raise IndexAborted(str(e)) from e
    except Exception as e:
        _fail(db, item_id, f"{type(e).__name__}: {e}", task_id, elapsed())
        raise

    failed = len(plan.failed) + vec_failed
    result = IndexResult(
        item_id=item.id,
        status=str(Status.PARTIAL if failed else Status.INDEXED),
        chunk_method=str(method),
        chunks=len(chunks),
        reused=len(plan.reuse),
        embedded=len(plan.vectors) - len(plan.reuse),
        failed=failed,
        dimensions=dims,
        model=model,
        duration_ms=elapsed(),
        repaired=repaired,
        error=next(iter(plan.failed.values()), None),
        fallback=outcome.fallback,
    )
    ilog.info(f"{KI_EMBED} indexed", **{k: v for k, v in result.as_dict().items() if v is not None})
    return result


def _fail(db: Database, item_id: int, reason: str, task_id: str | None, duration: int) -> None:
    with db.atomic():
        set_state(
            db,
            item_id,
            status=Status.FAILED,
            last_error=reason,
            last_task_id=task_id,
            duration_ms=duration,
        )
        db.execute(
            "UPDATE item_index_state SET attempts = attempts + 1 WHERE item_id = ?", (item_id,)
        )


def _plan(
    db: Database, item_id: int, title: str, chunks: list[Chunk], model: str, dims: int
) -> Plan:
    """Match new chunks to old vectors by the hash of the embedder input, wherever they moved."""
    inputs = [c.embedding_input(title) for c in chunks]
    plan = Plan(chunks, inputs, [text_hash(x) for x in inputs])
    pool: dict[str, list[tuple[int, bytes]]] = defaultdict(list)
    for chunk_id, embed_hash, vector in db.all(
        "SELECT c.id, c.embed_hash, e.vector FROM note_chunks c "
        "JOIN note_chunk_embeddings e ON e.chunk_id = c.id AND e.model = ? AND e.dimensions = ? "
        "WHERE c.item_id = ? ORDER BY c.chunk_index",
        (model, dims, item_id),
    ):
        pool[embed_hash].append((chunk_id, vector))
    for i, h in enumerate(plan.hashes):
        if pool.get(h):
            plan.reuse[i] = pool[h].pop(0)
            plan.vectors[i] = plan.reuse[i][1]
    return plan


def _write(
    db: Database,
    item_id: int,
    plan: Plan,
    model: str,
    dims: int,
    content_hash: str,
    task_id: str | None,
    elapsed: Callable[[], int],
    limit: int,
    ilog: object,
    method: ChunkMethod,
    fallback: str | None,
) -> tuple[int, int]:
    """The one write transaction. Returns (vec rows repaired, vec rows that failed)."""
    counter = FailureCounter(limit, ilog)
    vec_failed = 0
    with db.atomic():
        mirror = vec_ready(db, dims)
        current = {
            cid: h
            for cid, h in db.all(
                "SELECT id, embed_hash FROM note_chunks WHERE item_id = ?", (item_id,)
            )
        }
        keep = {i: old for i, (old, _) in plan.reuse.items() if current.get(old) == plan.hashes[i]}
        gone = [cid for cid in current if cid not in set(keep.values())]
        if gone:
            if mirror:
                vec_delete(db, "vec_chunk_embeddings", gone)
            db.execute(f"DELETE FROM note_chunks WHERE id IN ({','.join('?' * len(gone))})", gone)
        # Out of the way of UNIQUE(item_id, chunk_index) while kept chunks move.
        db.execute(
            "UPDATE note_chunks SET chunk_index = -1 - chunk_index WHERE item_id = ?", (item_id,)
        )
        ids: dict[int, int] = {}
        for i, c in enumerate(plan.chunks):
            row = (
                c.index,
                c.content,
                c.summary,
                str(c.method),
                c.start,
                c.end,
                " > ".join(c.headings),
                plan.hashes[i],
            )
            if i in keep:
                ids[i] = keep[i]
                db.execute(
                    "UPDATE note_chunks SET chunk_index = ?, content = ?, summary = ?, method = ?, "
                    "start_offset = ?, end_offset = ?, headings = ?, embed_hash = ? WHERE id = ?",
                    (*row, keep[i]),
                )
                continue
            ids[i] = db.scalar(
                "INSERT INTO note_chunks(chunk_index, content, summary, method, start_offset, "
                "end_offset, headings, embed_hash, item_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) "
                "RETURNING id",
                (*row, item_id),
            )
            vector = plan.vectors.get(i)
            if vector is None:
                continue
            db.execute(
                "INSERT INTO note_chunk_embeddings(chunk_id, model, dimensions, vector) "
                "VALUES (?, ?, ?, ?)",
                (ids[i], model, dims, vector),
            )
            if mirror:
                try:
                    vec_replace(db, "vec_chunk_embeddings", ids[i], vector)
                except apsw.Error as e:
                    vec_failed += 1
                    counter.fail(c.index, f"vec write: {e}")
                else:
                    counter.ok()
        _write_whole_item(db, item_id, plan, model, dims, mirror)
        report = repair_vectors(db, dims, item_id=item_id)
        if report.total:
            ilog.info(
                f"{KI_EMBED} repaired the mirror",
                restored=report.restored,
                orphans_deleted=report.orphans_deleted,
            )
        failed = len(plan.failed) + vec_failed
        notes = []
        if failed:
            first = next(iter(plan.failed.values()), "vec write failed")
            notes.append(f"{failed} of {len(plan.chunks)} chunks have no vector: {first}")
        if fallback:
            notes.append(f"LLM chunking fell back to structure: {fallback}")
        reason = "; ".join(notes) or None
        db.execute(
            "UPDATE knowledge_items SET content_hash = ? WHERE id = ? AND "
            "(content_hash IS NULL OR content_hash != ?)",
            (content_hash, item_id, content_hash),
        )
        set_state(
            db,
            item_id,
            status=Status.PARTIAL if failed else Status.INDEXED,
            indexed_hash=content_hash,
            chunk_method=str(method),
            chunk_count=len(plan.chunks),
            model=model,
            dimensions=dims,
            last_error=reason,
            last_task_id=task_id,
            attempts=0,
            duration_ms=elapsed(),
        )
        db.execute(f"UPDATE item_index_state SET indexed_at = {NOW} WHERE item_id = ?", (item_id,))
    return report.total, vec_failed


def _write_whole_item(
    db: Database, item_id: int, plan: Plan, model: str, dims: int, mirror: bool
) -> None:
    """Single-chunk content also gets a whole-item vector (the seed's vec_note_embeddings), so
    the note itself can be recalled; it is the chunk's vector, as the chunk is the whole text.
    Content of several chunks has none."""
    vector = plan.vectors.get(0) if len(plan.chunks) == 1 else None
    db.execute("DELETE FROM note_embeddings WHERE item_id = ?", (item_id,))
    if mirror:
        vec_delete(db, "vec_note_embeddings", [item_id])
    if vector is None:
        return
    db.execute(
        "INSERT INTO note_embeddings(item_id, model, dimensions, vector) VALUES (?, ?, ?, ?)",
        (item_id, model, dims, vector),
    )
    if mirror:
        vec_replace(db, "vec_note_embeddings", item_id, vector)
