"""The search paths against what a host (or a model switch) leaves in the database: every path
(sqlite-vec's KNN, two passes over the bit mirror, the exact fallback, filtered, hybrid,
keyword) answers the same, or says why it cannot, never crashes nor quietly drops hits."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import AFTER_THE_RUN, AS_A_RUN, DIMS, FakeEmbedder, forge_vector, standin_settings
from host import host
from worker.bulk import index_item, index_items
from worker.errors import InvalidInput
from worker.indexers import IndexOptions
from worker.indexers.code import search_code
from worker.indexers.memories import add_memory, search_memories
from worker.retrieval import Filters, search_chunks
from worker.settings import FilesSettings, SearchSettings
from worker.sources import Reader
from worker.store import connect
from worker.store.db import Database
from worker.store.items import add_item

TWO_PASSES = SearchSettings(exact_below=0, oversample=2)
WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]


@pytest.fixture
def fake() -> FakeEmbedder:
    return FakeEmbedder()


@pytest.fixture
def notes(db: Database, fake: FakeEmbedder) -> Database:
    """Twelve one-chunk notes of a few shared words."""
    rng = np.random.default_rng(7)
    for n in range(12):
        text = " ".join(rng.choice(WORDS, 12))
        index_item(db, add_item(db, kind="note", title=f"n{n}", content=text), embedder=fake)
    return db


@pytest.fixture
def no_vec(notes: Database, emb_settings: Any) -> Any:
    """The same file without sqlite-vec: every vector search takes the exact path."""
    other = connect(notes.path, embedding=emb_settings, vec=False)
    yield other
    other.close()


def ids(result: Any) -> list[int]:
    return [h.chunk_id for h in result.hits]


def every_path(db: Database, no_vec: Database, fake: FakeEmbedder, query: str, k: int) -> dict:
    return {
        "knn": search_chunks(db, query, fake, k=k, mode="vector"),
        "two passes": search_chunks(db, query, fake, k=k, mode="vector", tuning=TWO_PASSES),
        "filtered": search_chunks(
            db, query, fake, k=k, mode="vector", filters=Filters(kinds=("note",))
        ),
        "fallback": search_chunks(no_vec, query, fake, k=k, mode="vector"),
    }


# -- F1: an empty bit mirror -----------------------------------------------------------------


def test_a_model_switch_leaves_the_bit_mirror_empty_and_search_says_so_rather_than_crash(
    notes, standin, tmp_path
):
    """A switch to a model of another dimension rebuilds the vec tables empty; on a database
    of 50,000 chunks (two passes) every vector and hybrid search crashed in worker.hamming
    (an empty array reshaped) until the first new vector was written."""
    path = notes.path
    notes.close()
    db = connect(path, embedding=standin_settings(standin, model="new-model", dimensions=128))
    try:
        assert db.scalar("SELECT count(*) FROM vec_chunk_bits") == 0
        new = FakeEmbedder(128, "new-model")
        for mode in ("vector", "hybrid"):
            got = search_chunks(db, "alpha beta", new, k=3, mode=mode, tuning=TWO_PASSES)
            assert "12 items are not indexed with new-model yet" in str(got.reason), mode
            vec_hits = [h for h in got.hits if "vec" in h.via]
            assert vec_hits == [], mode
    finally:
        db.close()


def test_a_bit_mirror_a_host_emptied_leaves_the_float_table_to_answer(notes, fake):
    """Two passes over an empty mirror crashed, and with that mended answered nothing at all
    while the float table and the relational vectors held every chunk."""
    want = ids(search_chunks(notes, "alpha beta", fake, k=3, mode="vector"))
    notes.execute("DELETE FROM vec_chunk_bits")
    got = search_chunks(notes, "alpha beta", fake, k=3, mode="vector", tuning=TWO_PASSES)
    assert (ids(got), got.via) == (want, "vec")


# -- F5: a vec row whose relational vector a host made unreadable -----------------------------


# (as a host's INSERT OR REPLACE writes them: a vector an UPDATE changes is dropped at once,
# schema migration 15)
_REPLACED = (
    "INSERT OR REPLACE INTO {{table}}({{key}}, model, dimensions, created_at, vector) "
    "SELECT {{key}}, model, {values}, created_at, {vector} FROM {{table}} WHERE {{key}} = ?"
)
UNREADABLE = {
    "text of the right length": _REPLACED.format(
        values="dimensions", vector="printf('%.*c', 4 * {dims}, 'x')"
    ),
    "another dimension": _REPLACED.format(values="32", vector="zeroblob(128)"),
}


@pytest.mark.parametrize("damage", UNREADABLE)
def test_a_chunk_whose_vector_a_host_made_unreadable_is_on_no_path(notes, no_vec, fake, damage):
    """sqlite-vec's KNN returned it (its vec row stays), the exact and two-pass paths did not."""
    top = ids(search_chunks(notes, "alpha beta", fake, k=1, mode="vector"))[0]
    sql = UNREADABLE[damage].format(table="note_chunk_embeddings", dims=DIMS, key="chunk_id")
    host(notes.path, (sql, [top]))
    paths = every_path(notes, no_vec, fake, "alpha beta", 4)
    for name, result in paths.items():
        assert top not in ids(result), name
        assert ids(result) == ids(paths["fallback"]), name


