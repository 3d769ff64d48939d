"""Code items audited as a careless or hostile user would feed them: edits that move lines,
minified sources, and what a re-index costs."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import FakeEmbedder
from host import host
from worker.bulk import index_item
from worker.chunking import text_hash
from worker.chunking.code import chunk_code
from worker.indexers import IndexOptions
from worker.settings import FilesSettings
from worker.sources import Reader
from worker.store.db import Database
from worker.store.items import add_item


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
