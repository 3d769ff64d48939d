"""Numbered migrations of the relational tables. Each runs once, in its own transaction, and
records its number in `index_meta`; running them again does nothing. The vec0 tables depend on
the resolved dimension and on the extension, so `worker.store.vec` creates them."""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import apsw

from worker.errors import StoreError
from worker.store.db import Database, set_meta
from worker.store.fts import FTS_TABLES, create_sql, sync_fts

ITEM_KINDS = ("note", "file", "url", "code")
STATUSES = ("pending", "indexing", "indexed", "partial", "failed", "skipped", "cancelled")

_NOW = "(strftime('%Y-%m-%dT%H:%M:%fZ', 'now'))"

MIGRATIONS: list[tuple[int, str]] = [
    (
        1,
        f"""
CREATE TABLE IF NOT EXISTS index_meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);

CREATE TABLE IF NOT EXISTS knowledge_items (
    id           INTEGER PRIMARY KEY,
    kind         TEXT NOT NULL CHECK (kind IN {ITEM_KINDS}),
    title        TEXT NOT NULL DEFAULT '',
    source       TEXT,
    content      TEXT NOT NULL DEFAULT '',
    content_hash TEXT,
    created_at   TEXT NOT NULL DEFAULT {_NOW},
    updated_at   TEXT NOT NULL DEFAULT {_NOW}
);

CREATE TABLE IF NOT EXISTS item_index_state (
    item_id      INTEGER PRIMARY KEY REFERENCES knowledge_items(id) ON DELETE CASCADE,
    status       TEXT NOT NULL DEFAULT 'pending' CHECK (status IN {STATUSES}),
    indexed_hash TEXT,
    chunk_method TEXT,
    chunk_count  INTEGER NOT NULL DEFAULT 0,
    model        TEXT,
    dimensions   INTEGER,
    last_error   TEXT,
    last_task_id TEXT,
    attempts     INTEGER NOT NULL DEFAULT 0,
    duration_ms  INTEGER,
    indexed_at   TEXT,
    updated_at   TEXT NOT NULL DEFAULT {_NOW}
);
CREATE INDEX IF NOT EXISTS item_index_state_status ON item_index_state(status);

CREATE TABLE IF NOT EXISTS note_chunks (
    id           INTEGER PRIMARY KEY,
    item_id      INTEGER NOT NULL REFERENCES knowledge_items(id) ON DELETE CASCADE,
    chunk_index  INTEGER NOT NULL,
    content      TEXT NOT NULL,
    summary      TEXT,
    method       TEXT NOT NULL CHECK (method IN ('llm', 'structure')),
    start_offset INTEGER NOT NULL,
    end_offset   INTEGER NOT NULL,
    headings     TEXT NOT NULL DEFAULT '',
    embed_hash   TEXT NOT NULL,
    UNIQUE (item_id, chunk_index),
    CHECK (end_offset > start_offset)
);
CREATE INDEX IF NOT EXISTS note_chunks_embed_hash ON note_chunks(item_id, embed_hash);

CREATE TABLE IF NOT EXISTS note_chunk_embeddings (
    chunk_id   INTEGER PRIMARY KEY REFERENCES note_chunks(id) ON DELETE CASCADE,
    model      TEXT NOT NULL,
    dimensions INTEGER NOT NULL CHECK (dimensions > 0),
    created_at TEXT NOT NULL DEFAULT {_NOW},
    vector     BLOB NOT NULL CHECK (length(vector) = 4 * dimensions)
);
CREATE INDEX IF NOT EXISTS note_chunk_embeddings_created ON note_chunk_embeddings(created_at);

CREATE TABLE IF NOT EXISTS note_embeddings (
    item_id    INTEGER PRIMARY KEY REFERENCES knowledge_items(id) ON DELETE CASCADE,
    model      TEXT NOT NULL,
    dimensions INTEGER NOT NULL CHECK (dimensions > 0),
    created_at TEXT NOT NULL DEFAULT {_NOW},
    vector     BLOB NOT NULL CHECK (length(vector) = 4 * dimensions)
);

CREATE TABLE IF NOT EXISTS memories (
    id         INTEGER PRIMARY KEY,
    content    TEXT NOT NULL,
    created_at TEXT NOT NULL DEFAULT {_NOW}
);

CREATE TABLE IF NOT EXISTS memory_embeddings (
    memory_id  INTEGER PRIMARY KEY REFERENCES memories(id) ON DELETE CASCADE,
    model      TEXT NOT NULL,
    dimensions INTEGER NOT NULL CHECK (dimensions > 0),
    created_at TEXT NOT NULL DEFAULT {_NOW},
    vector     BLOB NOT NULL CHECK (length(vector) = 4 * dimensions)
);

CREATE TABLE IF NOT EXISTS code_chunks (
    id          INTEGER PRIMARY KEY,
    item_id     INTEGER NOT NULL REFERENCES knowledge_items(id) ON DELETE CASCADE,
    chunk_index INTEGER NOT NULL,
    path        TEXT NOT NULL,
    start_line  INTEGER NOT NULL,
    end_line    INTEGER NOT NULL,
    content     TEXT NOT NULL,
    embed_hash  TEXT NOT NULL,
    UNIQUE (item_id, chunk_index)
);

CREATE TABLE IF NOT EXISTS code_chunk_embeddings (
    chunk_id   INTEGER PRIMARY KEY REFERENCES code_chunks(id) ON DELETE CASCADE,
    model      TEXT NOT NULL,
    dimensions INTEGER NOT NULL CHECK (dimensions > 0),
    created_at TEXT NOT NULL DEFAULT {_NOW},
    vector     BLOB NOT NULL CHECK (length(vector) = 4 * dimensions)
);

CREATE TABLE IF NOT EXISTS index_batches (
    id                   INTEGER PRIMARY KEY,
    kind                 TEXT NOT NULL CHECK (kind IN ('reindex', 'reconcile', 'retry')),
    state                TEXT NOT NULL DEFAULT 'running'
                         CHECK (state IN ('running', 'done', 'aborted')),
    total                INTEGER NOT NULL DEFAULT 0,
    ok                   INTEGER NOT NULL DEFAULT 0,
    failed               INTEGER NOT NULL DEFAULT 0,
    skipped              INTEGER NOT NULL DEFAULT 0,
    consecutive_failures INTEGER NOT NULL DEFAULT 0,
    abort_reason         TEXT,
    created_at           TEXT NOT NULL DEFAULT {_NOW},
    finished_at          TEXT
);

-- One row per run of a task: a retry is another run of the same task id.
CREATE TABLE IF NOT EXISTS index_jobs (
    task_id     TEXT NOT NULL,
    attempt     INTEGER NOT NULL DEFAULT 0,
    task_name   TEXT NOT NULL,
    item_id     INTEGER,
    batch_id    INTEGER REFERENCES index_batches(id),
    state       TEXT NOT NULL,
    reason      TEXT,
    started_at  TEXT,
    finished_at TEXT,
    duration_ms INTEGER,
    error       TEXT,
    PRIMARY KEY (task_id, attempt)
);
CREATE INDEX IF NOT EXISTS index_jobs_state ON index_jobs(state);
CREATE INDEX IF NOT EXISTS index_jobs_item ON index_jobs(item_id);
CREATE INDEX IF NOT EXISTS index_jobs_batch ON index_jobs(batch_id);
""",
    ),
]

