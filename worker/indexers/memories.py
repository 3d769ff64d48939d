"""Memories: short texts embedded whole (no chunking), in `memories` / `vec_memories`, found
only by a memory search. Not knowledge items (no task or sweep runs them), but planned, written
and searched through the same interface: `add_memory` plans the text as one chunk, embeds it
and writes it at once."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import apsw

from worker.chunking import Chunk, text_hash
from worker.embedding import FailureCounter, Plan, learn_batch_size, too_much
from worker.errors import (
    IndexAborted,
    InvalidInput,
    KidxError,
    PermanentProviderError,
)
from worker.indexers.base import MAX_CONSECUTIVE_FAILURES, Indexer, IndexOptions, Planned
from worker.log import KI_EMBED, get_logger
from worker.nearest import nearest
from worker.providers.base import EmbeddingModel, to_blob
from worker.retrieval import check_query
from worker.store.db import Database
from worker.store.items import Item
from worker.store.schema import named_refusals, refused_by_host
from worker.store.text import NotText, given_text, shown, strict
from worker.store.vec import (
    VEC,
    VEC_BEHIND,
    mirror_ready,
    refuse_stale,
    set_meta,
    sound,
    vec_replace,
)

MAX_MEMORY = 2000  # characters: longer texts are notes, which are chunked
# A stored memory longer than this in bytes is over MAX_MEMORY characters whatever its text (UTF-8
# takes at most 4 bytes a character): refused unread, so that a host's 15 MB row costs no
# memory (read whole, the local tokenizer took it to 2.6 GB).
_MAX_BYTES = 4 * MAX_MEMORY

log = get_logger("kidx.memories")


@dataclass
class MemoryHit:
    memory_id: int
    score: float
    content: str
    via: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class Memories(Indexer):
    """Memories: an `Item` of kind `memory` whose id is the memory's."""

    def plan(
        self, db: Database, item: Item, text: str, model: str, options: IndexOptions, ilog: Any
    ) -> Planned:
        """The text whole, one chunk; its vector kept if this model already made it."""
        chunks = [Chunk(0, 0, len(text), text)]
        plan = Plan(chunks, lambda i: text, [text_hash(text)], item_id=item.id)
        row = db.one(
            "SELECT vector FROM memory_embeddings WHERE memory_id = ? AND model = ? "
            f"AND dimensions = ? AND {sound()}",
            (item.id, model, db.dimensions),
        )
        if row is not None:
            plan.reuse[0] = (item.id, row[0])
            plan.vectors[0] = row[0]
        return Planned(plan)

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
        vector, dims = planned.plan.vectors[0], db.dimensions
        db.execute(
            # (REPLACE: an UPDATE would fire the trigger that drops a vector a host changed)
            "INSERT OR REPLACE INTO memory_embeddings(memory_id, model, dimensions, vector) "
            "VALUES (?, ?, ?, ?)",
            (item.id, model, dims, vector),
        )
        if mirror_ready(db, dims):
            _mirror(db, item.id, vector)
        return 0, 0

    def search(
        self, db: Database, query: str, embedder: EmbeddingModel, *, k: int = 10
    ) -> tuple[list[MemoryHit], str, str | None]:
        k = check_query(query, k)
        vector = embedder.embed([query])[0]
        hits = []
        with db.reading():  # one snapshot from ranking to the rows read (retrieval's reason)
            found, via, reason = nearest(db, VEC["vec_memories"], vector, k, embedder.model_id)
            for memory_id, distance in found:
                content = db.scalar(
                    "SELECT CAST(content AS BLOB) FROM memories WHERE id = ?", (memory_id,)
                )
                if content is not None:  # a host's bytes are shown, not raised (store.text)
                    score = round(1.0 - distance, 6)
                    hits.append(MemoryHit(memory_id, score, shown(content), via))
        return hits, via, reason


MEMORIES = Memories()


def _mirror(db: Database, memory_id: int, vector: bytes) -> None:
    """A memory's vec row, in a savepoint of the caller's transaction. vec0 fails on storage a
    host wrote into (its shadow tables: "Could not fetch vector data"); that failed the whole
    write, `embed_memories` and `add_memory` with it, until a sweep rebuilt the table. The
    relational vector is the truth and stands: the database is marked `vec_behind`, so that
    the sweep (or the next writer's connection) rebuilds the mirror from it, an old vector
    left under this key included."""
    try:
        with db.atomic():
            vec_replace(db, "vec_memories", memory_id, vector)
    except (apsw.SQLError, apsw.CorruptError) as e:
        set_meta(db, VEC_BEHIND, "1")
        log.warning(
            f"{KI_EMBED} a memory's vec row could not be written",
            memory_id=memory_id,
            reason=str(e),
        )


