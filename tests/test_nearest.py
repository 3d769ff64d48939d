"""The in-memory search paths (worker.nearest, worker.hamming) against a real SQLite file with
sqlite-vec: what a search process holds between searches (one budget a connection, nothing of a
rolled-back write), ties by id on every path, and vectors without a direction (NaN, zeros) that
a host wrote."""

from __future__ import annotations

import math
import zlib
from typing import Any

import numpy as np
import pytest

from conftest import DIMS, FakeEmbedder, as_a_run, corpus_text, forge_vector
from worker import nearest
from worker.bulk import index_item
from worker.indexers.memories import add_memory, search_memories
from worker.retrieval import Filters, search_chunks
from worker.settings import SearchSettings
from worker.store import connect
from worker.store.db import Database
from worker.store.items import add_item
from worker.store.removal import delete_items
from worker.store.vec import vec_replace

CHAPTERS = ["ch04-01-what-is-ownership.md", "ch08-03-hash-maps.md", "ch15-01-box.md"]
TWO_PASSES = SearchSettings(exact_below=0, oversample=2)
FRESH = SearchSettings(fallback_hold_mb=0)  # nothing held: reads the rows every time


class Rollback(Exception):
    """Raised inside a unit of work to roll it back."""


@pytest.fixture
def fake() -> FakeEmbedder:
    return FakeEmbedder()


@pytest.fixture
def notes_db(db: Database, fake: FakeEmbedder) -> tuple[Database, dict[str, int]]:
    ids = {}
    for name in CHAPTERS:
        ids[name] = add_item(db, kind="note", title=name, content=corpus_text(name))
        index_item(db, ids[name], embedder=fake)
    return db, ids


@pytest.fixture
def no_vec(notes_db: tuple[Database, dict[str, int]], emb_settings: Any) -> Any:
    """A second connection to the same file without sqlite-vec: every vector search goes
    through the exact path, which holds what it read (fallback_hold_mb)."""
    db, _ = notes_db
    other = connect(db.path, embedding=emb_settings, vec=False)
    yield other
    other.close()


def chunk_ids(result: Any) -> list[int]:
    return [h.chunk_id for h in result.hits]


def held_bytes(db: Database) -> int:
    return sum(h.keys.nbytes + h.units.nbytes for h in nearest._HELD.get(db, {}).values())


# -- one budget for what a connection holds --------------------------------------------------------


def test_held_vectors_stay_within_one_budget_however_many_filters_the_searches_use(
    notes_db, no_vec, fake
):
    """A host that searches with a filter of its own each time (a user's item ids) made one
    held entry per filter, each within the budget and all together without bound."""
    _db, ids = notes_db
    budget = SearchSettings(fallback_hold_mb=1)
    every = sorted(ids.values())
    whole = held_bytes_of_one = None
    for n in range(80):  # the same rows each time, but a different filter: a different entry
        filters = Filters(item_ids=(*every, 10_000 + n))
        got = search_chunks(
            no_vec, "ownership", fake, k=5, mode="vector", filters=filters, tuning=budget
        )
        if n == 0:
            held_bytes_of_one = held_bytes(no_vec)
            whole = chunk_ids(got)
        assert chunk_ids(got) == whole
        assert held_bytes(no_vec) <= 1_000_000
    assert held_bytes_of_one and 80 * held_bytes_of_one > 1_000_000  # the budget was reached
    assert len(nearest._HELD[no_vec]) > 1  # and it still holds several, the latest among them
    plain = search_chunks(
        no_vec, "ownership", fake, k=5, mode="vector", filters=filters, tuning=FRESH
    )
    assert chunk_ids(plain) == whole


def test_a_change_lets_go_of_everything_held_before_it(notes_db, no_vec, fake):
    """What was held for an older version of the database is dropped at the next search, not
    kept beside the new entry until the process ends."""
    db, ids = notes_db
    for item in ids.values():
        search_chunks(no_vec, "heap", fake, k=3, mode="vector", filters=Filters(item_ids=(item,)))
    assert len(nearest._HELD[no_vec]) == len(ids)
    index_item(db, add_item(db, kind="note", title="New", content="A later note."), embedder=fake)
    search_chunks(no_vec, "heap", fake, k=3, mode="vector")
    assert len(nearest._HELD[no_vec]) == 1


# -- nothing of a rolled-back write is held --------------------------------------------------------


