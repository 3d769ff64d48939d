"""Knowledge items and their index state: the rows a host application and the CLI touch."""

from __future__ import annotations

import enum
import numbers
import operator
from dataclasses import dataclass
from typing import Any, TypeGuard

import apsw

from worker.chunking.base import FELL_BACK, ChunkMethod, text_hash
from worker.errors import InvalidInput, ItemNotFound, StoreError
from worker.store.db import Database
from worker.store.schema import ITEM_KINDS, host_objects, named_refusals
from worker.store.text import NotText, given_text, readable, shown, shown_row, strict
from worker.store.vec import index_config, sound

NOW = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"


def valid_item_id(item_id: object) -> TypeGuard[int]:
    """An item id SQLite can hold: a 64-bit integer, not a bool (True would be item 1), nor
    "1" or 1.0 (SQLite's affinity makes them 1), nor 2**70 (an overflow). Zero and negative
    ids are rows a host may write (SQLite takes any 64-bit rowid): ids as any."""
    return type(item_id) is int and -(2**63) <= item_id < 2**63


def check_item_id(item_id: object) -> int:
    """`item_id` as an int (a numpy integer too: apsw bound it as bytes, and item 1 was "not
    found"), or InvalidInput saying what it is when it is no `valid_item_id`."""
    if isinstance(item_id, numbers.Integral) and not isinstance(item_id, bool):
        item_id = operator.index(item_id)
    if not valid_item_id(item_id):
        raise InvalidInput(f"the item id must be a 64-bit integer, not {item_id!r:.60}")
    return item_id


class Status(enum.StrEnum):
    """The lifecycle of an item's index."""

    PENDING = "pending"  # never indexed, or its vectors must be remade
    INDEXING = "indexing"  # a run is under way
    INDEXED = "indexed"  # every chunk has its vector
    PARTIAL = "partial"  # indexed, but some chunks have no vector (see last_error)
    FAILED = "failed"  # the last run failed; the index before it is intact
    SKIPPED = "skipped"  # nothing to do (no provider configured)
    CANCELLED = "cancelled"  # the last run was revoked; the index before it is intact


@dataclass(frozen=True)
class Item:
    id: int
    kind: str
    title: str
    source: str | None
    content: str
    content_hash: str | None
    unreadable: str | None = None  # why its content or source cannot be indexed (not UTF-8)
    # kind, title and source as stored, bytes for bytes: a write compares them with the row
    # then (`origin_unchanged`), so that a rename during the run is not recorded as indexed.
    origin: tuple[Any, Any, Any] = (None, None, None)


def origin_unchanged(item: str, kind: str, title: str, source: str) -> str:
    """SQL: whether the item (parameter `item`) still has the kind, title and source of its
    `Item.origin` (the parameters `kind`, `title`, `source`)."""
    return (
        f"EXISTS (SELECT 1 FROM knowledge_items WHERE id = {item} AND CAST(kind AS BLOB) IS "
        f"{kind} AND CAST(title AS BLOB) IS {title} AND CAST(source AS BLOB) IS {source})"
    )


@dataclass(frozen=True)
class Claim:
    """An item's index state as a run read it, or as its own `indexing` mark left it: what
    the run may write over (its task, status and `claim` token; all None: no state row). A
    run's lock may expire while its process is stopped (a VM pause, swap); another run then
    takes the item and indexes a newer text, and the first, resumed, must not write over it.
    Neither the task id (a second delivery of a task has the same) nor `updated_at` (two marks
    in one millisecond have the same) tells every two writes apart: the token does, as every
    write of the row changes it (migration 11: kidx's writes set a new one, a trigger any
    other write's)."""

    task_id: str | None
    status: str | None
    token: int | bytes | None

    def taken(self, now: Claim) -> bool:
        """Whether the state row, as it is `now`, has been written since this claim: another
        run's mark or a duplicate delivery's, the sweep ending an overrun `failed`, a host's
        write. A host's rename (the trigger makes `pending` an item this run marked, and turns
        the token over, `~claim`, rather than drawing one) is not one: the write records
        `pending`."""
        if now == self:
            return False
        renamed = (
            self.status == Status.INDEXING
            and now.status == Status.PENDING
            and now.task_id == self.task_id
            and isinstance(self.token, int)
            and now.token in (self.token, ~self.token)
        )
        return not renamed