def add_memory(db: Database, text: str, embedder: EmbeddingModel) -> int:
    """Embed `text` whole and store it; its id. The vector is made before the transaction."""
    text = given_text(text, "memory").strip()
    if not text:
        raise InvalidInput("the memory is empty")
    if len(text) > MAX_MEMORY:
        raise InvalidInput(
            f"a memory is a short text (at most {MAX_MEMORY} characters, this one has "
            f"{len(text)}); add it as a note instead"
        )
    if why := over_model(text, embedder):
        raise InvalidInput(f"a memory is embedded whole: this one {why}")
    vector = embedder.embed_checked([text])[0]  # the memory's embedder input is its text
    with named_refusals(db), db.atomic():  # a host's trigger or index refusing it: named
        memory_id = int(db.scalar("INSERT INTO memories(content) VALUES (?) RETURNING id", (text,)))
        _write_vector(db, memory_id, text, vector, embedder.model_id)
    return memory_id


def over_model(text: str, embedder: EmbeddingModel) -> str | None:
    """Why `embedder` would not embed `text` whole, or None. A model that cuts its input (the
    local one reads 256 tokens, some 1,100 characters) gives two memories that differ in
    their tail the same vector: such a memory is refused, not embedded in part. Only a model
    that says what it reads (`reads_whole`: the local provider) is asked; the APIs' limits
    (8k tokens) are far above a memory's."""
    counted = embedder.reads_whole(text)
    if counted is None:
        return None
    empty = embedder.reads_whole("")
    if empty is not None and counted[0] <= empty[0]:
        # NUL, zero-width spaces, a BOM: the model reads its markers alone, and such memories
        # came first for any query of punctuation, above every real one
        return f"holds nothing {embedder.model_id} reads (only characters it drops)"
    if counted[0] <= counted[1]:
        return None
    tokens, most = counted
    return (
        f"has {tokens} tokens, more than the {most} that {embedder.model_id} reads of a text "
        "(it would embed the start only): shorten it, or add it as a note (notes are chunked)"
    )


def _write_vector(db: Database, memory_id: int, text: str, vector: Any, model: str) -> None:
    """A memory's vector and its mirror, through the indexer, in the caller's transaction."""
    memory = Item(memory_id, "memory", "", None, text, None)
    options = IndexOptions()
    planned = MEMORIES.plan(db, memory, text, "", options, log)
    planned.plan.vectors[0] = to_blob(vector)
    with db.writing_index():
        MEMORIES.write(db, memory, planned, model, options, log, orphans=False)


def search_memories(
    db: Database, query: str, embedder: EmbeddingModel, *, k: int = 10
) -> tuple[list[MemoryHit], str, str | None]:
    return MEMORIES.search(db, query, embedder, k=k)


# A memory refused (or unreadable) is not tried again for this long, unless its text or the
# model changes: long enough for every sweep in between to find nothing to do, short enough
# that memories a provider refused while it misbehaved get their vectors the next day.
REFUSAL_TTL_S = 86_400

# Memories with no vector of this model and dimension: written by a host with plain SQL, changed
# since (a trigger drops the vector of a changed text), or embedded by a model used before;
# but not those refused lately as they are now (`memory_refusals`, migration 9): a refusal
# dated in the future (a host's row, a clock set back since) is none, or it hid its memory
# until that date (year 9999: for good). Empty means
# whitespace only, measured in bytes: `length()` of a text stops at its first NUL, and a memory
# that starts with one was never embedded, counted or recorded. The content of a row longer
# than `_MAX_BYTES` is not read (NULL), only its size.
# The characters Python's str.strip() takes for white space (add_memory refuses a memory of
# only them), as SQLite's trim() is told them: with ASCII's alone, a host's row of U+3000 was
# embedded, and came back from memory search.
_BLANKS = "char(" + ", ".join(str(ord(c)) for c in map(chr, range(0x3001)) if c.isspace()) + ")"
_MISSING = (
    f"SELECT m.id, CASE WHEN length(CAST(m.content AS BLOB)) <= {_MAX_BYTES} "
    "THEN CAST(m.content AS BLOB) END, length(CAST(m.content AS BLOB)) "
    "FROM memories m LEFT JOIN memory_embeddings e "
    f"ON e.memory_id = m.id AND e.model = :model AND e.dimensions = :dims AND {sound('e')} "
    "WHERE e.memory_id IS NULL "
    f"AND length(CAST(trim(CAST(m.content AS TEXT), {_BLANKS}) AS BLOB)) > 0 "
    "AND NOT EXISTS (SELECT 1 FROM memory_refusals r WHERE r.memory_id = m.id "
    "AND r.model = :model AND r.content IS CAST(m.content AS BLOB) "
    f"AND (julianday('now') - julianday(r.refused_at)) * 86400 BETWEEN 0 AND {REFUSAL_TTL_S})"
)