@pytest.mark.parametrize("damage", UNREADABLE)
def test_a_memory_whose_vector_a_host_made_unreadable_is_on_no_path(db, fake, emb_settings, damage):
    memories = [add_memory(db, text, fake) for text in ("alpha beta", "gamma delta", "omega")]
    sql = UNREADABLE[damage].format(table="memory_embeddings", dims=DIMS, key="memory_id")
    host(db.path, (sql, [memories[0]]))
    no_vec = connect(db.path, embedding=emb_settings, vec=False)
    try:
        found, via, _ = search_memories(db, "alpha beta", fake, k=3)
        exact, fallback, _ = search_memories(no_vec, "alpha beta", fake, k=3)
    finally:
        no_vec.close()
    assert (via, fallback) == ("vec", "fallback")
    assert [m.memory_id for m in found] == [m.memory_id for m in exact] == memories[1:]


# -- F6: negative ids ------------------------------------------------------------------------


def test_the_exact_path_finds_a_chunk_a_host_wrote_under_a_negative_id(notes, no_vec, fake):
    """The fallback paged its rows from rowid -1 up: it never saw a negative one."""
    item = notes.scalar("SELECT max(id) FROM knowledge_items")
    vector = fake.embed(["zz unique"])[0].astype("<f4").tobytes()
    host(
        notes.path,
        (AS_A_RUN, []),  # (a host's rows would go at once: schema migration 16)
        (
            "INSERT INTO note_chunks(id, item_id, chunk_index, content, method, start_offset, "
            "end_offset, embed_hash) VALUES (-7, ?, 5, 'zz unique', 'structure', 0, 9, 'h')",
            [item],
        ),
        (
            "INSERT INTO note_chunk_embeddings(chunk_id, model, dimensions, vector) "
            "VALUES (-7, 'fake', ?, ?)",
            [DIMS, {"hex": vector.hex()}],
        ),
        (AFTER_THE_RUN, []),
    )
    got = search_chunks(no_vec, "zz unique", fake, k=2, mode="vector")
    assert got.via == "fallback" and ids(got)[0] == -7
    filtered = search_chunks(
        no_vec, "zz unique", fake, k=2, mode="vector", filters=Filters(item_ids=(item,))
    )
    assert ids(filtered)[0] == -7


# -- F9: twins beyond the first pass's candidates ---------------------------------------------


def test_two_passes_return_the_lowest_ids_of_twins_as_every_path_does(notes, no_vec, fake):
    """A boilerplate footer saved 300 times: hamming distances are all equal, and the first
    pass kept an arbitrary 32 of them (numpy's partition), so two passes returned other twins
    than the KNN and the fallback."""
    twins = [
        add_item(notes, kind="note", title="footer", content="copyright footer boilerplate")
        for _ in range(300)
    ]
    index_items(notes, twins, embedder=fake)
    query = fake.calls[-1][0]  # what the twins' chunks were embedded as
    first = sorted(r[0] for r in notes.all("SELECT id FROM note_chunks WHERE content LIKE 'copy%'"))
    for k in (1, 3):
        paths = every_path(notes, no_vec, fake, query, k)
        for name, result in paths.items():
            assert ids(result) == first[:k], (name, k)