MIGRATIONS.append(
    (
        2,
        f"""
-- LLM chunking: the model's validated boundaries for a window of units, so unchanged text
-- never calls the model again and its chunks do not reshuffle.
CREATE TABLE IF NOT EXISTS chunk_boundaries (
    model       TEXT NOT NULL,
    window_hash TEXT NOT NULL,
    boundaries  TEXT NOT NULL,
    created_at  TEXT NOT NULL DEFAULT {_NOW},
    PRIMARY KEY (model, window_hash)
);
""",
    )
)

MIGRATIONS.append(
    (
        3,
        f"""
-- A host application that changes knowledge_items.content directly (without the hash) leaves
-- content_hash NULL, which the reconcile sweep looks for: no hashing of every item per sweep.
CREATE TRIGGER IF NOT EXISTS knowledge_items_content_changed
AFTER UPDATE OF content ON knowledge_items
WHEN new.content IS NOT old.content AND new.content_hash IS old.content_hash
BEGIN
    UPDATE knowledge_items SET content_hash = NULL, updated_at = {_NOW} WHERE id = new.id;
END;

-- When a task was sent, so that a sweep can tell a queued task from a lost one.
ALTER TABLE index_jobs ADD COLUMN queued_at TEXT;
""",
    )
)

MIGRATIONS.append(
    (
        4,
        """
-- Whether a run's outcome has been counted in its batch: a run redelivered after its
-- process died (or a group redelivered) is not counted twice.
ALTER TABLE index_jobs ADD COLUMN counted INTEGER NOT NULL DEFAULT 0;
""",
    )
)

# What a deleted item leaves, removed by the database itself: a host's plain-SQL DELETE runs
# with foreign keys off (SQLite's default), so ON DELETE CASCADE does nothing there; a trigger
# fires on every connection. Only relational rows: a trigger naming a vec0 table would fail
# the host's DELETE on a connection without sqlite-vec. Vec rows left behind are orphans,
# which search never returns and the reconcile sweep deletes.
_DEPENDANTS = """
    DELETE FROM note_chunk_embeddings
     WHERE chunk_id IN (SELECT id FROM note_chunks WHERE item_id = old.id);
    DELETE FROM note_chunks WHERE item_id = old.id;
    DELETE FROM note_embeddings WHERE item_id = old.id;
    DELETE FROM code_chunk_embeddings
     WHERE chunk_id IN (SELECT id FROM code_chunks WHERE item_id = old.id);
    DELETE FROM code_chunks WHERE item_id = old.id;
    DELETE FROM item_index_state WHERE item_id = old.id;"""

MIGRATIONS.append(
    (
        5,
        f"""
-- knowledge_items again, with AUTOINCREMENT: an id is never given twice, so an id a host
-- remembers never names another item, and nothing an old item left can meet a new one.
-- (SQLite cannot add AUTOINCREMENT in place: the table is rebuilt, with foreign keys off.)
CREATE TABLE knowledge_items_new (
    id           INTEGER PRIMARY KEY AUTOINCREMENT,
    kind         TEXT NOT NULL CHECK (kind IN {ITEM_KINDS}),
    title        TEXT NOT NULL DEFAULT '',
    source       TEXT,
    content      TEXT NOT NULL DEFAULT '',
    content_hash TEXT,
    created_at   TEXT NOT NULL DEFAULT {_NOW},
    updated_at   TEXT NOT NULL DEFAULT {_NOW}
);
INSERT INTO knowledge_items_new(id, kind, title, source, content, content_hash, created_at,
                                updated_at)
SELECT id, kind, title, source, content, content_hash, created_at, updated_at
  FROM knowledge_items;
-- Run again on a table that has AUTOINCREMENT (a schema_version set back: a restored copy, a
-- hand's edit), its sequence counts ids deleted items had: kept past the DROP, which takes
-- it with the table (an id a host still held was given to a new item).
INSERT INTO sqlite_sequence(name, seq)
SELECT 'kidx_items_before', seq FROM sqlite_sequence
 WHERE name = 'knowledge_items' AND typeof(seq) = 'integer';
DROP TABLE knowledge_items;
ALTER TABLE knowledge_items_new RENAME TO knowledge_items;

-- Ids that deleted items had (their rows may linger elsewhere) are not given again either.
DELETE FROM sqlite_sequence WHERE name = 'knowledge_items';
INSERT INTO sqlite_sequence(name, seq)
SELECT 'knowledge_items', coalesce(max(m), 0) FROM (
    SELECT max(id) AS m FROM knowledge_items
    UNION ALL SELECT max(seq) FROM sqlite_sequence WHERE name = 'kidx_items_before'
    UNION ALL SELECT max(item_id) FROM item_index_state WHERE typeof(item_id) = 'integer'
    UNION ALL SELECT max(item_id) FROM note_chunks WHERE typeof(item_id) = 'integer'
    UNION ALL SELECT max(item_id) FROM note_embeddings WHERE typeof(item_id) = 'integer'
    UNION ALL SELECT max(item_id) FROM code_chunks WHERE typeof(item_id) = 'integer'
    UNION ALL SELECT max(item_id) FROM index_jobs WHERE typeof(item_id) = 'integer'
);
DELETE FROM sqlite_sequence WHERE name = 'kidx_items_before';

CREATE TRIGGER knowledge_items_content_changed
AFTER UPDATE OF content ON knowledge_items
WHEN new.content IS NOT old.content AND new.content_hash IS old.content_hash
BEGIN
    UPDATE knowledge_items SET content_hash = NULL, updated_at = {_NOW} WHERE id = new.id;
END;

CREATE TRIGGER knowledge_items_deleted
AFTER DELETE ON knowledge_items
BEGIN{_DEPENDANTS}
END;

CREATE TRIGGER knowledge_items_id_changed
AFTER UPDATE OF id ON knowledge_items
WHEN new.id IS NOT old.id
BEGIN{_DEPENDANTS}
END;
""",
    )
)

# The keyword index (worker.store.fts): one FTS5 table for prose chunks, one for code chunks,
# filled by connect() for a database that already has chunks.
FTS_MIGRATION = 6
MIGRATIONS.append((FTS_MIGRATION, ";\n".join(create_sql(t.name) for t in FTS_TABLES) + ";\n"))

