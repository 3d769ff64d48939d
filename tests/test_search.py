"""Chunk-level search (worker.retrieval.search_chunks) and the keyword index (worker.store.fts),
against a real SQLite file with sqlite-vec: keyword rows kept equal to chunk rows, identifiers,
hostile queries, filters, the fallback's shape, and (with the local model) a question that only
the keyword side answers."""

from __future__ import annotations

import functools
import json
import math
import random
import re
import subprocess
import sys
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import example, given, settings
from hypothesis import strategies as st

from conftest import (
    DIMS,
    FakeEmbedder,
    as_a_run,
    corpus_text,
    forge_vector,
    keyword_rows_problems,
    standin_settings,
)
from host import host
from ops.doctor import Fail, check_keywords
from worker import hamming, nearest, retrieval
from worker.bulk import index_item
from worker.errors import BadAnswer, IndexAborted, InvalidInput
from worker.indexers import IndexOptions
from worker.indexers.code import search_code
from worker.indexers.memories import add_memory, search_memories
from worker.reconcile import reconcile
from worker.retrieval import Filters, search_chunks
from worker.settings import FilesSettings, SearchSettings, load_settings
from worker.sources import Reader
from worker.store import connect
from worker.store.fts import (
    _row,
    chunk_parts,
    identifier_parts,
    keyword_query,
    keyword_row,
)
from worker.store.items import add_item, list_chunks, update_content
from worker.store.removal import delete_items
from worker.store.vec import vec_replace

ROOT = Path(__file__).resolve().parents[1]
CHAPTERS = ["ch04-01-what-is-ownership.md", "ch08-03-hash-maps.md", "ch15-01-box.md"]
HIT_KEYS = {
    "item_id",
    "title",
    "kind",
    "source",
    "chunk_index",
    "headings",
    "start_offset",
    "end_offset",
    "content",
    "score",
    "via",
    "chunk_id",
    "snippet",
}


@pytest.fixture
def fake() -> FakeEmbedder:
    return FakeEmbedder()


@pytest.fixture
def notes_db(db, fake):
    ids = {}
    for name in CHAPTERS:
        ids[name] = add_item(db, kind="note", title=name, content=corpus_text(name))
        index_item(db, ids[name], embedder=fake)
    return db, ids


# -- the keyword index follows the chunks ----------------------------------------------------


def test_keyword_rows_equal_chunk_rows_through_edits_deletes_a_host_and_a_dropped_table(
    notes_db, fake, emb_settings
):
    db, ids = notes_db
    code = add_item(
        db, kind="code", title="x.py", content="", source=str(ROOT / "worker" / "errors.py")
    )
    reader = Reader(FilesSettings(roots=[ROOT / "worker"]))
    index_item(db, code, embedder=fake, options=IndexOptions(reader=reader))
    assert db.scalar("SELECT count(*) FROM note_chunks") > 20
    assert db.scalar("SELECT count(*) FROM code_chunks") > 3
    assert keyword_rows_problems(db) == []

    edited = ids[CHAPTERS[1]]
    text = corpus_text(CHAPTERS[1])
    update_content(db, edited, text.replace("HashMap", "Dictionary", 3) + "\n\nA new paragraph.")
    index_item(db, edited, embedder=fake)
    assert keyword_rows_problems(db) == []
    assert search_chunks(db, "Dictionary", None, mode="keyword").hits  # the new words are in

    delete_items(db, [ids[CHAPTERS[0]]])
    assert keyword_rows_problems(db) == []

    # A host deletes an item with plain SQL (foreign keys off): the trigger takes the chunks,
    # their keyword rows stay until the sweep, which removes them with no provider call.
    host(db.path, ("DELETE FROM knowledge_items WHERE id = ?", [ids[CHAPTERS[2]]]))
    assert keyword_rows_problems(db) != []
    hits = search_chunks(db, "Box heap pointer", None, mode="keyword", k=50).hits
    assert ids[CHAPTERS[2]] not in {h.item_id for h in hits}  # stale rows are never returned
    settings = load_settings(db=db.path, embedding=emb_settings.model_dump())
    with pytest.raises(Fail, match=r"stale rows? in note_chunks_fts"):
        check_keywords(settings, 5)  # kidx doctor names them
    calls = len(fake.calls)
    drift = reconcile(db, model=fake.model_id, max_items=100)
    assert drift.repaired["keyword_rows"]["note_chunks_fts stale"] > 0
    assert keyword_rows_problems(db) == [] and len(fake.calls) == calls
    assert "one keyword row per chunk" in check_keywords(settings, 5)

    # A dropped table: writes go on (the chunks are the truth), the sweep rebuilds it.
    host(db.path, ("DROP TABLE note_chunks_fts", []))
    update_content(db, edited, text + "\n\nAnother paragraph.")
    assert index_item(db, edited, embedder=fake).status == "indexed"
    result = search_chunks(db, "ownership", None, mode="keyword")
    assert result.hits == [] and "missing" in (result.reason or "")
    with pytest.raises(Fail, match="note_chunks_fts is missing"):
        check_keywords(settings, 5)
    calls = len(fake.calls)
    reconcile(db, model=fake.model_id, max_items=100)
    assert keyword_rows_problems(db) == [] and len(fake.calls) == calls
    assert search_chunks(db, "HashMap insert", None, mode="keyword").hits

    # Its index no longer matching its text (a host wrote into its shadow table; a full disk
    # under a worker did the same once): doctor says so, the sweep builds it again.
    host(
        db.path,
        (
            "UPDATE note_chunks_fts_content SET c2 = 'altered' "
            "WHERE id IN (SELECT id FROM note_chunks_fts_content LIMIT 3)",
            [],
        ),
    )
    assert db.scalar("PRAGMA integrity_check") != "ok"
    with pytest.raises(Fail, match="does not match its text"):
        check_keywords(settings, 5)
    # (the sweep runs FTS5's integrity check hourly, or once a write failed on the damage, or
    # once `kidx doctor` found it: this one)
    drift = reconcile(db, model=fake.model_id, max_items=100)
    assert drift.repaired["keyword_rows"]["note_chunks_fts rebuilt"] == 1
    assert db.scalar("PRAGMA integrity_check") == "ok" and keyword_rows_problems(db) == []
    assert not search_chunks(db, "altered", None, mode="keyword").hits


