"""The vec tables as an audit found them: a table of another shape (the seed's own application
makes them L2), shadow tables a host damaged, a read-only command during a model switch, and
what `kidx search --code` says without a provider."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import NOWHERE, Kidx, base_env, one_line_error

from conftest import DIMS, FakeEmbedder, as_a_run, mirror_problems, standin_settings
from host import host
from worker.bulk import index_item
from worker.indexers.memories import add_memory, search_memories
from worker.providers import build_embedder
from worker.reconcile import reconcile
from worker.retrieval import search_chunks
from worker.settings import EmbeddingSettings
from worker.store import Database, connect, vec_table_dimensions
from worker.store.items import add_item, get_state

# a provider never reached: FakeEmbedder embeds
FAKE = EmbeddingSettings(
    provider="openai", model="fake", dimensions=DIMS, api_key="x", base_url=NOWHERE
)
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]
QUERY = "alpha beta"


def indexed(path: Path, notes: int = 12, memories: int = 0) -> list[int]:
    """A database of `notes` indexed notes (and `memories`), by FakeEmbedder: their ids."""
    db = connect(path, embedding=FAKE)
    try:
        ids = []
        for n in range(notes):
            text = " ".join(WORDS[(n * 7 + j) % len(WORDS)] for j in range(9))
            ids.append(add_item(db, kind="note", title=f"n{n}", content=f"{text} {n}."))
            index_item(db, ids[-1], embedder=FakeEmbedder())
        for n in range(memories):
            add_memory(db, f"memory {n}: {WORDS[n]} {WORDS[-n - 1]}", FakeEmbedder())
        return ids
    finally:
        db.close()


def ranked(db: Database) -> tuple[str, list[tuple[int, float]]]:
    found = search_chunks(db, QUERY, FakeEmbedder(), k=5, mode="vector")
    return found.via, [(h.chunk_id, h.score) for h in found.hits]


def exact(path: Path) -> list[tuple[int, float]]:
    """The answer of the exact scan over the relational vectors (sqlite-vec off)."""
    db = connect(path, embedding=FAKE, vec=False)
    try:
        via, hits = ranked(db)
        assert via == "fallback" and len(hits) == 5
        return hits
    finally:
        db.close()


def same(got: list[tuple[int, float]], want: list[tuple[int, float]]) -> bool:
    return [c for c, _ in got] == [c for c, _ in want] and [s for _, s in got] == pytest.approx(
        [s for _, s in want], abs=1e-5
    )


def declaration(db: Database, table: str) -> str:
    return str(db.scalar("SELECT sql FROM sqlite_master WHERE name = ?", (table,)))


@pytest.mark.parametrize(
    ("table", "column"),
    [
        ("vec_chunk_embeddings", "embedding float[64]"),  # sqlite-vec's default: L2
        ("vec_chunk_embeddings", "embedding float[64] distance_metric=l2"),
        ("vec_chunk_embeddings", "embedding float[64] distance_metric=cosine, +note text"),
        ("vec_chunk_bits", "embedding float[64]"),  # floats where the bit mirror goes
    ],
)
def test_a_vec_table_of_another_shape_is_not_used_and_is_rebuilt(tmp_path, table, column):
    """A host's vec table of the right dimension but another shape (the seed's application
    makes `vec_chunk_embeddings` without `distance_metric=cosine`): its L2 distances were
    reported as cosine scores. It counts as no table: search scans exactly until a writer's
    connection rebuilds it from the relational vectors (no provider call), then vec0 serves
    the exact answer again."""
    path = tmp_path / "kidx.db"
    ids = indexed(path)
    want = exact(path)
    db = connect(path, embedding=FAKE)
    key = "chunk_id"
    db.execute(f"DROP TABLE {table}")
    db.execute(f"CREATE VIRTUAL TABLE {table} USING vec0({key} INTEGER PRIMARY KEY, {column})")
    db.execute(
        f"INSERT INTO {table}({key}, embedding) SELECT chunk_id, vector FROM note_chunk_embeddings"
    )
    try:
        assert vec_table_dimensions(db)[table] is None
        via, hits = ranked(db)
        if table == "vec_chunk_embeddings":
            assert via == "fallback"
        assert same(hits, want)
    finally:
        db.close()
    db = connect(path, embedding=FAKE)  # a writer's connection: rebuilt, the items kept
    try:
        assert declaration(db, table).endswith(
            "embedding float[64] distance_metric=cosine)"
            if table == "vec_chunk_embeddings"
            else "embedding bit[64])"
        )
        assert set(vec_table_dimensions(db).values()) == {DIMS}
        assert mirror_problems(db) == []
        assert {get_state(db, i)["status"] for i in ids} == {"indexed"}
        via, hits = ranked(db)
        assert via == "vec" and same(hits, want)
    finally:
        db.close()


DAMAGE = {
    "short vectors blob": (
        "vec_chunk_embeddings",
        "UPDATE {t}_vector_chunks00 SET vectors = x'00'",
    ),
    "text vectors blob": ("vec_chunk_embeddings", "UPDATE {t}_vector_chunks00 SET vectors = 'abc'"),
    "empty validity": ("vec_chunk_embeddings", "UPDATE {t}_chunks SET validity = x''"),
    "rowids garbage": ("vec_chunk_embeddings", "UPDATE {t}_chunks SET rowids = x'01'"),
    "huge size": ("vec_chunk_embeddings", "UPDATE {t}_chunks SET size = 100000000"),
    "chunks deleted": ("vec_chunk_embeddings", "DELETE FROM {t}_chunks"),
    "rowids deleted": ("vec_chunk_embeddings", "DELETE FROM {t}_rowids"),
    "chunks dropped": ("vec_chunk_embeddings", "DROP TABLE {t}_chunks"),
    "bit vectors dropped": ("vec_chunk_bits", "DROP TABLE {t}_vector_chunks00"),
    "memory chunks dropped": ("vec_memories", "DROP TABLE {t}_chunks"),
    "memory blob short": ("vec_memories", "UPDATE {t}_vector_chunks00 SET vectors = x'00'"),
}


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_the_sweep_rebuilds_a_vec_table_whose_shadow_tables_a_host_damaged(tmp_path, case):
    """A host's plain SQL into sqlite-vec's own shadow tables: every search of the table
    failed ("vectors blob size doesn't match") or found nothing, and the repair crashed on it
    or saw nothing to do. The reconcile sweep rebuilds that table from the relational vectors
    (no provider call), and vector search serves the exact answer again."""
    table, sql = DAMAGE[case]
    path = tmp_path / "kidx.db"
    indexed(path, memories=6)
    want = exact(path)
    db = connect(path, embedding=FAKE)
    want_memories = [h.memory_id for h in search_memories(db, "memory 2", FakeEmbedder(), k=3)[0]]
    db.close()
    host(path, (sql.format(t=table), []))
    db = connect(path, embedding=FAKE)
    try:
        drift = reconcile(db, model="fake", max_items=10)
        expected = (
            6
            if table == "vec_memories"
            else db.scalar("SELECT count(*) FROM note_chunk_embeddings")
        )
        assert drift.repaired["tables_rebuilt"] == {table: expected}
        assert drift.to_index == []
        assert mirror_problems(db) == []
        via, hits = ranked(db)
        assert via == "vec" and same(hits, want)
        memories, via, reason = search_memories(db, "memory 2", FakeEmbedder(), k=3)
        assert via == "vec" and reason is None
        assert [h.memory_id for h in memories] == want_memories
        assert reconcile(db, model="fake", max_items=10).repaired["tables_rebuilt"] == {}
    finally:
        db.close()


def test_a_read_only_command_keeps_the_index_during_a_model_switch(tmp_path, standin):
    """Half-way through a model switch (the workers re-index with the new model), `kidx
    search`, `status` and `chunks` run with the old model still configured (another shell, a
    cron job) rebuilt the vec tables back to the old dimension and marked the re-indexed
    items `pending`. They only read now: the tables and the states stay; the search scans the
    old model's vectors exactly, and says so."""
    path = tmp_path / "kidx.db"
    old = standin_settings(standin)  # 64 dimensions
    db = connect(path, embedding=old)
    embedder = build_embedder(old, dimensions=db.dimensions)
    assert embedder is not None
    texts = [f"Note {n} is about {WORDS[n]} and {WORDS[n + 4]}." for n in range(4)]
    ids = [add_item(db, kind="note", title=f"n{n}", content=t) for n, t in enumerate(texts)]
    for i in ids:
        index_item(db, i, embedder=embedder)
    embedder.close()
    db.close()
    new = standin_settings(standin, model="new-embed", dimensions=32)
    db = connect(path, embedding=new)  # the workers, switched: the tables at 32
    for i in ids[:2]:
        index_item(db, i, embedder=FakeEmbedder(32, "new-embed"))
    db.close()

    def index_state() -> tuple[dict[str, int | None], list[tuple[object, ...]]]:
        bare = Database(path)
        try:
            states = bare.all(
                "SELECT item_id, status, model, dimensions FROM item_index_state ORDER BY item_id"
            )
            return vec_table_dimensions(bare), states
        finally:
            bare.close()

    before = index_state()
    assert set(before[0].values()) == {32}
    assert [s[1] for s in before[1]] == ["indexed", "indexed", "pending", "pending"]
    work = tmp_path / "work"
    work.mkdir()
    kidx = Kidx(work, base_env(path, standin.base_url), process=True)  # the old model, 64
    scan = connect(path, embedding=old, vec=False)  # the exact answer, sqlite-vec off
    embedder = build_embedder(old, dimensions=scan.dimensions)
    assert embedder is not None
    want = search_chunks(scan, texts[2], embedder, k=10, mode="vector")
    embedder.close()
    scan.close()
    assert {h.item_id for h in want.hits} == {ids[2], ids[3]}  # the old model's items
    found = kidx("search", texts[2], "--mode", "vector", "--json")
    assert found.returncode == 0, found.stderr
    hits = json.loads(found.stdout)
    assert [(h["item_id"], h["score"]) for h in hits] == [
        (h.item_id, pytest.approx(h.score, abs=1e-5)) for h in want.hits
    ]
    assert "in-memory fallback" in found.stderr
    assert "2 items are not indexed with standin-embed" in found.stderr
    kidx.ok("status")
    kidx.ok("chunks", str(ids[0]))
    assert index_state() == before