NO_ROW = Claim(None, None, None)

# The token as read and compared: an integer (kidx's, the trigger's) as it is, anything else a
# host may have written there as its bytes (a TEXT that is not UTF-8 must not raise).
TOKEN = "CASE WHEN typeof(claim) IN ('integer', 'null') THEN claim ELSE CAST(claim AS BLOB) END"

_CLAIM = (
    "SELECT CAST(s.last_task_id AS BLOB), CAST(s.status AS BLOB), "
    f"{TOKEN.replace('claim', 's.claim')} FROM knowledge_items i "
    "LEFT JOIN item_index_state s ON s.item_id = i.id WHERE i.id = ?"
)


def read_claim(db: Database, item_id: int) -> Claim | None:
    """The item's state as a run reads it (before its text: a run that starts on the item
    after this, whatever text it reads, read it later); None: the item is gone."""
    row = db.one(_CLAIM, (item_id,))
    if row is None:
        return None
    task_id, status, token = row
    return Claim(_text(task_id), _text(status), token)


def _text(value: bytes | None) -> str | None:
    return None if value is None else shown(value)


def claim_items(
    db: Database, claims: list[tuple[int, Claim]], task_id: str | None
) -> dict[int, Claim]:
    """Mark items `indexing` for the run `task_id`, in the caller's transaction, each only
    while its state row is still as the run read it (`claims`: its token unchanged), with a
    new token: the run's own claims, by item. An item left out has been taken since it was
    read (by another run, or anything that wrote its state), or is gone: what the run read of
    it may be older than what that run read."""
    held: dict[int, Claim] = {}
    with db.atomic():  # all or none: the marks of a call that fails must not stay `indexing`
        for item_id, claim in claims:
            if claim == NO_ROW:
                row = db.one(
                    "INSERT INTO item_index_state(item_id, status, last_task_id) "
                    "SELECT id, 'indexing', ?1 FROM knowledge_items WHERE id = ?2 "
                    "ON CONFLICT(item_id) DO NOTHING RETURNING item_id",
                    (task_id, item_id),
                )
                if row is not None:  # its token is the insert trigger's
                    row = db.one("SELECT claim FROM item_index_state WHERE item_id = ?", (item_id,))
            else:
                row = db.one(
                    f"UPDATE item_index_state SET status = 'indexing', last_task_id = ?1, "
                    f"updated_at = {NOW}, claim = random() WHERE item_id = ?2 AND {TOKEN} IS ?3 "
                    "RETURNING claim",
                    (task_id, item_id, claim.token),
                )
                if row is not None:
                    _not_rewritten(db, item_id, row[0])
            if row is not None:
                held[item_id] = Claim(task_id, str(Status.INDEXING), row[0])
    return held


def _not_rewritten(db: Database, item_id: int, token: Any) -> None:
    """The mark just written is still the row's: nothing but a trigger can write it within
    this transaction, and kidx's leave a row whose token changed alone. A host's trigger that
    writes the row again (`SET updated_at = ...` on every UPDATE) gave it a new token each
    time, every run took that for another's write and wrote nothing (`coalesced`), and its
    items stayed `indexing` for good, with no error anywhere: a StoreError naming it."""
    if db.scalar("SELECT claim FROM item_index_state WHERE item_id = ?", (item_id,)) == token:
        return
    theirs = [
        o
        for o in host_objects(db)
        if o.startswith("trigger ") and o.endswith(" on item_index_state")
    ]
    by = ", ".join(theirs) or "a trigger not kidx's"
    raise StoreError(
        f"item_index_state's row is written again as kidx writes it (by {by}): kidx takes "
        "that for another run's write and never writes the item; drop that trigger"
    )


# An item's state row, created when missing: never for an item that is gone (a task still
# running for a deleted item must not bring a row of it back).
CREATE_STATE = (
    "INSERT INTO item_index_state(item_id) SELECT id FROM knowledge_items WHERE id = ?1 "
    "ON CONFLICT(item_id) DO NOTHING"
)