# Memories written or changed by a host with plain SQL (foreign keys off included): a changed
# text loses its vector, so that it is embedded again (`embed_memories`); a deleted memory
# loses it too. The vec row left behind is an orphan, which the reconcile sweep deletes (no
# trigger may touch a vec0 table: a host's connection without sqlite-vec would fail).
MIGRATIONS.append(
    (
        7,
        """
CREATE TRIGGER IF NOT EXISTS memories_content_changed
AFTER UPDATE OF content ON memories
WHEN new.content IS NOT old.content
BEGIN
    DELETE FROM memory_embeddings WHERE memory_id = new.id;
END;

CREATE TRIGGER IF NOT EXISTS memories_deleted
AFTER DELETE ON memories
BEGIN
    DELETE FROM memory_embeddings WHERE memory_id = old.id;
END;

CREATE TRIGGER IF NOT EXISTS memories_id_changed
AFTER UPDATE OF id ON memories
WHEN new.id IS NOT old.id
BEGIN
    DELETE FROM memory_embeddings WHERE memory_id IN (old.id, new.id);
END;
""",
    )
)

# An item whose kind, source or title a host changes with plain SQL is to be indexed again:
# its text comes from elsewhere now, or what each chunk's embedder input starts with changed.
# Marked `pending`, which the reconcile sweep sends (a content change leaves content_hash NULL
# instead: migration 3).
MIGRATIONS.append(
    (
        8,
        f"""
CREATE TRIGGER IF NOT EXISTS knowledge_items_origin_changed
AFTER UPDATE OF kind, source, title ON knowledge_items
WHEN new.kind IS NOT old.kind OR new.source IS NOT old.source OR new.title IS NOT old.title
BEGIN
    UPDATE item_index_state SET status = 'pending', updated_at = {_NOW} WHERE item_id = new.id;
END;
""",
    )
)

# Memories kidx could not embed (the provider refused the text alone, or it is not UTF-8),
# with the text as it was then: skipped by `embed_memories` until the text changes, the model
# changes or the record is older than a day (a provider that refused everything for a while
# is asked again), so that refused memories neither hold back the ones after them nor make
# every sweep send a run. kidx's table; a deleted memory's row goes with it.
MIGRATIONS.append(
    (
        9,
        f"""
CREATE TABLE IF NOT EXISTS memory_refusals (
    memory_id  INTEGER PRIMARY KEY,
    model      TEXT NOT NULL,
    content    BLOB,
    reason     TEXT NOT NULL,
    refused_at TEXT NOT NULL DEFAULT {_NOW}
);

CREATE TRIGGER IF NOT EXISTS memories_deleted_refusal
AFTER DELETE ON memories
BEGIN
    DELETE FROM memory_refusals WHERE memory_id = old.id;
END;
""",
    )
)

# A host's change of kind, source or title (migration 8) also moves the item's `updated_at`:
# the reconcile sweep tells by it that a `cancelled` item's index is older than the item (the
# run that a rename sent was cancelled, and `cancelled` had replaced the `pending` the
# rename left), whatever its kind; a content change moved it already (migration 3).
MIGRATIONS.append(
    (
        10,
        f"""
DROP TRIGGER IF EXISTS knowledge_items_origin_changed;
CREATE TRIGGER knowledge_items_origin_changed
AFTER UPDATE OF kind, source, title ON knowledge_items
WHEN new.kind IS NOT old.kind OR new.source IS NOT old.source OR new.title IS NOT old.title
BEGIN
    UPDATE knowledge_items SET updated_at = {_NOW} WHERE id = new.id;
    UPDATE item_index_state SET status = 'pending', updated_at = {_NOW} WHERE item_id = new.id;
END;
""",
    )
)

# The write fence's claim (worker.store.items.Claim): a token that every write of a state row
# changes. `updated_at` told two marks apart only to the millisecond: a second delivery of a
# task marking the item within the same millisecond as the first looked like the first's own
# mark, and the stale run wrote over the newer one. kidx's marks and writes set a new token
# themselves; any other write (a host's plain SQL, whatever it writes, `claim` included) gets
# one from the trigger. A rename's `pending` (migration 10's trigger) turns the token over
# (`~claim`) instead: a run that marked the item still writes it, and records `pending`.
MIGRATIONS.append(
    (
        11,
        f"""
ALTER TABLE item_index_state ADD COLUMN claim INTEGER;

CREATE TRIGGER IF NOT EXISTS item_index_state_claim_kept
AFTER UPDATE ON item_index_state
WHEN new.claim IS old.claim
BEGIN
    UPDATE item_index_state SET claim = random() WHERE item_id = new.item_id;
END;

CREATE TRIGGER IF NOT EXISTS item_index_state_inserted
AFTER INSERT ON item_index_state
BEGIN
    UPDATE item_index_state SET claim = random() WHERE item_id = new.item_id;
END;

DROP TRIGGER IF EXISTS knowledge_items_origin_changed;
CREATE TRIGGER knowledge_items_origin_changed
AFTER UPDATE OF kind, source, title ON knowledge_items
WHEN new.kind IS NOT old.kind OR new.source IS NOT old.source OR new.title IS NOT old.title
BEGIN
    UPDATE knowledge_items SET updated_at = {_NOW} WHERE id = new.id;
    UPDATE item_index_state SET status = 'pending', updated_at = {_NOW}, claim = ~claim
     WHERE item_id = new.id;
END;
""",
    )
)

# What a host's plain SQL must not leave stale for good (both found by an audit):
# - A content change of a `failed` item (the host fixed what made it fail) makes it `pending`
#   with its attempts back at 0: the retry sweep had given up on it after its last attempt, and
#   the reconcile sweep leaves failed items to the retry sweep's backoff.
# - `INSERT OR REPLACE` of an item deletes the old row without its delete trigger (SQLite fires
#   delete triggers for a REPLACE only with recursive triggers on), so the old index stayed
#   `indexed` under the new item. An inserted item's id now has nothing of an earlier item's:
#   chunks, vectors and state go (its vec and keyword rows become orphans the sweep removes),
#   and the item, with no state row, is `pending`. For kidx's own inserts there is nothing to
#   remove (AUTOINCREMENT never gives an id twice).
MIGRATIONS.append(
    (
        12,
        f"""
DROP TRIGGER IF EXISTS knowledge_items_content_changed;
CREATE TRIGGER knowledge_items_content_changed
AFTER UPDATE OF content ON knowledge_items
WHEN new.content IS NOT old.content AND new.content_hash IS old.content_hash
BEGIN
    UPDATE knowledge_items SET content_hash = NULL, updated_at = {_NOW} WHERE id = new.id;
    UPDATE item_index_state SET status = 'pending', attempts = 0, updated_at = {_NOW}
     WHERE item_id = new.id AND status = 'failed';
END;

CREATE TRIGGER IF NOT EXISTS knowledge_items_inserted
AFTER INSERT ON knowledge_items
BEGIN{_DEPENDANTS.replace("old.id", "new.id")}
END;
""",
    )
)