def memories_missing(db: Database, model: str) -> int:
    """How many memories have no vector of `model` at the index's dimension."""
    return int(
        db.scalar(f"SELECT count(*) FROM ({_MISSING})", {"model": model, "dims": db.dimensions})
    )


SHOWN_IDS = 20  # the ids a report names of each kind of skipped memory; its counts are whole


@dataclass
class MemoryBackfill:
    """What `embed_memories` did: memories embedded; memories still to embed (`left`: those
    refused lately, as they are now, not counted); memories skipped because the
    provider refused each alone (`refused`), because their content is not UTF-8
    (`unreadable`), or because it is too long to embed whole (`too_long`: over `MAX_MEMORY`
    characters, or over what the model reads, `over_model`), with their first ids; and why
    the run stopped early (a provider error, or three refusals in a row), if it did."""

    embedded: int = 0
    left: int = 0
    error: str | None = None
    refused: int = 0
    refused_ids: list[int] = field(default_factory=list)
    unreadable: int = 0
    unreadable_ids: list[int] = field(default_factory=list)
    too_long: int = 0
    too_long_ids: list[int] = field(default_factory=list)

    def skip_refused(self, memory_id: int) -> None:
        self.refused += 1
        if len(self.refused_ids) < SHOWN_IDS:
            self.refused_ids.append(memory_id)

    def skip_unreadable(self, memory_id: int) -> None:
        self.unreadable += 1
        if len(self.unreadable_ids) < SHOWN_IDS:
            self.unreadable_ids.append(memory_id)

    def skip_too_long(self, memory_id: int) -> None:
        self.too_long += 1
        if len(self.too_long_ids) < SHOWN_IDS:
            self.too_long_ids.append(memory_id)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


Memory = tuple[int, bytes, str]  # id, the stored bytes (to see a change), the text embedded
# id, the stored bytes (or, for a text too long to read, its size in bytes), why it was refused
Refusal = tuple[int, bytes | int, str]


def embed_memories(db: Database, embedder: EmbeddingModel, *, limit: int = 512) -> MemoryBackfill:
    """Embed up to `limit` memories that have no vector of this model (`memories_missing`), a
    batch a request and a write transaction, each memory as `add_memory` writes it. A text
    changed or deleted while its batch was embedded is not written (the next run takes the
    new text). A host's empty row is left alone: it has nothing to find.

    One memory must not hold back the others (every run starts again at the lowest ids):
    * content that is not UTF-8 is skipped unread (`store.text`: U+FFFD would change what the
      host wrote), with no request, and does not count towards `limit`; so is content too
      long to embed whole (`add_memory` refuses it; a host's row has no limit);
    * a batch refused in a way that may be one input's fault (`per_input`) is sent again text
      by text, as the pipeline does: the good memories get their vectors, a refused one is
      skipped.
    A refused or unreadable memory is recorded (`memory_refusals`) and skipped by later runs
    until its text or the model changes, or for `REFUSAL_TTL_S`: three refused memories in a
    row stop one run, not every run at the same place, and the sweep does not send a run for
    them every time.
    Any other provider error stops the run, as do the third refusal in a row
    (`FailureCounter`: a provider that refuses every text is not asked once per memory) and a
    write the database refuses for a reason that may pass (`_written`), with what was written
    kept: the error is returned, not raised, for a sweep to report and try
    again later."""
    refuse_stale(db)  # another model's index: nothing embedded to be refused at the write
    report = MemoryBackfill()
    refusals: list[Refusal] = []
    todo = _readable(db, embedder, limit, report, refusals)
    counter = FailureCounter(MAX_CONSECUTIVE_FAILURES, log)
    start = 0
    while start < len(todo):  # (the batch size may be learnt on the way: `_embedded`)
        batch = todo[start : start + embedder.batch_size]
        start += len(batch)
        done, _ = _embedded(batch, embedder, counter, report, refusals)
        if not _written(report, _write, db, done, embedder.model_id, report):
            break
        if report.error:
            break
    _written(report, _record_refusals, db, refusals, embedder.model_id)
    report.left = memories_missing(db, embedder.model_id)
    if report.embedded or report.error or report.refused or report.unreadable or report.too_long:
        log.info("memories embedded", **report.as_dict())
    return report