def test_a_model_switch_rebuilds_the_keyword_index_with_the_vec_tables(tmp_path, standin):
    path = tmp_path / "switch.db"
    db = connect(path, embedding=standin_settings(standin))
    emb = FakeEmbedder()
    for name in CHAPTERS[:2]:
        index_item(
            db, add_item(db, kind="note", title=name, content=corpus_text(name)), embedder=emb
        )
    db.close()
    host(
        path,
        ("DELETE FROM note_chunks_fts WHERE rowid IN (SELECT id FROM note_chunks LIMIT 5)", []),
    )
    db = connect(path, embedding=standin_settings(standin, model="other", dimensions=32))
    assert keyword_rows_problems(db) == []
    db.close()


def test_a_database_from_before_the_keyword_index_gets_it_filled(tmp_path, standin, fake):
    path = tmp_path / "old.db"
    db = connect(path, embedding=standin_settings(standin))
    index_item(
        db, add_item(db, kind="note", title="Old", content=corpus_text(CHAPTERS[0])), embedder=fake
    )
    db.close()
    host(
        path,
        ("DROP TABLE note_chunks_fts", []),
        ("DROP TABLE code_chunks_fts", []),
        ("UPDATE index_meta SET value = '5' WHERE key = 'schema_version'", []),
    )
    db = connect(path, embedding=standin_settings(standin))
    assert keyword_rows_problems(db) == [] and db.scalar("SELECT count(*) FROM note_chunks") > 3
    assert search_chunks(db, "ownership rules", None, mode="keyword").hits
    db.close()


# -- identifiers and queries -------------------------------------------------------------------

IDENTIFIERS = """# API notes

Pass `response_model_exclude_unset=True` to leave defaults out of the response.

## Tasks

`BackgroundTasks` runs work after the response; `HTTPServer` serves it.

Join paths with `os.path.join`, and install with `pip install --no-deps kidx`.
"""
FILLER = "Nothing to see in this note about gardening and tomatoes and the weather today."


def test_an_identifier_is_found_by_the_whole_and_by_its_parts(db, fake):
    target = add_item(db, kind="note", title="API", content=IDENTIFIERS)
    index_item(db, target, embedder=fake)
    for n in range(5):
        index_item(db, add_item(db, kind="note", title=f"F{n}", content=FILLER), embedder=fake)
    for query in (
        "response_model_exclude_unset",
        "exclude unset",
        "BackgroundTasks",
        "background",
        "tasks",
        "HTTPServer",
        "server",
        "os.path.join",
        "--no-deps",
        "deps",
    ):
        hits = search_chunks(db, query, None, mode="keyword", k=3).hits
        assert hits and hits[0].item_id == target, query
        assert hits[0].via == "fts"
    assert (
        identifier_parts("BackgroundTasks HTTPServer snake_case") == "background tasks http server"
    )


@functools.cache
def _letter_classes() -> tuple[str, str, str]:
    """Regex classes of every uppercase letter, lowercase letter and combining mark (in that
    order of precedence: U+0345, a mark, is lowercase)."""
    upper, lower, marks = [], [], []
    for code in range(sys.maxunicode + 1):
        c = chr(code)
        if c.isupper():
            upper.append(c)
        elif c.islower():
            lower.append(c)
        elif unicodedata.category(c).startswith("M"):
            marks.append(c)
    up, low, mark = ("".join(map(re.escape, cls)) for cls in (upper, lower, marks))
    return up, low, mark


def _parts_by_regex(text: str) -> str:
    """identifier_parts written plainly: NFC, token by token with unicode61's regex (a
    combining mark kept in its token), the CamelCase words of any script."""
    up, low, mark = _letter_classes()
    u, lo, d = f"[{up}][{mark}]*", f"[{low}][{mark}]*", f"\\d[{mark}]*"
    camel = re.compile(f"(?:{u})+(?={u}[{low}])|(?:{u})?(?:{lo})+|(?:{u})+|(?:{d})+")
    seen: dict[str, None] = {}
    text = unicodedata.normalize("NFC", text)
    marks = "\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f"
    for token in re.findall(f"(?:[^\\W_]|[{marks}])+", text):
        if token.islower() or token.isupper() or token.isdigit():
            continue
        words = camel.findall(token)
        if len(words) > 1:
            seen.update((w.lower(), None) for w in words)
    return " ".join(seen)


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from("aAbBzZ09_ -.éÉßẞ٣İıK\u0301’\ud800中xüÜ\u0303\u0345ǅ")))
@example("Größe K0ı HTTPServer x86_64 u32 ’tis")
@example("Zürich Résumé Tiếng Việt ZürichTrip Re\u0301sume\u0301Builder MÜNCHENStadt")
def test_identifier_parts_are_those_of_unicode61_tokens(text: str) -> None:
    """The bytes fast path finds the same words, in the same order, as the token regex."""
    assert identifier_parts(text) == _parts_by_regex(text)


_FIELD = st.text(alphabet=st.sampled_from("aAbBzZ09_ -.éÉßİK\u0301中xyTs"), max_size=40)