# `INSERT OR REPLACE` of a memory by a host deletes the old row without its delete triggers
# (migrations 7 and 9; as for items, migration 12), so the new text kept the old text's vector
# for good and was never embedded. An inserted memory's id now has nothing of an earlier
# memory's: its vector and its refusal go (the vec row becomes an orphan the reconcile sweep
# deletes), and `embed_memories` embeds the new text. kidx's own inserts have nothing to remove.
MIGRATIONS.append(
    (
        13,
        """
CREATE TRIGGER IF NOT EXISTS memories_inserted
AFTER INSERT ON memories
BEGIN
    DELETE FROM memory_embeddings WHERE memory_id = new.id;
    DELETE FROM memory_refusals WHERE memory_id = new.id;
END;
""",
    )
)

# A chunk row a host's plain SQL changed (its text, summary, headings, method, hash, place or
# offsets, or moved to another item) is not what the item's run wrote: search showed the host's
# text beside a vector and keyword row of the old one, and nothing sent the item again. The
# item (and the one it was moved from) becomes `pending`, unless a run holds it or it waits for
# one already; its run writes the chunks again from the item's text, unchanged ones keeping
# their vectors. kidx's own UPDATEs of chunk rows are a run's, which marks its item `indexing`
# first (and records its state after them). An edit's run moves its kept chunks, their index
# first out of the way below zero, then their index and offsets: the place and offsets count
# only between two indexes of zero or more, else the trigger's body ran for every kept chunk
# (7% of the edit of a note of 3,000 chunks).
_CHUNKS_CHANGED = """
CREATE TRIGGER IF NOT EXISTS {name}
AFTER UPDATE OF {columns} ON {table}
WHEN {changed}
BEGIN
    UPDATE item_index_state SET status = 'pending', updated_at = {now}, claim = ~claim
     WHERE item_id IN (new.item_id, old.item_id)
     AND status IN ('indexed', 'partial', 'failed', 'cancelled');
END;
"""
_CHUNK_COLUMNS = {  # (what a chunk is; its place)
    "note_chunks": (
        ("item_id", "content", "summary", "headings", "method", "embed_hash"),
        ("chunk_index", "start_offset", "end_offset"),
    ),
    "code_chunks": (
        ("item_id", "path", "content", "embed_hash"),
        ("chunk_index", "start_line", "end_line"),
    ),
}


def _differ(columns: tuple[str, ...]) -> str:
    return " OR ".join(f"new.{c} IS NOT old.{c}" for c in columns)


def _chunk_trigger(name: str, table: str, columns: tuple[str, ...], changed: str) -> str:
    return _CHUNKS_CHANGED.format(
        name=name, table=table, columns=", ".join(columns), changed=changed, now=_NOW
    )


def _chunk_triggers(table: str, what: tuple[str, ...], place: tuple[str, ...]) -> str:
    moved = f"new.chunk_index >= 0 AND old.chunk_index >= 0 AND ({_differ(place)})"
    return _chunk_trigger(f"{table}_changed", table, what, _differ(what)) + _chunk_trigger(
        f"{table}_moved", table, place, moved
    )


MIGRATIONS.append(
    (
        14,
        "".join(
            _chunk_triggers(table, what, place) for table, (what, place) in _CHUNK_COLUMNS.items()
        ),
    )
)

# A vector a host's plain SQL changed (its bytes, or moved under another chunk, item or memory)
# is not the embedding of its text: it was kept for good, the reconcile sweep's repair even
# mirroring it into the vec table. The row goes (its vec row becomes an orphan the sweep
# deletes), and the chunk, item or memory without a vector is embedded again (a whole-item
# vector is written again from its chunk's). kidx writes these rows with INSERT (OR REPLACE),
# never an UPDATE: the triggers fire for other writers only.
_VECTOR_CHANGED = """
CREATE TRIGGER IF NOT EXISTS {table}_changed
AFTER UPDATE OF {key}, vector ON {table}
WHEN new.{key} IS NOT old.{key} OR new.vector IS NOT old.vector
BEGIN
    DELETE FROM {table} WHERE {key} = new.{key};
END;
"""
MIGRATIONS.append(
    (
        15,
        "".join(
            _VECTOR_CHANGED.format(table=table, key=key)
            for table, key in (
                ("note_chunk_embeddings", "chunk_id"),
                ("code_chunk_embeddings", "chunk_id"),
                ("note_embeddings", "item_id"),
                ("memory_embeddings", "memory_id"),
            )
        ),
    )
)

# What a host's plain SQL could still do unseen to a chunk, a vector or an item (an audit
# reproduced each). kidx writes chunks and vectors with a row in `kidx_writer`, deleted before
# its transaction commits (`Database.writing_index`): SQLite has one writer at a time, so no
# other connection's write ever sees the row, and `_BY_HOST` tells the host's writes from
# kidx's (the item's state could not: a rename during a run makes it `pending`, and the run's
# new vectors went):
# - a chunk row inserted (`INSERT OR REPLACE` under a chunk's id replaces it without any
#   UPDATE trigger) or given another id (two ids swapped: each text beside the other's
#   vector, which the next run even reused, as vectors are reused by their chunk's id): the
#   item is `pending`, and the vectors under both ids go, to be embedded again;
# - a vector row inserted (`INSERT OR REPLACE` over kidx's: search ranked by a vector that is
#   not its text's), a memory's too: the row goes, and what lacks a vector is embedded again;
# - a chunk moved through a negative index (migration 14 left those to kidx's own moves);
# - `UPDATE OR REPLACE` of an item's id onto another item's: the replaced item's index stayed,
#   `indexed`, under the item that took its id (as `INSERT OR REPLACE`, migration 12);
# - a failed item's text fixed together with its `content_hash`: only a fix that kept the
#   hash made the item `pending` again.
_BY_HOST = "NOT EXISTS (SELECT 1 FROM kidx_writer)"
_SETTLED = "status IN ('indexed', 'partial', 'failed', 'cancelled')"
_CHUNK_BY_HOST = """
CREATE TRIGGER IF NOT EXISTS {table}_inserted
AFTER INSERT ON {table}
WHEN {by_host}
BEGIN
    DELETE FROM {vectors} WHERE chunk_id = new.id;
    UPDATE item_index_state SET status = 'pending', updated_at = {now}, claim = ~claim
     WHERE item_id = new.item_id AND {settled};
END;

CREATE TRIGGER IF NOT EXISTS {table}_rekeyed
AFTER UPDATE OF id ON {table}
WHEN new.id IS NOT old.id
BEGIN
    DELETE FROM {vectors} WHERE chunk_id IN (old.id, new.id);
    UPDATE item_index_state SET status = 'pending', updated_at = {now}, claim = ~claim
     WHERE item_id IN (new.item_id, old.item_id) AND {settled};
END;

CREATE TRIGGER IF NOT EXISTS {vectors}_inserted
AFTER INSERT ON {vectors}
WHEN {by_host}
BEGIN
    DELETE FROM {vectors} WHERE chunk_id = new.chunk_id;
END;
"""
_HOST_WRITES = "CREATE TABLE IF NOT EXISTS kidx_writer (id INTEGER PRIMARY KEY);\n" + "".join(
    _CHUNK_BY_HOST.format(
        table=table,
        vectors=vectors,
        by_host=_BY_HOST,
        settled=_SETTLED,
        now=_NOW,
    )
    for table, vectors in (
        ("note_chunks", "note_chunk_embeddings"),
        ("code_chunks", "code_chunk_embeddings"),
    )
)
_HOST_WRITES += f"""
CREATE TRIGGER IF NOT EXISTS note_embeddings_inserted
AFTER INSERT ON note_embeddings
WHEN {_BY_HOST}
BEGIN
    DELETE FROM note_embeddings WHERE item_id = new.item_id;
END;

CREATE TRIGGER IF NOT EXISTS memory_embeddings_inserted
AFTER INSERT ON memory_embeddings
WHEN {_BY_HOST}
BEGIN
    DELETE FROM memory_embeddings WHERE memory_id = new.memory_id;
END;

CREATE TRIGGER IF NOT EXISTS knowledge_items_id_taken
AFTER UPDATE OF id ON knowledge_items
WHEN new.id IS NOT old.id
BEGIN{_DEPENDANTS.replace("old.id", "new.id")}
END;

DROP TRIGGER IF EXISTS knowledge_items_content_changed;
CREATE TRIGGER knowledge_items_content_changed
AFTER UPDATE OF content ON knowledge_items
WHEN new.content IS NOT old.content
BEGIN
    UPDATE knowledge_items SET content_hash = NULL, updated_at = {_NOW}
     WHERE id = new.id AND new.content_hash IS old.content_hash;
    UPDATE item_index_state SET status = 'pending', attempts = 0, updated_at = {_NOW}
     WHERE item_id = new.id AND status = 'failed';
END;
"""
for _table, (_what, _place) in _CHUNK_COLUMNS.items():
    # kidx's own moves (an edit's run) go below zero and back, its item `indexing`; a host's
    # may go there too. The state is looked at only for a move through a negative index.
    _moved = (
        f"({_differ(_place)}) AND (new.chunk_index >= 0 AND old.chunk_index >= 0 OR {_BY_HOST})"
    )
    _HOST_WRITES += f"DROP TRIGGER IF EXISTS {_table}_moved;\n" + _chunk_trigger(
        f"{_table}_moved", _table, _place, _moved
    )
