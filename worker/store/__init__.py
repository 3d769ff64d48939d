"""The store: one `connect()` for the whole project, migrations, vec tables, repair."""

from __future__ import annotations

from pathlib import Path

from worker.settings import EmbeddingSettings, Settings
from worker.store.db import Database, Resolution
from worker.store.fts import sync_fts
from worker.store.repair import RepairReport, repair_vectors
from worker.store.schema import FTS_MIGRATION, migrate, schema_version
from worker.store.vec import (
    VEC_TABLES,
    resolve_dimensions,
    sync_vec_tables,
    vec_behind,
    vec_ready,
    vec_table_dimensions,
)

__all__ = [
    "VEC_TABLES",
    "Database",
    "RepairReport",
    "Resolution",
    "connect",
    "open_store",
    "repair_vectors",
    "resolve_dimensions",
    "vec_ready",
    "vec_table_dimensions",
]


def connect(
    path: str | Path,
    *,
    embedding: EmbeddingSettings | None = None,
    vec: bool = True,
    vec_path: str | Path | None = None,
    busy_timeout_ms: int = 30_000,
    create: bool = True,
    read_only: bool = False,
) -> Database:
    """Open the database: WAL, busy timeout, foreign keys, migrations, sqlite-vec when it loads,
    and the vec tables at the resolved dimension (rebuilt only when it changed). `create=False`:
    a missing file is a StoreError and nothing is created (commands that expect a database).

    `read_only`: for a process that only reads (`kidx search`, `status`, `chunks`). The vec
    tables are kept as they are, whatever the settings resolve to: a reader still configured
    with the old model during a model switch would otherwise rebuild them back to the old
    dimension and mark the items the workers have re-indexed `pending`. A search whose query
    has another dimension than the tables then scans the relational vectors exactly. A
    database marked `vec_behind` is read without its vec tables (they may hold stale vectors,
    worker.store.vec) until a writer or the sweep rebuilds them. (Migrations still run: the
    code reads only the current schema.)"""
    db = Database(path, busy_timeout_ms=busy_timeout_ms, create=create)
    try:
        before = schema_version(db)
        migrate(db)
        db.instance()  # named once, by whichever process opens it first
        if before < FTS_MIGRATION:
            sync_fts(db)  # the chunks a database already had get their keyword rows
        if vec:
            db.load_vec(vec_path)
        else:
            db.vec_error = "disabled by KIDX_VEC=off"
        db.resolution = resolve_dimensions(db, embedding or EmbeddingSettings())
        if not read_only:
            sync_vec_tables(db, db.resolution.dimensions)
        elif db.vec_loaded and vec_behind(db):
            db.vec_loaded = False
            db.vec_error = (
                "not used: vectors were written while the vec tables could not be; "
                "a writer or the sweep rebuilds them"
            )
    except BaseException:
        db.close()
        raise
    return db


def open_store(settings: Settings, *, create: bool = True, read_only: bool = False) -> Database:
    """`connect()` with everything taken from the settings."""
    return connect(
        settings.db,
        embedding=settings.embedding,
        vec=settings.vec,
        vec_path=settings.vec_path,
        busy_timeout_ms=settings.busy_timeout_ms,
        create=create,
        read_only=read_only,
    )
