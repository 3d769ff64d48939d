"""Code items audited as a careless or hostile user would feed them: edits that move lines,
minified sources, and what a re-index costs."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_code_chunking import check_chunks

from conftest import FakeEmbedder
from host import host
from worker.bulk import index_item, index_items
from worker.chunking import text_hash
from worker.chunking.code import chunk_code
from worker.indexers import IndexOptions
from worker.indexers.code import search_code
from worker.settings import FilesSettings
from worker.sources import Reader
from worker.store.db import Database
from worker.store.items import add_item
from worker.store.repair import repair_vectors


@pytest.fixture
def fake() -> FakeEmbedder:
    return FakeEmbedder()


def functions(n: int, first: str = "    return x + 0\n") -> str:
    return "\n\n".join(
        [f"def f0(x):\n{first}", *(f"def f{i}(x):\n    return x + {i}\n" for i in range(1, n))]
    )


def test_a_line_added_to_the_first_function_re_embeds_that_function_only(
    db: Database, fake: FakeEmbedder, tmp_path: Path
) -> None:
    """The embedder input names the chunk's lines; reuse keyed on it re-embedded every chunk
    below an edit that added or removed a line (20 of 20 here), the trap LESSONS.md names."""
    path = tmp_path / "m.py"
    path.write_text(functions(20))
    item = add_item(db, kind="code", title="m.py", content="", source=str(path))
    options = IndexOptions(reader=Reader(FilesSettings(roots=[tmp_path])))
    assert index_item(db, item, embedder=fake, options=options).embedded == 20
    assert index_item(db, item, embedder=fake, options=options).embedded == 0
    path.write_text(functions(20, first="    y = x\n    return y\n"))
    edited = index_item(db, item, embedder=fake, options=options)
    assert (edited.status, edited.chunks, edited.embedded) == ("indexed", 20, 1)
    # The chunks show where each function is now.
    lines = db.all(
        "SELECT start_line, end_line FROM code_chunks WHERE item_id = ? ORDER BY chunk_index",
        (item,),
    )
    assert lines[:2] == [(1, 3), (6, 7)]
    assert edited.embedded == len(fake.calls[-1])
    assert fake.calls[-1] == ["m.py:1-3 f0\n\ndef f0(x):\n    y = x\n    return y"]


def test_rows_keyed_as_before_serve_an_unchanged_file(
    db: Database, fake: FakeEmbedder, tmp_path: Path
) -> None:
    """A database indexed before the reuse key left the lines out: its rows hold the hash of
    the whole input; an unchanged file embeds nothing again after the upgrade."""
    path = tmp_path / "m.py"
    path.write_text(functions(6))
    item = add_item(db, kind="code", title="m.py", content="", source=str(path))
    options = IndexOptions(reader=Reader(FilesSettings(roots=[tmp_path])))
    index_item(db, item, embedder=fake, options=options)
    for chunk in chunk_code(path.read_text(), "m.py"):
        host(
            db.path,
            (
                "UPDATE code_chunks SET embed_hash = ? WHERE item_id = ? AND chunk_index = ?",
                [text_hash(chunk.embedding_input("m.py")), item, chunk.index],
            ),
        )
    assert index_item(db, item, embedder=fake, options=options).embedded == 0


def test_a_stray_vec_row_under_a_new_code_chunks_id_fails_that_vec_write_only(
    db: Database, fake: FakeEmbedder, tmp_path: Path
) -> None:
    """A host's row in `vec_work_code_chunks_rowids` under the id the next code chunk gets
    (plain SQL, without the extension: vec0 can neither delete nor insert over it). Code's vec
    write was not caught as a note's is: every code item failed ("the database refused the
    write"), each rolled back to give the next one the same id. Now that item is partial, as
    a note in the same place is, its vector kept relationally; the sweep rebuilds the table
    and the next run indexes it."""
    items = []
    for k in range(4):
        path = tmp_path / f"m{k}.py"
        path.write_text(f"def first():\n    return {k}\n\n\ndef second():\n    return -{k}\n")
        items.append(add_item(db, kind="code", title=path.name, content="", source=str(path)))
    stray = 1 + db.scalar("SELECT coalesce(max(id), 0) FROM code_chunks")
    host(db.path, ("INSERT INTO vec_work_code_chunks_rowids(rowid) VALUES (?)", [stray]))
    options = IndexOptions(reader=Reader(FilesSettings(roots=[tmp_path])), task_id="t1")

    results = index_items(db, items, embedder=fake, options=options)

    first = results[items[0]]
    assert not isinstance(first, Exception), first
    assert first.status == "partial" and "Could not fetch vector data" in str(first.error)
    assert [results[i].status for i in items[1:]] == ["indexed"] * 3
    assert db.scalar("SELECT count(*) FROM code_chunks") == 8
    assert db.scalar("SELECT count(*) FROM code_chunk_embeddings") == 8  # kept relationally
    repair_vectors(db, db.dimensions)  # the sweep rebuilds the table, as for a note's
    again = index_items(db, items[:1], embedder=fake, options=options)[items[0]]
    assert again.status == "indexed" and again.embedded == 0
    assert db.scalar("SELECT count(*) FROM vec_work_code_chunks") == 8
    hits, via, _ = search_code(db, "first", fake, k=8)
    assert via == "vec+fts" and len(hits) == 8


def test_a_line_longer_than_the_maximum_is_not_cut_inside_a_word() -> None:
    """Minified JavaScript, JSON on one line: a line over the maximum was cut at exactly the
    maximum, in the middle of an identifier about two cuts in three; the halves of
    `customer_balance` in two chunks, a keyword search for it found neither."""
    names = [f"customer_balance_{i}" for i in range(400)]
    text = "var " + ",".join(f"{n}=f({i})" for i, n in enumerate(names)) + ";\n"
    for path, max_size in (("app.min.js", 1500), ("data.json", 700), ("x.py", 97)):
        chunks = chunk_code(text, path, max_size=max_size)
        assert len(chunks) > 3
        assert "".join(c.content for c in chunks) == text.strip()
        assert all(len(c.content) <= max_size for c in chunks)
        found = {w for c in chunks for w in re.findall(r"\w+", c.content)}
        assert set(names) <= found
    # Where the window holds no other place to cut, the word is cut (as before).
    long_word = "x" * 50
    assert [c.content for c in chunk_code(long_word, "w.js", max_size=20)] == [
        "x" * 20,
        "x" * 20,
        "x" * 10,
    ]


@settings(deadline=None)
@given(
    st.lists(st.text("abcé_0", min_size=1, max_size=9), min_size=1, max_size=300),
    st.text(" ,.;(){}=\n\t", min_size=1, max_size=2),
    st.integers(20, 200),
    st.sampled_from(["m.js", "m.py", "m.json"]),
)
def test_words_shorter_than_half_the_maximum_are_never_cut(
    words: list[str], sep: str, max_size: int, path: str
) -> None:
    """A window's second half always holds a place between two words then."""
    text = sep.join(words)
    chunks = chunk_code(text, path, max_size=max_size)
    check_chunks(text, chunks, max_size)
    found = {w for c in chunks for w in re.findall(r"[\wé]+", c.content)}
    assert set(re.findall(r"[\wé]+", text)) <= found
