"""The store against a fifth review: a model past sqlite-vec's 8192 dimensions made every
process fail to open the file; an upgrade stopped between its migration and the keyword fill
left keyword search empty for good; a quantized table outlived its float table's rebuild; a
host's trigger that refused a model switch's writes was not named."""

from __future__ import annotations

import apsw
import pytest

from conftest import FakeEmbedder, standin_settings
from worker.bulk import index_items
from worker.errors import StoreError
from worker.retrieval import search_chunks
from worker.store import connect
from worker.store.db import Database, set_meta
from worker.store.items import add_item
from worker.store.schema import MIGRATIONS, _statements, migrate
from worker.store.vec import vec_table_dimensions


def test_a_model_past_sqlite_vecs_8192_dimensions_is_searched_exactly(db_path, standin):
    """vec0 refuses a column of more than 8192 dimensions: `connect` raised its constructor
    error, so no worker could start and `kidx init` failed. Now the index is kept without
    vec tables and searched exactly, in memory."""
    settings = standin_settings(standin, dimensions=9000, model="big")
    db = connect(db_path, embedding=settings)
    try:
        assert not db.vec_loaded and "past sqlite-vec's 8192" in (db.vec_error or "")
        fake = FakeEmbedder(9000, model_id="big")
        item = add_item(db, kind="note", title="Big", content="Platypus eggs hatch. " * 20)
        assert index_items(db, [item], embedder=fake)[item].status == "indexed"
        found = search_chunks(db, "Platypus eggs hatch.", embedder=fake, k=1, mode="vector")
        assert [h.item_id for h in found.hits] == [item]
    finally:
        db.close()


def _version_5(path) -> Database:
    """A database as kidx of schema 5 left it (before the keyword tables), with one chunk."""
    old = Database(path)
    for number, sql in MIGRATIONS[:5]:
        for statement in _statements(sql):
            old.execute(statement)
        set_meta(old, "schema_version", str(number))
    old.execute(
        "INSERT INTO knowledge_items(id, kind, title, content) VALUES (1, 'note', 'T', 'x')"
    )
    old.execute(
        "INSERT INTO note_chunks(item_id, chunk_index, content, method, start_offset, "
        "end_offset, embed_hash) VALUES (1, 0, 'the wombat sleeps', 'structure', 0, 17, 'e')"
    )
    return old


def test_the_upgrade_that_makes_the_keyword_tables_fills_them_in_its_transaction(db_path):
    """The keyword rows of the chunks a database had were added by `connect` after the
    migration committed: a process stopped between the two (a deploy's restart) left the
    version saying done and keyword search empty until a sweep, for good without beat."""
    old = _version_5(db_path)
    migrate(old)  # ... and the process stops here
    assert old.scalar("SELECT count(*) FROM note_chunks_fts WHERE note_chunks_fts MATCH 'wombat'")
    old.close()


def test_a_quantized_table_is_rebuilt_with_its_float_table(db_path, standin, host):
    """A host dropped the float chunk table of a 9-dimension index (its bit table is bit[16]);
    a switch to 16 dimensions rebuilt the float table, and kept the bit table's old rows: it
    read as 16 dimensions."""
    first = connect(db_path, embedding=standin_settings(standin, dimensions=9, model="m1"))
    item = add_item(first, kind="note", title="T", content="Nine dimensions. " * 10)
    index_items(first, [item], embedder=FakeEmbedder(9, model_id="m1"))
    assert first.scalar("SELECT count(*) FROM vec_chunk_bits")
    first.close()
    host.enable_load_extension(True)
    host.load_extension(__import__("sqlite_vec").loadable_path())
    host.execute("DROP TABLE vec_chunk_embeddings")
    second = connect(db_path, embedding=standin_settings(standin, dimensions=16, model="m2"))
    try:
        assert set(vec_table_dimensions(second).values()) == {16}
        assert second.scalar("SELECT count(*) FROM vec_chunk_bits") == 0
    finally:
        second.close()


def test_a_host_trigger_that_refuses_a_model_switch_is_named(db_path, standin, host):
    first = connect(db_path, embedding=standin_settings(standin, dimensions=8, model="m1"))
    item = add_item(first, kind="note", title="T", content="Eight dimensions. " * 10)
    index_items(first, [item], embedder=FakeEmbedder(8, model_id="m1"))
    first.close()
    host.execute(
        "CREATE TRIGGER host_audit BEFORE UPDATE OF status ON item_index_state "
        "BEGIN SELECT RAISE(ABORT, 'audit table full'); END"
    )
    with pytest.raises(StoreError, match="trigger host_audit on item_index_state"):
        connect(db_path, embedding=standin_settings(standin, dimensions=16, model="m2"))
    assert isinstance(host, apsw.Connection)
