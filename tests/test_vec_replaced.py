"""A vec table a host replaced with a plain table or a view of the same name (an application
with sqlite-vec of its own, or one that dropped and re-made what it took for its table): the
rebuild made sqlite-vec's shadow tables for it first, dropped it, then could not create the
vec0 table ("vec_chunk_embeddings_info already exists"), and a view could not be dropped as a
table: every writer's connect() failed. Now the table is made again from the relational
vectors, with no provider call."""

from __future__ import annotations

import pytest
from test_vec_tables_audit import FAKE, exact, indexed, ranked, same

from conftest import DIMS, mirror_problems
from worker.store import connect, vec_table_dimensions
from worker.store.vec import vec_behind

REPLACEMENTS = {
    "a plain table": "CREATE TABLE {t}(chunk_id INTEGER PRIMARY KEY, embedding BLOB)",
    "a view": "CREATE VIEW {t} AS SELECT chunk_id, vector AS embedding FROM note_chunk_embeddings",
}


@pytest.mark.parametrize("table", ["vec_chunk_embeddings", "vec_chunk_bits"])
@pytest.mark.parametrize("replacement", sorted(REPLACEMENTS))
def test_a_vec_table_replaced_by_a_plain_table_or_a_view_is_made_again(
    tmp_path, table, replacement
):
    path = tmp_path / "kidx.db"
    indexed(path)
    want = exact(path)
    db = connect(path, embedding=FAKE)
    db.execute(f"DROP TABLE {table}")
    db.execute(REPLACEMENTS[replacement].format(t=table))
    db.close()
    db = connect(path, embedding=FAKE)  # a writer's connection rebuilds it
    try:
        kind, sql = db.one("SELECT type, sql FROM sqlite_master WHERE name = ?", (table,))
        assert kind == "table" and "USING vec0" in sql
        assert set(vec_table_dimensions(db).values()) == {DIMS}
        assert mirror_problems(db) == []
        via, hits = ranked(db)
        assert via == "vec" and same(hits, want)
    finally:
        db.close()


def test_vec_behind_is_read_whatever_bytes_a_host_wrote_as_its_value(tmp_path):
    """Its value was read as TEXT: bytes that are not UTF-8 raised UnicodeDecodeError in
    every connect() and sweep."""
    path = tmp_path / "kidx.db"
    indexed(path, notes=2)
    db = connect(path, embedding=FAKE)
    try:
        db.execute(
            "INSERT INTO index_meta(key, value) VALUES ('vec_behind', CAST(x'ff00fe' AS TEXT))"
        )
        assert vec_behind(db)
    finally:
        db.close()
    db = connect(path, embedding=FAKE)  # the mark is honoured: the mirror rebuilt, mark gone
    try:
        assert not vec_behind(db) and mirror_problems(db) == []
    finally:
        db.close()