def test_change_version_moves_when_a_transaction_or_a_savepoint_rolls_back(db):
    """A rollback restores rows but moves neither PRAGMA data_version nor total_changes."""
    first = db.change_version()
    with pytest.raises(Rollback), db.atomic():
        db.execute("INSERT INTO memories(content) VALUES ('gone')")
        inside = db.change_version()
        raise Rollback
    assert db.change_version() not in (first, inside)
    with db.atomic():
        db.execute("INSERT INTO memories(content) VALUES ('kept')")
        with pytest.raises(Rollback), db.atomic():
            db.execute("INSERT INTO memories(content) VALUES ('gone')")
            inside = db.change_version()
            raise Rollback
        assert db.change_version() != inside
    db.execute("BEGIN")  # a rollback that does not go through atomic(): SQLite's hook sees it
    db.execute("INSERT INTO memories(content) VALUES ('gone')")
    inside = db.change_version()
    db.execute("ROLLBACK")
    assert db.change_version() != inside
    assert [r[0] for r in db.all("SELECT content FROM memories")] == ["kept"]


def test_a_rolled_back_transaction_leaves_nothing_held_for_the_next_search(no_vec, fake):
    with pytest.raises(Rollback), no_vec.atomic():
        ghost = add_item(no_vec, kind="note", title="Ghost", content="A note rolled back.")
        index_item(no_vec, ghost, embedder=fake)
        query = fake.calls[-1][0]
        inside = search_chunks(no_vec, query, fake, k=3, mode="vector")
        assert inside.hits[0].item_id == ghost  # held with the ghost
        raise Rollback
    after = search_chunks(no_vec, query, fake, k=3, mode="vector")
    assert ghost not in [h.item_id for h in after.hits] and len(after.hits) == 3
    assert chunk_ids(after) == chunk_ids(
        search_chunks(no_vec, query, fake, k=3, tuning=FRESH, mode="vector")
    )


def test_a_rolled_back_savepoint_leaves_nothing_held_for_the_rest_of_its_transaction(no_vec, fake):
    with no_vec.atomic():
        with pytest.raises(Rollback), no_vec.atomic():
            ghost = add_item(no_vec, kind="note", title="Ghost", content="A unit rolled back.")
            index_item(no_vec, ghost, embedder=fake)
            query = fake.calls[-1][0]
            inside = search_chunks(no_vec, query, fake, k=3, mode="vector")
            assert inside.hits[0].item_id == ghost
            raise Rollback
        after = search_chunks(no_vec, query, fake, k=3, mode="vector")
        assert ghost not in [h.item_id for h in after.hits] and len(after.hits) == 3


def test_the_bits_held_for_two_passes_come_back_with_a_rolled_back_delete(notes_db, fake):
    db, _ids = notes_db
    before = search_chunks(db, "borrowing", fake, k=5, mode="vector", tuning=TWO_PASSES)
    target = before.hits[0].item_id
    with pytest.raises(Rollback), db.atomic():
        delete_items(db, [target])  # its chunks' bits go from vec_chunk_bits
        inside = search_chunks(db, "borrowing", fake, k=5, mode="vector", tuning=TWO_PASSES)
        assert target not in [h.item_id for h in inside.hits]  # the bits are held without them
        raise Rollback
    after = search_chunks(db, "borrowing", fake, k=5, mode="vector", tuning=TWO_PASSES)
    assert chunk_ids(after) == chunk_ids(before)


# -- ties by id on every path ----------------------------------------------------------------------


@pytest.mark.parametrize("twins", [6, 40])
def test_twins_come_back_by_id_on_the_vec_path_and_the_fallback_alike(
    db, fake, emb_settings, twins
):
    """The same memory saved several times: sqlite-vec returned the twins highest id first, the
    fallback lowest first; and with more twins than its first fetch (32 rows), sqlite-vec's cut
    left the lowest ids out."""
    for i in range(5):
        add_memory(db, f"filler memory {i}", fake)
    same = [add_memory(db, "the user likes rust", fake) for _ in range(twins)]
    no_vec = connect(db.path, embedding=emb_settings, vec=False)
    try:
        for k in (3, 6):
            found, via, _ = search_memories(db, "the user likes rust", fake, k=k)
            exact, fallback, _ = search_memories(no_vec, "the user likes rust", fake, k=k)
            assert (via, fallback) == ("vec", "fallback")
            assert [m.memory_id for m in found] == same[:k]
            assert [m.memory_id for m in exact] == same[:k]
    finally:
        no_vec.close()


# -- vectors without a direction -------------------------------------------------------------------


def test_rows_of_nan_or_infinity_are_at_distance_one():
    matrix = np.array(
        [[np.nan] * 4, [np.inf, 0, 0, 0], [0.0] * 4, [1.0, 0, 0, 0], [1, np.nan, 0, 0]],
        dtype=np.float32,
    )
    with np.errstate(invalid="ignore"):
        got = nearest.distances(matrix, np.array([1.0, 0, 0, 0], dtype=np.float32))
    assert got.tolist() == [1.0, 1.0, 1.0, 0.0, 1.0]