# -- F10: hybrid served by vectors alone ------------------------------------------------------


def test_hybrid_served_by_vectors_alone_keeps_their_scores(notes, fake):
    """A query with no word to search for, or no keyword table: every hit scored 0.0."""
    vector = search_chunks(notes, "???", fake, k=3, mode="vector")
    hybrid = search_chunks(notes, "???", fake, k=3, mode="hybrid")
    assert hybrid.via == "vec"
    assert [(h.chunk_id, h.score) for h in hybrid.hits] == [
        (h.chunk_id, h.score) for h in vector.hits
    ]
    assert all(h.score != 0.0 for h in hybrid.hits)
    alpha = search_chunks(notes, "alpha", fake, k=3, mode="vector")
    notes.execute("DROP TABLE note_chunks_fts")
    dropped = search_chunks(notes, "alpha", fake, k=3, mode="hybrid")
    assert dropped.via == "vec" and "missing" in str(dropped.reason)
    assert [h.score for h in dropped.hits] == [h.score for h in alpha.hits]


# -- F11: a chosen hit that cannot be shown ---------------------------------------------------


@pytest.mark.parametrize("mode", ["vector", "keyword", "hybrid"])
@pytest.mark.parametrize("per_item", [False, True])
def test_a_hit_a_host_made_unshowable_gives_its_place_to_the_next(notes, fake, mode, per_item):
    """A host wrote TEXT into the first hit's end offset (the CHECK lets it through): it was
    dropped after the cut to k, and k=3 returned 2 hits."""
    before = ids(search_chunks(notes, "alpha beta", fake, k=4, mode=mode, per_item=per_item))
    host(notes.path, ("UPDATE note_chunks SET end_offset = 'zzz' WHERE id = ?", [before[0]]))
    after = search_chunks(notes, "alpha beta", fake, k=3, mode=mode, per_item=per_item)
    assert ids(after) == before[1:]


# -- F12: code search and an item a host turned into a note -----------------------------------


def test_code_chunks_of_an_item_turned_into_a_note_take_no_candidate_slot(db, fake, tmp_path: Path):
    """Their vectors filled the candidate list and were dropped when loaded: 33 hits of 40."""
    reader = Reader(FilesSettings(roots=[tmp_path]))
    items = []
    for n in range(3):
        path = tmp_path / f"m{n}.py"
        path.write_text(
            "\n\n".join(f"def f{n}_{j}():\n    return 'alpha beta {j}'\n" for j in range(20))
        )
        item = add_item(db, kind="code", title=path.name, content="", source=str(path))
        index_item(db, item, embedder=fake, options=IndexOptions(reader=reader))
        items.append(item)
    host(db.path, ("UPDATE knowledge_items SET kind = 'note' WHERE id = ?", [items[0]]))
    left = db.scalar(
        "SELECT count(*) FROM code_chunks c JOIN knowledge_items i ON i.id = c.item_id "
        "WHERE i.kind = 'code'"
    )
    assert left == 40
    hits, via, _ = search_code(db, "zzqq", fake, k=40)  # no keyword hit: vectors alone
    assert via == "vec" and len(hits) == 40
    assert items[0] not in {h.item_id for h in hits}


# -- F13: damage in FTS5's shadow tables ------------------------------------------------------


FTS_DAMAGE = {
    "a NULL score": "UPDATE note_chunks_fts_data SET block = x'01' WHERE id = 1",
    "an invalid format": "UPDATE note_chunks_fts_config SET v = 99 WHERE k = 'version'",
}


