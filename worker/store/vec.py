"""The vec0 tables: a mirror of the relational vectors that can always be rebuilt.

Dimension resolution, in this order, with one refinement: the most recent embedding row counts
only if the configured model made it (with the configured `dimensions`, when that is set).
Otherwise a model switch could never rebuild the tables: the old model's rows would keep
winning, and the new model's vectors would have nowhere to go.

    1. `dimensions` of the most recent embedding row of the configured model
    2. the configured model's known dimension
    3. `KIDX_EMBEDDING__DIMENSIONS` (default 1536)

vec0 has no REPLACE and no UPSERT: a changed vector is always a DELETE then an INSERT.

Vectors written while the mirror cannot be (sqlite-vec off or failing to load, a table missing
or of another dimension) leave the database marked `vec_behind` in `index_meta`: a new vector
under a key the vec table already holds (a chunk id taken again after a delete, an item's or a
memory's new whole vector) would leave the old one there, under the right key, where no
comparison of keys finds it. The next connection that loads sqlite-vec, or the next full repair
(the reconcile sweep), rebuilds every vec table from the relational vectors then.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from worker.errors import StaleConfig
from worker.log import KI_EMBED, get_logger
from worker.settings import DEFAULT_DIMENSIONS, EmbeddingSettings
from worker.store.db import Database, Resolution, set_meta
from worker.store.fts import sync_fts

log = get_logger("kidx.store")


@dataclass(frozen=True)
class VecTable:
    name: str
    key: str  # the vec table's primary key column
    source: str  # the relational table of vectors it mirrors
    source_key: str
    element: str = "float"  # float: the vectors themselves; bit: their signs (a first pass)
    mirrors: str | None = None  # a quantized table: the float table it shadows

    def column(self, dimensions: int) -> str:
        if self.element == "bit":
            return f"embedding bit[{bit_width(dimensions)}]"  # hamming distance
        return f"embedding float[{dimensions}] distance_metric=cosine"

    def value(self, expr: str) -> str:
        """The SQL that turns a float32 blob (`expr`, evaluated up to three times: a column
        or a numbered parameter) into this table's element. sqlite-vec quantizes only whole
        bytes: a vector of a dimension that is not a multiple of 8 is padded with zero floats
        first, which quantize to 0 in every row and query alike (distances unchanged)."""
        if self.element != "bit":
            return expr
        return (
            f"vec_quantize_binary(CASE WHEN length({expr}) % 32 = 0 THEN {expr} "
            f"ELSE CAST({expr} || zeroblob(32 - length({expr}) % 32) AS BLOB) END)"
        )

    def insert(self) -> str:
        """INSERT of one (key, float32 blob) row, the blob made this table's element."""
        return f"INSERT INTO {self.name}({self.key}, embedding) VALUES (?1, {self.value('?2')})"


# sqlite-vec's vec0 declares no vector column longer (SQLITE_VEC_VEC0_MAX_DIMENSIONS).
VEC0_MAX_DIMENSIONS = 8192