STATE_COLUMNS = (
    "item_id",
    "status",
    "chunk_method",
    "chunk_count",
    "model",
    "dimensions",
    "last_error",
    "duration_ms",
)


def add_item(
    db: Database, *, kind: str, title: str, content: str, source: str | None = None
) -> int:
    """Insert an item and its `pending` state; returns the new id."""
    if kind not in ITEM_KINDS:
        raise InvalidInput(f"unknown kind {kind!r}: one of {', '.join(ITEM_KINDS)}")
    title, content = given_text(title, "title"), given_text(content, "content")
    source = None if source is None else given_text(source, "source")
    if kind == "note" and not content.strip():
        raise InvalidInput("the note is empty")
    with named_refusals(db), db.atomic():  # a host's trigger that refuses it: named
        try:
            item_id = db.scalar(
                "INSERT INTO knowledge_items(kind, title, source, content, content_hash) "
                "VALUES (?, ?, ?, ?, ?) RETURNING id",
                (kind, title, source, content, text_hash(content)),
            )
        except apsw.FullError:
            _ids_used_up(db)
            raise
        # A state row a host left under this id (ids are never reused, but a host may
        # write any row) is not this item's.
        db.execute("DELETE FROM item_index_state WHERE item_id = ?", (item_id,))
        db.execute("INSERT INTO item_index_state(item_id) VALUES (?)", (item_id,))
    return int(item_id)


def _ids_used_up(db: Database) -> None:
    """StoreError when SQLITE_FULL on adding an item means that its ids are used up, not the
    disk: a host's row at the largest id, 2**63 - 1, leaves AUTOINCREMENT no id to give (ever
    after, even once the row is gone, as `sqlite_sequence` keeps it), and "the disk holding
    the database is full" sent the user to look at a disk with room to spare."""
    last = db.scalar("SELECT seq FROM sqlite_sequence WHERE name = 'knowledge_items'")
    # (a REAL of 9.2e18 too: a host's 2**63, which no integer holds, in a table it came from)
    if isinstance(last, int | float) and not isinstance(last, bool) and last >= 2**63 - 1:
        raise StoreError(
            "no item id left to give: knowledge_items has had an item with the largest id "
            "SQLite holds (9223372036854775807, written by a host); give that row a smaller id, "
            "then set sqlite_sequence's seq for knowledge_items to the largest id left"
        )


def get_item(db: Database, item_id: int, *, content: bool = True) -> Item:
    """The item; with `content=False` its content is "" (a 20 MB note is 80 MB in Python).
    Columns a host filled with bytes that are not UTF-8 never raise here (worker.store.text):
    a title is shown with U+FFFD, content or a source that is not text sets `unreadable`."""
    item_id = check_item_id(item_id)  # a host's call: "1", True, 2**70 are no id
    column = "content" if content else "''"
    sql = (
        "SELECT id, {}, {}, {}, " + column + ", {}, CAST(kind AS BLOB), CAST(title AS BLOB), "
        "CAST(source AS BLOB) FROM knowledge_items WHERE id = ?"
    )
    names = ("kind", "title", "source", "content_hash")
    try:
        row = db.one(sql.format(*names), (item_id,))
    except UnicodeDecodeError:  # a TEXT value that is not UTF-8: read every column's bytes
        raw = sql.replace(column, f"CAST({column} AS BLOB)") if content else sql
        row = db.one(raw.format(*(f"CAST({n} AS BLOB)" for n in names)), (item_id,))
    if row is None:
        raise ItemNotFound(item_id)
    return _item(row)


def _item(row: tuple[Any, ...]) -> Item:
    item_id, kind, title, source, text, content_hash, *origin = row
    problems = []
    try:
        text = strict(text, "the content")
    except NotText as e:
        text, problems = "", [str(e)]
    if source is not None:
        try:
            source = strict(source, "the source")
        except NotText as e:
            source, problems = shown(source), [*problems, str(e)]
    return Item(
        int(item_id),
        shown(kind),
        shown(title),
        source,
        text,
        shown(content_hash) or None,
        "; ".join(problems) or None,
        (origin[0], origin[1], origin[2]),
    )


