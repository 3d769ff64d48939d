"""Memories a host writes with plain SQL, found by an audit: a real SQLite file with sqlite-vec,
the embedding stand-in over real HTTP, the host's SQL in a process of its own."""

from __future__ import annotations

import numpy as np

from host import host
from testkit.standin import vector_for
from worker.indexers.memories import add_memory, embed_memories, memories_missing, search_memories
from worker.reconcile import reconcile

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
