"""The quantized mirrors (`vec_chunk_bits`, `vec_note_bits`): written with the float vec rows,
rebuilt with them, mended by the sweep, never needing the provider."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import (
    DIMS,
    FakeEmbedder,
    corpus_text,
    integrity,
    keyword_rows_problems,
    mirror_problems,
    standin_settings,
)
from host import host
from worker.bulk import index_item
from worker.errors import PermanentProviderError
from worker.indexers import IndexOptions
from worker.indexers.memories import add_memory, embed_memories
from worker.reconcile import reconcile
from worker.retrieval import search_chunks
from worker.settings import FilesSettings, SearchSettings
from worker.sources import Reader
from worker.store import connect, vec_table_dimensions
from worker.store.items import add_item, get_state, list_chunks, update_content
from worker.store.removal import delete_items, leftovers
from worker.store.repair import repair_vectors
from worker.store.vec import vec_behind, vec_delete_from

CHAPTERS = ("ch04-01-what-is-ownership.md", "ch10-02-traits.md", "ch15-01-box.md")
TESTS = Path(__file__).parent


@pytest.fixture
def fake() -> FakeEmbedder:
    return FakeEmbedder()


def indexed(path: Path, standin, fake: FakeEmbedder, **settings: object):
    db = connect(path, embedding=standin_settings(standin, **settings))
    for name in CHAPTERS:
        index_item(
            db, add_item(db, kind="note", title=name, content=corpus_text(name)), embedder=fake
        )
    index_item(db, add_item(db, kind="note", title="Short", content="A short note."), embedder=fake)
    return db


def test_indexing_and_edits_write_the_bits_with_the_floats(tmp_path, standin, fake):
    db = indexed(tmp_path / "q.db", standin, fake)
    assert db.scalar("SELECT count(*) FROM vec_chunk_bits") > 20
    assert db.scalar("SELECT count(*) FROM vec_note_bits") == 1  # the one-chunk note
    assert mirror_problems(db) == []
    text = corpus_text(CHAPTERS[1])
    middle = text.index("\n\n", len(text) // 2)
    update_content(db, 2, text[:middle] + "\n\nAn inserted paragraph." + text[middle:])
    index_item(db, 2, embedder=fake)
    update_content(db, 4, "The short note, longer now.\n\n" + corpus_text(CHAPTERS[2]))
    index_item(db, 4, embedder=fake)  # one chunk to several: its whole-item vector goes
    assert db.scalar("SELECT count(*) FROM vec_note_bits") == 0
    assert mirror_problems(db) == [] and integrity(db) == "ok"
    db.close()


@pytest.mark.parametrize("shadow", ["rowids", "scan"])
def test_rows_from_a_key_up_leave_the_float_and_bit_tables(tmp_path, standin, fake, shadow):
    """vec_delete_from finds the keys through sqlite-vec's `_rowids` table, or, in a version
    without it, by reading the vec table: the same rows go, the others stay."""
    db = indexed(tmp_path / "q.db", standin, fake)
    keys = [r[0] for r in db.all("SELECT chunk_id FROM vec_chunk_embeddings ORDER BY chunk_id")]
    first = keys[len(keys) // 2]
    if shadow == "scan":
        exists = db.table_exists
        db.table_exists = lambda name: not name.endswith("_rowids") and exists(name)
    vec_delete_from(db, "vec_chunk_embeddings", first)
    below = [k for k in keys if k < first]
    for table in ("vec_chunk_embeddings", "vec_chunk_bits"):
        assert [r[0] for r in db.all(f"SELECT chunk_id FROM {table} ORDER BY chunk_id")] == below
    db.close()


def test_a_vec_row_unlike_its_vector_is_replaced_by_the_sweep_a_slice_at_a_time(
    tmp_path, standin, fake
):
    """A host wrote another vector into a live key's vec row (or a bit row drifted): key
    checks never see it. Each full repair compares the contents of the next slice of keys,
    from where the last stopped, and replaces what differs; the sweep's does too."""
    db = indexed(tmp_path / "q.db", standin, fake)
    keys = [r[0] for r in db.all("SELECT chunk_id FROM vec_chunk_embeddings ORDER BY chunk_id")]
    other = np.ones(DIMS, dtype=np.float32).tobytes()
    wrong = [keys[1], keys[-2]]  # one early, one late: two slices apart
    for key in wrong:
        for table, value in (
            ("vec_chunk_embeddings", "?"),
            ("vec_chunk_bits", "vec_quantize_binary(?)"),
        ):
            db.execute(f"DELETE FROM {table} WHERE chunk_id = ?", (key,))
            db.execute(
                f"INSERT INTO {table}(chunk_id, embedding) VALUES (?, {value})", (key, other)
            )
    assert mirror_problems(db)
    first = repair_vectors(db, db.dimensions, verify=len(keys) // 2)
    assert first.replaced == {"vec_chunk_embeddings": 1, "vec_chunk_bits": 1}  # the early one
    assert mirror_problems(db)
    second = repair_vectors(db, db.dimensions, verify=len(keys) // 2)
    assert second.replaced == {"vec_chunk_embeddings": 1, "vec_chunk_bits": 1}  # the late one
    assert mirror_problems(db) == []
    assert reconcile(db, model=fake.model_id, max_items=10).repaired["replaced"] == {}
    db.execute("DELETE FROM vec_chunk_embeddings WHERE chunk_id = ?", (keys[0],))
    db.execute(
        "INSERT INTO vec_chunk_embeddings(chunk_id, embedding) VALUES (?, ?)", (keys[0], other)
    )
    drift = reconcile(db, model=fake.model_id, max_items=10)  # the round ended: from the first
    assert drift.repaired["replaced"] == {"vec_chunk_embeddings": 1}
    assert mirror_problems(db) == []
    db.close()


def test_a_model_switch_and_back_rebuilds_the_bits_with_the_floats(tmp_path, standin, fake):
    path = tmp_path / "switch.db"
    indexed(path, standin, fake).close()
    db = connect(path, embedding=standin_settings(standin, model="wide", dimensions=1536))
    assert set(vec_table_dimensions(db).values()) == {1536}
    wide = FakeEmbedder(dimensions=1536, model_id="wide")
    index_item(db, 1, embedder=wide)
    assert db.scalar("SELECT count(*) FROM vec_chunk_bits") > 5 and mirror_problems(db) == []
    db.close()
    db = connect(path, embedding=standin_settings(standin))
    assert set(vec_table_dimensions(db).values()) == {DIMS}
    assert mirror_problems(db) == []
    index_item(db, 1, embedder=fake)  # back at the first model: its vectors again
    assert mirror_problems(db) == []
    db.close()


def test_a_dropped_or_emptied_mirror_is_rebuilt_with_no_provider_call(tmp_path, standin, fake):
    """Dropped (by an operator with sqlite-vec loaded: a host without it cannot touch a vec0
    table) or missing rows: filled from the relational vectors."""
    path = tmp_path / "drop.db"
    db = indexed(path, standin, fake)
    chunks = db.scalar("SELECT count(*) FROM vec_chunk_bits")
    calls = len(fake.calls)
    db.execute("DROP TABLE vec_chunk_bits")
    db.execute("DROP TABLE vec_note_bits")
    db.close()
    db = connect(path, embedding=standin_settings(standin))  # as an old database: filled
    assert db.scalar("SELECT count(*) FROM vec_chunk_bits") == chunks
    assert mirror_problems(db) == []
    db.execute("DELETE FROM vec_chunk_bits WHERE chunk_id % 3 = 0")
    assert mirror_problems(db) != []
    reconcile(db, model=fake.model_id, max_items=100)
    assert mirror_problems(db) == [] and len(fake.calls) == calls
    db.close()


def test_a_hosts_plain_sql_delete_is_mended_by_the_sweep(tmp_path, standin, fake):
    path = tmp_path / "host.db"
    indexed(path, standin, fake).close()
    host(
        path,
        ("DELETE FROM knowledge_items WHERE id = 1", []),  # foreign keys off: rows stay
        (
            "DELETE FROM note_chunk_embeddings WHERE chunk_id IN "
            "(SELECT id FROM note_chunks WHERE item_id = 2 LIMIT 3)",
            [],
        ),
        ("DELETE FROM note_embeddings", []),
    )
    db = connect(path, embedding=standin_settings(standin))
    assert mirror_problems(db) != []
    reconcile(db, model=fake.model_id, max_items=100)
    assert mirror_problems(db) == [] and integrity(db) == "ok"
    db.close()


WRITER = """
import json, sys
sys.path[:0] = [{tests!r}]
from conftest import FakeEmbedder, corpus_text, standin_settings
from worker.bulk import index_item
from worker.settings import EmbeddingSettings
from worker.store import connect
from worker.store.items import add_item
settings = EmbeddingSettings(**json.loads(sys.argv[2]))
db = connect(sys.argv[1], embedding=settings)
fake = FakeEmbedder(model_id="fake")
n = 0
while True:
    name = {chapters!r}[n % 3]
    index_item(db, add_item(db, kind="note", title=name, content=corpus_text(name)), embedder=fake)
    n += 1
    print("written", n, flush=True)
"""


def test_a_writer_killed_mid_write_leaves_floats_and_bits_equal(tmp_path, standin):
    path = tmp_path / "killed.db"
    settings = standin_settings(standin).model_dump(mode="json")
    code = WRITER.format(tests=str(TESTS), chapters=CHAPTERS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)])}
    for kill_after in (2, 5):
        writer = subprocess.Popen(
            [sys.executable, "-c", code, str(path), json.dumps(settings)],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        try:
            deadline = time.monotonic() + 60
            assert writer.stdout is not None
            for line in writer.stdout:  # "written N": one more item written (else a log line)
                done = line.startswith("written ") and int(line.split()[1]) >= kill_after
                if done or time.monotonic() > deadline:
                    break
            os.kill(writer.pid, signal.SIGKILL)  # mid-item: the next one is being written
        finally:
            writer.kill()
            writer.wait(10)
        assert done, "the writer wrote too little in a minute"
        db = connect(path, embedding=standin_settings(standin))
        assert db.scalar("SELECT count(*) FROM vec_chunk_bits") > 0
        assert mirror_problems(db) == [] and integrity(db) == "ok"
        db.close()


# -- vectors under keys taken again, and vectors written without the mirror ------------------


class Refusing(FakeEmbedder):
    """Refuses any batch holding `word` (a refusal of one input: each text is tried alone)."""

    def __init__(self, word: str) -> None:
        super().__init__()
        self.word = word

    def embed_batch(self, texts: list[str]) -> np.ndarray:
        if any(self.word in t for t in texts):
            self.calls.append(list(texts))
            raise PermanentProviderError("refused input", per_input=True)
        return super().embed_batch(texts)


def sections(word: str, n: int = 3) -> str:
    para = f"A paragraph about {word} that is long enough to stand as a chunk of its own. " * 12
    return "\n\n".join(f"## {word} {k}\n\n{para}" for k in range(n))


def code_file(word: str, n: int = 3) -> str:
    body = "".join(f"    {word}_{j} = {j}  # {word} step {j}\n" for j in range(12))
    return "\n\n".join(f"def {word}_{k}():\n{body}    return {k}\n" for k in range(n))


@pytest.mark.parametrize("kind", ["note", "code"])
def test_a_chunk_whose_embedding_failed_never_inherits_a_vector_left_under_its_id(
    tmp_path, standin, fake, kind
):
    """A host deletes the newest chunk by hand (foreign keys off: its vector stays); the next
    new chunk takes its id, and its embedding is refused: it must have no vector, not that one."""
    path = tmp_path / "k.db"
    db = connect(path, embedding=standin_settings(standin))
    chunks, vectors = (
        ("note_chunks", "note_chunk_embeddings")
        if kind == "note"
        else ("code_chunks", "code_chunk_embeddings")
    )
    options = IndexOptions(reader=Reader(FilesSettings(roots=[tmp_path])))

    def add(name: str, text: str) -> int:
        if kind == "note":
            return add_item(db, kind="note", title=name, content=text)
        (tmp_path / f"{name}.py").write_text(text)
        source = str(tmp_path / f"{name}.py")
        return add_item(db, kind="code", title=f"{name}.py", content="", source=source)

    make = sections if kind == "note" else code_file
    a = add("a", make("alpha"))
    assert index_item(db, a, embedder=fake, options=options).status == "indexed"
    top = db.scalar(f"SELECT max(id) FROM {chunks}")
    host(path, (f"DELETE FROM {chunks} WHERE id = ?", [top]))
    assert db.scalar(f"SELECT count(*) FROM {vectors} WHERE chunk_id = ?", (top,)) == 1
    b = add("b", make("POISON", 1) + "\n\n" + make("bravo"))
    result = index_item(db, b, embedder=Refusing("POISON"), options=options)
    assert result.status == "partial"
    first = db.scalar(f"SELECT id FROM {chunks} WHERE item_id = ? ORDER BY chunk_index", (b,))
    assert first == top  # the id was taken again, by the chunk whose embedding was refused
    assert db.scalar(f"SELECT count(*) FROM {vectors} WHERE chunk_id = ?", (top,)) == 0
    assert list_chunks(db, b)[0]["has_embedding"] is False
    assert mirror_problems(db) == []
    fake.calls.clear()  # the next run embeds it: nothing of another chunk is reused for it
    result = index_item(db, b, embedder=fake, options=options)
    assert result.status == "indexed"
    assert any("POISON" in t for call in fake.calls for t in call)
    assert mirror_problems(db) == [] and integrity(db) == "ok"
    db.close()


@pytest.mark.parametrize("mended_by", ["connect", "sweep"])
def test_vectors_written_without_the_mirror_are_rebuilt_when_it_is_back(
    tmp_path, standin, fake, mended_by
):
    """A process without sqlite-vec deletes an item and indexes others: new chunks take the
    deleted ones' ids, a note's whole-item vector changes under the same key. No comparison
    of keys sees the old vec rows; the database is marked and its vec tables rebuilt."""
    path = tmp_path / "off.db"
    settings = standin_settings(standin)
    db = connect(path, embedding=settings)
    a = add_item(db, kind="note", title="A", content=sections("alpha"))
    short = add_item(db, kind="note", title="S", content="A short note about alpha.")
    for item in (short, a):  # A has the highest chunk ids: B takes them again
        index_item(db, item, embedder=fake)
    memory = add_memory(db, "Likes alpha.", fake)
    assert mirror_problems(db) == [] and not vec_behind(db)
    live = connect(path, embedding=settings)  # a worker that keeps running meanwhile
    off = connect(path, embedding=settings, vec=False)
    off.execute("UPDATE memories SET content = 'Likes bravo.' WHERE id = ?", (memory,))
    assert not vec_behind(off) and embed_memories(off, fake).embedded == 1
    assert vec_behind(off)  # a memory's new vector is enough
    delete_items(off, [a])
    b = add_item(off, kind="note", title="B", content=sections("bravo"))
    index_item(off, b, embedder=fake)
    update_content(off, short, "A short note about bravo now.")
    index_item(off, short, embedder=fake)
    assert vec_behind(off)
    off.close()
    stale = [p.split(":")[0] for p in mirror_problems(live) if "unlike their vectors" in p]
    assert {"vec_chunk_embeddings", "vec_note_embeddings", "vec_memories"} <= set(stale)
    if mended_by == "connect":
        live.close()
        live = connect(path, embedding=settings)
    else:
        reconcile(live, model=fake.model_id, max_items=100, locked=lambda ids: set())
    assert mirror_problems(live) == [] and not vec_behind(live)
    hits = search_chunks(live, sections("alpha").split("\n\n")[1], fake, k=1, mode="vector").hits
    assert hits and hits[0].item_id != a and hits[0].score < 0.99
    live.close()
    db.close()


@pytest.mark.parametrize("mended_by", ["write", "sweep"])
def test_an_item_whose_kind_a_host_changed_keeps_nothing_of_the_other_kind(
    tmp_path, standin, fake, mended_by
):
    """A host turns a note into code with plain SQL, then back: the rows of the kind it was
    (chunks, vectors, the whole-item vector, vec and keyword rows) go at its next write, or
    with the sweep's leftovers; prose search no longer returns it."""
    path = tmp_path / "kind.db"
    db = connect(path, embedding=standin_settings(standin))
    options = IndexOptions(reader=Reader(FilesSettings(roots=[tmp_path])))
    note = add_item(db, kind="note", title="Z", content="A note about zebras and stripes.")
    other = add_item(db, kind="note", title="O", content=sections("alpha"))
    for item in (note, other):
        assert index_item(db, item, embedder=fake, options=options).status == "indexed"
    (tmp_path / "z.py").write_text(code_file("zebra"))
    host(
        path,
        (
            "UPDATE knowledge_items SET kind = 'code', source = ?, title = 'z.py', content = '' "
            "WHERE id = ?",
            [str(tmp_path / "z.py"), note],
        ),
    )
    assert leftovers(db) == {"chunk vectors": 1, "note chunks": 1, "whole-item vectors": 1}
    host(path, ("UPDATE knowledge_items SET title = 'O, renamed' WHERE id = ?", [other]))
    for item in (note, other):  # its text comes from elsewhere, or its embedder input changed
        assert get_state(db, item)["status"] == "pending"
    if mended_by == "write":
        assert index_item(db, note, embedder=fake, options=options).status == "indexed"
    else:
        drift = reconcile(db, model=fake.model_id, max_items=100, locked=lambda ids: set())
        assert sorted(drift.to_index) == sorted([note, other])
    for table in ("note_chunks", "note_embeddings"):
        assert db.scalar(f"SELECT count(*) FROM {table} WHERE item_id = ?", (note,)) == 0
    assert leftovers(db) == {} and mirror_problems(db) == []
    assert keyword_rows_problems(db) == []
    hits = search_chunks(db, "zebras stripes", fake, k=5, mode="hybrid").hits
    assert note not in {h.item_id for h in hits} and hits  # the other note still answers
    if mended_by == "write":  # and back: its code rows go
        assert db.scalar("SELECT count(*) FROM code_chunks WHERE item_id = ?", (note,)) > 0
        host(
            path,
            ("UPDATE knowledge_items SET kind = 'note', content = 'Zebras.' WHERE id = ?", [note]),
        )
        assert index_item(db, note, embedder=fake, options=options).status == "indexed"
        assert db.scalar("SELECT count(*) FROM code_chunks WHERE item_id = ?", (note,)) == 0
        assert leftovers(db) == {} and mirror_problems(db) == [] and keyword_rows_problems(db) == []
    assert integrity(db) == "ok"
    db.close()


@pytest.mark.parametrize("dims", [100, 96, 7])
def test_any_dimension_gets_its_bits_and_two_pass_search(tmp_path, standin, dims):
    """sqlite-vec quantizes whole bytes only (a `bit[100]` table took no row: indexing failed,
    and a reconnect after vectors written without the mirror failed every command), and
    worker.hamming reads only whole 64-bit words (96: the first pass went through vec0's KNN,
    which was handed the bits as floats and failed every search past `exact_below`)."""
    fake = FakeEmbedder(dimensions=dims)
    db = indexed(tmp_path / f"d{dims}.db", standin, fake, dimensions=dims)
    assert set(vec_table_dimensions(db).values()) == {dims} and mirror_problems(db) == []
    bits = dict(db.all("SELECT chunk_id, embedding FROM vec_chunk_bits"))
    floats = db.all("SELECT chunk_id, vector FROM note_chunk_embeddings")
    assert len(bits) == len(floats) > 20
    for key, vector in floats:  # the signs, zero-padded to whole bytes, as numpy packs them
        signs = np.frombuffer(vector, dtype="<f4") > 0
        padded = np.concatenate([signs, np.zeros(-dims % 8, dtype=bool)])
        assert bytes(bits[key]) == np.packbits(padded, bitorder="little").tobytes()
    db.close()
    db = connect(tmp_path / f"d{dims}.db", embedding=standin_settings(standin, dimensions=dims))
    assert set(vec_table_dimensions(db).values()) == {dims}  # no rebuild on opening
    two_pass = SearchSettings(exact_below=0, oversample=40)  # every chunk a candidate
    for query in ("ownership and borrowing", "trait objects", "Box<T> on the heap"):
        exact = search_chunks(db, query, fake, k=5, mode="vector")
        quick = search_chunks(db, query, fake, k=5, mode="vector", tuning=two_pass)
        assert quick.via == "vec" and [h.chunk_id for h in quick.hits] == [
            h.chunk_id for h in exact.hits
        ]
    key = next(iter(bits))
    db.execute("DELETE FROM vec_chunk_bits WHERE chunk_id = ?", (key,))
    assert repair_vectors(db, dims).restored == {"vec_chunk_bits": 1}
    assert mirror_problems(db) == []
    db.close()
