"""Memories against a careless or hostile host application, found by an audit: a bare apsw
connection (foreign keys off, no sqlite-vec) writes kidx's memory tables with plain SQL, and
`search_memories`, `embed_memories` and `memories_missing` must neither crash, nor return a
memory twice or deleted, nor leave one without its vector for good."""

from __future__ import annotations

import apsw
import pytest

from conftest import mirror_problems
from worker.indexers.memories import add_memory, embed_memories, memories_missing, search_memories
from worker.reconcile import reconcile
from worker.store import connect


def host(db_path) -> apsw.Connection:
    """A host application's connection: plain SQLite, foreign keys off, no sqlite-vec."""
    return apsw.Connection(str(db_path))


@pytest.mark.parametrize("refused_at", ["9999-01-01T00:00:00Z", 2_999_999.5])
def test_a_refusal_dated_in_the_future_does_not_hide_its_memory_for_good(
    db, db_path, embedder, standin, refused_at
):
    """A refusal was skipped while younger than a day, measured as now less its date: one
    dated in the future (a host's row; a Julian day number, which SQLite takes as a date; a
    clock set back since) was younger than a day until that date. Its memory was never
    embedded (year 9999: for good) and no sweep sent a run for it. Such a refusal is none."""
    h = host(db_path)
    h.execute("INSERT INTO memories(id, content) VALUES (1, 'The user likes tea.')")
    h.execute(
        "INSERT INTO memory_refusals(memory_id, model, content, reason, refused_at) "
        "SELECT id, ?, CAST(content AS BLOB), 'refused', ? FROM memories",
        (embedder.model_id, refused_at),
    )
    h.close()
    assert memories_missing(db, embedder.model_id) == 1
    report = embed_memories(db, embedder)
    assert (report.embedded, report.left, report.refused) == (1, 0, 0)
    assert standin.texts == ["The user likes tea."]
    assert db.scalar("SELECT count(*) FROM memory_refusals") == 0


def test_a_memory_is_never_found_twice_when_a_host_emptied_vec_memories_rowids(
    db, db_path, embedder
):
    """vec0 finds a key through its `_rowids` table: a host's DELETE there left the vector in
    its chunk, which the next write of that memory (its text changed) could not delete, and
    the new vector went beside it. Search returned the memory twice, once scored by its old
    text, until a sweep rebuilt the table. A KNN that gives a key twice is storage that
    cannot be trusted: the exact path serves, with the reason."""
    texts = ["The user likes tea.", "The user lives in Oslo.", "The user has a cat."]
    ids = [add_memory(db, text, embedder) for text in texts]
    h = host(db_path)
    h.execute("DELETE FROM vec_memories_rowids WHERE rowid = ?", (ids[0],))
    h.execute("UPDATE memories SET content = 'The user likes coffee.' WHERE id = ?", (ids[0],))
    h.close()
    assert embed_memories(db, embedder).embedded == 1
    hits, via, reason = search_memories(db, "The user likes coffee.", embedder, k=4)
    assert sorted(h.memory_id for h in hits) == sorted(ids)  # each once
    assert hits[0].memory_id == ids[0] and hits[0].score > 0.99
    assert via == "fallback" and "vec_memories" in str(reason)
    reconcile(db, model=embedder.model_id, max_items=10)  # the sweep rebuilds the table
    again, via, _ = search_memories(db, "The user likes coffee.", embedder, k=4)
    assert via == "vec" and [h.memory_id for h in again] == [h.memory_id for h in hits]