@settings(max_examples=300, deadline=None)
@given(_FIELD, _FIELD, _FIELD)
@example("HttpServer notes", "Using BackgroundTasks", "the HttpServer and its BackgroundTasks")
def test_a_keyword_row_from_parts_made_with_the_chunk_is_the_row_made_whole(
    title: str, headings: str, content: str
) -> None:
    """A new item's keyword rows take the parts made when the chunk was cut (out of the write
    lock) and add the title's: the row is the one made from the three fields at once."""
    made = chunk_parts(headings, content)
    assert keyword_row(7, title, headings, content, made) == _row(7, title, headings, content)
    assert keyword_row(7, title, headings, content, None) == _row(7, title, headings, content)


def test_identifier_parts_of_a_real_chapter() -> None:
    text = corpus_text("ch08-03-hash-maps.md")
    assert identifier_parts(text) == _parts_by_regex(text)
    assert "hash map" in identifier_parts(text)


def test_any_user_text_is_a_valid_query():
    assert keyword_query('NEAR(a b) AND "x" -y z* ^w col:v (unbalanced') is not None
    for text in ("", "   ", "(((", "***", '"', "- : ^", "🙂🙃"):
        assert keyword_query(text) is None
    assert keyword_query("the of and") is not None  # only common words: they are kept


HOSTILE_PIECES = [
    '"',
    "'",
    "(",
    ")",
    "*",
    "^",
    ":",
    "-",
    "+",
    "NEAR",
    "AND",
    "OR",
    "NOT",
    "near/3",
    "{a b}",
    "col:",
    "title:",
    "\\",
    "\x00",
    "\x1b[2J",
    "\u202e",
    "🙂",
    "中文",
    "é",
    "NEAR(",
    "AND (",
    "--flag",
    "a.b.c",
    "snake_case",
    "CamelCase",
    "%",
    "_",
    "[",
    "]",
    "\n",
    "\t",
    "؟",
    "𝔘",
]


def hostile_queries(n: int, seed: int = 13) -> list[str]:
    rng = random.Random(seed)
    out = ["x" * 10_000, "NEAR " * 2000, '"' * 999, "(" * 500 + "word", "🙂" * 3000]
    while len(out) < n:
        out.append(" ".join(rng.choice(HOSTILE_PIECES) for _ in range(rng.randint(1, 12))))
    return out


def test_300_hostile_queries_through_the_function_never_raise_but_for_an_empty_one(notes_db, fake):
    db, _ = notes_db
    for q in hostile_queries(300):
        for mode in ("hybrid", "keyword", "vector"):
            if not q.strip():
                with pytest.raises(InvalidInput, match="empty"):
                    search_chunks(db, q, fake, mode=mode)
                continue
            result = search_chunks(db, q, fake, mode=mode, k=5)
            assert len(result.hits) <= 5
            assert all(set(h.as_dict()) == HIT_KEYS for h in result.hits)


def cli_env(db_path: Path, standin: Any) -> dict[str, str]:
    return {
        "KIDX_DB": str(db_path),
        "KIDX_EMBEDDING__PROVIDER": "openai",
        "KIDX_EMBEDDING__MODEL": "standin-embed",
        "KIDX_EMBEDDING__BASE_URL": standin.base_url,
        "KIDX_EMBEDDING__DIMENSIONS": str(DIMS),
        "KIDX_EMBEDDING__API_KEY": "sk-test-key-not-for-logs",
    }


def test_300_hostile_queries_through_the_cli(tmp_path, standin, monkeypatch):
    from ops.cli import cli

    path = tmp_path / "cli.db"
    env = cli_env(path, standin)
    db = connect(path, embedding=standin_settings(standin))
    fake = FakeEmbedder(model_id="standin-embed")
    index_item(
        db, add_item(db, kind="note", title="N", content=corpus_text(CHAPTERS[1])), embedder=fake
    )
    db.close()
    runner = CliRunner()
    for q in hostile_queries(300, seed=29):
        mode = "keyword" if len(q) % 2 else "hybrid"
        out = runner.invoke(cli, ["search", "--chunks", "--mode", mode, "--json", "--", q], env=env)
        if not q.strip():
            assert out.exit_code == 1 and "empty" in out.output, out.output
            continue
        assert out.exit_code == 0, (q, out.output)
        assert "Traceback" not in out.output
        hits = json.loads(out.stdout)
        assert isinstance(hits, list) and len(hits) <= 10


# -- filters ---------------------------------------------------------------------------------


class TwoPoles(FakeEmbedder):
    """Texts mentioning alpha point one way, the rest the opposite way: files about beta are
    the farthest chunks from an alpha query."""

    def embed_batch(self, texts: list[str]) -> np.ndarray:
        self.calls.append(list(texts))
        rng = np.random.default_rng(len(self.calls))
        out = rng.standard_normal((len(texts), self.dimensions)).astype(np.float32) * 0.05
        for i, t in enumerate(texts):
            out[i, 0] += 1.0 if "alpha" in t else -1.0
        return out


