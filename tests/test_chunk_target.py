"""The structural chunker's target as a setting (`KIDX_CHUNK__TARGET`)."""

from __future__ import annotations

from worker.chunking.base import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, TARGET_CHUNK_SIZE
from worker.settings import ChunkSettings


def test_the_setting_s_default_and_bounds_are_the_chunker_s():
    """Written out in worker/settings.py (importing the chunking package there is circular)."""
    field = ChunkSettings.model_fields["target"]
    bounds = {type(m).__name__: m for m in field.metadata}
    assert field.default == TARGET_CHUNK_SIZE
    assert bounds["Ge"].ge == MIN_CHUNK_SIZE and bounds["Le"].le == MAX_CHUNK_SIZE


def _sizes(db, item: int) -> list[tuple[int, int]]:
    return db.all(
        "SELECT start_offset, end_offset FROM note_chunks WHERE item_id = ? ORDER BY chunk_index",
        (item,),
    )


def test_a_new_target_takes_effect_on_an_item_indexed_at_another(db):
    """A run kept the previous version's cuts wherever the text was unchanged: an item indexed
    before the operator changed the target kept its old cuts for good, whatever was
    re-indexed. Cuts are kept now only when they were made at the run's own target (recorded
    with the item's state); chunks whose text stays the same keep their vectors."""
    from conftest import FakeEmbedder, corpus_text
    from worker.bulk import index_item
    from worker.chunking import chunk_structure
    from worker.indexers import IndexOptions
    from worker.store.items import add_item

    text = corpus_text("ch03-02-data-types.md")
    item = add_item(db, kind="note", title="Types", content=text)
    fake = FakeEmbedder()
    for target in (TARGET_CHUNK_SIZE, MAX_CHUNK_SIZE, MIN_CHUNK_SIZE, TARGET_CHUNK_SIZE):
        result = index_item(db, item, embedder=fake, options=IndexOptions(chunk_target=target))
        fresh = [(c.start, c.end) for c in chunk_structure(text, target=target)]
        assert _sizes(db, item) == fresh, target
        assert (
            db.scalar("SELECT chunk_target FROM item_index_state WHERE item_id = ?", (item,))
            == target
        )
        assert result.reused + result.embedded == len(fresh)
    # back at 650: the texts 650 made before are the same, and keep their vectors
    assert result.reused > 0
    # at the same target, an unchanged text is not embedded again
    fake.calls.clear()
    again = index_item(
        db, item, embedder=fake, options=IndexOptions(chunk_target=TARGET_CHUNK_SIZE)
    )
    assert again.embedded == 0 and fake.calls == []