def bit_width(dimensions: int) -> int:
    """The bits a quantized vector of `dimensions` takes in a `bit[N]` column: sqlite-vec
    needs N divisible by 8 (a model may have any dimension: OpenAI's `dimensions=100`)."""
    return -(-dimensions // 8) * 8


VEC_TABLES = (
    VecTable("vec_note_embeddings", "item_id", "note_embeddings", "item_id"),
    VecTable("vec_chunk_embeddings", "chunk_id", "note_chunk_embeddings", "chunk_id"),
    VecTable("vec_memories", "memory_id", "memory_embeddings", "memory_id"),
    VecTable("vec_work_code_chunks", "chunk_id", "code_chunk_embeddings", "chunk_id"),
    # The quantized mirrors: one bit a dimension, 32 times smaller than the floats, for the
    # first pass of a large search (worker.retrieval); written with their float table.
    VecTable(
        "vec_chunk_bits",
        "chunk_id",
        "note_chunk_embeddings",
        "chunk_id",
        "bit",
        "vec_chunk_embeddings",
    ),
    VecTable(
        "vec_note_bits", "item_id", "note_embeddings", "item_id", "bit", "vec_note_embeddings"
    ),
)
VEC = {t.name: t for t in VEC_TABLES}
MIRRORS = {t.name: tuple(m for m in VEC_TABLES if m.mirrors == t.name) for t in VEC_TABLES}
EMBEDDING_TABLES = tuple(dict.fromkeys(t.source for t in VEC_TABLES))
# A vec table's declaration, as sqlite_master keeps it: its module's arguments, and the shape
# of the one vector column kidx writes (`VecTable.column`).
_ARGS = re.compile(r"\busing\s+vec0\s*\((.*)\)\s*$", re.IGNORECASE | re.DOTALL)
_COLUMN = {
    "float": re.compile(r"embedding float\[(\d+)\] distance_metric=cosine"),
    "bit": re.compile(r"embedding bit\[(\d+)\]"),
}

# Items whose vectors (chunk, whole-item or code) are of another dimension than `?`.
ITEMS_WITH_OTHER_DIMENSIONS = """
SELECT c.item_id FROM note_chunks c JOIN note_chunk_embeddings e ON e.chunk_id = c.id
 WHERE e.dimensions != :d
UNION SELECT item_id FROM note_embeddings WHERE dimensions != :d
UNION SELECT c.item_id FROM code_chunks c JOIN code_chunk_embeddings e ON e.chunk_id = c.id
 WHERE e.dimensions != :d
"""


def sound(alias: str = "") -> str:
    """SQL: the embedding row (of table `alias`) holds a vector kidx can read: a BLOB of
    `dimensions` float32s. A host may write any value of any type (the schema's CHECK on the
    length lets TEXT through: it counts characters); a row that is not sound is read as no
    vector at all (the sweep embeds its item again), never into a search, a reuse or a vec
    table."""
    a = f"{alias}." if alias else ""
    return (
        f"typeof({a}dimensions) = 'integer' AND {a}dimensions > 0 AND "
        f"typeof({a}vector) = 'blob' AND length({a}vector) = 4 * {a}dimensions"
    )


_SOUND_ROW = sound()


def resolve_dimensions(db: Database, embedding: EmbeddingSettings) -> Resolution:
    """The dimension the index should have now, in the order of the module doc.

    A process with no provider (`none`: a CLI that only reads, a host's own tool) has no
    model to resolve from: it keeps the vec tables' dimension (or the most recent vector's),
    where the default model's would drop and rebuild them, and mark every item pending, at
    each command."""
    if embedding.provider == "none":
        return _kept_dimensions(db, embedding)
    where = "model = :model" + (" AND dimensions = :dims" if embedding.dimensions else "")
    latest = _latest_dimensions(db, where, {"model": embedding.model, "dims": embedding.dimensions})
    model = embedding.model
    if latest is not None:
        return Resolution(latest, "embedding row", model)
    known = embedding.model_dimensions()
    if known:
        return Resolution(known, "model", model)
    return Resolution(embedding.dimensions or DEFAULT_DIMENSIONS, "setting", model)


def _kept_dimensions(db: Database, embedding: EmbeddingSettings) -> Resolution:
    declared = [d for d in vec_table_dimensions(db).values() if d]
    if declared:
        return Resolution(max(declared, key=declared.count), "vec tables")
    latest = _latest_dimensions(db, "1", {})
    if latest is not None:
        return Resolution(latest, "embedding row")
    return Resolution(embedding.dimensions or DEFAULT_DIMENSIONS, "setting")


def _latest_dimensions(db: Database, where: str, params: dict[str, object]) -> int | None:
    """The dimension of the most recent sound embedding row, of any table, matching `where`."""
    union = " UNION ALL ".join(
        f"SELECT dimensions, created_at FROM {table} WHERE {where} AND {_SOUND_ROW}"
        for table in EMBEDDING_TABLES
    )
    row = db.one(f"SELECT dimensions FROM ({union}) ORDER BY created_at DESC LIMIT 1", params)
    return None if row is None else int(row[0])


def vec_table_dimensions(db: Database) -> dict[str, int | None]:
    """Each vec table's declared dimension, read from its definition (None: missing, or not
    of the shape kidx makes: `_declared`; a rebuild then makes it again, and search by vector
    falls back to exact until it has)."""
    result: dict[str, int | None] = {t.name: None for t in VEC_TABLES}
    for name, sql in db.all(
        "SELECT name, sql FROM sqlite_master WHERE type = 'table' "
        f"AND name IN ({','.join('?' * len(VEC_TABLES))})",
        [t.name for t in VEC_TABLES],
    ):
        result[name] = _declared(VEC[name], sql if isinstance(sql, str) else "")
    for t in VEC_TABLES:  # a quantized table has its float table's dimension, in whole bytes
        floats = result.get(t.mirrors or "")
        if t.mirrors and floats and result[t.name] == bit_width(floats):
            result[t.name] = floats
    return result


def _declared(t: VecTable, sql: str) -> int | None:
    """The dimension of a vec0 declaration of exactly kidx's two columns (`t.key` and the
    `VecTable.column` of its element; case, spacing and quotes aside), else None. A table of
    another shape is not a mirror kidx can use: without `distance_metric=cosine` (sqlite-vec's
    default is L2, the seed's own application's table) its distances are not cosine ones, and
    another key or more columns do not take kidx's rows."""
    m = _ARGS.search(sql)
    if m is None:
        return None
    args = [
        re.sub(r"\s*=\s*", "=", " ".join(a.replace('"', "").replace("`", "").split())).lower()
        for a in m.group(1).split(",")
    ]
    if len(args) != 2 or args[0] != f"{t.key} integer primary key":
        return None
    column = _COLUMN[t.element].fullmatch(args[1])
    return int(column.group(1)) if column else None


VEC_BEHIND = "vec_behind"


def vec_behind(db: Database) -> bool:
    """Whether vectors were written while the mirror could not be (the module doc). The mark
    is the row, not its value (which a host may have written as any bytes)."""
    return db.scalar("SELECT 1 FROM index_meta WHERE key = ?", (VEC_BEHIND,)) is not None


# The embedding configuration the index is kept for, `{"model", "dimensions"}`: that of the
# last writer connection that opened it (the newest process: a rolling restart's new worker).
INDEX_CONFIG = "embedding_config"


def _record(db: Database) -> dict[str, object]:
    raw = db.scalar("SELECT CAST(value AS BLOB) FROM index_meta WHERE key = ?", (INDEX_CONFIG,))
    try:
        found = json.loads(raw) if isinstance(raw, bytes) else None
    except (ValueError, RecursionError):
        return {}  # a host's value: the next writer connection writes it
    return found if isinstance(found, dict) else {}


def index_config(db: Database) -> tuple[str, int] | None:
    """The (model, dimensions) the index is kept for, as its last writer recorded it."""
    found = _record(db)
    model, dims = found.get("model"), found.get("dimensions")
    return (model, dims) if isinstance(model, str) and type(dims) is int else None


def claimed_since(db: Database, configured_at: float | None) -> bool:
    """Whether the index was claimed after `configured_at` (None: unknown, never). A claim
    recorded in the future (a clock set back since, a host's year 9999 or Infinity) is no
    time: it made every worker started before it refuse, the old model's index kept."""
    at = _record(db).get("at")
    return (
        configured_at is not None
        and isinstance(at, int | float)
        and configured_at < at <= time.time()
    )


def claim_config(db: Database) -> None:
    """Record this writer connection's model and dimension as the index's (connect()). Another
    one recorded before is a model switch (or a process of an old configuration started
    again): logged, naming both."""
    if claimed(db):
        return
    assert db.resolution is not None and db.resolution.model is not None
    mine = (db.resolution.model, db.resolution.dimensions)
    with db.atomic():
        before = index_config(db)  # again, under the write lock
        record = {"model": mine[0], "dimensions": mine[1], "at": time.time()}
        set_meta(db, INDEX_CONFIG, json.dumps(record))
    if before is not None and before != mine:
        log.warning(
            f"{KI_EMBED} the index's embedding model switched from {_named(before)} to "
            f"{_named(mine)}: processes still configured for {_named(before)} refuse to write "
            "until restarted with the new settings"
        )


def claimed(db: Database) -> bool:
    """Whether the index is recorded as this connection's model's, or this connection has no
    model (no provider: it writes no vector, and decides nothing)."""
    res = db.resolution
    if res is None or res.model is None:
        return True
    return index_config(db) == (res.model, res.dimensions)


def _named(config: tuple[str, int]) -> str:
    return f"{config[0]} ({config[1]} dimensions)"


def config_conflict(db: Database) -> str | None:
    """One line when the index is kept for another model or dimension than this
    connection's (`claim_config`: another process switched it since this one opened it, or
    this one, not claiming, opened an index of another model), else None. A worker not yet
    restarted after a model switch wrote its vectors, marking the mirror behind,
    and its sweep rebuilt the vec tables back to its dimension, marked the new model's items
    pending and sent them to be embedded again by the old model: both models' workers undid
    each other's work for as long as both ran."""
    res = db.resolution
    if res is None or res.model is None:
        return None
    mine, theirs = (res.model, res.dimensions), index_config(db)
    if theirs is None or theirs == mine:
        return None
    return (
        f"the index is kept for {_named(theirs)} (the model of the last process that started "
        f"indexing), this process is configured for {_named(mine)}: if {theirs[0]} is the "
        "model wanted, give this process its KIDX_EMBEDDING__MODEL/DIMENSIONS (a worker: "
        f"restart it with them; a shell: fix its .env); if {mine[0]} is, restart the "
        f"processes still on {theirs[0]}"
    )


def refuse_stale(db: Database) -> None:
    """Raise StaleConfig when `config_conflict` says this connection's model is not the
    index's any more."""
    if (conflict := config_conflict(db)) is not None:
        raise StaleConfig(conflict)


def mirror_ready(db: Database, dimensions: int) -> bool:
    """`vec_ready`, for a writer of vectors: when the mirror cannot be written now, the
    database is marked `vec_behind`, for a later rebuild. Every writer of vectors asks it in
    its write transaction: one of a configuration the index no longer has is refused there
    (`refuse_stale`), nothing written."""
    refuse_stale(db)
    ready = vec_ready(db, dimensions)
    if not ready:
        set_meta(db, VEC_BEHIND, "1")
    return ready


def sync_vec_tables(db: Database, dimensions: int) -> bool:
    """Make the vec tables exist with `dimensions`; rebuild those that differ, or all of them
    when the database is marked `vec_behind`.

    Returns True when a rebuild happened. A rebuild drops and re-creates each table of another
    dimension (or missing: a database from before the quantized mirrors gets only those), re-fills
    it from the relational vectors of that dimension and marks items whose vectors have another
    dimension `pending`, all in one transaction. Nothing is written when all is in order, so
    opening a connection does not re-mirror anything.
    """
    if not db.vec_loaded:
        return False
    if not vec_behind(db) and all(d == dimensions for d in vec_table_dimensions(db).values()):
        return False
    with db.atomic():
        before = vec_table_dimensions(db)  # again, under the write lock
        behind = vec_behind(db)
        wrong = [t for t in VEC_TABLES if behind or before[t.name] != dimensions]
        # A quantized table goes with its float table: one whose float table a host dropped
        # reads as its bit width (9 dimensions -> bit[16]), as if of a 16-dimension model.
        wrong += [m for t in list(wrong) for m in MIRRORS[t.name] if m not in wrong]
        if not wrong:
            return False
        refilled = {t.name: rebuild_vec_table(db, t, dimensions) for t in wrong}
        pending = db.execute(
            "UPDATE item_index_state SET status = 'pending', "
            "updated_at = strftime('%Y-%m-%dT%H:%M:%fZ', 'now') "
            f"WHERE item_id IN ({ITEMS_WITH_OTHER_DIMENSIONS}) RETURNING item_id",
            {"d": dimensions},
        ).fetchall()
        set_meta(db, "vec_dimensions", str(dimensions))
        db.execute("DELETE FROM index_meta WHERE key = ?", (VEC_BEHIND,))
        sync_fts(db)  # rebuilt with the vec tables: a switch mends the keyword index too
    old = sorted({d for d in before.values() if d})
    (log.warning if old else log.info)(
        f"{KI_EMBED} vec tables rebuilt" if old else f"{KI_EMBED} vec tables created",
        old_dimensions=old or None,
        dimensions=dimensions,
        refilled=refilled,
        items_pending=len(pending),
        **({"reason": "vectors were written while the mirror could not be"} if behind else {}),
    )
    return True


_VEC0 = re.compile(rb"(?is)\s*create\s+virtual\s+table\s.*?\busing\s+vec0\b")
# sqlite-vec 0.1's shadow tables of a vec0 table `{t}`: their declarations, as it makes them.
SHADOWS = {
    "info": "(key text primary key, value any)",
    "chunks": "(chunk_id INTEGER PRIMARY KEY AUTOINCREMENT,size INTEGER NOT NULL,"
    "validity BLOB NOT NULL,rowids BLOB NOT NULL)",
    "rowids": "(rowid INTEGER PRIMARY KEY AUTOINCREMENT,id,chunk_id INTEGER,chunk_offset INTEGER)",
    "vector_chunks00": "(rowid PRIMARY KEY,vectors BLOB NOT NULL)",
}


def rebuild_vec_table(db: Database, t: VecTable, dimensions: int) -> int:
    """Drop `t`, make it again with `dimensions` and refill it from the relational vectors of
    that dimension (no provider call); how many rows. Inside the caller's transaction.

    vec0 cannot drop a table one of whose shadow tables a host dropped ("SQL logic error",
    and from then on for as long as the connection lasts): those are made again, empty, first.
    A plain table or a view a host put in its place is dropped as what it is, with any table
    named as a shadow of this one (vec0 would refuse to make its own: "already exists")."""
    found = db.one(
        "SELECT type, CAST(sql AS BLOB) FROM sqlite_master WHERE name = ? "
        "AND type IN ('table', 'view')",
        (t.name,),
    )
    if found is not None and found[0] == "view":
        db.execute(f"DROP VIEW {t.name}")
    elif found is not None and _VEC0.match(bytes(found[1] or b"")):
        for shadow, declaration in SHADOWS.items():
            db.execute(f'CREATE TABLE IF NOT EXISTS "{t.name}_{shadow}"{declaration}')
        db.execute(f"DROP TABLE {t.name}")
    else:
        db.execute(f"DROP TABLE IF EXISTS {t.name}")
        for shadow in SHADOWS:
            db.execute(f'DROP TABLE IF EXISTS "{t.name}_{shadow}"')
    db.execute(
        f"CREATE VIRTUAL TABLE {t.name} USING vec0({t.key} INTEGER PRIMARY KEY, "
        f"{t.column(dimensions)})"
    )
    db.execute(
        f"INSERT INTO {t.name}({t.key}, embedding) "
        f"SELECT {t.source_key}, {t.value('vector')} FROM {t.source} "
        f"WHERE dimensions = ? AND {_SOUND_ROW}",
        (dimensions,),
    )
    return int(
        db.scalar(
            f"SELECT count(*) FROM {t.source} WHERE dimensions = ? AND {_SOUND_ROW}",
            (dimensions,),
        )
    )


def vec_table_damage(db: Database, t: VecTable, dimensions: int) -> str | None:
    """What is wrong with the shadow tables of `t` (of `dimensions`), that no row-by-row
    repair mends, or None: one missing; a chunk whose size, validity bitmap, rowid list or
    vector blob do not agree (sqlite-vec then fails every search: "vectors blob size doesn't
    match"); a row that points into no chunk (a search never finds it), or into another
    row's slot. Lengths only: no vector is read."""
    for shadow in SHADOWS:
        if not db.table_exists(f"{t.name}_{shadow}"):
            return f"its shadow table {t.name}_{shadow} is missing"
    width = bit_width(dimensions) // 8 if t.element == "bit" else 4 * dimensions
    chunks, rowids, vectors = (f'"{t.name}_{s}"' for s in ("chunks", "rowids", "vector_chunks00"))
    bad_chunk = db.one(
        f"SELECT c.chunk_id FROM {chunks} c LEFT JOIN {vectors} v ON v.rowid = c.chunk_id "
        "WHERE NOT (typeof(c.size) = 'integer' AND c.size > 0 AND c.size % 8 = 0 "
        "AND typeof(c.validity) = 'blob' AND length(c.validity) = c.size / 8 "
        "AND typeof(c.rowids) = 'blob' AND length(c.rowids) = 8 * c.size "
        "AND typeof(v.vectors) = 'blob' AND length(v.vectors) = :width * c.size) LIMIT 1",
        {"width": width},
    )
    if bad_chunk is not None:
        return f"chunk {bad_chunk[0]} of {t.name} does not add up"
    valid = sum(
        int.from_bytes(bitmap).bit_count() for (bitmap,) in db.all(f"SELECT validity FROM {chunks}")
    )
    rows = db.scalar(f"SELECT count(*) FROM {rowids}")
    if valid != rows:
        return f"{t.name} has {valid} vectors marked valid for another number of rows"
    stray = db.one(
        f"SELECT r.rowid FROM {rowids} r LEFT JOIN {chunks} c ON c.chunk_id = r.chunk_id "
        "WHERE c.chunk_id IS NULL OR typeof(r.chunk_offset) != 'integer' "
        "OR r.chunk_offset < 0 OR r.chunk_offset >= c.size LIMIT 1"
    )
    if stray is not None:
        return f"row {stray[0]} of {t.name} points into no chunk"
    # Two rows in one slot: each sweep's verify rewrote one of them, and the other's vector
    # then came back for both, for good (0.15 s at a million rows)
    slots = f"SELECT count(*) FROM (SELECT DISTINCT chunk_id, chunk_offset FROM {rowids})"
    if db.scalar(slots) != rows:
        return f"rows of {t.name} share a slot of its chunks"
    return None


def vec_ready(db: Database, dimensions: int) -> bool:
    """sqlite-vec is loaded and all four tables exist with this dimension."""
    return db.vec_loaded and all(d == dimensions for d in vec_table_dimensions(db).values())


def vec_replace(db: Database, table: str, key: int, vector: bytes) -> None:
    """Write one vector to a float table and its mirrors: DELETE then INSERT (vec0 rejects
    REPLACE)."""
    vec_delete(db, table, [key])
    vec_insert(db, table, [(key, vector)])


def vec_insert(db: Database, table: str, rows: list[tuple[int, bytes]]) -> None:
    """Insert (key, float32 blob) rows into a float table and its mirrors (keys not there)."""
    for t in (VEC[table], *MIRRORS[table]):
        db.executemany(t.insert(), rows)


def vec_delete(db: Database, table: str, keys: list[int]) -> None:
    """Delete rows of a float table and of its mirrors."""
    for t in (VEC[table], *MIRRORS[table]):
        db.executemany(f"DELETE FROM {t.name} WHERE {t.key} = ?", [(key,) for key in keys])


def vec_delete_from(db: Database, table: str, first: int) -> None:
    """Delete the rows of a float table and of its mirrors whose key is `first` or more: the
    strays under the ids a writer is about to give new rows. vec0 answers a range of keys
    only by reading every row, so the keys come from its `_rowids` shadow table (keyed by
    them) when it has one; a DELETE a key, as before, cost the bulk write a tenth of its
    write lock (bench/write_path.py)."""
    for t in (VEC[table], *MIRRORS[table]):
        shadow = f"{t.name}_rowids"
        source = shadow if db.table_exists(shadow) else t.name
        column = "rowid" if source == shadow else t.key
        keys = db.all(f'SELECT {column} FROM "{source}" WHERE {column} >= ?', (first,))
        db.executemany(f"DELETE FROM {t.name} WHERE {t.key} = ?", keys)