@pytest.mark.parametrize("path", ["exact", "knn", "two-pass"])
def test_a_filter_matching_k_far_chunks_returns_k_hits(db, monkeypatch, tmp_path, path):
    if path != "exact":  # the KNN paths ask sqlite-vec for more rows until k pass the filter
        monkeypatch.setattr(retrieval, "FILTER_EXACT", 0)
    passes = []
    tuning = SearchSettings(exact_below=0, oversample=2) if path == "two-pass" else None
    if path == "two-pass":  # the bit mirror first, whatever the size; few candidates
        real = retrieval._two_pass

        def two_pass(*args: Any) -> Any:
            passes.append(args[2])
            return real(*args)

        monkeypatch.setattr(retrieval, "_two_pass", two_pass)
    emb = TwoPoles()
    para = "alpha words here. " * 75  # a section over the target size: a chunk of its own
    for n in range(40):  # notes near the query: many chunks each
        content = "\n\n".join(f"# Alpha {n}.{j}\n\n{para}" for j in range(6))
        index_item(db, add_item(db, kind="note", title=f"alpha {n}", content=content), embedder=emb)
    docs = tmp_path / "docs"
    docs.mkdir()
    options = IndexOptions(reader=Reader(FilesSettings(roots=[tmp_path])))
    files = []
    for n in range(4):
        path_ = docs / f"b{n}.md"
        path_.write_text(
            "\n\n".join(f"# Beta {n}.{j}\n\n" + "beta words. " * 110 for j in range(4))
        )
        item = add_item(db, kind="file", title=path_.name, content="", source=str(path_))
        files.append(item)
        assert index_item(db, item, embedder=emb, options=options).status == "indexed"
    assert db.scalar("SELECT count(*) FROM note_chunks") >= 200
    assert (
        db.scalar(f"SELECT count(*) FROM note_chunks WHERE item_id IN ({files[0]}, {files[1]})")
        >= 8
    )
    k = 8
    find = functools.partial(search_chunks, tuning=tuning)
    for mode in ("vector", "hybrid"):
        kind = find(db, "alpha", emb, k=k, mode=mode, filters=Filters(kinds=("file",)))
        assert len(kind.hits) == k and {h.kind for h in kind.hits} == {"file"}, mode
        prefix = find(db, "alpha", emb, k=k, mode=mode, filters=Filters(source_prefix=f"{docs}/"))
        assert len(prefix.hits) == k and {h.item_id for h in prefix.hits} <= set(files)
        two = find(db, "alpha", emb, k=k, mode=mode, filters=Filters(item_ids=tuple(files[:2])))
        assert len(two.hits) == k and {h.item_id for h in two.hits} == set(files[:2])
        one = find(
            db, "alpha", emb, k=3, mode=mode, per_item=True, filters=Filters(kinds=("file",))
        )
        assert sorted(h.item_id for h in one.hits) == sorted({h.item_id for h in one.hits})
        assert len(one.hits) == 3
    kw = find(db, "beta words", None, k=k, mode="keyword", filters=Filters(item_ids=(files[3],)))
    own = db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (files[3],))
    assert len(kw.hits) == min(k, own) and {h.item_id for h in kw.hits} == {files[3]}
    assert bool(passes) == (path == "two-pass")
    with pytest.raises(InvalidInput, match="own search"):
        Filters(kinds=("code",))
    with pytest.raises(InvalidInput, match="64-bit integer"):
        Filters(item_ids=("1; DROP TABLE x",))  # type: ignore[arg-type]


def test_widening_grows_fourfold_up_to_the_limit_and_stops_when_told():
    asked: list[int] = []

    def enough_at(n: int, more: bool = True) -> Any:
        def attempt(fetch: int) -> tuple[int, bool]:
            asked.append(fetch)
            return fetch, fetch >= n or not more

        return attempt

    assert nearest.widening(32, 4096, enough_at(500)) == 512 and asked == [32, 128, 512]
    asked.clear()  # the limit itself is tried once, then it is given up
    assert nearest.widening(32, 1000, enough_at(5000)) is None and asked == [32, 128, 512, 1000]
    asked.clear()  # a source with no more rows answers at the first try
    assert nearest.widening(32, 4096, enough_at(5000, more=False)) == 32 and asked == [32]
    assert nearest.widening(5000, 4096, lambda f: None) is None  # an attempt that gives up


# -- the fallback and the shape --------------------------------------------------------------


@pytest.mark.parametrize("block", [3, 7, nearest.BLOCK])
def test_every_vector_path_gives_the_exact_order_ties_by_chunk_id(
    notes_db, fake, emb_settings, monkeypatch, block
):
    """The fallback read a few rows a block (the best kept across blocks), sqlite-vec's KNN and
    the two passes (bits, then floats) against a brute force in the test: the same chunks in
    the same order, twins (the same text twice: the same vector) by chunk id."""
    db, _ids = notes_db
    twin = "Twins: this paragraph is indexed twice, word for word."
    for _ in range(2):
        index_item(db, add_item(db, kind="note", title="Twin", content=twin), embedder=fake)
    monkeypatch.setattr(nearest, "BLOCK", block)
    [query] = fake.calls[-1]  # the twin's own input: distance 0 to both
    q = fake.embed([query])[0]
    rows = db.all(
        "SELECT r.chunk_id, r.vector FROM note_chunk_embeddings r "
        "JOIN note_chunks c ON c.id = r.chunk_id"
    )
    matrix = np.stack([np.frombuffer(v, dtype="<f4") for _, v in rows])
    cos = matrix @ q / np.linalg.norm(matrix, axis=1) / np.linalg.norm(q)
    expected = [c for _, c in sorted(zip((1 - cos).round(5).tolist(), [r[0] for r in rows]))][:12]
    no_vec = connect(db.path, embedding=emb_settings, vec=False)
    try:
        for conn, tuning, via in (
            (no_vec, None, "fallback"),
            (db, None, "vec"),
            (db, SearchSettings(exact_below=0, oversample=40), "vec"),
        ):
            got = search_chunks(conn, query, fake, k=12, mode="vector", tuning=tuning)
            assert got.via == via
            assert [h.chunk_id for h in got.hits] == expected, (via, tuning)
            assert got.hits[0].score == pytest.approx(1.0, abs=1e-5)
    finally:
        no_vec.close()


