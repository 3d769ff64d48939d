"""Search against a fifth review: the exact path read and sorted every vector again for each
block (a search grew with the square of the index); a filter's count counted every chunk it
passed; `kidx search --source docs/` matched nothing `kidx add file docs/a.md` added; code
search said the in-memory fallback served when vectors had; a word holding a private-use
character was cut where the keyword index keeps it whole."""

from __future__ import annotations

import json
from typing import Any

import apsw
import pytest
from test_cli import Kidx, base_env

from conftest import FakeEmbedder
from worker.bulk import index_item
from worker.indexers import IndexOptions
from worker.indexers.code import search_code
from worker.retrieval import Filters, search_chunks
from worker.settings import FilesSettings
from worker.sources import Reader
from worker.store import connect
from worker.store.db import Database
from worker.store.items import add_item


def _vector_reads(db: Database, search: Any) -> list[str]:
    """The query plan of each statement `search` ran that reads vectors for the exact path."""
    seen: list[tuple[str, Any]] = []

    def trace(cursor: Any, sql: str, bindings: Any) -> bool:
        if "r.vector FROM" in sql and "IN (SELECT value" not in sql:  # (not a rescoring)
            seen.append((sql, bindings))
        return True

    db.conn.exec_trace = trace
    try:
        search()
    finally:
        db.conn.exec_trace = None
    return [
        " / ".join(r[3] for r in db.all(f"EXPLAIN QUERY PLAN {sql}", bindings))
        for sql, bindings in seen
    ]


def search(db: Database, fake: FakeEmbedder, filters: Filters | None) -> Any:
    return search_chunks(db, "Words 1.", fake, k=2, mode="vector", filters=filters)


@pytest.mark.parametrize("filtered", [False, True])
def test_the_exact_path_reads_the_vectors_in_one_pass_without_sorting_them(
    db, emb_settings, filtered
) -> None:
    """Paged by rowid (`LIMIT 20000` after the last rowid), each page was planned from the
    kind filter every search has, and sorted all of its rows: 2.4 s for 160k chunks where a
    scan takes 0.3, growing with the square of them. One statement now, never sorted."""
    fake = FakeEmbedder()
    for n in range(3):
        index_item(
            db, add_item(db, kind="note", title=f"n{n}", content=f"Words {n}."), embedder=fake
        )
    no_vec = connect(db.path, embedding=emb_settings, vec=False)
    try:
        filters = Filters(kinds=("note",)) if filtered else None
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("worker.retrieval.FILTER_EXACT", 1)  # a filter passing more than that
            plans = _vector_reads(no_vec, lambda: search(no_vec, fake, filters))
    finally:
        no_vec.close()
    assert len(plans) == 1 and "TEMP B-TREE" not in plans[0], plans


def test_the_exact_path_of_code_search_reads_the_vectors_in_one_pass(db, emb_settings, tmp_path):
    fake = FakeEmbedder()
    reader = Reader(FilesSettings(roots=[tmp_path]))
    for n in range(3):
        path = tmp_path / f"m{n}.py"
        path.write_text(f"def f{n}(x):\n    return x + {n}\n")
        item = add_item(db, kind="code", title=path.name, content="", source=str(path))
        index_item(db, item, embedder=fake, options=IndexOptions(reader=reader))
    no_vec = connect(db.path, embedding=emb_settings, vec=False)
    try:
        plans = _vector_reads(no_vec, lambda: search_code(no_vec, "def f1", fake, k=2))
    finally:
        no_vec.close()
    assert len(plans) == 1 and "TEMP B-TREE" not in plans[0], plans


def test_a_filters_count_stops_where_the_choice_is_made(db) -> None:
    """Only whether a filter passes more than FILTER_EXACT chunks is asked."""
    from worker.retrieval import FILTER_EXACT, _count

    fake = FakeEmbedder()
    for n in range(5):
        index_item(
            db, add_item(db, kind="note", title=f"n{n}", content=f"Words {n}."), embedder=fake
        )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("worker.retrieval.FILTER_EXACT", 2)
        assert _count(db, fake.model_id, Filters(kinds=("note",))) == 3
    assert _count(db, fake.model_id, Filters(kinds=("note",))) == 5 <= FILTER_EXACT


def test_a_word_holding_a_private_use_character_is_found_by_keyword(db) -> None:
    word = "build\uf8ffstatus"
    item = add_item(db, kind="note", title="t", content=f"The {word} badge is red.")
    index_item(db, item, embedder=FakeEmbedder())
    other = add_item(db, kind="note", title="u", content="The build has a status.")
    index_item(db, other, embedder=FakeEmbedder())
    found = search_chunks(db, word, None, k=3, mode="keyword")
    assert [h.item_id for h in found.hits] == [item]


def test_search_by_a_relative_folder_finds_what_add_file_added_from_it(tmp_path, standin) -> None:
    (tmp_path / "work").mkdir()
    env = base_env(tmp_path / "kidx.db", standin.base_url)
    kidx = Kidx(tmp_path / "work", {**env, "KIDX_FILES__ROOTS": str(tmp_path / "work")})
    docs = tmp_path / "work" / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# A\n\nThe wombat sleeps all day.\n")
    kidx.ok("init")
    item = int(kidx.ok("add", "file", "docs/a.md", "--inline").stdout)
    for prefix in ("docs/", "./docs", "docs", str(docs) + "/"):
        hits = kidx.json("search", "wombat", "--mode", "keyword", "--source", prefix)
        assert [h["item_id"] for h in hits] == [item], prefix
    assert kidx.json("search", "wombat", "--mode", "keyword", "--source", "doc/") == []
    # a prefix that is no path on this disk is as given: a host's own sources, a URL's
    note = kidx.add("S", "--text", "The wombat digs.", inline=True)
    host = apsw.Connection(str(tmp_path / "kidx.db"))
    host.execute("UPDATE knowledge_items SET source = 'sample:wombat' WHERE id = ?", (note,))
    host.close()
    for prefix in ("sample:", "sample:wom"):
        hits = kidx.json("search", "wombat", "--mode", "keyword", "--source", prefix)
        assert [h["item_id"] for h in hits] == [note], prefix


def test_code_search_served_by_vectors_does_not_say_the_fallback_served(tmp_path, standin):
    """The keyword table's problem rode in the fallback's reason: `kidx search --code` said
    "served by the in-memory fallback" while sqlite-vec had answered."""
    (tmp_path / "work").mkdir()
    env = base_env(tmp_path / "kidx.db", standin.base_url)
    kidx = Kidx(tmp_path / "work", {**env, "KIDX_FILES__ROOTS": str(tmp_path / "work")})
    (tmp_path / "work" / "lamp.py").write_text("def light_the_lamp(keeper):\n    return keeper\n")
    kidx.ok("init")
    kidx.ok("add", "code", "lamp.py", "--inline")
    db = connect(tmp_path / "kidx.db", vec=False)
    db.execute("DROP TABLE code_chunks_fts")  # (the sweep makes it again)
    db.close()
    result = kidx.ok("search", "--code", "light the lamp", "--json")
    assert [h["path"].endswith("lamp.py") for h in json.loads(result.stdout)] == [True]
    assert "code_chunks_fts is missing" in result.stderr
    assert "fallback" not in result.stderr, result.stderr