def keep_note(db: Database, *, title: str, text: str, source: str) -> str:
    """A note kept in step with a source of a script's own (a corpus file, a sample): `added`,
    `updated` or `unchanged`. Only a note of that source is the one (an item of another kind
    there, `kidx add file` of the same file, was overwritten with the note's text), and its
    stored text is compared as bytes (a host's TEXT that is not UTF-8 failed the script)."""
    row = db.one(
        "SELECT id, CAST(content AS BLOB) FROM knowledge_items WHERE kind = 'note' "
        "AND source = ? ORDER BY id LIMIT 1",
        (source,),
    )
    if row is None:
        add_item(db, kind="note", title=title, content=text, source=source)
        return "added"
    if row[1] is not None and bytes(row[1]) == text.encode("utf-8", "surrogatepass"):
        return "unchanged"
    update_content(db, row[0], text)
    return "updated"


def update_content(db: Database, item_id: int, content: str, *, title: str | None = None) -> None:
    """Replace an item's text (the next index run sees it; so does a direct UPDATE)."""
    content = given_text(content, "content")
    title = None if title is None else given_text(title, "title")
    item = get_item(db, item_id)
    if item.kind == "note" and not content.strip():
        raise InvalidInput("the note is empty")
    with db.atomic():
        db.execute(
            "UPDATE knowledge_items SET content = ?, content_hash = ?, "
            f"title = coalesce(?, title), updated_at = {NOW} WHERE id = ?",
            (content, text_hash(content), title, item_id),
        )


def name_failure(db: Database, item_ids: list[int], task_id: str, reason: str) -> None:
    """`reason` as the last error of the items this task's run left failed: the caller knows
    better than the engine, which saw an exception it does not know (Celery's soft time limit
    reads "SoftTimeLimitExceeded()"). Not over a later run's state."""
    with db.atomic():
        db.executemany(
            "UPDATE item_index_state SET last_error = ? WHERE item_id = ? AND status = 'failed' "
            "AND last_task_id = ?",
            [(reason, item_id, task_id) for item_id in item_ids],
        )


def set_state(db: Database, item_id: int, **fields: Any) -> None:
    """Update columns of an item's index state (the row is created if a host app did not;
    nothing is written for an item that is gone)."""
    if "status" in fields:
        fields["status"] = str(fields["status"])
    names = list(fields)
    with db.atomic():
        db.execute(CREATE_STATE, (item_id,))
        if names:
            sets = ", ".join(f"{n} = :{n}" for n in names)
            db.execute(
                f"UPDATE item_index_state SET {sets}, updated_at = {NOW} WHERE item_id = :item_id",
                {**fields, "item_id": item_id},
            )


def mark_not_run(
    db: Database,
    item_id: int,
    task_id: str,
    job_task_id: str,
    error: str,
    status: Status = Status.FAILED,
    *,
    attempt: bool = False,
    since: str | None = None,
) -> bool:
    """An item its run did not run (its batch was aborted) becomes `failed`, so that `kidx
    retry --failed` finds it (or `cancelled`: revoked before its run got to it); unless a later
    run has indexed it since this job was queued, or another run is indexing it now: that
    run's outcome stands. `attempt`: the run counts as one of its attempts (a cause a retry
    may meet again until someone mends it). `since` (a time as NOW writes it: the run's
    start): an item this run has marked failed since is left as it is (the engine did, with
    its cause and its attempt; a retry keeps the task's id, so the id alone does not tell
    this run from the one before). Whether it was marked."""
    with db.atomic():
        db.execute(CREATE_STATE, (item_id,))
        db.execute(
            f"UPDATE item_index_state SET status = :status, last_task_id = :task, "
            f"last_error = :error, updated_at = {NOW}, "
            "attempts = coalesce(attempts, 0) + :attempt WHERE item_id = :item "
            "AND NOT (:since IS NOT NULL AND status = 'failed' "
            "AND coalesce(last_task_id, '') = :task AND updated_at >= :since) AND NOT ("
            "(status = 'indexing' AND coalesce(last_task_id, '') <> :task) OR "
            "(status = 'indexed' AND indexed_at >= coalesce((SELECT "
            "min(coalesce(queued_at, started_at)) FROM index_jobs WHERE task_id = :job), "
            "'9999')))",
            {
                "status": str(status),
                "task": task_id,
                "error": error,
                "item": item_id,
                "job": job_task_id,
                "attempt": int(attempt),
                "since": since,
            },
        )
        return db.conn.changes() > 0