def test_every_mode_answers_in_the_same_shape_with_and_without_sqlite_vec(
    notes_db, fake, emb_settings
):
    db, _ids = notes_db
    no_vec = connect(db.path, embedding=emb_settings, vec=False)
    try:
        for mode, served, served_without in (
            ("vector", "vec", "fallback"),
            ("keyword", "fts", "fts"),
            ("hybrid", "fts+vec", "fts+fallback"),
        ):
            a = search_chunks(db, "ownership and the heap", fake, k=6, mode=mode)
            b = search_chunks(no_vec, "ownership and the heap", fake, k=6, mode=mode)
            assert (a.via, b.via) == (served, served_without)
            assert len(a.hits) == len(b.hits) == 6
            assert [h.chunk_id for h in a.hits] == [h.chunk_id for h in b.hits]
            for h in a.hits + b.hits:
                assert set(h.as_dict()) == HIT_KEYS
                text = corpus_text(h.title)
                assert text[h.start_offset : h.end_offset] == h.content  # offsets are the truth
        keyword = search_chunks(no_vec, "ownership", None, mode="keyword")  # no embedder at all
        assert keyword.hits and keyword.via == "fts"
        assert keyword.hits[0].headings  # the heading path comes with the chunk
        with pytest.raises(InvalidInput, match="embedding provider"):
            search_chunks(no_vec, "ownership", None, mode="hybrid")
    finally:
        no_vec.close()


class Degenerate(FakeEmbedder):
    """A vector of zeros for a text naming ZERO, one too long for float32 for HUGE."""

    def embed_batch(self, texts: list[str]) -> Any:
        out = super().embed_batch(texts)
        for i, t in enumerate(texts):
            if "ZERO" in t:
                out[i] = 0.0
            elif "HUGE" in t:
                out[i] = 3e38
        return out


def test_a_vector_without_a_direction_is_refused_and_one_a_host_wrote_never_breaks_search(
    notes_db, emb_settings
):
    """A provider's vector of zeros (or past float32) is refused for its text alone; one a host
    wrote anyway scores as the exact path scores it (distance 1) on every path, memories too,
    where sqlite-vec's NULL distance made every search through it fail."""
    db, ids = notes_db
    bad = Degenerate()
    for word in ("ZERO", "HUGE"):
        item = add_item(db, kind="note", title=word, content=f"{word} text.\n\nOther text.")
        with pytest.raises(IndexAborted, match="vector of zeros, or one too long"):
            index_item(db, item, embedder=bad)
        with pytest.raises(BadAnswer, match="vector of zeros"):
            add_memory(db, f"a {word} memory", bad)
    zero = np.zeros(DIMS, dtype=np.float32).tobytes()
    (chunk,) = db.one("SELECT id FROM note_chunks WHERE item_id = ? LIMIT 1", (ids[CHAPTERS[0]],))
    memory = add_memory(db, "a memory about ownership", FakeEmbedder())
    with as_a_run(db):  # (a host's would go at once: schema migration 16)
        db.execute(forge_vector("note_chunk_embeddings", "chunk_id"), (zero, chunk))
        db.execute(forge_vector("memory_embeddings", "memory_id"), (zero, memory))
    for table, key, value in (
        ("vec_chunk_embeddings", "chunk_id", chunk),
        ("vec_memories", "memory_id", memory),
    ):
        db.execute(f"DELETE FROM {table} WHERE {key} = ?", (value,))
        db.execute(f"INSERT INTO {table}({key}, embedding) VALUES (?, ?)", (value, zero))
    no_vec = connect(db.path, embedding=emb_settings, vec=False)
    try:
        for store in (db, no_vec):
            for mode in ("vector", "hybrid"):
                hits = search_chunks(store, "ownership", FakeEmbedder(), k=500, mode=mode).hits
                assert hits and all(math.isfinite(h.score) for h in hits)
            found, _, _ = search_memories(store, "ownership", FakeEmbedder(), k=5)
            assert memory in [m.memory_id for m in found]
    finally:
        no_vec.close()


def test_chunk_rows_a_host_filled_with_other_bytes_or_types_never_stop_a_run_or_a_search(
    notes_db, fake
):
    """A host writes bytes that are not UTF-8 into a chunk's text columns and text into its
    integer ones (the schema's CHECKs let both through): search skips what it cannot place,
    shows the rest, the chunk list shows them, the keyword index is rebuilt from them, and
    the item is indexed again over them."""
    db, ids = notes_db
    item = ids[CHAPTERS[0]]
    first, second = [
        r[0] for r in db.all("SELECT id FROM note_chunks WHERE item_id = ? LIMIT 2", (item,))
    ]
    db.execute(
        "UPDATE note_chunks SET content = CAST(x'6f776e657273686970ff' AS TEXT), "
        "headings = CAST(x'ff' AS TEXT), summary = CAST(x'ff' AS TEXT) WHERE id = ?",
        (first,),
    )
    db.execute(
        "UPDATE note_chunks SET chunk_index = 'x', end_offset = 'zzz', start_offset = 'y' "
        "WHERE id = ?",
        (second,),
    )
    for mode in ("vector", "keyword", "hybrid"):
        hits = search_chunks(db, "ownership", fake, k=200, mode=mode).hits
        assert hits and second not in {h.chunk_id for h in hits}
    assert len(list_chunks(db, item)) == db.scalar(
        "SELECT count(*) FROM note_chunks WHERE item_id = ?", (item,)
    )
    db.execute("DROP TABLE note_chunks_fts")
    reconcile(db, model=fake.model_id, max_items=100)  # the keyword rows, from those chunks
    assert keyword_rows_problems(db) == []
    update_content(db, item, corpus_text(CHAPTERS[0]) + "\n\nOne more paragraph.")
    assert index_item(db, item, embedder=fake).status == "indexed"


