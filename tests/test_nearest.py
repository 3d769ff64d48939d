"""The in-memory search paths (worker.nearest) against a real SQLite file with sqlite-vec: what
a search process holds between searches (one budget a connection)."""

from __future__ import annotations

from typing import Any

import pytest

from conftest import FakeEmbedder, corpus_text
from worker import nearest
from worker.bulk import index_item
from worker.retrieval import Filters, search_chunks
from worker.settings import SearchSettings
from worker.store import connect
from worker.store.db import Database
from worker.store.items import add_item

CHAPTERS = ["ch04-01-what-is-ownership.md", "ch08-03-hash-maps.md", "ch15-01-box.md"]
FRESH = SearchSettings(fallback_hold_mb=0)  # nothing held: reads the rows every time


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
