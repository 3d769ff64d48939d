"""The keyword mend of the reconcile sweep against a fifth review: a `parts` a host wrote into
a keyword row was never compared, and keyword search answered by it; a host's change that made
every row differ (a rename of every title) was rewritten whole in one sweep, uncapped."""

from __future__ import annotations

import pytest

from conftest import FakeEmbedder
from host import host
from worker.bulk import index_items
from worker.reconcile import reconcile
from worker.retrieval import search_chunks
from worker.store import fts
from worker.store.db import Database
from worker.store.items import add_item


def keyword(db: Database, query: str) -> list[int]:
    return [h.chunk_id for h in search_chunks(db, query, None, k=5, mode="keyword").hits]


def test_a_parts_a_host_wrote_into_a_keyword_row_is_mended_by_the_sweep(db: Database) -> None:
    ids = [
        add_item(db, kind="note", title="Setup", content="Call BackgroundTasks from the handler."),
        add_item(db, kind="note", title="Other", content="Nothing about it here at all."),
    ]
    index_items(db, ids, embedder=FakeEmbedder())
    camel, other = (db.scalar("SELECT id FROM note_chunks WHERE item_id = ?", (i,)) for i in ids)
    assert keyword(db, "tasks") == [camel]
    host(
        db.path,
        ("UPDATE note_chunks_fts SET parts = '' WHERE rowid = ?", [camel]),
        ("UPDATE note_chunks_fts SET parts = 'xylophonezebra' WHERE rowid = ?", [other]),
    )
    assert keyword(db, "tasks") == [] and keyword(db, "xylophonezebra") == [other]
    drift = reconcile(db, model="fake", max_items=10)
    assert drift.repaired["keyword_rows"] == {"note_chunks_fts rewritten": 2}
    assert keyword(db, "tasks") == [camel] and keyword(db, "xylophonezebra") == []


def test_rows_a_host_change_made_unlike_are_rewritten_a_capped_number_a_sweep(
    db: Database,
) -> None:
    ids = [add_item(db, kind="note", title=f"T{n}", content=f"Text {n}.") for n in range(5)]
    index_items(db, ids, embedder=FakeEmbedder())
    host(db.path, ("UPDATE knowledge_items SET title = 'Renamed ' || title", []))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fts, "WHOLE_SLICE", 0)  # (the text's compare alone)
        first = fts.sync_fts(db, verify=True, check=False, most=2)
        second = fts.sync_fts(db, verify=True, check=False, most=2)
        third = fts.sync_fts(db, verify=True, check=False, most=2)
        fourth = fts.sync_fts(db, verify=True, check=False, most=2)
    assert [d.get("note_chunks_fts rewritten") for d in (first, second, third, fourth)] == [
        2,
        2,
        1,
        None,
    ]
    assert keyword(db, "renamed") != [] and len(keyword(db, "renamed")) == 5