def test_a_damaged_keyword_index_leaves_the_vectors_to_answer_until_the_sweep(notes_db, fake):
    """A host wrote into FTS5's shadow tables: the keyword side fails (CorruptError); hybrid
    search answers by vector and says why, as with a missing table, and code search too."""
    db, _ = notes_db
    code = add_item(
        db, kind="code", title="x.py", content="", source=str(ROOT / "worker" / "errors.py")
    )
    reader = Reader(FilesSettings(roots=[ROOT / "worker"]))
    index_item(db, code, embedder=fake, options=IndexOptions(reader=reader))
    # Zeros, not random bytes: FTS5 reads some random leaves as valid pages without the term,
    # which made this test fail once in a while (CI, 2026-12-03).
    for table in ("note_chunks_fts", "code_chunks_fts"):
        db.execute(f"UPDATE {table}_data SET block = zeroblob(length(block)) WHERE id > 10")
    hybrid = search_chunks(db, "ownership", fake, k=3, mode="hybrid")
    assert [h.via for h in hybrid.hits] == ["vec"] * 3
    assert "note_chunks_fts is damaged" in (hybrid.reason or "")
    keyword = search_chunks(db, "ownership", fake, k=3, mode="keyword")
    assert keyword.hits == [] and "damaged" in (keyword.reason or "")
    hits, served, reason = search_code(db, "StoreError", fake, k=3)
    assert hits and served == "vec" and "code_chunks_fts is damaged" in (reason or "")


def test_hybrid_without_a_word_to_search_is_vector_search(notes_db, fake):
    db, _ = notes_db
    hybrid = search_chunks(db, "🙂 ((( ***", fake, k=4)
    vector = search_chunks(db, "🙂 ((( ***", fake, k=4, mode="vector")
    assert hybrid.via == "vec" and [h.chunk_id for h in hybrid.hits] == [
        h.chunk_id for h in vector.hits
    ]


def test_per_item_keeps_the_best_chunk_of_each_item(notes_db, fake):
    db, _ids = notes_db
    query = "ownership of a String value"
    for mode in ("hybrid", "vector", "keyword"):
        chunks = search_chunks(db, query, fake, k=10, mode=mode).hits
        items = search_chunks(db, query, fake, k=10, mode=mode, per_item=True).hits
        assert len({h.item_id for h in chunks}) < len(chunks)  # several share an item
        first: dict[int, int] = {}
        for h in chunks:
            first.setdefault(h.item_id, h.chunk_id)
        # The items the chunk search reaches come first, each by the chunk it ranked best.
        assert [(h.item_id, h.chunk_id) for h in items][: len(first)] == list(first.items()), mode
        assert len(items) == len(CHAPTERS)
        two = search_chunks(db, query, fake, k=2, mode=mode, per_item=True).hits
        assert [h.chunk_id for h in two] == [h.chunk_id for h in items[:2]]


# -- the command -------------------------------------------------------------------------------


