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

import pytest

from conftest import DIMS, FakeEmbedder, corpus_text, integrity, mirror_problems, standin_settings
from host import host
from worker.bulk import index_item
from worker.reconcile import reconcile
from worker.store import connect, vec_table_dimensions
from worker.store.items import add_item, update_content

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