@pytest.mark.parametrize("damage", FTS_DAMAGE)
def test_a_damaged_keyword_index_leaves_hybrid_search_to_vectors(notes, fake, emb_settings, damage):
    """float(None) of a NULL bm25, and `invalid fts5 file format` (an SQLError, where only a
    CorruptError was caught), crashed keyword and hybrid search."""
    vector = ids(search_chunks(notes, "alpha beta", fake, k=3, mode="vector"))
    host(notes.path, (FTS_DAMAGE[damage], []))
    db = connect(notes.path, embedding=emb_settings)
    try:
        keyword = search_chunks(db, "alpha beta", None, k=3, mode="keyword")
        hybrid = search_chunks(db, "alpha beta", fake, k=3, mode="hybrid")
    finally:
        db.close()
    assert keyword.hits == [] and "note_chunks_fts is damaged" in str(keyword.reason)
    assert (ids(hybrid), hybrid.via) == (vector, "vec")
    assert "note_chunks_fts is damaged" in str(hybrid.reason)


# -- F14: damage in sqlite-vec's shadow tables ------------------------------------------------


VEC_DAMAGE = {
    "a short vectors blob": "UPDATE vec_chunk_embeddings_vector_chunks00 SET vectors = x'00'",
    "a validity of another size": "UPDATE vec_chunk_embeddings_chunks SET validity = x''",
    "its chunks deleted": "DELETE FROM vec_chunk_embeddings_chunks",
    # `||` makes a BLOB TEXT, here not UTF-8: apsw raised reading it (UnicodeDecodeError)
    "a validity made text": "UPDATE vec_chunk_embeddings_chunks "
    "SET validity = CAST(x'ff' || validity AS TEXT)",
    "vectors made text": "UPDATE vec_chunk_embeddings_vector_chunks00 "
    "SET vectors = CAST(x'ff' || vectors AS TEXT)",
}


@pytest.mark.parametrize("damage", VEC_DAMAGE)
def test_a_damaged_vec_table_leaves_vector_search_to_the_exact_path(notes, no_vec, fake, damage):
    """sqlite-vec raised (`vectors blob size doesn't match`) through vector and hybrid search,
    or, its chunks deleted, answered nothing at all without an error."""
    want = ids(search_chunks(no_vec, "alpha beta", fake, k=3, mode="vector"))
    hybrid_want = ids(search_chunks(no_vec, "alpha beta", fake, k=3, mode="hybrid"))
    host(notes.path, (VEC_DAMAGE[damage], []))
    got = search_chunks(notes, "alpha beta", fake, k=3, mode="vector")
    assert (ids(got), got.via) == (want, "fallback")
    assert "vec_chunk_embeddings" in str(got.reason)
    hybrid = search_chunks(notes, "alpha beta", fake, k=3, mode="hybrid")
    assert (ids(hybrid), hybrid.via) == (hybrid_want, "fts+fallback")


@pytest.mark.parametrize(
    "damage",
    [
        "DROP TABLE vec_chunk_bits_vector_chunks00",
        "UPDATE vec_chunk_bits_chunks SET rowids = CAST(x'ff' || rowids AS TEXT)",
        "UPDATE vec_chunk_bits_chunks SET validity = CAST(x'ff' || validity AS TEXT)",
    ],
)
def test_a_damaged_bit_mirror_leaves_two_passes_to_the_exact_path(notes, no_vec, fake, damage):
    want = ids(search_chunks(no_vec, "alpha beta", fake, k=3, mode="vector"))
    host(notes.path, (damage, []))
    got = search_chunks(notes, "alpha beta", fake, k=3, mode="vector", tuning=TWO_PASSES)
    assert (ids(got), got.via) == (want, "fallback")
    assert "vec_chunk_bits" in str(got.reason)


def test_a_bit_mirror_a_host_partly_emptied_leaves_two_passes_to_the_exact_path(
    notes, no_vec, fake
):
    """Two passes ranked the rows the mirror still marked valid (here 4 of 12; a host's
    DELETE of one of its storage chunks, 1,024 rows) and answered their best, as `vec`, with
    no word: the float KNN says when it ends short of the vectors it mirrors, and so do they."""
    want = ids(search_chunks(no_vec, "alpha beta", fake, k=5, mode="vector"))
    host(notes.path, ("UPDATE vec_chunk_bits_chunks SET validity = x'0f' || zeroblob(127)", []))
    got = search_chunks(notes, "alpha beta", fake, k=5, mode="vector", tuning=TWO_PASSES)
    assert (ids(got), got.via) == (want, "fallback")
    assert "vec_chunk_bits holds fewer vectors" in str(got.reason)


