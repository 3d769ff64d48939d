"""The write fence's claim token (migration 11): every write of an item's state row changes it,
so that a run tells its own `indexing` mark from any later write of the row, whoever made it.

It was told by (task id, status, `updated_at`): a second delivery of a task (a worker that lost
its lock) marking the item within the millisecond of the first looked like the first's own
mark, and the stale run wrote its older text over it; a host's write that left `updated_at`
alone was not seen at all. Two connections of a real SQLite file with sqlite-vec: the first
run's, and the one that writes the state row from inside its embedding request, after its mark.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest

from conftest import FakeEmbedder, mirror_problems
from worker.bulk import index_items
from worker.chunking import text_hash
from worker.indexers import IndexOptions
from worker.pipeline import IndexResult
from worker.settings import EmbeddingSettings
from worker.store import Database, connect
from worker.store.items import add_item, claim_items, read_claim
from worker.store.schema import MIGRATIONS, SCHEMA_VERSION

TEXT1 = "# Doc\n\n" + "\n\n".join(f"## Part {k}\n\nalpha " + "one two. " * 60 for k in range(3))
TEXT2 = "# Doc\n\n" + "\n\n".join(f"## Part {k}\n\nBETA " + "six ten. " * 60 for k in range(3))


@pytest.fixture
def other(db: Database, emb_settings: EmbeddingSettings) -> Iterator[Database]:
    """A second connection: the other delivery's (or the host's)."""
    conn = connect(db.path, embedding=emb_settings)
    yield conn
    conn.close()


class AfterMark(FakeEmbedder):
    """One text a request: at the first request made once the item is marked `indexing` by
    `task`, `act` runs (the first run's process stopped there, as it would be by a VM pause)."""

    def __init__(self, db: Database, item_id: int, task: str, act: Callable[[], None]) -> None:
        super().__init__()
        self.batch_size = 1
        self.db, self.item_id, self.task, self.act = db, item_id, task, act
        self.acted = False

    def embed_batch(self, texts: list[str]) -> np.ndarray:
        if not self.acted:
            row = self.db.one(
                "SELECT status, last_task_id FROM item_index_state WHERE item_id = ?",
                (self.item_id,),
            )
            if row == ("indexing", self.task):
                self.acted = True
                self.act()
        return super().embed_batch(texts)


def run(db: Database, ids: list[int], embedder: FakeEmbedder, task: str) -> dict[int, object]:
    return dict(index_items(db, ids, embedder=embedder, options=IndexOptions(task_id=task)))


def chunks_of(db: Database, item: int) -> list[str]:
    return [r[0] for r in db.all("SELECT content FROM note_chunks WHERE item_id = ?", (item,))]


def state(db: Database, item: int) -> tuple[object, ...]:
    row = db.one(
        "SELECT status, last_task_id, indexed_hash FROM item_index_state WHERE item_id = ?",
        (item,),
    )
    assert row is not None
    return row


def ids_of(db: Database, item: int, path: str) -> list[int]:
    """The item alone (`write_item`), or after another in a bulk run (`write_new_items`)."""
    if path == "one":
        return [item]
    return [add_item(db, kind="note", title="Filler", content="A short filler note."), item]


@pytest.mark.parametrize("path", ["one", "bulk"])
def test_a_second_delivery_marking_in_the_same_millisecond_fences_the_first(
    db: Database, other: Database, path: str
) -> None:
    """t1 marks the item and stalls in its request; a second delivery of t1 reads the edited
    text and marks the item within the same millisecond (its mark is the real `claim_items`,
    then its `updated_at` is set to the first mark's, as the clock would have it). t1 resumes:
    it writes nothing, its result is `coalesced`; the second delivery's run then indexes the
    newer text."""
    item = add_item(db, kind="note", title="Doc", content=TEXT1)
    ids = ids_of(db, item, path)

    def second_delivery_marks() -> None:
        stamp = other.scalar("SELECT updated_at FROM item_index_state WHERE item_id = ?", (item,))
        other.execute("UPDATE knowledge_items SET content = ? WHERE id = ?", (TEXT2, item))
        with other.atomic():
            claim = read_claim(other, item)
            assert claim is not None
            assert item in claim_items(other, [(item, claim)], "t1")
            other.execute(
                "UPDATE item_index_state SET updated_at = ? WHERE item_id = ?", (stamp, item)
            )

    embedder = AfterMark(other, item, "t1", second_delivery_marks)
    results = run(db, ids, embedder, "t1")

    assert embedder.acted
    result = results[item]
    assert isinstance(result, IndexResult) and result.status == "coalesced", result
    assert chunks_of(db, item) == []  # not one chunk of the older text
    assert state(db, item)[:2] == ("indexing", "t1")  # the second delivery's mark stands
    for filler in ids[:-1]:
        assert getattr(results[filler], "status", results[filler]) == "indexed"

    again = run(other, [item], FakeEmbedder(), "t1")  # the second delivery's run, to its end
    assert getattr(again[item], "status", again[item]) == "indexed"
    assert all("BETA" in c for c in chunks_of(db, item))
    assert state(db, item) == ("indexed", "t1", text_hash(TEXT2))
    assert mirror_problems(db) == []


HOST_WRITES = {
    # a column kidx does not fence on, `updated_at` left as it was
    "one column": "UPDATE item_index_state SET last_error = 'checked by the host' "
    "WHERE item_id = :item",
    # the row written again with its own values (a host's upsert, a copy restored)
    "the same row again": "INSERT OR REPLACE INTO item_index_state "
    "SELECT * FROM item_index_state WHERE item_id = :item",
}


@pytest.mark.parametrize("write", list(HOST_WRITES), ids=list(HOST_WRITES))
def test_a_hosts_write_of_the_state_row_counts_as_a_change_of_claim(
    db: Database, other: Database, write: str
) -> None:
    """Whatever a host writes to the state row while a run has it marked (plain SQL, foreign
    keys off), that run's claim is over: it writes nothing and says `coalesced`; the next
    run indexes the item."""
    item = add_item(db, kind="note", title="Doc", content=TEXT1)

    def host_writes() -> None:
        other.execute("PRAGMA foreign_keys = OFF")
        other.execute(HOST_WRITES[write], {"item": item})

    embedder = AfterMark(other, item, "t1", host_writes)
    result = run(db, [item], embedder, "t1")[item]

    assert embedder.acted
    assert isinstance(result, IndexResult) and result.status == "coalesced", result
    assert chunks_of(db, item) == []
    again = run(db, [item], FakeEmbedder(), "t2")[item]
    assert getattr(again, "status", again) == "indexed"
    assert state(db, item) == ("indexed", "t2", text_hash(TEXT1))


def test_a_rename_after_the_mark_is_written_and_left_pending(db: Database, other: Database) -> None:
    """A host's rename after the run's mark (the trigger turns the token over rather than
    drawing one) is not another run: the run writes, and records `pending`, for the sweep to
    embed the new title. (Kept from before the token: this test guards it.)"""
    item = add_item(db, kind="note", title="Doc", content=TEXT1)

    def rename() -> None:
        other.execute("UPDATE knowledge_items SET title = 'Doc, renamed' WHERE id = ?", (item,))

    embedder = AfterMark(other, item, "t1", rename)
    result = run(db, [item], embedder, "t1")[item]

    assert embedder.acted
    assert isinstance(result, IndexResult) and result.status == "indexed", result
    assert chunks_of(db, item) and state(db, item) == ("pending", "t1", text_hash(TEXT1))


def test_a_task_id_a_host_wrote_in_bytes_that_are_not_utf8_never_stops_a_run(
    db: Database,
) -> None:
    """Reading the state row's task id raised UnicodeDecodeError, which failed the whole run:
    it is read as bytes (shown with U+FFFD), and the items are indexed."""
    items = [add_item(db, kind="note", title=f"N{k}", content=f"Note {k}.") for k in range(2)]
    db.execute("UPDATE item_index_state SET last_task_id = CAST(x'ff41' AS TEXT)")
    results = run(db, items, FakeEmbedder(), "t1")
    assert [getattr(results[i], "status", results[i]) for i in items] == ["indexed"] * 2


@pytest.mark.parametrize("value", ["CAST(x'ff41' AS TEXT)", "x'00ff'", "1.5", "NULL"])
def test_any_value_a_host_left_in_the_claim_is_read_and_replaced(db: Database, value: str) -> None:
    """Whatever a host wrote in `claim` (text that is not UTF-8, a BLOB, a REAL, NULL), a run
    reads it, marks the item over it and indexes it."""
    item = add_item(db, kind="note", title="N", content="A note.")
    db.execute(f"UPDATE item_index_state SET claim = {value} WHERE item_id = ?", (item,))
    result = run(db, [item], FakeEmbedder(), "t1")[item]
    assert getattr(result, "status", result) == "indexed"
    assert db.scalar("SELECT typeof(claim) FROM item_index_state WHERE item_id = ?", (item,)) == (
        "integer"
    )


def test_a_database_of_the_schema_before_the_token_gets_it(
    db: Database, emb_settings: EmbeddingSettings
) -> None:
    """A database of schema 10 (no `claim` column, an item marked by a run of that kidx) is
    migrated on connect: the column and its triggers are there, and a host's write after a
    run's mark fences that run. Migrations run again from an older recorded version (5) add
    no column twice."""
    item = add_item(db, kind="note", title="Doc", content=TEXT1)
    db.execute("UPDATE item_index_state SET status = 'indexing', last_task_id = 'old'")
    db.execute("DROP TRIGGER item_index_state_claim_kept")
    db.execute("DROP TRIGGER item_index_state_inserted")
    for table in ("note_chunks", "code_chunks"):  # (schema 14's and 16's: they name `claim`)
        for trigger in ("changed", "moved", "inserted", "rekeyed"):
            db.execute(f"DROP TRIGGER {table}_{trigger}")
    db.execute(dict(MIGRATIONS)[10])  # the rename trigger of schema 10
    db.execute("ALTER TABLE item_index_state DROP COLUMN claim")
    db.execute("UPDATE index_meta SET value = '10' WHERE key = 'schema_version'")

    def columns(conn: Database) -> list[str]:
        return [r[1] for r in conn.all("PRAGMA table_info(item_index_state)")]

    with connect(db.path, embedding=emb_settings) as conn:
        assert columns(conn).count("claim") == 1
        assert conn.scalar("SELECT claim FROM item_index_state WHERE item_id = ?", (item,)) is None
        conn.execute("UPDATE index_meta SET value = '5' WHERE key = 'schema_version'")
    with connect(db.path, embedding=emb_settings) as conn:
        version = conn.scalar("SELECT value FROM index_meta WHERE key = 'schema_version'")
        assert version == str(SCHEMA_VERSION) and columns(conn).count("claim") == 1

        def host_writes() -> None:
            db.execute("UPDATE item_index_state SET last_error = 'x' WHERE item_id = ?", (item,))

        embedder = AfterMark(db, item, "t1", host_writes)
        result = run(conn, [item], embedder, "t1")[item]
        assert getattr(result, "status", result) == "coalesced"
        result = run(conn, [item], FakeEmbedder(), "t2")[item]
        assert getattr(result, "status", result) == "indexed"