# Refusals a run holds before it records them (each may hold its text, up to `_MAX_BYTES`).
REFUSALS_HELD = 256


def _readable(
    db: Database,
    embedder: EmbeddingModel,
    limit: int,
    report: MemoryBackfill,
    refusals: list[Refusal],
) -> list[Memory]:
    """Up to `limit` memories without a vector whose content is UTF-8 and short enough to
    embed whole, in id order; the others met on the way are counted in `report`, not
    returned, and read past: they cost no request, so that any number of them never hides
    the memories after them."""
    todo: list[Memory] = []
    first = -(2**63)  # the lowest rowid: a host may write any id
    params = {"model": embedder.model_id, "dims": db.dimensions}
    while len(todo) < limit:
        rows = db.all(
            f"{_MISSING} AND m.id >= :first ORDER BY m.id LIMIT :page",
            params | {"first": first, "page": limit - len(todo)},
        )
        for memory_id, raw, size in rows:
            if raw is None:  # not read: over MAX_MEMORY characters whatever it says
                report.skip_too_long(memory_id)
                why = (
                    f"memory {memory_id} has {size} bytes, more than a memory of at most "
                    f"{MAX_MEMORY} characters takes: shorten it, or add it as a note"
                )
                refusals.append((memory_id, size, why))
                continue
            try:
                text = strict(raw, f"memory {memory_id}")
            except NotText as e:
                report.skip_unreadable(memory_id)
                refusals.append((memory_id, raw, str(e)))
                continue
            if len(text) > MAX_MEMORY:
                why = (
                    f"memory {memory_id} has {len(text)} characters, more than a memory's "
                    f"{MAX_MEMORY}: shorten it, or add it as a note"
                )
            elif over := over_model(text, embedder):
                why = f"memory {memory_id} {over}"
            else:
                todo.append((memory_id, raw, text))
                continue
            report.skip_too_long(memory_id)
            refusals.append((memory_id, raw, why))
        if len(refusals) >= REFUSALS_HELD:
            # recorded now: a host's million unreadable rows were held, 8 KB each, until the end
            if not _written(report, _record_refusals, db, refusals, embedder.model_id):
                return []  # the database refuses writes: nothing to embed (`report.error`)
            refusals.clear()
        if not rows or rows[-1][0] >= 2**63 - 1:
            break
        first = rows[-1][0] + 1
    return todo


def _embedded(
    batch: list[Memory],
    embedder: EmbeddingModel,
    counter: FailureCounter,
    report: MemoryBackfill,
    refusals: list[Refusal],
) -> tuple[list[tuple[Memory, Any]], int]:
    """A batch's memories embedded, and the most texts a request took when every one went
    whole (else 0). Refused for what may be one input's fault: text by text (`_one_by_one`);
    refused as too large (413) or not answered in time, in halves, as the pipeline's
    `embed_batch` does (a server whose limit is under the batch size cost a request a
    memory), the batch size learnt from a full batch. Any other error stops the run
    (`report.error`)."""
    try:
        vectors = embedder.embed_checked([text for _, _, text in batch])
    except KidxError as e:
        halve = len(batch) > 1 and too_much(e)
        if not halve and not _per_input(e):
            report.error = _why(e)
            return [], 0
        if not halve:
            return _one_by_one(batch, embedder, counter, report, e, refusals), 0
        half = (len(batch) + 1) // 2
        done: list[tuple[Memory, Any]] = []
        took: list[int] = []
        for part in (batch[:half], batch[half:]):
            part_done, most = _embedded(part, embedder, counter, report, refusals)
            done += part_done
            took.append(most)
            if report.error:
                return done, 0
        most = max(took) if all(took) else 0
        learn_batch_size(embedder, len(batch), most, log)
        return done, most
    counter.ok()
    return list(zip(batch, vectors, strict=True)), len(batch)


