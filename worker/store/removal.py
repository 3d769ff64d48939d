"""Deleting items, and the rows that deleted items left behind.

`delete_items` removes an item with everything derived from it in one transaction: its state,
chunks, vectors and their vec rows. A host may also delete the row itself with plain SQL and
foreign keys off: the schema's trigger (migration 5) removes the relational rows then, and the
vec rows it cannot reach become orphans, which search skips and `repair_vectors` deletes.

What a deleted item can still leave (a database that predates the trigger, a host that deleted
chunks or state rows by hand) is a *leftover*: a row that no live item reaches. So is what an
item whose kind a host changed with plain SQL (a note into code, or back) keeps in the other
kind's tables: its next write removes those (`remove_other_kind`), and so does the sweep.
`leftovers()` counts them by kind, for `kidx doctor`; `remove_leftovers()` deletes them, for the
reconcile sweep. Neither needs a provider, and neither touches a live item's rows.
"""

from __future__ import annotations

from collections.abc import Iterable

from worker.errors import ItemNotFound
from worker.store.db import Database
from worker.store.fts import CODE, FTS_TABLES, NOTES, fts_delete
from worker.store.items import check_item_id
from worker.store.vec import vec_delete, vec_ready

# Items whose index lives in the prose tables, and in the code tables.
_PROSE_ITEMS = "SELECT id FROM knowledge_items WHERE kind IS NOT 'code'"
_CODE_ITEMS = "SELECT id FROM knowledge_items WHERE kind = 'code'"
_LIVE_NOTE_CHUNKS = f"SELECT id FROM note_chunks WHERE item_id IN ({_PROSE_ITEMS})"
_LIVE_CODE_CHUNKS = f"SELECT id FROM code_chunks WHERE item_id IN ({_CODE_ITEMS})"

# kind of leftover -> (table, the condition that makes one of its rows a leftover); vectors
# before their chunks: with foreign keys on, a chunk's deletion would take its vector along,
# uncounted.
LEFTOVERS: dict[str, tuple[str, str]] = {
    "chunk vectors": ("note_chunk_embeddings", f"chunk_id NOT IN ({_LIVE_NOTE_CHUNKS})"),
    "note chunks": ("note_chunks", f"item_id NOT IN ({_PROSE_ITEMS})"),
    "whole-item vectors": ("note_embeddings", f"item_id NOT IN ({_PROSE_ITEMS})"),
    "code vectors": ("code_chunk_embeddings", f"chunk_id NOT IN ({_LIVE_CODE_CHUNKS})"),
    "code chunks": ("code_chunks", f"item_id NOT IN ({_CODE_ITEMS})"),
    "memory vectors": ("memory_embeddings", "memory_id NOT IN (SELECT id FROM memories)"),
    "memory refusals": ("memory_refusals", "memory_id NOT IN (SELECT id FROM memories)"),
    "index states": ("item_index_state", "item_id NOT IN (SELECT id FROM knowledge_items)"),
}


def leftovers(db: Database) -> dict[str, int]:
    """Rows that no live item (or memory) reaches, counted by kind; only kinds with some."""
    found = {}
    for kind, (table, where) in LEFTOVERS.items():
        count = int(db.scalar(f"SELECT count(*) FROM {table} WHERE {where}") or 0)
        if count:
            found[kind] = count
    return found


def remove_leftovers(db: Database) -> dict[str, int]:
    """Delete every leftover, in one transaction; what was removed, by kind. Their vec rows
    become orphans, for `repair_vectors` (which runs after this in a sweep)."""
    removed = {}
    with db.atomic():
        for kind, (table, where) in LEFTOVERS.items():
            db.execute(f"DELETE FROM {table} WHERE {where}")
            if changed := db.conn.changes():
                removed[kind] = changed
    return removed


def delete_items(db: Database, item_ids: Iterable[int]) -> list[int]:
    """Delete items with their state, chunks, vectors and vec rows, in one transaction; all
    or nothing (ItemNotFound names the first unknown id). A run still under way for one of
    them finds it gone when it writes, and writes nothing. An id that is not a 64-bit integer
    is InvalidInput, before anything is deleted: True, "1" or 1.0 would be item 1 to SQLite."""
    ids = list(dict.fromkeys(map(check_item_id, item_ids)))
    with db.atomic():
        for item_id in ids:
            if db.one("SELECT 1 FROM knowledge_items WHERE id = ?", (item_id,)) is None:
                raise ItemNotFound(item_id)
        for start in range(0, len(ids), 500):
            _delete(db, ids[start : start + 500])
    return ids


def _delete(db: Database, ids: list[int]) -> None:
    marks = ",".join("?" * len(ids))
    if db.vec_loaded and vec_ready(db, db.dimensions):
        for table, source in (
            ("vec_chunk_embeddings", "note_chunks"),
            ("vec_work_code_chunks", "code_chunks"),
        ):
            chunks = db.all(f"SELECT id FROM {source} WHERE item_id IN ({marks})", ids)
            vec_delete(db, table, [r[0] for r in chunks])
        vec_delete(db, "vec_note_embeddings", ids)
    for fts in FTS_TABLES:
        if db.table_exists(fts.name):
            chunks = db.all(f"SELECT id FROM {fts.chunks} WHERE item_id IN ({marks})", ids)
            fts_delete(db, fts, [r[0] for r in chunks])
    # The relational rows go with the item: the trigger of migration 5 (and, on this
    # connection, the foreign keys' cascade).
    db.execute(f"DELETE FROM knowledge_items WHERE id IN ({marks})", ids)


def remove_other_kind(db: Database, item_ids: list[int], *, code: bool) -> int:
    """What these items (all code, or all prose) have in the other kind's tables, in the
    caller's transaction: chunks, their vectors, vec and keyword rows, and a whole-item vector.
    A host that changes an item's kind with plain SQL leaves them; search would still return
    a code item's old note chunks. Returns the chunks removed."""
    if not item_ids:
        return 0
    marks = ",".join("?" * len(item_ids))
    chunks, vectors, vec, fts = (
        ("note_chunks", "note_chunk_embeddings", "vec_chunk_embeddings", NOTES)
        if code
        else ("code_chunks", "code_chunk_embeddings", "vec_work_code_chunks", CODE)
    )
    ids = [r[0] for r in db.all(f"SELECT id FROM {chunks} WHERE item_id IN ({marks})", item_ids)]
    wholes = (
        [
            r[0]
            for r in db.all(
                f"SELECT item_id FROM note_embeddings WHERE item_id IN ({marks})", item_ids
            )
        ]
        if code
        else []
    )
    if not ids and not wholes:
        return 0
    if vec_ready(db, db.dimensions):  # else they are orphans, for the repair
        vec_delete(db, vec, ids)
        vec_delete(db, "vec_note_embeddings", wholes)
    if db.table_exists(fts.name):
        fts_delete(db, fts, ids)
    for start in range(0, len(ids), 500):
        part = ids[start : start + 500]
        in_part = ",".join("?" * len(part))
        db.execute(f"DELETE FROM {vectors} WHERE chunk_id IN ({in_part})", part)
        db.execute(f"DELETE FROM {chunks} WHERE id IN ({in_part})", part)
    if wholes:
        db.execute(f"DELETE FROM note_embeddings WHERE item_id IN ({marks})", item_ids)
    return len(ids)