MIGRATIONS.append((16, _HOST_WRITES))

# The structural target an item's chunks were cut at (KIDX_CHUNK__TARGET; NULL: before the
# setting, 650). A run keeps the previous version's cuts only when they were made at its own
# target: otherwise an operator's new target never took effect on an item already indexed,
# whatever was re-indexed (chunks whose text stays the same keep their vectors all the same).
MIGRATIONS.append((17, "ALTER TABLE item_index_state ADD COLUMN chunk_target INTEGER;\n"))

# The item of a source (`kidx add file|url|code` looks each up): without it, each look read the
# whole table, and adding a tree of 40,000 source files took 65 s, 100,000 past two minutes.
MIGRATIONS.append(
    (
        18,
        "CREATE INDEX IF NOT EXISTS knowledge_items_source ON knowledge_items(kind, source);\n",
    )
)

# Which items' texts hold each cached window of LLM boundaries (`chunk_windows`, written as a
# window is cached for an item, and kept by the item's index): a window goes from the cache
# once no item holds it. A renumbered item (a host's UPDATE of its id) keeps its windows.
# Every edit left the old windows' rows behind, and a deleted note's model summaries stayed
# in the file for good.
_WINDOWS_OF_OLD = (
    "SELECT w.model, w.window_hash FROM chunk_windows w WHERE w.item_id = old.id "
    "AND NOT EXISTS (SELECT 1 FROM chunk_windows o WHERE o.model = w.model "
    "AND o.window_hash = w.window_hash AND o.item_id IS NOT old.id)"
)
_UNLINK_OLD = f"""
    DELETE FROM chunk_boundaries WHERE (model, window_hash) IN ({_WINDOWS_OF_OLD});
    DELETE FROM chunk_windows WHERE item_id = old.id;"""
MIGRATIONS.append(
    (
        19,
        f"""
CREATE TABLE IF NOT EXISTS chunk_windows (
    item_id     INTEGER NOT NULL,
    model       TEXT NOT NULL,
    window_hash TEXT NOT NULL,
    PRIMARY KEY (item_id, model, window_hash)
);
CREATE INDEX IF NOT EXISTS chunk_windows_window ON chunk_windows(model, window_hash);
CREATE TRIGGER IF NOT EXISTS chunk_windows_item_deleted
AFTER DELETE ON knowledge_items
BEGIN{_UNLINK_OLD}
END;
CREATE TRIGGER IF NOT EXISTS chunk_windows_item_renumbered
AFTER UPDATE OF id ON knowledge_items
WHEN new.id IS NOT old.id
BEGIN
    UPDATE OR REPLACE chunk_windows SET item_id = new.id WHERE item_id = old.id;
END;
""",
    )
)

SCHEMA_VERSION = MIGRATIONS[-1][0]


def schema_version(db: Database) -> int:
    """The file's schema version (0: none yet). A value that is not a whole number is refused
    (StoreError): migrations decided on it would run against a schema nobody knows."""
    if not db.table_exists("index_meta"):
        return 0
    # As bytes: apsw cannot read a host's TEXT that is not UTF-8 (every command failed as a
    # bug), and a BLOB's digits are the number they spell, not "b'13'".
    value = db.scalar("SELECT CAST(value AS BLOB) FROM index_meta WHERE key = 'schema_version'")
    if value is None:
        return 0
    text = bytes(value).decode("utf-8", errors="replace")
    try:
        return int(text.strip())
    except ValueError:
        raise StoreError(
            f"{db.path} has schema_version {text[:40]!r} in index_meta, not a number: "
            "not a kidx database, or damaged (restore a backup)"
        ) from None


def check_not_newer(db: Database, version: int) -> None:
    """A file written by a newer kidx is refused, never opened and written: this kidx does not
    know its tables, and what it wrote there could break the newer one's data."""
    if version > SCHEMA_VERSION:
        raise StoreError(
            f"{db.path} was written by a newer kidx (schema {version}, this one knows "
            f"{SCHEMA_VERSION}): upgrade kidx"
        )