def test_kidx_search_chunks_json_and_80_column_output(tmp_path, standin):
    path = tmp_path / "c.db"
    db = connect(path, embedding=standin_settings(standin))
    fake = FakeEmbedder(model_id="standin-embed")
    hostile_title = "T\x1b[2J\nitle " + "long " * 30
    index_item(
        db,
        add_item(db, kind="note", title=hostile_title, content=corpus_text(CHAPTERS[2])),
        embedder=fake,
    )
    db.close()
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1", **cli_env(path, standin)}
    exe = str(Path(sys.executable).parent / "kidx")

    def kidx(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([exe, *args], env=env, capture_output=True, text=True, timeout=60)

    out = kidx("search", "Box<T> on the heap", "--chunks", "-k", "3", "--json")
    assert out.returncode == 0, out.stderr
    hits = json.loads(out.stdout)
    assert len(hits) == 3 and all(set(h) >= HIT_KEYS for h in hits)
    out = kidx("search", "Box<T> on the heap", "--chunks", "-k", "3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines and max(len(line) for line in lines) <= 80
    assert "\x1b" not in out.stdout and "Box" in out.stdout
    out = kidx("search", "Box", "--mode", "keyword", "--kind", "code")
    assert out.returncode == 2 and "Traceback" not in out.stderr  # click refuses the choice
    out = kidx("search", "Box", "--mode", "keyword", "--item", "999", "--json")
    assert out.returncode == 0 and json.loads(out.stdout) == []


# -- real documents, the local model ---------------------------------------------------------


@pytest.mark.model
def test_a_question_naming_an_identifier_is_answered_by_hybrid_search(tmp_path):
    """`unwrap_or` appears in one chunk of these chapters, in code: the small model ranks that
    chunk outside its top 5 for the question; the keyword side puts it in the top 3."""
    from worker.providers import build_embedder
    from worker.settings import EmbeddingSettings

    settings = EmbeddingSettings(provider="local")
    db = connect(tmp_path / "model.db", embedding=settings)
    model = build_embedder(settings, dimensions=db.dimensions)
    assert model is not None
    for name in (
        "ch08-01-vectors.md",
        "ch08-02-strings.md",
        "ch08-03-hash-maps.md",
        "ch06-02-match.md",
        "ch06-03-if-let.md",
    ):
        index_item(
            db, add_item(db, kind="note", title=name, content=corpus_text(name)), embedder=model
        )
    question = "What is `unwrap_or` used for?"

    def rank(mode: str) -> int:
        hits = search_chunks(db, question, model, k=20, mode=mode).hits
        return next((n for n, h in enumerate(hits, 1) if "unwrap_or" in h.content), 99)

    assert rank("vector") > 5
    assert rank("hybrid") <= 3
    db.close()


# -- two passes: the bits a search process keeps -----------------------------------------------


def test_two_passes_see_what_another_connection_wrote_and_survive_an_unknown_layout(
    notes_db, fake, emb_settings, monkeypatch
):
    db, _ids = notes_db
    tuning = SearchSettings(exact_below=0, oversample=2)
    query = "A paragraph written by another process after the first search."
    before = search_chunks(db, query, fake, k=3, mode="vector", tuning=tuning)
    assert before.hits and before.hits[0].score < 0.99  # the bits are now held in memory
    other = connect(db.path, embedding=emb_settings)
    new = add_item(other, kind="note", title="Later", content=query)
    index_item(other, new, embedder=fake)
    other.close()
    after = search_chunks(db, fake.calls[-1][0], fake, k=3, mode="vector", tuning=tuning)
    assert after.hits[0].item_id == new and after.hits[0].score == pytest.approx(1.0, abs=1e-5)
    monkeypatch.setitem(hamming._SHADOW, "chunks", "CREATE TABLE other layout")
    other = connect(db.path, embedding=emb_settings)  # nothing held yet: reads the layout
    assert hamming.nearest_bits(other, "vec_chunk_bits", bytes(DIMS // 8), 3) is None
    other.close()
    knn = search_chunks(db, fake.calls[-1][0], fake, k=3, mode="vector", tuning=tuning)
    assert [h.chunk_id for h in knn.hits] == [h.chunk_id for h in after.hits]  # vec0's KNN


def test_the_fallback_holds_its_vectors_until_the_database_changes(notes_db, fake, emb_settings):
    db, _ids = notes_db
    no_vec = connect(db.path, embedding=emb_settings, vec=False)
    held, fresh = SearchSettings(fallback_hold_mb=64), SearchSettings(fallback_hold_mb=0)
    try:
        query = "ownership and the heap"
        first = search_chunks(no_vec, query, fake, k=8, mode="vector", tuning=held)
        assert nearest._HELD[no_vec]  # kept for the next search
        again = search_chunks(no_vec, query, fake, k=8, mode="vector", tuning=held)
        plain = search_chunks(no_vec, query, fake, k=8, mode="vector", tuning=fresh)
        assert [h.chunk_id for h in again.hits] == [h.chunk_id for h in first.hits]
        assert [h.chunk_id for h in plain.hits] == [h.chunk_id for h in first.hits]
        assert [h.score for h in again.hits] == pytest.approx([h.score for h in plain.hits])
        text = "Written by another connection after the vectors were held."
        index_item(db, add_item(db, kind="note", title="New", content=text), embedder=fake)
        [written] = fake.calls[-1]
        seen = search_chunks(no_vec, written, fake, k=1, mode="vector", tuning=held)
        assert seen.hits[0].title == "New" and seen.hits[0].score == pytest.approx(1.0, abs=1e-5)
    finally:
        no_vec.close()


# -- the search audit of 2026-12-03 ------------------------------------------------------------


@pytest.mark.parametrize(
    ("given", "words"),
    [
        ({"kinds": "note"}, "kinds must be a list"),  # was read a letter at a time
        ({"item_ids": 7}, "item_ids must be a list"),
        ({"source_prefix": 5}, "the source prefix must be a string"),
        ({"source_prefix": b"/docs"}, "the source prefix must be a string"),
        ({"source_prefix": "/docs/\ud800"}, "not UTF-8 text"),
    ],
)
def test_filters_of_the_wrong_type_are_refused_when_made(given, words):
    with pytest.raises(InvalidInput, match=words):
        Filters(**given)


def test_filters_of_none_are_no_filter_and_a_query_of_bytes_is_named(notes_db, fake):
    db, _ = notes_db
    assert Filters(kinds=None, item_ids=None) == Filters()  # type: ignore[arg-type]
    assert Filters(kinds=["note"], item_ids=[1]).kinds == ("note",)
    with pytest.raises(InvalidInput, match="the query must be a string, not bytes"):
        search_chunks(db, b"ownership", fake)  # type: ignore[arg-type]


def test_a_source_a_host_wrote_as_a_blob_matches_its_prefix(notes_db, fake):
    db, ids = notes_db
    first, second, third = ids.values()
    host(
        db.path,
        (
            "UPDATE knowledge_items SET source = CAST(? AS BLOB) WHERE id = ?",
            ["/docs/café.md", first],
        ),
        ("UPDATE knowledge_items SET source = ? WHERE id = ?", ["/docs/text.md", second]),
        ("UPDATE knowledge_items SET source = ? WHERE id = ?", ["/elsewhere/x.md", third]),
    )
    assert db.scalar("SELECT typeof(source) FROM knowledge_items WHERE id = ?", (first,)) == "blob"
    for mode in ("vector", "keyword", "hybrid"):
        hits = search_chunks(
            db, "the value", fake, k=100, mode=mode, filters=Filters(source_prefix="/docs/")
        ).hits
        assert {h.item_id for h in hits} == {first, second}, mode


def test_the_first_hybrid_hits_are_the_same_whatever_k(notes_db, fake):
    """The fusion scores a fixed depth of each side: with k past a quarter of it, a chunk deep
    in one list gained score it had not at a small k, and the first hits changed order."""
    db, _ = notes_db
    queries = [
        "ownership",
        "hash map entry",
        "Box pointer heap",
        "the value is moved",
        "String from",
        "insert or update",
        "recursive types",
        "scope drop",
        "borrow a reference",
        "iterate keys",
    ]
    for query in queries:
        small = search_chunks(db, query, fake, k=5).hits
        large = search_chunks(db, query, fake, k=60).hits[:5]
        assert [(h.chunk_id, h.score) for h in small] == [(h.chunk_id, h.score) for h in large]


def test_tied_vectors_come_back_lowest_id_first_on_the_vec_path(notes_db, fake):
    """sqlite-vec cuts its k rows anywhere in a tie (many copies of a boilerplate paragraph):
    the vec path fetches past the tie, so it gives what the exact path gives."""
    db, _ = notes_db
    query = "the same paragraph everywhere"
    vector = fake.embed([query])[0].astype("<f4").tobytes()
    twins = [r[0] for r in db.all("SELECT chunk_id FROM note_chunk_embeddings ORDER BY chunk_id")]
    twins = twins[::2][:60]
    with as_a_run(db):
        for chunk_id in twins:
            db.execute(forge_vector("note_chunk_embeddings", "chunk_id"), (vector, chunk_id))
            vec_replace(db, "vec_chunk_embeddings", chunk_id, vector)
    found = search_chunks(db, query, fake, k=3, mode="vector")
    assert found.via == "vec" and [h.chunk_id for h in found.hits] == twins[:3]
    only = Filters(item_ids=tuple(ids for (ids,) in db.all("SELECT id FROM knowledge_items")))
    exact = search_chunks(db, query, fake, k=3, mode="vector", filters=only)  # the exact path
    assert [h.chunk_id for h in exact.hits] == twins[:3]


def test_an_item_a_host_turned_into_code_or_a_note_leaves_the_other_search(notes_db, fake):
    """Its chunks of the other kind stay until the sweep re-indexes it: they are not the other
    search's to show (plain search never returns code)."""
    db, ids = notes_db
    code = add_item(
        db, kind="code", title="x.py", content="", source=str(ROOT / "worker" / "errors.py")
    )
    reader = Reader(FilesSettings(roots=[ROOT / "worker"]))
    index_item(db, code, embedder=fake, options=IndexOptions(reader=reader))
    assert search_code(db, "StoreError", fake, k=3)[0]
    turned = ids[CHAPTERS[0]]
    host(
        db.path,
        ("UPDATE knowledge_items SET kind = 'code' WHERE id = ?", [turned]),
        ("UPDATE knowledge_items SET kind = 'note' WHERE id = ?", [code]),
    )
    for mode in ("vector", "keyword", "hybrid"):
        hits = search_chunks(db, "ownership", fake, k=50, mode=mode).hits
        assert hits and turned not in {h.item_id for h in hits}, mode
    assert search_code(db, "StoreError", fake, k=3)[0] == []


def test_a_chunk_has_an_embedding_only_of_the_index_dimension_and_model(db_path, emb_settings):
    """After a switch of model and dimension the old vectors stay until the item is indexed
    again; the chunk list said `has_embedding` for them, while no search could find them. So
    after a switch to another model of the same dimension (its vec tables are not rebuilt)."""
    fake = FakeEmbedder(model_id=emb_settings.model)  # the connection's model
    db = connect(db_path, embedding=emb_settings)
    item = add_item(db, kind="note", title="n", content=corpus_text(CHAPTERS[2]))
    index_item(db, item, embedder=fake)
    assert {c["has_embedding"] for c in list_chunks(db, item)} == {True}
    first = db.scalar("SELECT min(chunk_id) FROM note_chunk_embeddings")
    db.execute(forge_vector("note_chunk_embeddings", "chunk_id"), ("a" * 4 * DIMS, first))
    assert [c["has_embedding"] for c in list_chunks(db, item)].count(False) == 1  # a host's row
    db.close()
    wide = emb_settings.model_copy(update={"dimensions": DIMS * 2, "model": "wide"})
    db = connect(db_path, embedding=wide)
    assert {c["has_embedding"] for c in list_chunks(db, item)} == {False}
    db.close()
    same = emb_settings.model_copy(update={"model": "another-of-the-same-size"})
    db = connect(db_path, embedding=same)
    assert {c["has_embedding"] for c in list_chunks(db, item)} == {False}
    other = FakeEmbedder(model_id=same.model)  # what vector search finds: none of them either
    assert search_chunks(db, "ownership", other, k=3, mode="vector").hits == []
    db.close()


def test_a_search_reads_one_snapshot_whatever_commits_meanwhile(
    db, fake, emb_settings, monkeypatch
):
    """Ranking and reading the ranked rows were separate statements: an item deleted and
    another indexed between them (new chunks take the freed ids) paired A's score with B's
    text. The commit is made, deterministically, right before the rows are read."""
    first = add_item(db, kind="note", title="A", content="alpha alpha alpha about apples.\n")
    index_item(db, first, embedder=fake)
    other = connect(db.path, embedding=emb_settings)
    load = retrieval._load

    def racing_load(*args: Any, **kwargs: Any) -> Any:
        other.execute("DELETE FROM knowledge_items WHERE id = ?", (first,))
        second = add_item(other, kind="note", title="B", content="zebra crossing, nothing.\n")
        index_item(other, second, embedder=fake)
        return load(*args, **kwargs)

    monkeypatch.setattr(retrieval, "_load", racing_load)
    hits = search_chunks(db, "alpha", fake, k=5, mode="keyword").hits
    assert [(h.title, "alpha" in h.content) for h in hits] == [("A", True)]  # as ranked
    monkeypatch.setattr(retrieval, "_load", load)
    assert [h.title for h in search_chunks(db, "zebra", fake, k=5, mode="keyword").hits] == ["B"]
    other.close()


@pytest.mark.parametrize("bad", ["nan", "zeros"])
def test_a_vec_row_without_a_direction_leaves_chunk_search_to_the_exact_path(notes_db, fake, bad):
    """sqlite-vec's KNN ranks every query wrongly once its table holds a NaN or zero vector (a
    host's): such a table is searched exactly, with the reason, and the right chunk is first."""
    db, _ = notes_db
    keys = [r[0] for r in db.all("SELECT chunk_id FROM note_chunk_embeddings ORDER BY chunk_id")]
    value = np.full(DIMS, np.nan if bad == "nan" else 0.0, dtype="<f4").tobytes()
    for key in keys[:: max(1, len(keys) // 8)]:  # a few, spread over the table
        vec_replace(db, "vec_chunk_embeddings", key, value)
    target = keys[-3]
    text = db.scalar("SELECT content FROM note_chunks WHERE id = ?", (target,))
    vector = db.scalar("SELECT vector FROM note_chunk_embeddings WHERE chunk_id = ?", (target,))
    query = "a query whose vector is that chunk's"
    fake.embed_batch = lambda texts: np.stack(  # type: ignore[method-assign]
        [np.frombuffer(vector, dtype="<f4")] * len(texts)
    )
    found = search_chunks(db, query, fake, k=3, mode="vector")
    assert found.hits[0].chunk_id == target and found.hits[0].content == text
    assert found.via == "fallback" and "no direction" in (found.reason or "")
