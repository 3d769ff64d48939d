"""An item whose vec rows fail as it is written fails alone in a bulk run: three vec writes of
one item failing in a row were taken for the database refusing writes, and the run stopped;
every item after it ended with that item's abort, unindexed, and `failed`.

The real cause here: rows a host left in sqlite-vec's `_rowids` table of `vec_chunk_embeddings`
under the ids the next chunks get (plain SQL, without the extension: a stray key vec0 can
neither delete nor insert over, "Could not fetch vector data"). A real SQLite file with
sqlite-vec, a host process of its own (tests/host.py), the engine of a bulk run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import FakeEmbedder
from host import host
from worker.bulk import index_items
from worker.errors import IndexAborted
from worker.indexers import IndexOptions
from worker.settings import FilesSettings
from worker.sources import Reader
from worker.store import Database
from worker.store.items import add_item, get_state

SECTIONS = "# Doc\n\n" + "\n\n".join(
    f"## Part {k}\n\nPart {k} words " + "one two three. " * 30 for k in range(4)
)  # four chunks
CODE = "def first():\n    return 1\n\n\ndef second():\n    return 2\n"


def stray_rows_at_the_next_chunk_ids(db: Database, n: int) -> list[int]:
    """A host's rows in vec0's `_rowids` table under the next n chunk ids: the ids the next
    chunks written get."""
    top = db.scalar("SELECT coalesce(max(id), 0) FROM note_chunks")
    keys = list(range(top + 1, top + 1 + n))
    host(
        db.path,
        *[("INSERT INTO vec_chunk_embeddings_rowids(rowid) VALUES (?)", [k]) for k in keys],
    )
    return keys


def status(outcome: Any) -> str:
    return outcome.status if not isinstance(outcome, Exception) else type(outcome).__name__


@pytest.fixture
def root(tmp_path: Path) -> Path:
    folder = tmp_path / "code"
    folder.mkdir()
    return folder


def test_one_items_failing_vec_rows_fail_it_alone_and_the_run_goes_on(
    db: Database, root: Path
) -> None:
    """A note's three vec rows fail (stray rows under its chunk ids): that note fails with the
    cause, its previous index (none) intact; the code items after it in the run (their ids
    are elsewhere) are indexed, and a note indexed before stays so. The run's orphan check
    then deletes the host's rows (it stopped the run with SQLError, all items written), and
    the note's next run indexes it."""
    before = add_item(db, kind="note", title="Before", content="An older note. " * 20)
    options = IndexOptions(reader=Reader(FilesSettings(roots=[root])), task_id="t1")
    assert status(index_items(db, [before], embedder=FakeEmbedder())[before]) == "indexed"
    note = add_item(db, kind="note", title="Doc", content=SECTIONS)
    code = []
    for k in range(4):
        (root / f"m{k}.py").write_text(CODE.replace("1", str(k)), encoding="utf-8")
        code.append(
            add_item(db, kind="code", title=f"m{k}.py", content="", source=str(root / f"m{k}.py"))
        )
    keys = stray_rows_at_the_next_chunk_ids(db, 3)
    embedder = FakeEmbedder()
    embedder.batch_size = 1  # the note is written on its own, before the code items are back

    results = index_items(db, [note, *code, before], embedder=embedder, options=options)

    outcome = results[note]
    assert isinstance(outcome, IndexAborted), outcome
    assert "3 consecutive vector failures" in str(outcome)
    assert "vec write: Could not fetch vector data" in str(outcome)
    state = get_state(db, note)
    assert state["status"] == "failed" and "Could not fetch vector data" in state["last_error"]
    assert db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (note,)) == 0
    assert [status(results[i]) for i in [*code, before]] == ["indexed"] * 5
    assert [get_state(db, i)["status"] for i in [*code, before]] == ["indexed"] * 5

    # The run's orphan check deleted the host's rows (vec0 could not: from its `_rowids`).
    assert not db.all(
        f"SELECT rowid FROM vec_chunk_embeddings_rowids WHERE rowid IN ({','.join('?' * 3)})",
        keys,
    )
    again = index_items(db, [note], embedder=FakeEmbedder(), options=options)[note]
    assert status(again) == "indexed"


def test_the_run_stops_once_the_vec_rows_of_three_items_in_a_row_fail(db: Database) -> None:
    """Each item given the ids that hold the host's rows fails on them (an item's rollback
    leaves them to the next): three items so in a row and the vec table is taken to refuse
    every row; the run stops, the items not written say why."""
    notes = [add_item(db, kind="note", title=f"Doc {k}", content=SECTIONS) for k in range(5)]
    stray_rows_at_the_next_chunk_ids(db, 3)
    embedder = FakeEmbedder()
    embedder.batch_size = 1

    results = index_items(db, notes, embedder=embedder)

    for item in notes[:3]:
        assert "3 consecutive vector failures" in str(results[item]), results[item]
    for item in notes[3:]:
        outcome = results[item]
        assert isinstance(outcome, IndexAborted), outcome
        assert "the vec writes of 3 items in a row failed" in str(outcome)