def migrate(db: Database) -> int:
    """Apply the migrations this database has not seen; returns the schema version.

    Foreign keys are off while they run (a table rebuild drops the old table, which with
    foreign keys on would delete every row that refers to it; the pragma cannot change
    inside a transaction, so it is set around it), and renames leave the schema's other
    objects as they are (legacy_alter_table)."""
    version = schema_version(db)
    check_not_newer(db, version)
    if version == SCHEMA_VERSION:
        return SCHEMA_VERSION
    db.execute("PRAGMA foreign_keys = OFF")
    # A host's own view over a table being rebuilt must not stop the rename that ends it.
    db.execute("PRAGMA legacy_alter_table = ON")
    try:
        with db.atomic():
            current = schema_version(db)  # again, under the write lock: another may have won
            check_not_newer(db, current)
            _refuse_taken(db, current)
            _refuse_rebuilt(db, current)
            for number, sql in MIGRATIONS:
                if number <= current:
                    continue
                with db.atomic():
                    for statement in _statements(sql):
                        if not _column_there(db, statement):
                            _run(db, number, statement)
                    set_meta(db, "schema_version", str(number))
            if current < FTS_MIGRATION:
                # The chunks the database already had get their keyword rows, in the same
                # transaction: filled by `connect` after it, a process stopped between the
                # two left keyword search empty for good (the version said it was done).
                sync_fts(db)
    finally:
        db.execute("PRAGMA legacy_alter_table = OFF")
        db.execute("PRAGMA foreign_keys = ON")
    return SCHEMA_VERSION


_CREATES = re.compile(r"CREATE TABLE IF NOT EXISTS (\w+)")


def _run(db: Database, number: int, statement: str) -> None:
    """One statement of migration `number`; a row it cannot keep (a host's, written with its
    CHECKs off: a `kind` of 'Note') is said as such, not as apsw's bare ConstraintError that
    every kidx command printed."""
    try:
        db.execute(statement)
    except apsw.ConstraintError as e:
        raise StoreError(
            f"{db.path}: migration {number} cannot keep a row a host wrote ({e}): mend or "
            "delete it, then open the database again (nothing was changed)"
        ) from None


# knowledge_items as migration 5 rebuilds it, and what kidx had made on it before then.
_ITEM_COLUMNS_V4 = frozenset(
    {"id", "kind", "title", "source", "content", "content_hash", "created_at", "updated_at"}
)


def _refuse_rebuilt(db: Database, current: int) -> None:
    """Migration 5 rebuilds knowledge_items with kidx's columns only: a host's own column,
    index or trigger on it would be dropped, its data with it. Refused before any migration
    runs, naming them, so that the host can move them first."""
    if current >= 5 or not db.table_exists("knowledge_items"):
        return
    columns = {str(r[1]) for r in db.all("SELECT * FROM pragma_table_info('knowledge_items')")}
    objects = {
        str(r[0])
        for r in db.all(
            "SELECT name FROM sqlite_schema WHERE tbl_name = 'knowledge_items' "
            "AND type IN ('index', 'trigger') AND sql IS NOT NULL"
        )
    }
    # (kidx's are those the migrations make on it: a database whose version a host set back
    # holds those of later migrations already)
    kidx = {name for _, name, table, _ in _reference() if table == "knowledge_items"}
    theirs = sorted(columns - _ITEM_COLUMNS_V4) + sorted(objects - kidx)
    if theirs:
        raise StoreError(
            f"{db.path}: upgrading rebuilds knowledge_items, which would drop what a host added "
            f"to it ({', '.join(theirs)[:300]}): move it to a table of its own (or restore a "
            "backup), then open the database again (nothing was changed)"
        )


def _refuse_taken(db: Database, current: int) -> None:
    """A table that a migration still to run creates `IF NOT EXISTS`, which the file has
    already, is kidx's (a schema_version set back) or a host's own of that name: that one
    `IF NOT EXISTS` took for kidx's, the migration's triggers then named it (the host's own
    DELETEs failed), and `restore_dropped` dropped it, its rows with it. Refused before any
    migration runs, so that the host can still rename it."""
    names = sorted({n for num, sql in MIGRATIONS if num > current for n in _CREATES.findall(sql)})
    there = db.all(
        f"SELECT type, name FROM sqlite_schema WHERE name IN ({', '.join('?' * len(names))})",
        names,
    )
    # A view of the name: the migration's triggers wrote to it, and the host's own DELETEs
    # of memories failed ("cannot modify memory_refusals because it is a view").
    if other := sorted(n for t, n in there if t != "table"):
        raise StoreError(
            f"{db.path}: {', '.join(other)} is not what kidx made (another object took the "
            "name, which this kidx's migrations need): drop or rename it, or restore a backup"
        )
    if tables := [n for t, n in there if t == "table"]:  # (never in `_made`'s empty database)
        _refuse_foreign(db, tables)


# At a line's start: a statement may begin with the comment lines above it.
_ADD_COLUMN = re.compile(
    r"^\s*ALTER\s+TABLE\s+(\w+)\s+ADD\s+COLUMN\s+(\w+)", re.IGNORECASE | re.MULTILINE
)


def _column_there(db: Database, statement: str) -> bool:
    """Whether `statement` adds a column the table has already: SQLite has no `ADD COLUMN IF
    NOT EXISTS`, and a database whose recorded version is older than its tables (restored
    from a copy, or set back by hand) runs its migrations again."""
    m = _ADD_COLUMN.search(statement)  # (`match` missed the comment-led ones: migrations 3, 4)
    if m is None:
        return False
    table, column = m.groups()
    return any(row[1] == column for row in db.all(f'PRAGMA table_info("{table}")'))


def _statements(sql: str) -> list[str]:
    """Statements of a migration: split at `;` line ends, but a trigger's body (BEGIN ... END;)
    stays one statement."""
    out: list[str] = []
    current: list[str] = []
    in_body = False
    for line in sql.splitlines():
        if line.strip().startswith("--") and not current:
            continue
        current.append(line)
        stripped = line.strip().upper()
        if stripped == "BEGIN":
            in_body = True
        if stripped.endswith(";") and (not in_body or stripped == "END;"):
            statement = "\n".join(current).strip().rstrip(";")
            if statement:
                out.append(statement)
            current, in_body = [], False
    tail = "\n".join(current).strip()
    if tail:
        out.append(tail)
    return out


# kidx's tables that hold what only a host or a user gave (the items, the memories) or the
# schema's version. Dropped, they cannot be made again: the database is refused, and the rows
# derived from them are kept for a restore (recreated empty, the sweep would delete them all).
SOURCE_TABLES = ("index_meta", "knowledge_items", "memories")


@dataclass(frozen=True)
class _Shape:
    """What kidx's SQL relies on in a table, beyond its columns' names: a host that made the
    table again (`CREATE TABLE new ...; INSERT ... SELECT; DROP; RENAME`, or `CREATE TABLE AS`)
    may keep every name and lose the rest, and then kidx's writes fail (`ON CONFLICT clause
    does not match`, `foreign key mismatch`) or its ids are NULL, at every run."""

    columns: dict[str, tuple[str, bool, str | None]]  # name: (affinity, NOT NULL, default)
    rowid: str | None  # the column that is the rowid (`INTEGER PRIMARY KEY`), if any
    unique: frozenset[frozenset[str]]  # PRIMARY KEY and UNIQUE column sets (any origin)
    declared: frozenset[frozenset[str]]  # those of the table's own definition
    without_rowid: bool
    references: frozenset[tuple[str, str, str]]  # (column, table, column) of its foreign keys


