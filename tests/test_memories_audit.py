"""Memories a host writes with plain SQL, found by an audit: a real SQLite file with sqlite-vec,
the embedding stand-in over real HTTP, the host's SQL in a process of its own."""

from __future__ import annotations

import re

import numpy as np
import pytest

from host import host
from testkit.standin import vector_for
from worker.errors import InvalidInput
from worker.indexers.memories import (
    MAX_MEMORY,
    add_memory,
    embed_memories,
    memories_missing,
    search_memories,
)
from worker.providers import build_embedder
from worker.reconcile import reconcile
from worker.settings import EmbeddingSettings
from worker.store import connect

OLD = "The user prefers examples in Rust."
NEW = "The user never wants Rust: only Go examples."


def test_a_memory_a_host_rewrites_with_insert_or_replace_gets_the_new_texts_vector(
    db, db_path, embedder
):
    """REPLACE deletes the old row without its delete triggers: the new text kept the old
    text's vector (and its refusal) for good. Migration 13's insert trigger drops both; the
    vec row left behind is removed by the sweep, and the next run embeds the new text."""
    memory = add_memory(db, OLD, embedder)
    refused = add_memory(db, "A memory the provider once refused.", embedder)
    db.execute(
        "INSERT INTO memory_refusals(memory_id, model, content, reason) "
        "SELECT id, ?, CAST(content AS BLOB), 'refused' FROM memories WHERE id = ?",
        (embedder.model_id, refused),
    )
    db.execute("DELETE FROM memory_embeddings WHERE memory_id = ?", (refused,))
    host(
        db_path,
        ("INSERT OR REPLACE INTO memories(id, content) VALUES (?, ?)", [memory, NEW]),
        ("INSERT OR REPLACE INTO memories(id, content) VALUES (?, ?)", [refused, "Tea, no milk."]),
    )
    assert db.all("SELECT memory_id FROM memory_embeddings") == []
    assert db.all("SELECT memory_id FROM memory_refusals") == []
    assert memories_missing(db, embedder.model_id) == 2
    reconcile(db, model=embedder.model_id, max_items=10)
    assert db.all("SELECT memory_id FROM vec_memories") == []  # the sweep took the stale one
    assert embed_memories(db, embedder).embedded == 2
    blob = db.scalar("SELECT vector FROM memory_embeddings WHERE memory_id = ?", (memory,))
    assert np.allclose(np.frombuffer(blob, "<f4"), vector_for(NEW, db.dimensions))
    hits, via, _ = search_memories(db, NEW, embedder, k=1)
    assert via == "vec" and hits[0].memory_id == memory and hits[0].score > 0.99


def test_memories_a_host_writes_too_long_to_embed_whole_are_refused_not_embedded(
    db, db_path, embedder, standin
):
    """`add_memory` refuses over MAX_MEMORY characters; a host's row had no limit (one of
    15 MB took the local tokenizer to 2.6 GB). Such rows are not sent (one over 4 bytes a
    character not even read), but recorded with the reason and counted; the others are
    embedded, and no later run asks for them again."""
    big = "word " * 200_000  # 1 MB: not read
    over = "x" * (MAX_MEMORY + 1)  # read, and over by characters
    host(
        db_path,
        ("INSERT INTO memories(id, content) VALUES (1, ?)", [big]),
        ("INSERT INTO memories(id, content) VALUES (2, ?)", [over]),
        ("INSERT INTO memories(id, content) VALUES (3, ?)", ["The user likes tea."]),
    )
    report = embed_memories(db, embedder)
    assert (report.embedded, report.too_long, report.too_long_ids) == (1, 2, [1, 2])
    assert report.error is None and report.left == 0
    assert standin.texts == ["The user likes tea."]
    reasons = dict(db.all("SELECT memory_id, reason FROM memory_refusals"))
    assert f"has {len(big)} bytes, more than a memory of at most {MAX_MEMORY}" in reasons[1]
    assert f"has {MAX_MEMORY + 1} characters, more than a memory's {MAX_MEMORY}" in reasons[2]
    assert db.scalar("SELECT CAST(content AS BLOB) FROM memory_refusals WHERE memory_id = 1")
    assert memories_missing(db, embedder.model_id) == 0
    again = embed_memories(db, embedder)
    assert (again.embedded, again.too_long) == (0, 0) and len(standin.texts) == 1
    host(db_path, ("UPDATE memories SET content = 'The user likes coffee.' WHERE id = 1", []))
    assert embed_memories(db, embedder).embedded == 1  # shortened: embedded


def test_a_memory_that_starts_with_a_nul_is_embedded(db, db_path, embedder, standin):
    """SQLite's `length()` of a text stops at its first NUL: a memory starting with one was
    never embedded, counted or recorded. Emptiness is measured in bytes now (and whitespace
    only, tabs and newlines too, is empty: nothing to find)."""
    text = "\x00The user likes tea (a leading NUL)"
    host(
        db_path,
        ("INSERT INTO memories(id, content) VALUES (1, ?)", [text]),
        ("INSERT INTO memories(id, content) VALUES (2, ?)", ["\t\n \r"]),
    )
    assert memories_missing(db, embedder.model_id) == 1
    assert embed_memories(db, embedder).embedded == 1
    assert standin.texts == [text]
    blob = db.scalar("SELECT vector FROM memory_embeddings WHERE memory_id = 1")
    assert np.allclose(np.frombuffer(blob, "<f4"), vector_for(text, db.dimensions))


@pytest.mark.model
def test_a_memory_longer_than_the_local_model_reads_is_refused_not_cut(tmp_path):
    """The local model reads 256 tokens (some 1,100 characters) of a text: two memories that
    differ in their tail got the same vector. Over what the model reads, `add_memory`
    refuses the memory, and a host's row is recorded as too long, neither embedded in part."""
    settings = EmbeddingSettings(provider="local")
    db = connect(tmp_path / "kidx.db", embedding=settings)
    embedder = build_embedder(settings, dimensions=db.dimensions)
    assert embedder is not None
    try:
        long = "The user keeps a diary of the weather in the mountains. " * 30
        assert len(long) < MAX_MEMORY
        with pytest.raises(InvalidInput, match=r"more than the 256 that all-MiniLM-L6-v2 reads"):
            add_memory(db, long, embedder)
        db.execute("INSERT INTO memories(id, content) VALUES (1, ?), (2, 'Tea, no milk.')", (long,))
        report = embed_memories(db, embedder)
        assert (report.embedded, report.too_long_ids) == (1, [1])
        reason = db.scalar("SELECT reason FROM memory_refusals WHERE memory_id = 1")
        assert "tokens, more than the 256 that all-MiniLM-L6-v2 reads" in reason
        assert memories_missing(db, embedder.model_id) == 0
    finally:
        embedder.close()
        db.close()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (5, "the memory must be text (str), not int"),
        (b"likes tea", "the memory must be text (str), not bytes"),
        (None, "the memory must be text (str), not NoneType"),
        ("likes \udce9 tea", "the memory is not UTF-8: it holds a lone surrogate U+DCE9"),
    ],
)
def test_a_python_caller_s_memory_that_is_no_text_is_one_clear_error(
    db, embedder, standin, text, message
):
    """`text.strip()` failed with an AttributeError on bytes, a number or None."""
    with pytest.raises(InvalidInput, match=re.escape(message)):
        add_memory(db, text, embedder)
    assert db.scalar("SELECT count(*) FROM memories") == 0
    assert standin.bodies == []  # nothing was sent
