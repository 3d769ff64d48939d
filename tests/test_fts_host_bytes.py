"""The keyword index's bookkeeping and rows as a host may leave them: bytes that are not UTF-8
in the `fts_rows` mark or in a keyword row's text (read as TEXT, they raised
UnicodeDecodeError in every reconcile sweep), and a view put in place of a keyword table (the
sweep could neither drop it nor make the table, and every item's write failed on it)."""

from __future__ import annotations

import pytest
from test_vec_tables_audit import FAKE, indexed

from conftest import FakeEmbedder
from host import host
from worker.reconcile import reconcile
from worker.retrieval import search_chunks
from worker.store import connect
from worker.store.fts import fts_counts


def keyword_hits(db, query: str) -> list[int]:
    return [h.chunk_id for h in search_chunks(db, query, None, k=20, mode="keyword").hits]


def swept(path) -> dict:
    db = connect(path, embedding=FAKE)
    try:
        return reconcile(db, model="fake", max_items=10).repaired["keyword_rows"]
    finally:
        db.close()


def test_a_mark_of_bytes_that_are_not_utf8_is_no_mark(tmp_path):
    path = tmp_path / "kidx.db"
    indexed(path, notes=3)
    host(
        path,
        (
            "INSERT OR REPLACE INTO index_meta(key, value) "
            "VALUES ('fts_rows', CAST(x'ff32' AS TEXT))",
            [],
        ),
    )
    assert swept(path) == {}  # every row compared once more: all as made now
    db = connect(path, embedding=FAKE)
    try:
        assert db.scalar("SELECT value FROM index_meta WHERE key = 'fts_rows'") == "2"
    finally:
        db.close()


@pytest.mark.parametrize("column", ["title", "headings", "content", "parts"])
def test_a_keyword_row_a_host_wrote_as_bytes_is_made_again(tmp_path, column):
    """Every sweep compares a row's text with its chunk's, and a slice of rows whole, their
    `parts` (the CamelCase words, made in Python) too (`WHOLE_SLICE`): bytes there raised in
    the sweep that read every row, and were left for good after it."""
    path = tmp_path / "kidx.db"
    indexed(path, notes=3)
    db = connect(path, embedding=FAKE)
    chunk = db.scalar("SELECT min(id) FROM note_chunks")
    want = keyword_hits(db, "alpha")
    db.close()
    assert chunk in want
    host(
        path,
        (f"UPDATE note_chunks_fts SET {column} = CAST(x'ff00fe' AS TEXT) WHERE rowid = ?", [chunk]),
        *([("DELETE FROM index_meta WHERE key = 'fts_rows'", [])] if column == "parts" else []),
    )
    assert swept(path) == {"note_chunks_fts rewritten": 1}
    db = connect(path, embedding=FAKE)
    try:
        assert keyword_hits(db, "alpha") == want
        assert swept(path) == {}
    finally:
        db.close()


def test_a_view_in_place_of_a_keyword_table_is_replaced_by_the_table(tmp_path):
    path = tmp_path / "kidx.db"
    ids = indexed(path, notes=3)
    db = connect(path, embedding=FAKE)
    want = keyword_hits(db, "alpha")
    db.close()
    host(
        path,
        ("DROP TABLE note_chunks_fts", []),
        ("CREATE VIEW note_chunks_fts AS SELECT id AS rowid, content FROM note_chunks", []),
    )
    repaired = swept(path)
    assert repaired.get("note_chunks_fts rebuilt") == 1, repaired
    db = connect(path, embedding=FAKE)
    try:
        kind = db.scalar("SELECT type FROM sqlite_master WHERE name = 'note_chunks_fts'")
        assert kind == "table" and fts_counts(db)["note_chunks_fts"] == {"stale": 0, "missing": 0}
        assert keyword_hits(db, "alpha") == want
        assert search_chunks(db, "alpha", FakeEmbedder(), k=5).hits
        assert ids
    finally:
        db.close()