def _affinity(declared: str) -> str:
    """A declared type's affinity (SQLite's rules, in their order)."""
    t = declared.upper()
    if "INT" in t:
        return "INTEGER"
    if any(w in t for w in ("CHAR", "CLOB", "TEXT")):
        return "TEXT"
    if "BLOB" in t or not t:
        return "BLOB"
    if any(w in t for w in ("REAL", "FLOA", "DOUB")):
        return "REAL"
    return "NUMERIC"


def _shape(db: Database, table: str) -> _Shape:
    info = db.all(f'PRAGMA table_info("{table}")')
    columns = {r[1]: (_affinity(str(r[2] or "")), bool(r[3]), r[4]) for r in info}
    keys = [r for r in sorted(info, key=lambda r: r[5]) if r[5]]
    without_rowid = any(r[0] == "main" and r[4] for r in db.all(f'PRAGMA table_list("{table}")'))
    rowid = None
    if len(keys) == 1 and str(keys[0][2]).upper() == "INTEGER" and not without_rowid:
        rowid = keys[0][1]
    unique: set[frozenset[str]] = {frozenset(r[1] for r in keys)} if keys else set()
    declared = set(unique)
    for _, index, is_unique, origin, partial in db.all(f'PRAGMA index_list("{table}")'):
        names = [r[2] for r in db.all(f'PRAGMA index_info("{index}")')]
        if is_unique and not partial and None not in names:
            unique.add(frozenset(names))
            if origin != "c":
                declared.add(frozenset(names))
    references = frozenset(
        (r[3], r[2], r[4]) for r in db.all(f'PRAGMA foreign_key_list("{table}")')
    )
    return _Shape(columns, rowid, frozenset(unique), frozenset(declared), without_rowid, references)


def _unlike(have: _Shape, want: _Shape, *, source: bool) -> list[str]:
    """What in `have` (a table kidx has made) breaks kidx's SQL, as `want` made it: its
    columns missing (`lacks`) or of another affinity (a TEXT column made NUMERIC turns the
    text '42' into a number), its rowid or uniqueness lost, WITHOUT ROWID; in a derived table
    also what fails some of kidx's writes: NOT NULL where kidx's column is not, or on a
    column a host added without a default, a default lost, a uniqueness kidx did not declare
    (`source`: a source table is refused for those, and indexing can go on with them). Empty:
    as kidx made it."""
    lacks = sorted(set(want.columns) - set(have.columns))
    out = [f"lacks {', '.join(lacks)}"] if lacks else []
    strict = not source
    for name, (affinity, not_null, default) in sorted(want.columns.items()):
        if name not in have.columns:
            continue
        h_affinity, h_not_null, h_default = have.columns[name]
        if h_affinity != affinity:
            out.append(f"{name} is {h_affinity}, not {affinity}")
        if strict and h_not_null and not not_null:
            out.append(f"{name} is NOT NULL")
        if strict and default is not None and h_default is None:
            out.append(f"{name} has no default")
    extra = sorted(
        n for n, (_, nn, d) in have.columns.items() if n not in want.columns and nn and d is None
    )
    if strict and extra:
        out.append(f"{', '.join(extra)} NOT NULL without a default")
    if want.rowid and have.rowid != want.rowid:
        out.append(f"{want.rowid} is not its INTEGER PRIMARY KEY")
    for cols in sorted(sorted(c) for c in want.unique - have.unique):
        if want.rowid is None or cols != [want.rowid]:  # (said just above)
            out.append(f"no PRIMARY KEY or UNIQUE ({', '.join(cols)})")
    for cols in sorted(sorted(c) for c in have.declared - want.unique):
        if strict:
            out.append(f"UNIQUE ({', '.join(cols)}) is not kidx's")
    if have.without_rowid and not want.without_rowid:
        out.append("WITHOUT ROWID")
    # A host's `ALTER TABLE note_chunks RENAME TO old` rewrote the REFERENCES of the tables
    # that name it: once `old` was dropped, every write there failed on `no such table`.
    for column, table, to in sorted(want.references - have.references):
        out.append(f"{column} does not reference {table}({to})")
    return out


@functools.cache
def _made() -> tuple[tuple[tuple[str, str, str, str], ...], dict[str, _Shape]]:
    """kidx's tables, indexes and triggers as the migrations leave a new database (type, name,
    table, sql; the keyword tables left out: `sync_fts` makes and mends those), and the
    shape of each table; from one database in memory."""
    ref = Database(":memory:")
    try:
        migrate(ref)
        rows = ref.all(
            "SELECT type, name, tbl_name, sql FROM sqlite_schema WHERE sql IS NOT NULL "
            "AND type IN ('table', 'index', 'trigger') AND name NOT LIKE 'sqlite_%'"
        )
        fts = tuple(t.name for t in FTS_TABLES)
        order = {"table": 0, "index": 1, "trigger": 2}
        kept = [r for r in rows if not str(r[2]).startswith(fts)]
        objects = tuple(sorted(kept, key=lambda r: (order[r[0]], r[1])))
        shapes = {n: _shape(ref, n) for t, n, _, _ in objects if t == "table"}
    finally:
        ref.close()
    return objects, shapes


def _reference() -> tuple[tuple[str, str, str, str], ...]:
    return _made()[0]


def restore_dropped(db: Database) -> list[str]:
    """Create again kidx's tables, indexes and triggers that a host dropped (a `DROP TABLE
    note_chunks` made every later sweep and task fail on `no such table`); returns their names.
    A derived table comes back empty and the reconcile sweep indexes what it held again; so
    does one a host took a column from (renamed or dropped: `no such column` at every run) or
    made again otherwise than kidx did (`_unlike`), with every trigger made again (a rename
    rewrites the triggers that name the column). A trigger or index of kidx's name whose SQL
    is not kidx's (a host renamed a table away and back: the triggers named the old one) is
    made again too. A dropped or altered source table (SOURCE_TABLES) is a StoreError naming
    it; so is a name kidx needs that another object has taken (a host's view called
    `note_chunks`, or a host's own table of a name a later migration gave kidx's)."""
    if not _missing(db) and not _altered(db) and not _rewritten(db):
        return []
    db.execute("PRAGMA foreign_keys = OFF")  # a DROP must not delete through the cascades
    try:
        with db.atomic():  # again, under the write lock: another process may have made them
            altered = _altered(db)
            _refuse_altered(db, altered)
            for table in altered:
                db.execute(f'DROP TABLE "{table}"')
            rewritten = _rewritten(db)
            for kind, name in rewritten:
                db.execute(f'DROP {kind.upper()} IF EXISTS "{name}"')
            if altered:
                for _, name, _, _ in (r for r in _reference() if r[0] == "trigger"):
                    db.execute(f'DROP TRIGGER IF EXISTS "{name}"')
            missing = _missing(db)
            _refuse_lost(db, missing)
            for _, _, _, sql in missing:
                db.execute(sql)
    finally:
        db.execute("PRAGMA foreign_keys = ON")
    return sorted({n for _, n, _, _ in missing} | {n for _, n in rewritten})


