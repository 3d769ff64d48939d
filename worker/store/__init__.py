"""The store: one `connect()` for the whole project, migrations, vec tables, repair."""

from __future__ import annotations

import re
from pathlib import Path

import apsw

from worker.errors import StoreError
from worker.log import KI_EMBED, get_logger
from worker.settings import EmbeddingSettings, Settings
from worker.store.db import Database, Resolution
from worker.store.repair import RepairReport, repair_vectors
from worker.store.schema import (
    MIGRATIONS,
    migrate,
    named_refusals,
    restore_dropped,
)
from worker.store.vec import (
    VEC0_MAX_DIMENSIONS,
    VEC_TABLES,
    claim_config,
    claimed,
    claimed_since,
    config_conflict,
    resolve_dimensions,
    sync_vec_tables,
    vec_behind,
    vec_ready,
    vec_table_dimensions,
)

log = get_logger("kidx.store")

__all__ = [
    "VEC_TABLES",
    "Database",
    "RepairReport",
    "Resolution",
    "connect",
    "open_store",
    "refuse_foreign",
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
    claim: bool = True,
    configured_at: float | None = None,
    adopt: bool = False,
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
    code reads only the current schema.)

    `claim`: this process indexes with its model: the index becomes that model's (rebuilt
    at its dimension, `claim_config`), and any other process still on the model it had
    refuses to write vectors from then on (`config_conflict`). Without it (a command that
    writes no vector: `kidx add` without `--inline`, `update`, `delete`, `reindex`), a
    database kept for another model is left as it is, with one warning: a shell with a
    stale .env switched every worker's index back to the old model. `configured_at` (a
    time.time()): when this process's settings were read; an index another model claimed
    since is not claimed back (a pool process that a worker of the old model forks after the
    switch, to replace one, has that worker's old settings). `adopt`: kidx's tables may be
    added to a file that holds another program's (`kidx init` only: `refuse_foreign`)."""
    refuse_foreign(Path(path), must_be_kidx=not create, adopt=adopt)
    db = Database(path, busy_timeout_ms=busy_timeout_ms, create=create)
    try:
        migrate(db)
        if restored := restore_dropped(db):
            log.warning(
                "kidx's tables, indexes or triggers dropped or altered outside kidx were made "
                "again: the sweep refills them",
                restored=restored,
            )
        db.instance()  # named once, by whichever process opens it first
        if vec:
            db.load_vec(vec_path)
        else:
            db.vec_error = "disabled by KIDX_VEC=off"
        db.resolution = resolve_dimensions(db, embedding or EmbeddingSettings())
        if db.vec_loaded and db.resolution.dimensions > VEC0_MAX_DIMENSIONS:
            # (vec0 refuses the table: every process failed to open the file)
            db.vec_loaded = False
            db.vec_error = (
                f"not used: {db.resolution.dimensions} dimensions is past sqlite-vec's "
                f"{VEC0_MAX_DIMENSIONS}; search is exact, in memory"
            )
        conflict = config_conflict(db)
        claim = claim and not (conflict is not None and claimed_since(db, configured_at))
        rebuilds = not read_only and (claim or conflict is None)
        if conflict is not None and not (claim and not read_only):
            log.warning(f"{KI_EMBED} {conflict}")
        # (a host's trigger that refuses the rebuild's writes is named, not SQLite's words)
        if rebuilds and claim and not claimed(db):
            # The newest indexing process's model is the index's (a rolling restart): its
            # rebuild and its record in one transaction, or two processes starting together
            # could leave the tables at one's dimension and the record naming the other.
            with named_refusals(db), db.atomic():
                sync_vec_tables(db, db.resolution.dimensions)
                claim_config(db)
        elif rebuilds:
            with named_refusals(db):
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


# The tables kidx's first migrations create: a file that has one of them without kidx's schema
# is another application's, and migrating it would fail half-way or mix the two.
_KIDX_TABLES = frozenset(
    re.findall(r"CREATE TABLE IF NOT EXISTS (\w+)", " ".join(sql for _, sql in MIGRATIONS))
)


def refuse_foreign(path: Path, *, must_be_kidx: bool, adopt: bool = False) -> None:
    """Refuse, before anything is written (even the switch to WAL), a file that is not a
    kidx database: one with tables of kidx's names but no kidx schema (another application's);
    for a command that expects kidx's database (`must_be_kidx`: every one but `init` and
    `add`), any file without kidx's schema; and for any but `init` (`adopt`), a file with
    tables that are not kidx's (`kidx add --db` mistyped gave another program's database 112
    of kidx's objects and WAL mode). A host's own tables beside kidx's are fine: `kidx init`
    adds kidx's tables to such a file, and nothing else does."""
    if str(path) == ":memory:" or not path.is_file():
        return
    try:
        conn = apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    except apsw.Error:
        return  # Database() says what is wrong with it
    try:
        names = [r[0] for r in conn.execute("SELECT name FROM sqlite_schema WHERE type = 'table'")]
        if "index_meta" in names:
            row = conn.execute(  # (not its value: a host's may not be UTF-8)
                "SELECT 1 FROM index_meta WHERE key = 'schema_version'"
            ).fetchone()
            if row is not None:
                return  # kidx's (schema_version says more, once open)
    except apsw.Error:
        return  # not a database, locked, damaged: Database() and the migrations say so
    finally:
        conn.close()
    theirs = sorted(n for n in names if not n.startswith("sqlite_"))
    clash = sorted(set(theirs) & _KIDX_TABLES)
    if clash:
        lost = (
            "the schema_version row of its index_meta was deleted"
            if "index_meta" in names
            else "its index_meta table was dropped"
        )
        raise StoreError(
            f"{path} is not a kidx database but has tables of kidx's names ({', '.join(clash)}): "
            "it belongs to another application (point KIDX_DB at another file), or it is kidx's "
            f"and {lost} (restore a backup)"
        )
    if must_be_kidx or (theirs and not adopt):
        shown = ", ".join(theirs[:5]) + (", ..." if len(theirs) > 5 else "")
        has = f" (it has tables {shown})" if theirs else " (it is empty)"
        raise StoreError(
            f"{path} is not a kidx database{has}: run `kidx init` to add kidx's tables to it, "
            "or point KIDX_DB at another file"
        )


def open_store(
    settings: Settings,
    *,
    create: bool = True,
    read_only: bool = False,
    claim: bool = True,
    configured_at: float | None = None,
    adopt: bool = False,
) -> Database:
    """`connect()` with everything taken from the settings."""
    return connect(
        settings.db,
        embedding=settings.embedding,
        vec=settings.vec,
        vec_path=settings.vec_path,
        busy_timeout_ms=settings.busy_timeout_ms,
        create=create,
        read_only=read_only,
        claim=claim,
        configured_at=configured_at,
        adopt=adopt,
    )