def get_state(db: Database, item_id: int) -> dict[str, Any]:
    """The item's state row (STATE_COLUMNS); whatever a host wrote in it is shown as text,
    never raised (`readable`)."""
    item_id = get_item(db, item_id, content=False).id
    rows = db.dicts(
        f"SELECT {', '.join(readable('s.' + c) for c in STATE_COLUMNS)} "
        "FROM item_index_state s WHERE s.item_id = ?",
        (item_id,),
    )
    if rows:
        return shown_row(rows[0])
    return {c: None for c in STATE_COLUMNS} | {"item_id": item_id, "status": "pending"}


PENDING = "coalesce(s.status, 'pending')"  # an item with no state row has not been indexed


def list_states(db: Database) -> list[dict[str, Any]]:
    """Every item's state, as `get_state` shows one."""
    cols = ", ".join(readable(f"s.{c}") for c in STATE_COLUMNS[2:])
    rows = db.dicts(
        f"SELECT i.id AS item_id, {readable(PENDING, 'status')}, "
        f"{cols} FROM knowledge_items i "
        "LEFT JOIN item_index_state s ON s.item_id = i.id ORDER BY i.id"
    )
    return [shown_row(r) for r in rows]


# The chunk's embedding row (`e`, LEFT JOINed) holds a vector of the index's dimension and
# model, as vector search asks (`:dims`, `:model`; any, on a connection that knows none): a
# switch to another model of the same size left the old vectors "embedded" in the chunk list,
# which search did not use.
_USABLE = (
    "e.chunk_id IS NOT NULL AND (:dims IS NULL OR e.dimensions = :dims) "
    f"AND (:model IS NULL OR e.model = :model) AND {sound('e')}"
)


def _index(db: Database) -> dict[str, object]:
    """The `:dims` and `:model` of `_USABLE`: the index's, as recorded by the writer that
    claimed it (a shell with another model in its settings is told what the index holds),
    else this connection's."""
    recorded = index_config(db)
    if recorded is not None:
        return {"model": recorded[0], "dims": recorded[1]}
    res = db.resolution
    return {"dims": res.dimensions if res else None, "model": res.model if res else None}


def list_chunks(db: Database, item_id: int) -> list[dict[str, Any]]:
    """What a chunk list shows (a UI's NoteChunkDto): index, method, has_embedding, summary,
    offsets, length. A code item's chunks (`code_chunks`) in the same shape: structural, with
    their place (`path:first-last` line) as the summary and no character offsets, since they
    are stored by line. `has_embedding`: a vector search can find it, i.e. its vector is one
    of the index's dimension (not one left from before a model switch, nor a host's row kidx
    cannot read)."""
    item = get_item(db, item_id, content=False)  # (the id checked)
    item_id = item.id
    if item.kind == "code":
        return _code_chunks(db, item_id)
    rows = db.dicts(
        f"SELECT {readable('c.chunk_index')}, CAST(c.method AS BLOB) AS chunk_method, "
        f"({_USABLE}) AS has_embedding, CAST(c.summary AS BLOB) AS summary, "
        f"{readable('c.start_offset')}, {readable('c.end_offset')}, "
        # Not length(content): SQLite's length() stops at a NUL character.
        "c.end_offset - c.start_offset AS length FROM note_chunks c "
        "LEFT JOIN note_chunk_embeddings e ON e.chunk_id = c.id "
        "WHERE c.item_id = :item ORDER BY c.chunk_index",
        {"item": item_id, **_index(db)},
    )
    rows = [shown_row(row) for row in rows]  # a host's bytes are shown, never raised
    for row in rows:
        row["has_embedding"] = bool(row["has_embedding"])
        row["chunk_method"] = shown(row["chunk_method"])
    return rows