def test_two_ids_swapped_in_the_knn_s_storage_leave_search_exact_until_the_sweep_rebuilds(
    notes, no_vec, fake
):
    """The KNN ranked the worst match first with the best one's score, and the best was gone;
    no sweep saw it (each row's own lookup, through `_rowids`, still held)."""
    import struct

    from worker.store.repair import repair_vectors

    want = search_chunks(no_vec, "alpha beta", fake, k=3, mode="vector")
    worst = search_chunks(no_vec, "alpha beta", fake, k=12, mode="vector").hits[-1].chunk_id
    (blob,) = notes.one("SELECT rowids FROM vec_chunk_embeddings_chunks")
    slots = list(struct.unpack(f"<{len(blob) // 8}q", blob))
    i, j = slots.index(want.hits[0].chunk_id), slots.index(worst)
    slots[i], slots[j] = slots[j], slots[i]
    swapped = struct.pack(f"<{len(slots)}q", *slots)
    host(
        notes.path, ("UPDATE vec_chunk_embeddings_chunks SET rowids = ?", [{"hex": swapped.hex()}])
    )
    got = search_chunks(notes, "alpha beta", fake, k=3, mode="vector")
    assert (ids(got), got.via) == (ids(want), "fallback")
    assert "a vector that is not its own" in str(got.reason)
    report = repair_vectors(notes, DIMS)
    assert report.tables_rebuilt.get("vec_chunk_embeddings") == 12
    again = search_chunks(notes, "alpha beta", fake, k=3, mode="vector")
    assert (ids(again), again.via) == (ids(want), "vec")