def _one_by_one(
    batch: list[Memory],
    embedder: EmbeddingModel,
    counter: FailureCounter,
    report: MemoryBackfill,
    error: KidxError,
    refusals: list[Refusal],
) -> list[tuple[Memory, Any]]:
    """A batch refused for what may be one input's fault, text by text (a batch of one is not
    asked again: its refusal was its own): the memories embedded. A refused one is skipped;
    another error, or the third refusal in a row, stops the run (`report.error`)."""
    done: list[tuple[Memory, Any]] = []
    for memory in batch:
        if len(batch) > 1:
            try:
                vector = embedder.embed_checked([memory[2]])[0]
            except KidxError as e:
                error = e
            else:
                counter.ok()
                done.append((memory, vector))
                continue
        if not _per_input(error):
            report.error = _why(error)
            break
        report.skip_refused(memory[0])
        refusals.append((memory[0], memory[1], _why(error)))
        try:
            counter.fail(0, str(error), error, item_id=memory[0])
        except IndexAborted as aborted:
            report.error = _why(aborted)
            break
    return done


def _write(
    db: Database, done: list[tuple[Memory, Any]], model: str, report: MemoryBackfill
) -> None:
    """The vectors of a batch, in one transaction; a memory changed or deleted meanwhile is
    left for the next run."""
    if not done:
        return
    with db.atomic():
        for (memory_id, raw, text), vector in done:
            now = db.scalar("SELECT CAST(content AS BLOB) FROM memories WHERE id = ?", (memory_id,))
            if now != raw:
                continue  # changed or deleted meanwhile
            _write_vector(db, memory_id, text, vector, model)
            db.execute("DELETE FROM memory_refusals WHERE memory_id = ?", (memory_id,))
            report.embedded += 1


_UPSERT_REFUSAL = (
    "ON CONFLICT(memory_id) DO UPDATE SET model = excluded.model, content = excluded.content, "
    "reason = excluded.reason, refused_at = excluded.refused_at"
)


def _record_refusals(db: Database, refusals: list[Refusal], model: str) -> None:
    """What could not be embedded, with the text it was (a text changed since is not). A
    text too long to read is copied by SQLite, as long as its size is the one measured."""
    if not refusals:
        return
    read = [(model, r, why[:500], i, r) for i, r, why in refusals if isinstance(r, bytes)]
    unread = [(model, why[:500], i, r) for i, r, why in refusals if isinstance(r, int)]
    with db.atomic():
        db.executemany(
            "INSERT INTO memory_refusals(memory_id, model, content, reason) "
            "SELECT id, ?, ?, ? FROM memories WHERE id = ? AND CAST(content AS BLOB) IS ? "
            + _UPSERT_REFUSAL,
            read,
        )
        db.executemany(
            "INSERT INTO memory_refusals(memory_id, model, content, reason) "
            "SELECT id, ?, CAST(content AS BLOB), ? FROM memories "
            "WHERE id = ? AND length(CAST(content AS BLOB)) = ? " + _UPSERT_REFUSAL,
            unread,
        )


def _per_input(error: Exception) -> bool:
    """Whether the provider's refusal may concern one text only: worth trying each alone."""
    return isinstance(error, PermanentProviderError) and error.per_input


# What a write may meet and the next run not: the write lock held past the busy timeout (a
# host's long transaction), a full disk, an I/O error, a file made read-only.
_PASSING = (apsw.BusyError, apsw.LockedError, apsw.FullError, apsw.IOError, apsw.ReadOnlyError)


def _written(report: MemoryBackfill, write: Any, db: Database, *args: Any) -> bool:
    """Run a write; when the database refuses it for a reason that may pass, stop the run
    with that reason as its error (what was written before stays; the next run embeds the
    rest) rather than failing the task with SQLite's exception."""
    embedded = report.embedded
    try:
        write(db, *args)
    except _PASSING as e:
        report.embedded = embedded  # counted in the transaction that was rolled back
        report.error = report.error or (
            f"the database could not be written ({_why(e)}); {report.embedded} memories "
            "written are kept, the next run embeds the rest"
        )
        return False
    except apsw.Error as e:
        # A host's trigger or index on kidx's tables refusing it: named, not SQLite's words
        # alone ("no vectors") raised as a bug; it stays until the host drops it.
        if (theirs := refused_by_host(db, e)) is None:
            raise
        report.embedded = embedded
        report.error = report.error or str(theirs)
        return False
    return True


def _why(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"