def test_code_and_memory_search_without_a_provider_suggest_nothing_refused(tmp_path):
    """Without a provider, `kidx search x --code` said "--mode keyword needs none", and
    `--code --mode keyword` was then refused: code and memory search are by vector. What
    plain search suggests works."""
    work = tmp_path / "work"
    work.mkdir()
    kidx = Kidx(
        work,
        base_env(tmp_path / "kidx.db", NOWHERE) | {"KIDX_EMBEDDING__PROVIDER": "none"},
        process=True,
    )
    kidx.ok("init")
    kidx.ok("add", "note", "--title", "t", "--text", "ownership and borrowing")
    for flag in ("--code", "--memories"):
        line = one_line_error(kidx("search", "borrowing", flag))
        assert f"{flag} search needs an embedding provider" in line
        assert "--mode" not in line
    line = one_line_error(kidx("search", "borrowing"))
    assert "--mode keyword needs none" in line
    assert kidx.ok("search", "borrowing", "--mode", "keyword").returncode == 0


def test_a_read_only_connection_does_not_search_a_mirror_marked_behind(tmp_path):
    """Vectors written while the mirror could not be (`vec_behind`): the vec table may hold an
    old vector under a live key. A writer's connection rebuilds it; a read-only one rewrites
    nothing, so it does not use the vec tables at all: the search scans exactly (and says
    so) until a writer or the sweep has rebuilt them."""
    path = tmp_path / "kidx.db"
    indexed(path)
    db = connect(path, embedding=FAKE)
    query = FakeEmbedder().embed_batch([QUERY])[0].astype("<f4").tobytes()
    with db.atomic(), as_a_run(db):  # a chunk's new vector, its mirror not written: the
        chunk = db.scalar("SELECT max(chunk_id) FROM note_chunk_embeddings")  # query's own
        db.execute(  # (as kidx writes one: an UPDATE is a host's, whose vector is dropped)
            "INSERT OR REPLACE INTO note_chunk_embeddings(chunk_id, model, dimensions, vector) "
            "SELECT chunk_id, model, dimensions, ? FROM note_chunk_embeddings WHERE chunk_id = ?",
            (query, chunk),
        )
        db.execute("INSERT INTO index_meta(key, value) VALUES ('vec_behind', '1')")
    db.close()
    want = exact(path)
    assert want[0] == (chunk, pytest.approx(1.0, abs=1e-5))
    reader = connect(path, embedding=FAKE, read_only=True)
    try:
        found = search_chunks(reader, QUERY, FakeEmbedder(), k=5, mode="vector")
        assert found.via == "fallback" and "vec tables could not be" in (found.reason or "")
        assert same([(h.chunk_id, h.score) for h in found.hits], want)
        assert reader.scalar("SELECT value FROM index_meta WHERE key = 'vec_behind'") == "1"
    finally:
        reader.close()
    db = connect(path, embedding=FAKE)  # a writer: rebuilt, and vec0 serves the same answer
    try:
        assert mirror_problems(db) == []
        via, hits = ranked(db)
        assert via == "vec" and same(hits, want)
    finally:
        db.close()
