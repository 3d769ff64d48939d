"""A cancelled run leaves its item `cancelled`; the reconcile sweep still sends the item when
its index is older than the item (a rename's `pending` was replaced by `cancelled`), or when it
has none (a file's first run cancelled), of any kind; not when the index is current."""

from __future__ import annotations

import pytest

from conftest import corpus_text
from host import host
from worker.bulk import index_item
from worker.errors import Cancelled
from worker.indexers import IndexOptions
from worker.reconcile import reconcile
from worker.settings import FilesSettings
from worker.sources import Reader
from worker.store.items import add_item, get_state

CHAPTER = "ch10-02-traits.md"


def cancelled_run(db, item: int, embedder, **options) -> None:
    with pytest.raises(Cancelled):
        index_item(
            db, item, embedder=embedder, options=IndexOptions(cancel=lambda: True, **options)
        )
    assert get_state(db, item)["status"] == "cancelled"


def sent(db, embedder) -> list[int]:
    return reconcile(db, model=embedder.model_id, max_items=100).to_index


def test_a_rename_whose_run_was_cancelled_is_sent_again(db, embedder, standin):
    item = add_item(db, kind="note", title="Traits", content=corpus_text(CHAPTER))
    index_item(db, item, embedder=embedder)
    assert sent(db, embedder) == []
    host(db.path, ("UPDATE knowledge_items SET title = 'Traits, renamed' WHERE id = ?", [item]))
    assert get_state(db, item)["status"] == "pending"
    cancelled_run(db, item, embedder)
    assert sent(db, embedder) == [item]  # the chunks' keyword rows still have the old title
    index_item(db, item, embedder=embedder)
    assert sent(db, embedder) == []


def test_a_file_whose_first_run_was_cancelled_is_sent_again(db, embedder, standin, tmp_path):
    root = tmp_path / "files"
    root.mkdir()
    (root / "a.md").write_text(corpus_text(CHAPTER), encoding="utf-8")
    reader = Reader(FilesSettings(roots=[root]))
    item = add_item(db, kind="file", title="a.md", content="", source=str(root / "a.md"))
    cancelled_run(db, item, embedder, reader=reader)
    assert sent(db, embedder) == [item]


def test_a_cancelled_run_over_a_current_index_is_not_sent(db, embedder, standin):
    item = add_item(db, kind="note", title="Traits", content=corpus_text(CHAPTER))
    index_item(db, item, embedder=embedder)
    cancelled_run(db, item, embedder)  # a reindex cancelled: the index is the item's
    assert sent(db, embedder) == []
