"""Files, URLs, code and memories through the pipeline and the `kidx` command: a real SQLite file,
the embedding stand-in, a real page server on 127.0.0.1 (allowed by setting in these tests only)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
import structlog
from markdown_it import MarkdownIt

from conftest import DIMS, corpus_text, standin_settings
from host import host
from incli import run_kidx
from stack import REDIS_DB, broker_url
from worker.bulk import index_item
from worker.errors import (
    IndexAborted,
    InvalidInput,
    PermanentProviderError,
    TransientProviderError,
)
from worker.indexers import IndexOptions
from worker.indexers.code import search_code
from worker.indexers.memories import (
    add_memory,
    embed_memories,
    memories_missing,
    search_memories,
)
from worker.providers import build_embedder
from worker.providers.base import EmbeddingModel
from worker.reconcile import due_retries, reconcile
from worker.retrieval import search
from worker.settings import FilesSettings, UrlSettings
from worker.sources import Reader
from worker.store import connect, vec_table_dimensions
from worker.store.items import add_item, get_state, list_chunks, summary
from worker.store.jobs import JobState, record_end, record_start

ROOT = Path(__file__).resolve().parents[1]
ARTICLE = """<html><head><title>Slices</title><script>var tracking = "SCRIPT-TEXT";</script></head>
<body><nav><a href="/">NAV-TEXT Home</a> | <a href="/about">About</a></nav>
<article><h1>The Slice Type</h1><p>Slices let you reference a contiguous sequence of elements in
a collection rather than the whole collection. A slice is a kind of reference, so it does not
have ownership.</p><h2>String Slices</h2><p>A string slice is a reference to part of a String,
and it looks like this: a range within brackets that says where the slice starts and ends. Range
indices must occur at valid UTF-8 character boundaries.</p></article>
<footer>FOOTER-TEXT Copyright 2026</footer></body></html>"""


@pytest.fixture
def files_root(tmp_path: Path) -> Path:
    root = tmp_path / "files"
    root.mkdir()
    return root


@pytest.fixture
def reader(files_root: Path) -> Reader:
    return Reader(FilesSettings(roots=[files_root]), UrlSettings(allow_hosts=["127.0.0.1"]))


def headings(markdown: str) -> list[str]:
    return [
        line.lstrip("#").strip()
        for line in markdown.splitlines()
        if line.startswith("#") and not line.startswith("#!")
    ]


def chunk_texts(db, item_id: int) -> list[str]:
    return [
        r[0]
        for r in db.all(
            "SELECT content FROM note_chunks WHERE item_id = ? ORDER BY chunk_index", (item_id,)
        )
    ]


# -- files -----------------------------------------------------------------------------------


def test_a_chapter_as_html_and_as_pdf_gives_chunks_with_its_headings(
    db, embedder, reader, files_root
):
    from fpdf import FPDF

    chapter = corpus_text("ch04-03-slices.md")
    (files_root / "slices.html").write_text(
        f"<html><body><article>{MarkdownIt().render(chapter)}</article></body></html>"
    )
    pdf = FPDF()
    pdf.add_page()
    for line in chapter.splitlines():
        clean = line.encode("latin-1", "replace").decode("latin-1")
        if line.startswith("#"):
            pdf.set_font("Helvetica", "B", 18)
            pdf.multi_cell(0, 10, clean.lstrip("# "), new_x="LMARGIN", new_y="NEXT")
        elif line.strip():
            pdf.set_font("Helvetica", "", 10)
            pdf.multi_cell(0, 5, clean, new_x="LMARGIN", new_y="NEXT")
    (files_root / "slices.pdf").write_bytes(bytes(pdf.output()))
    wanted = headings(chapter)
    assert len(wanted) >= 4
    for name in ("slices.html", "slices.pdf"):
        item = add_item(db, kind="file", title=name, content="", source=str(files_root / name))
        result = index_item(db, item, embedder=embedder, options=IndexOptions(reader=reader))
        assert result.status == "indexed" and result.chunks >= 3
        text = " ".join(chunk_texts(db, item))
        for heading in wanted:
            assert " ".join(heading.replace("`", "").split()[:3]) in text.replace("`", ""), (
                name,
                heading,
            )
        # The text just read is kept as the item's content, with its hash.
        content = db.scalar("SELECT content FROM knowledge_items WHERE id = ?", (item,))
        assert content and "Slice" in content


@pytest.mark.parametrize(
    "name, data, words",
    [
        ("outside.md", None, "outside"),
        ("binary.bin", b"\x00\x01\x02binary", "binary"),
        ("empty.md", b"", "empty"),
        ("latin.md", "caf\xe9".encode("latin-1"), "not UTF-8"),
    ],
)
def test_a_refused_file_gets_a_clear_stored_error(
    db, embedder, reader, files_root, tmp_path, name, data, words
):
    path = tmp_path / name if data is None else files_root / name
    path.write_bytes(data if data is not None else b"# Outside the roots\n")
    item = add_item(db, kind="file", title=name, content="", source=str(path))
    with pytest.raises(InvalidInput, match=words):
        index_item(db, item, embedder=embedder, options=IndexOptions(reader=reader))
    state = get_state(db, item)
    assert state["status"] == "failed" and words in state["last_error"]
    assert db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (item,)) == 0


def test_items_skipped_without_a_provider_are_sent_by_the_sweep_once_one_is(
    db, embedder, reader, files_root, pages
):
    """A file, URL or code item skipped while no provider was configured was never swept (the
    content check is for notes only); a note was, every sweep, even without a provider."""
    (files_root / "f.md").write_text("# F\n\nSome file text about things. " * 20)
    (files_root / "m.py").write_text("def things():\n    return 'code about things'\n" * 5)
    pages.routes["/slices"] = (200, "text/html; charset=utf-8", ARTICLE.encode())
    ids = [
        add_item(db, kind="note", title="N", content="A note about things. " * 20),
        add_item(db, kind="file", title="f.md", content="", source=str(files_root / "f.md")),
        add_item(db, kind="url", title="u", content="", source=pages.url + "/slices"),
        add_item(db, kind="code", title="m.py", content="", source=str(files_root / "m.py")),
    ]
    for item in ids:
        assert index_item(db, item, embedder=None).status == "skipped"
    still_none = reconcile(db, model=embedder.model_id, max_items=100, provider=False)
    assert still_none.to_index == [] and still_none.found["skipped"] == []  # no loop
    drift = reconcile(db, model=embedder.model_id, max_items=100)
    assert drift.to_index == ids and drift.found["skipped"] == ids
    for item in ids:
        result = index_item(db, item, embedder=embedder, options=IndexOptions(reader=reader))
        assert result.status == "indexed", result
    assert reconcile(db, model=embedder.model_id, max_items=100).to_index == []


def test_an_item_waiting_for_its_retry_countdown_is_busy_for_both_sweeps(db, embedder):
    """Celery's retry of a task: the failed attempt's row says `retry` and the item `failed`
    while the countdown runs (up to the visibility timeout less the time limit): neither the
    retry sweep nor the reconcile sweep sends it meanwhile (a duplicate run that ignores the
    provider's Retry-After); past the horizon it is theirs again (a retry the broker lost)."""
    item = add_item(db, kind="note", title="N", content="A note about things.")
    index_item(db, item, embedder=None)
    db.execute(
        "UPDATE item_index_state SET status = 'failed', attempts = 1, "
        "updated_at = '2000-01-01T00:00:00Z' WHERE item_id = ?",
        (item,),
    )
    record_start(db, "task-1", 0, "GenerateEmbedding", item, None, None)
    record_end(db, "task-1", 0, JobState.RETRY, 5, "rate limited")
    retries = {"max_attempts": 5, "backoff": 0.0, "backoff_max": 0.0}
    assert due_retries(db, **retries) == []
    assert item not in reconcile(db, model=embedder.model_id, max_items=10).to_index
    db.execute("UPDATE index_jobs SET started_at = '2000-01-01T00:00:00Z'")
    assert due_retries(db, **retries) == [item]
    record_start(db, "task-2", 0, "GenerateEmbedding", item, None, None)  # a retry of now
    record_end(db, "task-2", 0, JobState.RETRY, 5, "rate limited")
    assert due_retries(db, **retries) == []
    record_start(db, "task-2", 1, "GenerateEmbedding", item, None, None)  # its retry ran
    record_end(db, "task-2", 1, JobState.FAILED, 5, "rate limited, the last attempt")
    assert due_retries(db, **retries) == [item]  # not held for the horizon by the old row


# -- URLs ------------------------------------------------------------------------------------


def test_a_page_gives_the_article_only_and_an_unchanged_page_costs_nothing(
    db, embedder, reader, pages, standin
):
    pages.routes["/slices"] = (200, "text/html; charset=utf-8", ARTICLE.encode())
    item = add_item(db, kind="url", title="Slices", content="", source=pages.url + "/slices")
    result = index_item(db, item, embedder=embedder, options=IndexOptions(reader=reader))
    assert result.status == "indexed"
    text = " ".join(chunk_texts(db, item))
    assert "contiguous sequence of elements" in text and "String Slices" in text
    for noise in ("NAV-TEXT", "SCRIPT-TEXT", "FOOTER-TEXT"):
        assert noise not in text
    embedded = len(standin.texts)
    again = index_item(db, item, embedder=embedder, options=IndexOptions(reader=reader))
    assert pages.hits["/slices"] == 2  # fetched again...
    assert len(standin.texts) == embedded and again.embedded == 0  # ...and nothing embedded


def test_a_refused_or_missing_page_gets_a_clear_stored_error(db, embedder, pages):
    not_allowed = Reader(FilesSettings(), UrlSettings())  # loopback not allowed here
    item = add_item(db, kind="url", title="x", content="", source=pages.url + "/slices")
    with pytest.raises(InvalidInput, match="loopback"):
        index_item(db, item, embedder=embedder, options=IndexOptions(reader=not_allowed))
    assert "loopback" in get_state(db, item)["last_error"]
    assert "/slices" not in pages.hits  # refused before any connection
    allowed = Reader(FilesSettings(), UrlSettings(allow_hosts=["127.0.0.1"]))
    missing = add_item(db, kind="url", title="y", content="", source=pages.url + "/nothing")
    with pytest.raises(InvalidInput, match="404"):
        index_item(db, missing, embedder=embedder, options=IndexOptions(reader=allowed))
    assert "404" in get_state(db, missing)["last_error"]


def test_a_server_error_is_transient_and_retried_by_the_task(db, embedder, reader, pages):
    pages.routes["/down"] = (503, "text/plain", b"busy")
    item = add_item(db, kind="url", title="down", content="", source=pages.url + "/down")
    with pytest.raises(IndexAborted) as caught:
        index_item(db, item, embedder=embedder, options=IndexOptions(reader=reader))
    assert caught.value.transient and "503" in str(caught.value)


# -- code ------------------------------------------------------------------------------------


def test_a_python_package_becomes_code_chunks_that_only_code_search_returns(
    db, embedder, standin, tmp_path
):
    from worker.sources.code import list_code_files

    package = ROOT / "worker" / "store"
    code_reader = Reader(FilesSettings(roots=[package]))  # code is read under the roots only
    note = add_item(db, kind="note", title="A note", content="Vec rows are written here too.")
    index_item(db, note, embedder=embedder)
    ids = []
    for path in list_code_files(package):
        rel = str(path.relative_to(package))
        ids.append(add_item(db, kind="code", title=rel, content="", source=str(path)))
        result = index_item(
            db, ids[-1], embedder=embedder, options=IndexOptions(reader=code_reader)
        )
        assert result.status == "indexed" and result.chunks >= 1
    assert db.scalar("SELECT count(*) FROM note_chunks WHERE item_id != ?", (note,)) == 0
    code_rows = db.scalar("SELECT count(*) FROM code_chunks")
    assert code_rows == db.scalar("SELECT count(*) FROM vec_work_code_chunks") >= len(ids)
    # One chunk per top-level function, with its line range: connect() in store/__init__.py.
    start, end = db.one(
        "SELECT start_line, end_line FROM code_chunks WHERE path = '__init__.py' AND "
        "content LIKE 'def connect(%'"
    )
    lines = (package / "__init__.py").read_text().splitlines()
    assert lines[start - 1].startswith("def connect(") and end > start
    # A query made of a chunk's own embedded text finds it in code search, never in note search.
    row = db.one("SELECT id, path, start_line, end_line, content FROM code_chunks LIMIT 1 OFFSET 3")
    query = f"{row[1]}:{row[2]}-{row[3]}"
    hits, via, _ = search_code(db, query, embedder, k=50)
    assert "vec" in via.split("+") and all(h.path and h.start_line <= h.end_line for h in hits)
    # A name only the keyword side can find (the stand-in's vectors know no meaning): a hit of
    # the first five, found by its keywords, holds it. (Not necessarily the first: a chunk whose
    # comment says "vec table dimensions" matches the phrase too, and the stand-in's vectors,
    # which any edit to these files moves, break the ties of the fused order.)
    for name in ("repair_vectors", "vec_table_dimensions", "sync_vec_tables"):
        hits, via, _ = search_code(db, name, embedder, k=5)
        assert via == "vec+fts"
        held = [
            h
            for h in hits
            if "fts" in h.via.split("+")
            and name
            in db.scalar(
                "SELECT content FROM code_chunks WHERE path = ? AND start_line = ?",
                (h.path, h.start_line),
            )
        ]
        assert held, (name, hits)
    notes = search(db, "anything about code", embedder, k=50)
    assert {h.item_id for h in notes.hits} == {note}  # note search never returns code


def test_a_code_items_chunks_are_listed_like_a_notes(db, embedder, standin, files_root, reader):
    """`list_chunks` (`kidx chunks`) of a code item: its code_chunks, in the notes' shape, a
    chunk without a vector (the provider refused it) shown as such."""
    (files_root / "m.py").write_text(
        "def alpha():\n    return 1\n\n\ndef beta():\n    return 'POISON'\n\n\n"
        "def gamma():\n    return 3\n"
    )
    item = add_item(db, kind="code", title="m.py", content="", source=str(files_root / "m.py"))
    note = add_item(db, kind="note", title="N", content="A note about things.")
    index_item(db, note, embedder=embedder)
    standin.poison = "POISON"
    with structlog.testing.capture_logs() as logs:
        result = index_item(db, item, embedder=embedder, options=IndexOptions(reader=reader))
    assert result.status == "partial" and result.chunks == 3
    chunked = [e for e in logs if e["event"] == "[Chunk] chunked"]  # as a note's run logs it
    assert [(e["chunk_method"], e["chunk_count"], e["dimensions"]) for e in chunked] == [
        ("structure", 3, db.dimensions)
    ]
    rows = list_chunks(db, item)
    assert [(r["chunk_index"], r["has_embedding"], r["summary"]) for r in rows] == [
        (0, True, "m.py:1-2"),
        (1, False, "m.py:5-6"),
        (2, True, "m.py:9-10"),
    ]
    defs = [
        "def alpha():\n    return 1",
        "def beta():\n    return 'POISON'",
        "def gamma():\n    return 3",
    ]
    assert [r["length"] for r in rows] == [len(d) for d in defs]
    assert {r["chunk_method"] for r in rows} == {"structure"}
    assert {(r["start_offset"], r["end_offset"]) for r in rows} == {(None, None)}
    assert set(rows[0]) == set(list_chunks(db, note)[0])


def test_a_dimension_change_rebuilds_and_refills_all_four_vec_tables(tmp_path, standin):
    settings = standin_settings(standin)
    path = tmp_path / "four.db"
    db = connect(path, embedding=settings)
    model = build_embedder(settings, dimensions=db.dimensions)
    note = add_item(db, kind="note", title="N", content="A note.")
    index_item(db, note, embedder=model)
    code = add_item(
        db, kind="code", title="x.py", content="", source=str(ROOT / "worker" / "errors.py")
    )
    index_item(
        db,
        code,
        embedder=model,
        options=IndexOptions(reader=Reader(FilesSettings(roots=[ROOT / "worker"]))),
    )
    add_memory(db, "A memory to keep.", model)
    counts = {t: db.scalar(f"SELECT count(*) FROM {t}") for t in vec_table_dimensions(db)}
    assert all(counts.values())
    db.close()
    db = connect(path, embedding=standin_settings(standin, model="other", dimensions=32))
    assert set(vec_table_dimensions(db).values()) == {32}
    assert all(db.scalar(f"SELECT count(*) FROM {t}") == 0 for t in counts)
    db.close()
    db = connect(path, embedding=settings)  # back: re-filled from the relational vectors
    assert set(vec_table_dimensions(db).values()) == {DIMS}
    assert {t: db.scalar(f"SELECT count(*) FROM {t}") for t in counts} == counts
    db.close()


# -- memories --------------------------------------------------------------------------------


def test_a_memory_is_found_by_memory_search_and_by_nothing_else(db, embedder):
    note = add_item(db, kind="note", title="N", content="The user prefers examples in Rust.")
    index_item(db, note, embedder=embedder)
    memory = add_memory(db, "The user prefers examples in Rust.", embedder)
    hits, via, _ = search_memories(db, "The user prefers examples in Rust.", embedder, k=5)
    assert via == "vec" and hits[0].memory_id == memory and hits[0].score > 0.99
    assert {h.item_id for h in search(db, "The user prefers examples in Rust.", embedder).hits} == {
        note
    }
    assert search_code(db, "The user prefers examples in Rust.", embedder)[0] == []
    with pytest.raises(InvalidInput, match="short text"):
        add_memory(db, "x" * 5000, embedder)


@pytest.mark.parametrize("k", [0, -1, 2.5, True, "3", 10**6])
@pytest.mark.parametrize("which", ["memories", "code"])
def test_memory_and_code_search_refuse_what_chunk_search_refuses(db, embedder, which, k):
    """k=-1 returned every hit but the last, k=0 nothing, k=2.5 a TypeError; a query that is
    not a string an AttributeError."""
    add_memory(db, "The user likes tea.", embedder)
    find = search_memories if which == "memories" else search_code
    with pytest.raises(InvalidInput, match="k must be an integer from 1 to 1000"):
        find(db, "tea", embedder, k=k)
    with pytest.raises(InvalidInput, match="the query must be a string, not NoneType"):
        find(db, None, embedder, k=3)  # type: ignore[arg-type]


def memory_rows(db) -> dict[str, list]:
    return {
        "vectors": db.all("SELECT memory_id, model, dimensions FROM memory_embeddings ORDER BY 1"),
        "vec": db.all("SELECT memory_id FROM vec_memories ORDER BY 1"),
    }


def test_memories_a_host_writes_changes_or_deletes_are_embedded_again(db, db_path, embedder):
    """A host's plain SQL (foreign keys off): new rows, bytes that are not UTF-8 (skipped, not
    embedded as U+FFFD), an empty row, a changed text, a deleted row. `embed_memories` embeds
    what has no vector; the triggers drop the vector of a changed or deleted text; the vec
    mirror follows (orphans by the sweep)."""
    kept = add_memory(db, "The user deploys on Fridays.", embedder)
    host(
        db_path,
        ("INSERT INTO memories(id, content) VALUES (100, 'The user writes Rust at work.')", []),
        ("INSERT INTO memories(id, content) VALUES (101, ?)", [{"hex": "ff4361666588e9"}]),
        ("INSERT INTO memories(id, content) VALUES (102, '   ')", []),
    )
    assert memories_missing(db, embedder.model_id) == 2  # the empty row has nothing to find
    model = f"{embedder.model_id} ({db.dimensions})"
    assert summary(db)["memories_by_model"] == {"no vector": 3, model: 1}
    report = embed_memories(db, embedder)
    assert (report.embedded, report.left, report.error) == (1, 0, None)  # 101: recorded
    assert (report.unreadable, report.unreadable_ids) == (1, [101])
    assert memories_missing(db, embedder.model_id) == 0  # so the sweep has nothing to send
    rows = memory_rows(db)
    assert [r[0] for r in rows["vectors"]] == [r[0] for r in rows["vec"]] == [kept, 100]
    hits, via, _ = search_memories(db, "The user writes Rust at work.", embedder, k=1)
    assert via == "vec" and hits[0].memory_id == 100 and hits[0].score > 0.99
    assert embed_memories(db, embedder).embedded == 0  # nothing left: no provider call
    assert summary(db)["memories_by_model"] == {"no vector": 2, model: 2}  # empty, not UTF-8
    env = {
        "PATH": "/usr/bin:/bin",
        "KIDX_DB": str(db_path),
        "KIDX_EMBEDDING__PROVIDER": "openai",
        "KIDX_EMBEDDING__MODEL": embedder.model_id,
        "KIDX_EMBEDDING__DIMENSIONS": str(DIMS),
    }
    out = run_kidx(["status", "--summary"], env, db_path.parent)
    assert out.returncode == 0 and "memories 4" in out.stdout, out.stderr
    assert f"no vector: 2, {model}: 2" in out.stdout, out.stdout

    host(
        db_path,
        ("UPDATE memories SET content = 'The user writes Go now.' WHERE id = 100", []),
        ("DELETE FROM memories WHERE id = ?", [kept]),
    )
    assert memory_rows(db)["vectors"] == []  # the triggers
    assert embed_memories(db, embedder).embedded == 1
    hits, _, _ = search_memories(db, "The user writes Go now.", embedder, k=1)
    assert hits[0].memory_id == 100 and hits[0].score > 0.99
    reconcile(db, model=embedder.model_id, max_items=10)  # the deleted one's vec row goes
    rows = memory_rows(db)
    assert [r[0] for r in rows["vectors"]] == [r[0] for r in rows["vec"]] == [100]


def test_memories_of_an_earlier_model_are_embedded_by_the_new_one(tmp_path, standin):
    """A switch to a model of another dimension: the memories are embedded again (they kept
    the old vectors only, which no search of the new model can use); a provider error stops
    the run with what was done kept (a 401: every text would fail alike, so none is tried
    alone), and the next run ends it."""
    path = tmp_path / "kidx.db"
    small = standin_settings(standin, dimensions=DIMS)
    db = connect(path, embedding=small)
    model = build_embedder(small, dimensions=db.dimensions)
    ids = [add_memory(db, f"Memory number {n} about the user.", model) for n in range(5)]
    db.close()
    standin.dimensions = 2 * DIMS
    wide = standin_settings(standin, model="standin-wide", dimensions=2 * DIMS)
    db = connect(path, embedding=wide)
    try:
        other = build_embedder(wide, dimensions=db.dimensions)
        other.batch_size = 2
        assert memories_missing(db, other.model_id) == 5
        first = embed_memories(db, other, limit=4)  # two requests of two
        assert first.embedded == 4 and first.left == 1 and first.error is None
        standin.fail_status = 401  # every request fails now
        failed = embed_memories(db, other)
        assert failed.embedded == 0 and failed.left == 1 and "401" in (failed.error or "")
        standin.fail_status = None
        assert embed_memories(db, other).left == 0
        rows = memory_rows(db)
        assert rows["vectors"] == [(i, "standin-wide", 2 * DIMS) for i in ids]
        assert [r[0] for r in rows["vec"]] == ids
    finally:
        db.close()


def memory_ids_with_vectors(db) -> list[int]:
    return [r[0] for r in db.all("SELECT memory_id FROM memory_embeddings ORDER BY 1")]


def test_a_memory_the_provider_refuses_is_skipped_not_blocking_the_others(
    db, db_path, embedder, standin
):
    """A memory refused alone (a 400: per input) is skipped and reported; its batch is sent
    again text by text so the others get their vectors. It is recorded: later runs (the
    sweep's) do not ask again until its text changes, or the record is a day old."""
    host(
        db_path,
        *[
            ("INSERT INTO memories(id, content) VALUES (?, ?)", [i, text])
            for i, text in [
                (1, "POISON the user shares a secret."),
                (2, "The user likes tea."),
                (3, "The user lives in Oslo."),
                (4, "The user has a cat."),
            ]
        ],
    )
    standin.poison = "POISON"
    first = embed_memories(db, embedder)
    assert (first.embedded, first.left, first.error) == (3, 0, None)
    assert (first.refused, first.refused_ids) == (1, [1])
    assert memory_ids_with_vectors(db) == [2, 3, 4]
    assert standin.requests == 1 + 4  # the batch, then each text alone
    assert memories_missing(db, embedder.model_id) == 0  # the sweep sends no run for it
    again = embed_memories(db, embedder)  # a later run asks nothing
    assert (again.embedded, again.refused, again.left, again.error) == (0, 0, 0, None)
    assert standin.requests == 5
    host(db_path, ("INSERT INTO memories(id, content) VALUES (5, 'The user runs.')", []))
    later = embed_memories(db, embedder)  # a new memory after it is embedded
    assert (later.embedded, later.refused, later.left) == (1, 0, 0)
    assert standin.requests == 6 and memory_ids_with_vectors(db) == [2, 3, 4, 5]
    host(db_path, ("UPDATE memory_refusals SET refused_at = '2000-01-01T00:00:00Z'", []))
    assert memories_missing(db, embedder.model_id) == 1  # a day later: asked again
    assert embed_memories(db, embedder).refused == 1 and standin.requests == 7
    host(db_path, ("UPDATE memories SET content = 'The user shares a secret.' WHERE id = 1", []))
    assert embed_memories(db, embedder).embedded == 1  # its new text: asked at once
    assert memory_ids_with_vectors(db) == [1, 2, 3, 4, 5]
    assert db.scalar("SELECT count(*) FROM memory_refusals") == 0


class Scripted(EmbeddingModel):
    """Refuses (per input) a batch holding a text with REFUSED, fails as a provider that is down
    on one with DOWN; counts its requests."""

    model_id, batch_size, dimensions = "scripted", 8, DIMS

    def __init__(self) -> None:
        self.requests: list[list[str]] = []

    def embed_batch(self, texts: list[str]) -> np.ndarray:
        self.requests.append(list(texts))
        if any("REFUSED" in t for t in texts):
            raise PermanentProviderError("refused input", per_input=True)
        if any("DOWN" in t for t in texts):
            raise TransientProviderError("the provider timed out")
        return np.ones((len(texts), DIMS), dtype=np.float32)


def test_refusals_in_a_row_or_a_provider_down_stop_the_one_by_one_memories(db, db_path):
    """Text by text, the third refusal in a row stops the run (a provider refusing every
    text is not asked once per memory), and so does an error that is not one input's."""
    host(
        db_path,
        *[
            ("INSERT INTO memories(id, content) VALUES (?, ?)", [i, f"REFUSED {i}"])
            for i in range(1, 6)
        ],
        ("INSERT INTO memories(id, content) VALUES (6, 'a good memory')", []),
    )
    model = Scripted()
    report = embed_memories(db, model)
    assert (report.embedded, report.refused, report.refused_ids) == (0, 3, [1, 2, 3])
    assert "3 consecutive" in (report.error or "") and report.left == 3  # 1-3 recorded
    assert len(model.requests) == 1 + 3  # the batch, then three alone: not all six
    model.requests.clear()
    after = embed_memories(db, model)  # the next run goes past them: 4, 5, then 6
    assert (after.embedded, after.refused_ids, after.error) == (1, [4, 5], None)
    assert model.requests == [
        ["REFUSED 4", "REFUSED 5", "a good memory"],
        ["REFUSED 4"],
        ["REFUSED 5"],
        ["a good memory"],
    ]
    host(
        db_path,
        ("DELETE FROM memories WHERE id IN (2, 3, 4, 5)", []),
        ("INSERT INTO memories(id, content) VALUES (2, 'DOWN for a while')", []),
        ("INSERT INTO memories(id, content) VALUES (3, 'REFUSED again')", []),
        ("INSERT INTO memories(id, content) VALUES (7, 'another good memory')", []),
    )
    assert db.scalar("SELECT group_concat(memory_id) FROM memory_refusals") == "1"
    model.requests.clear()
    down = embed_memories(db, model)  # 1 is skipped; 2 meets a provider that is down
    assert (down.embedded, down.refused) == (0, 0) and "Transient" in (down.error or "")
    assert model.requests == [
        ["DOWN for a while", "REFUSED again", "another good memory"],
        ["DOWN for a while"],
    ]  # 3 and 7 are left for a later run, not tried against a provider that is down


def test_a_memory_that_is_not_utf8_is_skipped_unread_and_holds_back_nothing(
    db, db_path, embedder, standin
):
    """Bytes that are not UTF-8 are not embedded as U+FFFD (store.text): no vector, no
    request, reported; any number of them, before the limit, hides no memory after them. A
    BLOB holding UTF-8 is the text it is."""
    host(
        db_path,
        *[
            ("INSERT INTO memories(id, content) VALUES (?, CAST(? AS TEXT))", [i, {"hex": hx}])
            for i, hx in [(1, "4361666520ff"), (2, "ff"), (3, "c328"), (4, "e282")]
        ],
        (
            "INSERT INTO memories(id, content) VALUES (5, ?)",
            [{"hex": "436166c3a9206175206c616974"}],
        ),
        ("INSERT INTO memories(id, content) VALUES (6, 'The user drinks tea.')", []),
    )
    report = embed_memories(db, embedder, limit=2)
    assert (report.embedded, report.unreadable, report.unreadable_ids) == (2, 4, [1, 2, 3, 4])
    assert report.error is None and report.left == 0  # 1-4 recorded: no run is sent for them
    assert memory_ids_with_vectors(db) == [5, 6]
    assert standin.texts == ["Café au lait", "The user drinks tea."]  # no U+FFFD sent
    requests = standin.requests
    again = embed_memories(db, embedder, limit=2)
    assert (again.embedded, again.unreadable, again.left) == (0, 0, 0)
    assert standin.requests == requests  # nothing to send


# -- the command, as a new user would ---------------------------------------------------------


def test_kidx_add_file_url_code_memory_and_search(tmp_path, standin, pages, files_root):
    pages.routes["/slices"] = (200, "text/html", ARTICLE.encode())
    (files_root / "notes.md").write_text(corpus_text("ch04-02-references-and-borrowing.md"))
    env = {
        "PATH": "/usr/bin:/bin",
        "HF_HUB_OFFLINE": "1",
        "KIDX_DB": str(tmp_path / "cli.db"),
        "KIDX_BROKER_URL": broker_url(REDIS_DB),
        "KIDX_EMBEDDING__PROVIDER": "openai",
        "KIDX_EMBEDDING__MODEL": "standin-embed",
        "KIDX_EMBEDDING__BASE_URL": standin.base_url,
        "KIDX_EMBEDDING__DIMENSIONS": str(DIMS),
        "KIDX_FILES__ROOTS": f"{files_root},{ROOT / 'worker'}",
        "KIDX_URLS__ALLOW_HOSTS": "127.0.0.1",
    }

    def kidx(*args: str) -> subprocess.CompletedProcess[str]:
        return run_kidx(args, env, tmp_path)

    out = kidx("add", "file", str(files_root / "notes.md"), "--inline")
    assert out.returncode == 0, out.stderr
    out = kidx("add", "url", pages.url + "/slices", "--inline")
    assert out.returncode == 0, out.stderr
    out = kidx("add", "code", str(ROOT / "worker" / "store"), "--inline", "--json")
    assert out.returncode == 0, out.stderr
    code_ids = json.loads(out.stdout)["ids"]
    assert len(code_ids) >= 5
    # A code item's chunks list as a note's do: where each is, whether it has a vector.
    rows = json.loads(kidx("chunks", str(code_ids[0]), "--json").stdout)
    assert rows and all(r["has_embedding"] and r["chunk_method"] == "structure" for r in rows)
    assert all(re.fullmatch(r"\S+\.py:\d+-\d+", r["summary"]) for r in rows)
    table = kidx("chunks", str(code_ids[0])).stdout
    body = [ln for ln in table.splitlines() if ln.startswith("│")]
    assert len(body) == len(rows) and rows[0]["summary"] in body[0] and "yes" in body[0]
    assert kidx("add", "memory", "Remember the borrow checker.").returncode == 0
    out = kidx("search", "--code", "def connect", "--json")
    assert out.returncode == 0 and {"path", "start_line", "end_line", "score", "via"} <= set(
        json.loads(out.stdout)[0]
    )
    out = kidx("search", "--memories", "Remember the borrow checker.", "--json")
    assert json.loads(out.stdout)[0]["content"] == "Remember the borrow checker."
    kinds = {h["kind"] for h in json.loads(kidx("search", "slices", "-k", "50", "--json").stdout)}
    assert kinds == {"file", "url"}
    refused = kidx("add", "file", str(tmp_path / "cli.db"))
    assert refused.returncode == 1 and "outside" in refused.stderr
    assert "Traceback" not in refused.stderr
    added_again = kidx("add", "url", pages.url + "/slices", "--json", "--inline")
    assert json.loads(added_again.stdout)["ids"] == [2]  # the same item, not a duplicate