def _altered(db: Database) -> dict[str, list[str]]:
    """kidx's tables that are not as kidx made them (`_unlike`: a host renamed or dropped a
    column, or made the table again without its key): what differs, per table. Columns a host
    added are its own, unless no INSERT of kidx's can leave them out."""
    want = _made()[1]
    there = [
        r[0]
        for r in db.all(
            f"SELECT name FROM sqlite_schema WHERE type = 'table' AND name IN "
            f"({', '.join('?' * len(want))})",
            list(want),
        )
    ]
    out = {t: _unlike(_shape(db, t), want[t], source=t in SOURCE_TABLES) for t in there}
    return {t: d for t, d in out.items() if d}


def _rewritten(db: Database) -> list[tuple[str, str]]:
    """kidx's triggers and indexes whose SQL is not what kidx made: a host's `ALTER TABLE
    note_chunks RENAME TO old` rewrote the triggers that name it, and once `old` was dropped
    every DELETE of an item failed on `no such table: main.old`."""
    want = {(t, n): sql for t, n, _, sql in _reference() if t in ("index", "trigger")}
    return sorted(
        (t, n)
        for t, n, sql in db.all(
            "SELECT type, name, sql FROM sqlite_schema WHERE type IN ('index', 'trigger')"
        )
        if (t, n) in want and sql != want[(t, n)]
    )


def _refuse_altered(db: Database, altered: dict[str, list[str]]) -> None:
    lost = {t: d for t, d in altered.items() if t in SOURCE_TABLES}
    if lost:
        shown = "; ".join(f"{t} {', '.join(d)}" for t, d in sorted(lost.items()))
        raise StoreError(
            f"{db.path}: {shown} (altered outside kidx?): what it holds cannot be made again; "
            "put the table back as kidx made it, or restore a backup"
        )
    _refuse_foreign(db, list(altered))


def _refuse_foreign(db: Database, tables: list[str]) -> None:
    """A table of kidx's name with fewer than half of kidx's columns is not kidx's table with
    a column renamed but another's (a host's table of a name a later migration gives kidx's):
    refused, never dropped."""
    want = _made()[1]
    foreign = sorted(
        t
        for t in tables
        if 2 * len(set(want[t].columns) & set(_shape(db, t).columns)) < len(want[t].columns)
    )
    if foreign:
        raise StoreError(
            f"{db.path}: table {', '.join(foreign)} is not kidx's (it has few of kidx's "
            "columns: another application's?): kidx needs the name; rename it, or restore "
            "a backup"
        )


def _missing(db: Database) -> list[tuple[str, str, str, str]]:
    there = {(t, n) for t, n in db.all("SELECT type, name FROM sqlite_schema")}
    return [r for r in _reference() if (r[0], r[1]) not in there]


def _refuse_lost(db: Database, missing: list[tuple[str, str, str, str]]) -> None:
    lost = [n for t, n, _, _ in missing if t == "table" and n in SOURCE_TABLES]
    if lost:
        raise StoreError(
            f"{db.path} has kidx's tables but not {', '.join(lost)} (dropped outside kidx?): "
            "what it held cannot be made again; restore a backup (`kidx backup` makes one)"
        )
    names = [n for _, n, _, _ in missing]
    taken = sorted(
        r[0]
        for r in db.all(
            f"SELECT name FROM sqlite_schema WHERE name IN ({', '.join('?' * len(names))})",
            names,
        )
    )
    if taken:
        raise StoreError(
            f"{db.path}: {', '.join(taken)} is not what kidx made (another object took "
            "the name): drop or rename it, or restore a backup"
        )


def schema_problems(db: Database) -> tuple[str | None, list[str]]:
    """For `kidx doctor`, nothing written: why every kidx process refuses the file (a source
    table dropped or altered, a name taken), or None; and kidx's derived tables, indexes and
    triggers that the next connection or reconcile sweep makes again."""
    altered, missing = _altered(db), _missing(db)
    try:
        _refuse_altered(db, altered)
        if missing:
            _refuse_lost(db, missing)
    except StoreError as e:
        return str(e), []
    again = {f"{t} ({', '.join(d)})" for t, d in altered.items()}
    again |= {f"{n} (missing)" for _, n, _, _ in missing}
    again |= {f"{n} (not kidx's SQL)" for _, n in _rewritten(db)}
    return None, sorted(again)


def host_objects(db: Database) -> list[str]:
    """Triggers and indexes on kidx's tables that kidx did not make (a host's): one that
    refuses kidx's writes (a RAISE, an INSERT into a table the host dropped since, a UNIQUE
    kidx does not keep, an expression that fails on some text) fails every such write alike,
    and SQLite's words ("host says no", "malformed JSON") name neither it nor its table."""
    ours = {n for _, n, _, _ in _reference()}
    checks = {n: _checks(sql) for t, n, _, sql in _reference() if t == "table"}
    tables = set(_made()[1])
    try:
        rows = db.all(
            "SELECT type, name, tbl_name, sql FROM sqlite_schema "
            "WHERE type IN ('trigger', 'index', 'table') AND sql IS NOT NULL"
        )
    except apsw.Error:
        return []
    found = [
        f"{t} {n} on {tbl}"
        for t, n, tbl, _ in rows
        if t != "table" and tbl in tables and n not in ours
    ]
    # A CHECK of a host's in a kidx table it made again (or a column it added with one): the
    # table's shape is kidx's, so it is kept, and the CHECK refuses kidx's rows.
    found += [
        f"CHECK constraints on {n}"
        for t, n, _, sql in rows
        if t == "table" and n in checks and _checks(str(sql)) > checks[n]
    ]
    return found


def _checks(sql: str) -> int:
    """How many CHECK constraints a CREATE TABLE statement has (as SQLite keeps its text)."""
    return len(re.findall(r"\bCHECK\s*\(", sql, re.IGNORECASE))


def refused_by_host(db: Database, e: apsw.Error) -> StoreError | None:
    """A write SQLite refused (a constraint, or an error in a trigger or an index's
    expression) while a host has its own triggers or indexes on kidx's tables: the error
    naming them, and what to do; None when there are none, or the cause is another."""
    if not isinstance(e, apsw.ConstraintError | apsw.SQLError):
        return None
    theirs = host_objects(db)
    if not theirs:
        return None
    return StoreError(
        f"the database refused the write ({type(e).__name__}: {e}); not kidx's, on its tables: "
        f"{', '.join(theirs)}: drop (or fix) the one that refuses kidx's writes"
    )


@contextmanager
def named_refusals(db: Database) -> Iterator[None]:
    """Around a write a caller cannot go on without (adding an item or a memory, a job row):
    what a host's trigger or index refuses is raised as `refused_by_host`'s StoreError, naming
    it, where SQLite's words ("no jobs here") named neither it nor its table."""
    try:
        yield
    except apsw.Error as e:
        if (theirs := refused_by_host(db, e)) is not None:
            raise theirs from None
        raise