def test_chunk_vectors_of_nan_a_host_wrote_score_zero_on_every_path(db, fake, emb_settings):
    """8 of 12 chunk vectors NaN: the exact path (filtered, or without sqlite-vec) found
    nothing (NaN as the k-th best drops every row), two passes ranked them first with score
    NaN. Every path now gives the same ten: those nearer than distance 1, then the NaN rows by
    id, with score 0."""
    for n in range(12):
        item = add_item(db, kind="note", title=f"n{n}", content=f"alpha note {n}.\n")
        index_item(db, item, embedder=fake)
    nan = np.full(DIMS, np.nan, dtype="<f4").tobytes()
    chunks = [r[0] for r in db.all("SELECT id FROM note_chunks ORDER BY id")]
    with as_a_run(db):
        for chunk in chunks[:8]:  # the relational row and its vec0 mirror alike
            db.execute(forge_vector("note_chunk_embeddings", "chunk_id"), (nan, chunk))
            vec_replace(db, "vec_chunk_embeddings", chunk, nan)
    no_vec = connect(db.path, embedding=emb_settings, vec=False)
    try:
        paths = {
            "vec0": search_chunks(db, "alpha", fake, k=10, mode="vector"),
            "filtered exact": search_chunks(
                db, "alpha", fake, k=10, mode="vector", filters=Filters(kinds=("note",))
            ),
            "fallback": search_chunks(no_vec, "alpha", fake, k=10, mode="vector"),
            "fallback, held": search_chunks(no_vec, "alpha", fake, k=10, mode="vector"),
            "two passes": search_chunks(db, "alpha", fake, k=10, mode="vector", tuning=TWO_PASSES),
        }
    finally:
        no_vec.close()
    want = chunk_ids(paths["vec0"])
    # three of the four others are nearer than no direction at all, the fourth is farther
    assert want[3:] == chunks[:7] and not set(want[:3]) & set(chunks[:8])
    for name, result in paths.items():
        assert chunk_ids(result) == want, name
        assert all(math.isfinite(h.score) for h in result.hits), name
        assert [h.score for h in result.hits[3:]] == [0.0] * 7, name
        assert all(h.score > 0 for h in result.hits[:3]), name


class Placed(FakeEmbedder):
    """Vectors by the text's first word: the query along one axis, `near N` close to it (the
    smaller N, the closer), anything else along another axis."""

    def embed_batch(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dimensions), dtype=np.float32)
        for row, text in zip(out, texts, strict=True):
            word, _, rest = text.partition(" ")
            if word == "query":
                row[0] = 1.0
            elif word == "near":
                row[0], row[1] = 1.0, 0.01 * int(rest)
            else:
                row[2], row[3 + zlib.crc32(text.encode()) % (self.dimensions - 3)] = 1.0, 0.5
        return out


@pytest.mark.parametrize("poison", ["nan", "zeros"])
def test_one_memory_without_a_direction_never_makes_the_vec_path_answer_wrongly(db, poison):
    """sqlite-vec's cosine distance to a vector of NaN or zeros is NaN, and its KNN then takes
    that row, met first, for the nearest of its 1,024-row chunk, and drops the chunk's better
    rows when it merges the next chunk: the nearest memories never came back. A table holding
    such a vector is searched exactly, with the row at distance 1."""
    placed = Placed()
    bad = add_memory(db, "the memory a host spoils", placed)  # the first slot of vec0's chunk
    near = [add_memory(db, f"near {n}", placed) for n in range(1, 11)]
    for n in range(1100):  # into a second chunk of vec0
        add_memory(db, f"far {n}", placed)
    vector = np.full(DIMS, np.nan if poison == "nan" else 0.0, dtype="<f4").tobytes()
    with as_a_run(db):  # (a host's would go at once: schema migration 16)
        db.execute(forge_vector("memory_embeddings", "memory_id"), (vector, bad))
    vec_replace(db, "vec_memories", bad, vector)
    found, via, reason = search_memories(db, "query", placed, k=3)
    assert [m.memory_id for m in found] == near[:3]
    assert via == "fallback" and "without a direction" in str(reason)
    # distance 1, the first of the rows at 1 (the far ones, at a right angle) by its id
    eleven, _, _ = search_memories(db, "query", placed, k=11)
    assert [m.memory_id for m in eleven] == [*near, bad] and eleven[-1].score == 0.0