def test_a_validity_bit_a_host_moved_is_found_by_the_sweep_and_rebuilt(notes, no_vec, fake):
    """One bit moved from the best hit's slot to an empty one (the count of valid slots still
    agrees): the KNN never answered that chunk again, and no sweep saw it (the search now
    leaves it to the exact path: the empty slot's vector has no direction)."""
    import struct

    from worker.store.repair import repair_vectors

    want = search_chunks(no_vec, "alpha beta", fake, k=3, mode="vector")
    (blob, bits) = notes.one("SELECT rowids, validity FROM vec_chunk_embeddings_chunks")
    slot = list(struct.unpack(f"<{len(blob) // 8}q", blob)).index(want.hits[0].chunk_id)
    flags = bytearray(bits)
    flags[slot // 8] &= ~(1 << slot % 8) & 0xFF
    flags[-1] |= 0x80  # the last slot, empty with 12 rows of 1,024
    moved = {"hex": flags.hex()}
    host(notes.path, ("UPDATE vec_chunk_embeddings_chunks SET validity = ?", [moved]))
    assert search_chunks(notes, "alpha beta", fake, k=3, mode="vector").via == "fallback"
    assert repair_vectors(notes, DIMS).tables_rebuilt.get("vec_chunk_embeddings") == 12
    again = search_chunks(notes, "alpha beta", fake, k=3, mode="vector")
    assert (ids(again), again.via) == (ids(want), "vec")


def test_the_knn_s_hits_have_the_exact_path_s_scores(notes, no_vec, fake):
    """sqlite-vec's float32 distances differed from numpy's in the sixth decimal: one chunk,
    two scores, by the path that served it."""
    for query in ("alpha beta", "gamma delta epsilon", "kappa"):
        knn = search_chunks(notes, query, fake, k=5, mode="vector")
        exact = search_chunks(no_vec, query, fake, k=5, mode="vector")
        assert (knn.via, exact.via) == ("vec", "fallback")
        assert [(h.chunk_id, h.score) for h in knn.hits] == [
            (h.chunk_id, h.score) for h in exact.hits
        ]


@pytest.mark.parametrize(
    "damage",
    [
        "UPDATE vec_memories_vector_chunks00 SET vectors = x'00'",
        "DELETE FROM vec_memories_chunks",
        "DROP TABLE vec_memories_chunks",
        "UPDATE vec_memories_chunks SET validity = CAST(x'ff' || validity AS TEXT)",
    ],
)
def test_a_damaged_memory_vec_table_leaves_memory_search_to_the_exact_path(db, fake, damage):
    memories = [add_memory(db, f"memory {w}", fake) for w in WORDS]
    want, via, _ = search_memories(db, "memory alpha", fake, k=3)
    assert via == "vec"
    host(db.path, (damage, []))
    got, via, reason = search_memories(db, "memory alpha", fake, k=3)
    assert via == "fallback" and "vec_memories" in str(reason)
    assert [m.memory_id for m in got] == [m.memory_id for m in want]
    assert set(memories) >= {m.memory_id for m in got}


# -- F16: infinite values ---------------------------------------------------------------------


def test_an_infinite_vector_scores_zero_without_a_warning(notes, no_vec, fake):
    chunk = notes.scalar("SELECT min(id) FROM note_chunks")
    inf = np.full(DIMS, np.inf, dtype="<f4").tobytes()
    host(
        notes.path,
        (AS_A_RUN, []),
        (
            forge_vector("note_chunk_embeddings", "chunk_id"),
            [{"hex": inf.hex()}, chunk],
        ),
        (AFTER_THE_RUN, []),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = search_chunks(no_vec, "alpha beta", fake, k=12, mode="vector")
    scores = {h.chunk_id: h.score for h in got.hits}
    assert scores[chunk] == 0.0 and len(scores) == 12


# -- F17: the arguments a host sends ----------------------------------------------------------


def test_filters_given_as_a_dict_are_refused_with_what_is_expected(notes, fake):
    with pytest.raises(InvalidInput, match=r"filters must be a worker\.retrieval\.Filters"):
        search_chunks(notes, "alpha", fake, k=3, filters={"kinds": ["note"]})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("argument", "value", "said"),
    [
        ("tuning", {"exact_below": 0}, "tuning must be a worker.settings.SearchSettings"),
        ("per_item", "no", "per_item must be True or False, not 'no'"),
        ("per_item", 1, "per_item must be True or False, not 1"),
    ],
)
def test_a_tuning_or_per_item_of_another_type_is_refused_with_what_is_expected(
    notes, fake, argument, value, said
):
    """A dict for `tuning` raised AttributeError; `per_item="no"` was taken for true."""
    with pytest.raises(InvalidInput, match=said):
        search_chunks(notes, "alpha", fake, k=3, **{argument: value})


def test_numpy_integers_are_integers_for_k_and_item_ids(notes, fake):
    items = [r[0] for r in notes.all("SELECT id FROM knowledge_items ORDER BY id")][:5]
    plain = search_chunks(notes, "alpha", fake, k=3, filters=Filters(item_ids=tuple(items)))
    numpy = search_chunks(
        notes,
        "alpha",
        fake,
        k=np.int64(3),  # type: ignore[arg-type]
        filters=Filters(item_ids=tuple(np.array(items, dtype=np.int64))),
    )
    assert ids(numpy) == ids(plain) and len(plain.hits) == 3
    for wrong in (True, 2.0, "3"):
        with pytest.raises(InvalidInput, match="k must be an integer"):
            search_chunks(notes, "alpha", fake, k=wrong)  # type: ignore[arg-type]
        with pytest.raises(InvalidInput, match="an item id is a 64-bit integer"):
            Filters(item_ids=(wrong,))  # type: ignore[arg-type]


def test_code_and_memory_search_take_a_numpy_k_as_prose_search_does(db, fake, tmp_path: Path):
    """They refused np.int64(3) ("k must be an integer"), which prose search took."""
    path = tmp_path / "m.py"
    path.write_text("\n\n".join(f"def f{j}():\n    return 'alpha {j}'\n" for j in range(6)))
    item = add_item(db, kind="code", title=path.name, content="", source=str(path))
    index_item(
        db,
        item,
        embedder=fake,
        options=IndexOptions(reader=Reader(FilesSettings(roots=[tmp_path]))),
    )
    for text in ("alpha beta", "gamma delta", "omega", "alpha again"):
        add_memory(db, text, fake)
    for search in (search_code, search_memories):
        plain, _, _ = search(db, "alpha", fake, k=3)
        numpy, _, _ = search(db, "alpha", fake, k=np.int64(3))  # type: ignore[arg-type]
        assert numpy == plain and len(plain) == 3
        for wrong in (True, 2.0, "3", np.float64(3)):
            with pytest.raises(InvalidInput, match="k must be an integer"):
                search(db, "alpha", fake, k=wrong)  # type: ignore[arg-type]


# -- F19: a source prefix holding NUL ---------------------------------------------------------


def test_a_source_prefix_holding_nul_matches_on_every_path(notes, no_vec, fake):
    """SQL's text functions stop at NUL: the prefix never matched."""
    item = notes.scalar("SELECT min(id) FROM knowledge_items")
    host(notes.path, ("UPDATE knowledge_items SET source = ? WHERE id = ?", ["dir\x00a/f", item]))
    only = Filters(source_prefix="dir\x00a/")
    other = Filters(source_prefix="dir\x00b/")
    for name, db, mode in (
        ("vector", notes, "vector"),
        ("keyword", notes, "keyword"),
        ("hybrid", notes, "hybrid"),
        ("fallback", no_vec, "vector"),
    ):
        got = search_chunks(db, "alpha beta gamma delta", fake, k=3, mode=mode, filters=only)
        assert {h.item_id for h in got.hits} == {item}, name
        none = search_chunks(db, "alpha beta gamma delta", fake, k=3, mode=mode, filters=other)
        assert none.hits == [], name


def test_a_filter_gets_the_full_oversample_on_two_passes(db, emb_settings, fake, monkeypatch):
    """The widening stopped once k candidates passed the filter: a filter of a fifth of the
    chunks was rescored over a fifth of the oversample (recall 0.70 at 120k chunks, where the
    unfiltered search had 0.77). It goes on until k x oversample pass, or none are left."""
    import worker.retrieval as retrieval

    rng = np.random.default_rng(11)
    items = [
        add_item(db, kind="note", title=f"n{n}", content=" ".join(rng.choice(WORDS, 12)))
        for n in range(100)
    ]
    index_items(db, items, embedder=fake)
    monkeypatch.setattr(retrieval, "FILTER_EXACT", 0)  # (a filter of this few: two passes too)
    passed: list[int] = []
    rescore = retrieval._rescore
    monkeypatch.setattr(retrieval, "_rescore", lambda *a: passed.append(len(r := rescore(*a))) or r)
    filters = Filters(item_ids=tuple(items[::5]))  # 20 of the 100 one-chunk notes
    tuning = SearchSettings(exact_below=0, oversample=8)  # 2 x 8: at least 32 candidates
    found = search_chunks(
        db, "alpha beta", fake, k=2, mode="vector", filters=filters, tuning=tuning
    )
    assert passed[-1] == 20  # each of the filter's, not the first few that passed
    no_vec = connect(db.path, embedding=emb_settings, vec=False)
    try:
        exact = search_chunks(no_vec, "alpha beta", fake, k=2, mode="vector", filters=filters)
    finally:
        no_vec.close()
    assert ids(found) == ids(exact)


def test_two_passes_answer_at_their_candidate_limit_once_k_pass(db, fake, monkeypatch):
    """Past TWO_PASS_MAX candidates a k x oversample that large can never pass (hybrid at
    k >= 55, with the default oversample): the two passes answer with the k best of those,
    as before, not the float table's KNN every time."""
    import worker.retrieval as retrieval

    rng = np.random.default_rng(5)
    items = [
        add_item(db, kind="note", title=f"n{n}", content=" ".join(rng.choice(WORDS, 12)))
        for n in range(100)
    ]
    index_items(db, items, embedder=fake)
    monkeypatch.setattr(retrieval, "TWO_PASS_MAX", 64)
    knn: list[int] = []
    real = retrieval._knn
    monkeypatch.setattr(retrieval, "_knn", lambda *a: knn.append(1) or real(*a))
    tuning = SearchSettings(exact_below=0, oversample=100)  # 2 x 100 past the 64
    found = search_chunks(db, "alpha beta", fake, k=2, mode="vector", tuning=tuning)
    assert len(found.hits) == 2 and knn == []