def _code_chunks(db: Database, item_id: int) -> list[dict[str, Any]]:
    rows = db.all(
        f"SELECT {readable('c.chunk_index')}, ({_USABLE}), CAST(c.path AS BLOB), "
        f"{readable('c.start_line')}, {readable('c.end_line')}, CAST(c.content AS BLOB) "
        "FROM code_chunks c "
        "LEFT JOIN code_chunk_embeddings e ON e.chunk_id = c.id "
        "WHERE c.item_id = :item ORDER BY c.chunk_index",
        {"item": item_id, **_index(db)},
    )
    return [
        {
            "chunk_index": shown(index) if isinstance(index, bytes) else index,
            "chunk_method": ChunkMethod.STRUCTURE.value,  # code is cut at its definitions
            "has_embedding": bool(embedded),
            "summary": f"{shown(path)}:{shown(first)}-{shown(last)}",
            "start_offset": None,
            "end_offset": None,
            "length": len(shown(content)),  # in Python: SQLite's length() stops at a NUL
        }
        for index, embedded, path, first, last, content in rows
    ]


def all_item_ids(db: Database) -> list[int]:
    return [r[0] for r in db.all("SELECT id FROM knowledge_items ORDER BY id")]


RUNNING = ("id", "kind", "total", "ok", "failed", "skipped", "created_at")  # a batch's


def summary(db: Database) -> dict[str, Any]:
    """Counts per status, chunk method and model; the running batches; the memories per model
    of their vector (for `kidx status`)."""

    def counts(sql: str) -> dict[str, int]:
        """`sql`'s (key, count) rows; a key is read as its bytes (`readable`: a host's TEXT
        that is not UTF-8 raised) and shown as text, the counts of keys shown alike summed."""
        found: dict[str, int] = {}
        for k, n in db.all(f"SELECT {readable('k')}, n FROM ({sql}) ORDER BY 1"):
            key = shown(k) if isinstance(k, bytes) else str(k)
            found[key] = found.get(key, 0) + int(n)
        return found

    return {
        "items": int(db.scalar("SELECT count(*) FROM knowledge_items") or 0),
        "by_status": counts(
            "SELECT coalesce(s.status, 'pending') AS k, count(*) AS n FROM knowledge_items i "
            "LEFT JOIN item_index_state s ON s.item_id = i.id GROUP BY 1 ORDER BY 1"
        ),
        # items LLM chunking fell back to structure for (the reconcile sweep asks the chunk
        # model again) apart from those structural by choice
        "by_chunk_method": counts(
            "SELECT CASE WHEN chunk_method = 'structure' AND status = 'indexed' AND "
            f"instr(last_error, '{FELL_BACK}') > 0 THEN 'structure (fell back)' "
            "ELSE chunk_method END AS k, count(*) AS n FROM item_index_state "
            "WHERE chunk_method IS NOT NULL GROUP BY 1 ORDER BY 1"
        ),
        "by_model": counts(
            "SELECT model || ' (' || dimensions || ')' AS k, count(*) AS n FROM item_index_state "
            "WHERE model IS NOT NULL GROUP BY 1 ORDER BY 1"
        ),
        "running_batches": [
            shown_row(b)
            for b in db.dicts(
                f"SELECT {', '.join(map(readable, RUNNING))} FROM index_batches "
                "WHERE state = 'running' ORDER BY id"
            )
        ],
        "memories": int(db.scalar("SELECT count(*) FROM memories") or 0),
        # `no vector`: a host's new or changed memories, until kidx.embed_memories runs
        "memories_by_model": counts(
            "SELECT coalesce(e.model || ' (' || e.dimensions || ')', 'no vector') AS k, "
            "count(*) AS n "
            "FROM memories m LEFT JOIN memory_embeddings e ON e.memory_id = m.id "
            "GROUP BY 1 ORDER BY 1"
        ),
    }