def test_a_memory_whose_vec_row_cannot_be_written_keeps_its_vector_and_the_run_goes_on(
    db, db_path, embedder
):
    """A host that emptied vec0's storage of vec_memories (its `_vector_chunks00` rows) made
    every write of a memory's vec row fail ("Could not fetch vector data"): `embed_memories`
    raised apsw.SQLError, its batch's vectors rolled back, and `add_memory` (`kidx add
    memory`) failed the same way. The relational vector is written all the same now, the
    database marked `vec_behind`, and the sweep rebuilds the mirror from it."""
    first = add_memory(db, "The user likes tea.", embedder)
    other = add_memory(db, "The user lives in Oslo.", embedder)
    h = host(db_path)
    h.execute("DELETE FROM vec_memories_vector_chunks00")
    h.execute("UPDATE memories SET content = 'The user likes coffee.' WHERE id = ?", (first,))
    h.close()
    report = embed_memories(db, embedder)
    assert (report.embedded, report.left, report.error) == (1, 0, None)
    added = add_memory(db, "The user has a cat.", embedder)
    assert memories_missing(db, embedder.model_id) == 0
    assert db.scalar("SELECT 1 FROM index_meta WHERE key = 'vec_behind'") == 1
    hits, via, _ = search_memories(db, "The user likes coffee.", embedder, k=3)
    assert hits[0].memory_id == first and hits[0].score > 0.99 and via == "fallback"
    reconcile(db, model=embedder.model_id, max_items=10)
    assert mirror_problems(db) == []
    again, via, _ = search_memories(db, "The user has a cat.", embedder, k=3)
    assert via == "vec" and again[0].memory_id == added
    assert {h.memory_id for h in again} == {first, other, added}


def test_a_deleted_memory_s_vector_never_answers_for_the_memory_given_its_id(
    db, db_path, emb_settings, embedder
):
    """`memories.id` is SQLite's rowid: a host that deletes the last memory and inserts
    another gets the same id. Embedded by a worker without sqlite-vec (KIDX_VEC=off), the new
    vector is relational only and the database marked `vec_behind`; the deleted memory's vec
    row stayed under that id. A search connection opened before (a long-lived process) ranked
    by it: the new memory came first, at 1.0, for the deleted memory's text. Only a connection
    opened afterwards (read-only) knew not to use the vec tables. Every search checks the mark
    now: the exact path serves until the sweep rebuilds them."""
    texts = ["The user lives in Oslo.", "The user has a cat.", "The user likes tea."]
    ids = [add_memory(db, text, embedder) for text in texts]
    h = host(db_path)
    h.execute("DELETE FROM memories WHERE id = ?", (ids[-1],))
    new = h.execute("INSERT INTO memories(content) VALUES ('Never tea.') RETURNING id").get
    h.close()
    assert new == ids[-1]
    without_vec = connect(db_path, embedding=emb_settings, vec=False)
    try:
        assert embed_memories(without_vec, embedder).embedded == 1
    finally:
        without_vec.close()
    hits, via, reason = search_memories(db, "The user likes tea.", embedder, k=3)
    assert via == "fallback" and "vec_behind" in str(reason)
    assert not any(h.score > 0.99 for h in hits)
    reconcile(db, model=embedder.model_id, max_items=10)  # the sweep rebuilds the mirror
    again, via, _ = search_memories(db, "The user likes tea.", embedder, k=3)
    assert via == "vec" and [(h.memory_id, h.score) for h in again] == [
        (h.memory_id, h.score) for h in hits
    ]


def test_a_host_holding_the_write_lock_past_the_busy_timeout_stops_the_run_with_a_reason(
    db, db_path, emb_settings, embedder, standin
):
    """A host's transaction held the write lock past the busy timeout while `embed_memories`
    ran: the task failed with apsw's BusyError, the vectors it had paid for gone and no reason
    in its result. The run stops with the reason as its error, what it wrote before kept; the
    next run embeds the rest."""
    h = host(db_path)
    h.executemany(
        "INSERT INTO memories(content) VALUES (?)", [(f"memory {i} of the host",) for i in range(5)]
    )
    patient = connect(db_path, embedding=emb_settings, busy_timeout_ms=1000)
    try:
        h.execute("BEGIN IMMEDIATE")  # held while the run embeds and tries to write
        report = embed_memories(patient, embedder)
        h.execute("COMMIT")
        assert report.embedded == 0 and report.left == 5, report
        assert "BusyError" in report.error and "the next run embeds the rest" in report.error
        assert len(standin.texts) == 5  # asked for, then not written
        again = embed_memories(patient, embedder)
    finally:
        patient.close()
        h.close()
    assert (again.embedded, again.left, again.error) == (5, 0, None)
    assert db.scalar("SELECT count(*) FROM memory_embeddings") == 5
    assert mirror_problems(db) == []
