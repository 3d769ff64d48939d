"""The `kidx` command as a new user runs it: a real SQLite file, and the HTTP stand-in as the
embedding provider (never the local model). Most runs go through click's runner in this process
(`incli.run_kidx`, the same command without a Python start each); the tests about the process
itself (its first start, its streams, a file that is not a database) run the console
script as a subprocess.

Every run goes through `Kidx.__call__`, which checks what must hold for any command: the API key
never appears on stdout or stderr, and stderr never carries a traceback.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import apsw
import pytest

from conftest import CORPUS, DIMS
from incli import run_kidx
from stack import REDIS_DB, broker_url, free_port

KIDX = Path(sys.executable).parent / "kidx"
API_KEY = "sk-cli-secret-123"
CHAPTER = CORPUS / "ch10-02-traits.md"  # 20 structural chunks
CHUNK_KEYS = {
    "chunk_index",
    "chunk_method",
    "has_embedding",
    "summary",
    "start_offset",
    "end_offset",
    "length",
}
HIT_KEYS = {"item_id", "title", "kind", "chunk_index", "score", "snippet", "via"}
STATE_KEYS = {
    "item_id",
    "status",
    "chunk_method",
    "chunk_count",
    "model",
    "dimensions",
    "last_error",
    "duration_ms",
}
NOWHERE = "http://127.0.0.1:9/v1"  # for runs that must never reach a provider


CLI_BROKER = broker_url(REDIS_DB)  # in-process runs take their locks there


def base_env(db: Path, base_url: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("KIDX_") and k not in {"FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE"}
    }
    env.update(
        KIDX_DB=str(db),
        KIDX_BROKER_URL=CLI_BROKER,  # in-process runs take the items' locks there
        KIDX_EMBEDDING__PROVIDER="openai",
        KIDX_EMBEDDING__MODEL="standin-embed",
        KIDX_EMBEDDING__BASE_URL=base_url,
        KIDX_EMBEDDING__DIMENSIONS=str(DIMS),
        KIDX_EMBEDDING__API_KEY=API_KEY,
        KIDX_EMBEDDING__MAX_RETRIES="0",
        HF_HUB_OFFLINE="1",
        COLUMNS="120",
    )
    return env


class Kidx:
    """Runs the real console script with an environment; checks the invariants of every run."""

    def __init__(self, cwd: Path, env: dict[str, str], *, process: bool = False) -> None:
        self.cwd = cwd  # not the checkout: Settings also reads ./.env
        self.env = env
        self.process = process  # the console script in a subprocess, else in this process

    def __call__(
        self, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        merged = {**self.env, **(env or {})}
        if not self.process:
            result = run_kidx(args, merged, self.cwd)
        else:
            result = subprocess.run(
                [str(KIDX), *args],
                env=merged,
                cwd=self.cwd,
                capture_output=True,
                text=True,
                timeout=60,
            )
        shown = f"kidx {' '.join(args)}\nstdout: {result.stdout}\nstderr: {result.stderr}"
        assert API_KEY not in result.stdout, f"the API key is on stdout\n{shown}"
        assert API_KEY not in result.stderr, f"the API key is on stderr\n{shown}"
        assert "Traceback" not in result.stderr, shown
        return result

    def ok(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        result = self(*args, env=env)
        assert result.returncode == 0, f"kidx {' '.join(args)} failed:\n{result.stderr}"
        return result

    def json(self, *args: str, env: dict[str, str] | None = None) -> Any:
        return json.loads(self.ok(*args, "--json", env=env).stdout)

    def add(self, title: str, *source: str, inline: bool = False) -> int:
        """`kidx add note`; stdout is the new id and nothing else."""
        result = self.ok(
            "add", "note", "--title", title, *source, *(["--inline"] if inline else [])
        )
        assert result.stdout.strip().isdigit(), result.stdout
        assert result.stdout == f"{int(result.stdout)}\n", repr(result.stdout)
        return int(result.stdout)


def is_log_line(line: str) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return False
    return isinstance(record, dict) and "event" in record


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The run failed with exactly one error line on stderr (besides JSON log records)."""
    assert result.returncode != 0, result.stdout
    lines = [ln for ln in result.stderr.splitlines() if ln.strip() and not is_log_line(ln)]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), result.stderr
    return lines[0]


def edited_chapter(marker: str) -> str:
    """The chapter with one new paragraph in its middle, containing `marker`."""
    text = CHAPTER.read_text(encoding="utf-8")
    middle = text.index("\n\n", len(text) // 2)
    return text[:middle] + f"\n\n{marker}: one new paragraph in the middle." + text[middle:]


@pytest.fixture
def kidx(tmp_path: Path, standin) -> Kidx:
    work = tmp_path / "work"
    work.mkdir()
    return Kidx(work, base_env(tmp_path / "kidx.db", standin.base_url))


@pytest.fixture
def kidx_process(tmp_path: Path, standin) -> Kidx:
    """The console script itself, for what only a process shows: its start, streams, exit."""
    work = tmp_path / "work"
    work.mkdir()
    return Kidx(work, base_env(tmp_path / "kidx.db", standin.base_url), process=True)


# -- init ------------------------------------------------------------------------------------


def test_init_creates_the_database_and_reports_sqlite_vec_and_dimensions(kidx_process, tmp_path):
    db = tmp_path / "kidx.db"
    assert not db.exists()
    human = kidx_process.ok("init").stdout
    assert db.is_file()
    assert "sqlite-vec v" in human and f"{DIMS} dimensions" in human
    info = kidx_process.json("init")  # a second init is fine: it brings the database up to date
    assert info["sqlite_vec"].startswith("v") and info["vec_error"] is None
    assert info["dimensions"] == DIMS
    assert info["model"] == "standin-embed" and info["provider"] == "openai"
    assert Path(info["db"]) == db
    off = kidx_process.json("init", env={"KIDX_VEC": "off"})
    assert off["sqlite_vec"] is None and "KIDX_VEC" in off["vec_error"]
    assert off["dimensions"] == DIMS


def test_init_on_a_newer_kidx_s_database_refuses_and_writes_nothing(kidx, tmp_path):
    """init reports the file's own schema version; a file of a newer schema is refused by
    every command (this kidx would write tables it does not know), in one line."""
    db = tmp_path / "kidx.db"
    info = kidx.json("init")
    conn = apsw.Connection(str(db))
    [(stored,)] = conn.execute("SELECT value FROM index_meta WHERE key = 'schema_version'")
    assert info["schema_version"] == int(stored)
    conn.execute("UPDATE index_meta SET value = ? WHERE key = 'schema_version'", (stored + "0",))
    conn.close()
    before = db.read_bytes()
    for args in (("init",), ("status",), ("add", "note", "--title", "T", "--text", "words")):
        line = one_line_error(kidx(*args))
        assert f"schema {stored}0, this one knows {stored}" in line and "upgrade kidx" in line
    assert db.read_bytes() == before


@pytest.mark.parametrize(
    "args",
    [
        ("status",),
        ("search", "traits"),
        ("chunks", "1"),
        ("jobs",),
        ("index", "--all", "--inline"),
        ("update", "1", "--text", "new words"),
        ("delete", "1"),
    ],
)
def test_a_command_on_a_missing_database_says_so_and_creates_nothing(kidx, tmp_path, args):
    """A mistyped --db is one line, and no file and no folder is made there (a read-only
    command used to create an empty database and report "items 0")."""
    missing = tmp_path / "nope" / "b.db"
    line = one_line_error(kidx(*args, "--db", str(missing)))
    assert line == f"error: no database at {missing}; run `kidx init`"
    assert not (tmp_path / "nope").exists()
    assert not (kidx.cwd / "data").exists()  # nor the default data folder, for a log file


def test_init_and_add_create_the_database_and_its_folder(kidx, tmp_path):
    """The README's first steps on a fresh machine: init (or a first add) makes the file."""
    first = tmp_path / "a" / "kidx.db"
    kidx.ok("init", "--db", str(first))
    assert kidx.json("status", "--db", str(first)) == []
    second = tmp_path / "b" / "kidx.db"
    item = kidx.json("add", "note", "--title", "T", "--text", "words", "--db", str(second))["id"]
    assert [s["item_id"] for s in kidx.json("status", "--db", str(second))] == [item]


# -- add, chunks -----------------------------------------------------------------------------


def test_add_file_inline_indexes_at_once_and_chunks_show_every_chunk(kidx, tmp_path, standin):
    marker = "POISONED-PARAGRAPH"
    text = edited_chapter(marker)
    source = tmp_path / "traits.md"
    source.write_text(text, encoding="utf-8")
    standin.poison = marker  # the provider refuses the one chunk with the marker
    item = kidx.add("Traits", "--file", str(source), inline=True)
    assert standin.texts, "--inline did not index"

    rows = kidx.json("chunks", str(item))
    assert isinstance(rows, list) and len(rows) > 10
    for i, row in enumerate(rows):
        assert set(row) == CHUNK_KEYS
        assert row["chunk_index"] == i
        assert row["chunk_method"] == "structure"
        assert row["has_embedding"] is (marker not in text[row["start_offset"] : row["end_offset"]])
        assert row["length"] == row["end_offset"] - row["start_offset"] > 0
    assert rows[0]["start_offset"] == 0 and text[rows[-1]["end_offset"] :].strip() == ""
    with_vectors = [r for r in rows if r["has_embedding"]]
    assert 1 <= len(rows) - len(with_vectors) <= 2
    assert len(standin.texts) == len(with_vectors)
    assert all(marker not in t for t in standin.texts)

    state = kidx.json("status", str(item))
    assert state["status"] == "partial" and state["chunk_count"] == len(rows)

    table = kidx.ok("chunks", str(item)).stdout
    assert "┏" in table and "method" in table and "vector" in table
    body = [ln for ln in table.splitlines() if ln.startswith("│")]
    assert len(body) == len(rows)
    assert sum(" no " in ln for ln in body) == len(rows) - len(with_vectors)


# -- index, update ---------------------------------------------------------------------------


def test_index_ids_and_all_embed_only_what_changed(kidx, tmp_path, standin):
    a = kidx.add("Alpha", "--text", "Ownership moves values between bindings.")
    b = kidx.add("Beta", "--text", "Borrowing lends a reference without moving.")
    c = kidx.add("Traits", "--file", str(CHAPTER))
    assert standin.requests == 0, "add without --inline must not index"
    assert kidx.json("chunks", str(a)) == []

    results = kidx.json("index", str(a), str(b), "--inline")
    assert [(r["item_id"], r["status"], r["embedded"]) for r in results] == [
        (a, "indexed", 1),
        (b, "indexed", 1),
    ]
    assert len(standin.texts) == 2
    assert "Ownership moves values" in standin.texts[0]
    assert "Borrowing lends" in standin.texts[1]

    standin.texts.clear()
    results = {r["item_id"]: r for r in kidx.json("index", "--all", "--inline")}
    assert set(results) == {a, b, c}
    assert all(r["status"] == "indexed" for r in results.values())
    assert results[a]["reused"] == results[b]["reused"] == 1
    assert results[a]["embedded"] == results[b]["embedded"] == 0
    chapter_chunks = results[c]["chunks"]
    assert results[c]["embedded"] == chapter_chunks > 10
    assert len(standin.texts) == chapter_chunks
    assert not any("Ownership moves values" in t or "Borrowing lends" in t for t in standin.texts)

    marker = "KIDXEDIT"
    edited = tmp_path / "edited.md"
    edited.write_text(edited_chapter(marker), encoding="utf-8")
    assert kidx.json("update", str(c), "--file", str(edited)) == {"id": c, "updated": True}
    standin.texts.clear()
    [result] = kidx.json("index", str(c), "--inline")
    assert result["status"] == "indexed"
    assert 1 <= result["embedded"] <= 3
    assert result["reused"] == result["chunks"] - result["embedded"]
    assert len(standin.texts) == result["embedded"]
    assert any(marker in t for t in standin.texts)

    kidx.ok("update", str(b), "--text", "Borrowing, rewritten: references are lent.")
    standin.texts.clear()
    human = kidx.ok("index", "--all", "--inline").stdout
    assert len(standin.texts) == 1 and "Borrowing, rewritten" in standin.texts[0]
    assert "┏" in human and "indexed" in human


# -- search ----------------------------------------------------------------------------------


def test_search_vec_and_fallback_agree_one_hit_per_item(kidx, standin):
    notes = {
        "Moves": "A move transfers ownership of a heap value to another binding.",
        "Lifetimes": "Lifetimes name how long a reference stays valid.",
        "Closures": "A closure captures values from the scope it is defined in.",
    }
    inputs = {}
    ids = {}
    for title, text in notes.items():
        before = len(standin.texts)
        ids[title] = kidx.add(title, "--text", text, inline=True)
        [inputs[title]] = standin.texts[before:]  # exactly what the note's vector embeds
    chapter = kidx.add("Traits", "--file", str(CHAPTER), inline=True)

    query = inputs["Lifetimes"]
    hits = kidx.json("search", query, "-k", "10", "--mode", "vector")
    assert all(set(h) >= HIT_KEYS for h in hits)
    assert [h["via"] for h in hits] == ["vec"] * len(hits)
    item_ids = [h["item_id"] for h in hits]
    assert sorted(item_ids) == sorted([*ids.values(), chapter])  # one hit per item
    top = hits[0]
    assert top["item_id"] == ids["Lifetimes"] and top["title"] == "Lifetimes"
    assert top["kind"] == "note" and top["chunk_index"] == 0
    assert top["score"] == pytest.approx(1.0, abs=1e-4)
    assert top["snippet"] == notes["Lifetimes"]
    scores = [h["score"] for h in hits]
    assert scores == sorted(scores, reverse=True)

    two = kidx.json("search", query, "-k", "2", "--mode", "vector")
    assert [h["item_id"] for h in two] == item_ids[:2]

    off = kidx("search", query, "-k", "10", "--mode", "vector", "--json", env={"KIDX_VEC": "off"})
    assert off.returncode == 0, off.stderr
    fallback = json.loads(off.stdout)
    assert "fallback" in off.stderr
    assert [h["item_id"] for h in fallback] == item_ids
    assert [h["via"] for h in fallback] == ["fallback"] * len(hits)
    assert [h["score"] for h in fallback] == pytest.approx(scores, abs=1e-4)
    assert [h["chunk_index"] for h in fallback] == [h["chunk_index"] for h in hits]

    table = kidx.ok("search", query, "-k", "1").stdout
    assert "┏" in table and "Lifetimes" in table and "Closures" not in table


# -- status ----------------------------------------------------------------------------------


def test_status_of_every_item_and_of_one(kidx):
    kidx.ok("init")
    assert kidx.json("status") == []
    pending = kidx.add("Later", "--text", "Indexed some other day.")
    done = kidx.add("Now", "--text", "Indexed right away.", inline=True)

    states = kidx.json("status")
    assert isinstance(states, list) and [s["item_id"] for s in states] == [pending, done]
    assert all(set(s) == STATE_KEYS for s in states)
    assert states[0]["status"] == "pending" and states[0]["model"] is None
    assert states[1]["status"] == "indexed"
    assert states[1]["chunk_method"] == "structure" and states[1]["chunk_count"] == 1
    assert states[1]["model"] == "standin-embed" and states[1]["dimensions"] == DIMS
    assert states[1]["last_error"] is None and isinstance(states[1]["duration_ms"], int)

    one = kidx.json("status", str(done))
    assert isinstance(one, dict) and one == states[1]

    table = kidx.ok("status").stdout
    assert "┏" in table and "item_id" in table and "indexed" in table and "pending" in table


# -- --db, --json, logs ----------------------------------------------------------------------


def test_every_command_takes_db_over_kidx_db(kidx, tmp_path):
    decoy = tmp_path / "kidx.db"  # what KIDX_DB names
    target = tmp_path / "elsewhere" / "chosen.db"
    db = ["--db", str(target)]
    assert kidx.json("init", *db)["db"] == str(target)
    added = kidx.json("add", "note", "--title", "N", "--text", "First words.", *db)
    item = added["id"]
    assert isinstance(item, int) and added["index"] is None
    assert kidx.json("update", str(item), "--text", "Second words.", *db)["updated"] is True
    [result] = kidx.json("index", str(item), "--inline", *db)
    assert result["status"] == "indexed"
    assert len(kidx.json("chunks", str(item), *db)) == 1
    hits = kidx.json("search", "N\n\nSecond words.", "-k", "1", *db)
    assert [h["item_id"] for h in hits] == [item]
    assert [s["item_id"] for s in kidx.json("status", *db)] == [item]
    assert kidx.json("status", str(item), *db)["status"] == "indexed"
    assert not decoy.exists(), "a command ignored --db"
    assert target.is_file()
    assert "no database at" in one_line_error(kidx("status"))  # KIDX_DB is another one
    assert not decoy.exists()


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_json_stdout_stays_clean_while_logs_go_to_stderr(kidx_process, fmt):
    env = {"KIDX_LOG_FORMAT": fmt, "KIDX_LOG_LEVEL": "debug"}
    result = kidx_process.ok(
        "add", "note", "--title", "T", "--file", str(CHAPTER), "--inline", "--json", env=env
    )
    data = json.loads(result.stdout)
    assert isinstance(data["id"], int) and data["index"][0]["status"] == "indexed"
    assert "[KI Embed] indexed" in result.stderr and "[Chunk] chunked" in result.stderr
    assert "[KI Embed]" not in result.stdout
    if fmt == "json":
        assert all(is_log_line(ln) for ln in result.stderr.splitlines() if ln.strip())


# -- a provider that is down -----------------------------------------------------------------


def test_provider_down_during_index_fails_with_the_reason(kidx, standin):
    item = kidx.add("Traits", "--file", str(CHAPTER))
    standin.fail_status = 500

    human = kidx("index", str(item), "--inline")
    assert human.returncode != 0
    assert "failed" in human.stdout
    result = kidx("index", str(item), "--inline", "--json")
    assert result.returncode != 0
    [row] = json.loads(result.stdout)
    assert row["item_id"] == item and row["status"] == "failed" and "HTTP 500" in row["error"]
    state = kidx.json("status", str(item))
    assert state["status"] == "failed" and "HTTP 500" in state["last_error"]
    assert kidx.json("chunks", str(item)) == []  # nothing half-written

    assert "HTTP 500" in one_line_error(kidx("search", "traits"))

    standin.fail_status = None
    [row] = kidx.json("index", str(item), "--inline")
    assert row["status"] == "indexed"
    assert kidx.json("status", str(item))["last_error"] is None


def test_provider_down_fails_a_short_note_too(kidx, standin):
    item = kidx.add("Short", "--text", "One chunk only.")
    standin.fail_status = 500
    result = kidx("index", str(item), "--inline", "--json")
    state = kidx.json("status", str(item))
    assert result.returncode != 0, "exit status 0 although no chunk got a vector"
    assert state["status"] == "failed" and "HTTP 500" in state["last_error"]


def test_api_key_echoed_by_the_provider_never_reaches_the_output(kidx, standin):
    item = kidx.add("Traits", "--file", str(CHAPTER))
    standin.fail_status = 401
    standin.error_code = f"invalid_api_key {API_KEY}"  # as some servers quote the key back
    assert kidx("index", str(item), "--inline", "--json").returncode != 0
    assert kidx.json("status", str(item))["status"] == "failed"
    assert kidx("search", "traits").returncode != 0


# -- bad input -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def seeded(tmp_path_factory) -> tuple[Kidx, Path]:
    """A database with one pending note (id 1), and files to feed to --file."""
    root = tmp_path_factory.mktemp("bad-input")
    (root / "latin1.txt").write_bytes("Caf\u00e9 au lait\n".encode("latin-1"))
    (root / "ok.md").write_text("fine\n", encoding="utf-8")
    locked = root / "locked.md"
    locked.write_text("secret\n", encoding="utf-8")
    locked.chmod(0)
    with (root / "big.md").open("wb") as f:  # sparse: over the default KIDX_FILES__MAX_BYTES
        f.truncate(50_000_001)
    os.mkfifo(root / "fifo.md")  # no writer: an open() for reading would wait for good
    kidx = Kidx(root, base_env(root / "kidx.db", NOWHERE))
    assert kidx.add("Seed", "--text", "The one note.") == 1
    return kidx, root


NOT_ROOT = pytest.mark.skipif(
    hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads any file"
)
BAD_INPUT = [
    pytest.param(["chunks", "999"], "no item with id 999", id="chunks-unknown"),
    pytest.param(["chunks", "999", "--json"], "no item with id 999", id="chunks-unknown-json"),
    pytest.param(["status", "999"], "no item with id 999", id="status-unknown"),
    pytest.param(["status", "999", "--json"], "no item with id 999", id="status-unknown-json"),
    pytest.param(["update", "999", "--text", "x"], "no item with id 999", id="update-unknown"),
    pytest.param(["index", "1", "999", "--inline"], "no item with id 999", id="index-unknown"),
    pytest.param(
        ["add", "note", "--title", "T", "--file", "{d}/missing.md"],
        "missing.md",
        id="add-missing-file",
    ),
    pytest.param(
        ["add", "note", "--title", "T", "--file", "{d}"], "not a readable file", id="add-directory"
    ),
    pytest.param(
        ["add", "note", "--title", "T", "--file", "{d}/locked.md"],
        "locked.md",
        id="add-unreadable",
        marks=NOT_ROOT,
    ),
    pytest.param(
        ["add", "note", "--title", "T", "--file", "{d}/latin1.txt"], "not UTF-8", id="add-not-utf8"
    ),
    pytest.param(["update", "1", "--file", "{d}/latin1.txt"], "not UTF-8", id="update-not-utf8"),
    # a 1.2 GB file took 2.5 GB of memory, then failed on SQLite's "string or blob too big"
    pytest.param(
        ["add", "note", "--title", "T", "--file", "{d}/big.md"],
        "larger than KIDX_FILES__MAX_BYTES (50000000 bytes)",
        id="add-too-large",
    ),
    pytest.param(
        ["update", "1", "--file", "{d}/big.md"],
        "larger than KIDX_FILES__MAX_BYTES",
        id="update-big",
    ),
    pytest.param(
        ["add", "note", "--title", "T", "--file", "{d}/fifo.md"],
        "not a readable file",
        id="add-fifo",
    ),
    pytest.param(
        ["update", "1", "--file", "{d}/missing.md"], "missing.md", id="update-missing-file"
    ),
    pytest.param(["add", "note", "--title", "T", "--text", "   "], "empty", id="add-empty"),
    pytest.param(
        ["add", "note", "--title", "T", "--text", " \n\t ", "--json"], "empty", id="add-empty-json"
    ),
    pytest.param(["update", "1", "--text", "  \n "], "empty", id="update-empty"),
    pytest.param(
        ["add", "note", "--title", "T", "--text", "x", "--file", "{d}/ok.md"],
        "exactly one",
        id="add-text-and-file",
    ),
    pytest.param(["add", "note", "--title", "T"], "exactly one", id="add-neither"),
    pytest.param(["update", "1"], "exactly one", id="update-neither"),
    pytest.param(["index", "--inline"], "--all", id="index-neither"),
    pytest.param(["index", "1", "--all", "--inline"], "--all", id="index-ids-and-all"),
    pytest.param(["search", ""], "empty", id="search-empty"),
    pytest.param(["search", "   ", "--json"], "empty", id="search-blank-json"),
]


@pytest.mark.parametrize(("args", "expected"), BAD_INPUT)
def test_bad_input_is_one_line_on_stderr(seeded, args, expected):
    kidx, root = seeded
    result = kidx(*(a.replace("{d}", str(root)) for a in args))
    line = one_line_error(result)
    assert expected in line
    assert result.stdout == ""


def test_rejected_input_writes_nothing(kidx, tmp_path):
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(b"na\xefve\n")
    kidx.ok("init")
    assert kidx.json("status") == []
    one_line_error(kidx("add", "note", "--title", "T", "--text", "   "))
    one_line_error(kidx("add", "note", "--title", "T", "--file", str(latin1)))
    assert kidx.json("status") == []


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("KIDX_EMBEDDING__BATCH_SIZE", "0"),
        ("KIDX_EMBEDDING__DIMENSIONS", "sixty-four"),
        ("KIDX_LOG_LEVEL", "loud"),
    ],
)
def test_an_invalid_setting_names_the_variable(kidx, tmp_path, name, value):
    result = kidx("init", env={name: value})
    assert name in one_line_error(result)
    assert result.stdout == ""
    assert not (tmp_path / "kidx.db").exists(), "settings are checked before anything is written"


@pytest.mark.parametrize("name", ["notes[draft].md", "notes[/draft].md"])
def test_error_naming_a_path_with_brackets_shows_it_verbatim(kidx, tmp_path, name):
    missing = tmp_path / name
    line = one_line_error(kidx("add", "note", "--title", "T", "--file", str(missing)))
    assert str(missing) in line


def test_search_table_shows_a_title_with_brackets_verbatim(kidx, standin):
    title = "Plan [/wip] [draft]"
    item = kidx.add(title, "--text", "A note whose title has brackets.", inline=True)
    [query] = standin.texts
    assert [h["item_id"] for h in kidx.json("search", query, "-k", "1")] == [item]
    table = kidx.ok("search", query, "-k", "1").stdout
    assert "[/wip] [draft]" in table


def test_db_that_is_not_a_database_is_one_line(kidx_process, tmp_path):
    not_a_db = tmp_path / "notes.db"
    shutil.copyfile(CORPUS / "SUMMARY.md", not_a_db)
    line = one_line_error(kidx_process("status", "--db", str(not_a_db), "--json"))
    assert "not a database" in line


# -- what SQLite and the broker say, in the user's terms ---------------------------------------


def _unprivileged() -> list[str]:
    """root writes to a read-only file anyway: the command runs without the capabilities
    that let it (setpriv), or the test is skipped."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("as root without setpriv, a read-only file is writable")
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search,-fowner", "--inh-caps=-all"]


def _unprivileged_kidx(kidx: Kidx, *args: str) -> subprocess.CompletedProcess[str]:
    """`kidx ARGS`, run without root's power to write what is read-only (`_unprivileged`)."""
    return subprocess.run(
        [*_unprivileged(), str(KIDX), *args],
        env=kidx.env,
        cwd=kidx.cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_read_only_database_is_one_line_naming_it(kidx_process, tmp_path):
    db = tmp_path / "kidx.db"
    kidx_process.ok("init")
    db.chmod(0o444)
    try:
        result = _unprivileged_kidx(kidx_process, "add", "note", "--title", "T", "--text", "w")
    finally:
        db.chmod(0o644)
    assert "Traceback" not in result.stderr, result.stderr
    line = one_line_error(result)
    assert result.returncode == 1
    assert str(db) in line and "read-only" in line


def test_a_database_in_a_folder_kidx_cannot_write_names_the_folder(kidx_process, tmp_path):
    """`kidx status` only reads, yet SQLite must make the -wal and -shm files beside the
    database: it said "attempt to write a readonly database", naming neither."""
    kidx_process.ok("init")
    for leftover in tmp_path.glob("kidx.db-*"):  # (as a stopped stack leaves the folder)
        leftover.unlink()
    tmp_path.chmod(0o555)
    try:
        result = _unprivileged_kidx(kidx_process, "status", "--json")
    finally:
        tmp_path.chmod(0o755)
    assert "Traceback" not in result.stderr, result.stderr
    line = one_line_error(result)
    assert result.returncode == 1
    assert f"its folder {tmp_path} is not writable" in line, line


def test_a_locked_database_says_another_process_holds_the_write_lock(kidx_process, tmp_path):
    kidx_process.ok("init")
    holder = apsw.Connection(str(tmp_path / "kidx.db"))  # this process: the other writer
    try:
        holder.execute("BEGIN IMMEDIATE")
        result = kidx_process(
            "add", "note", "--title", "T", "--text", "words", env={"KIDX_BUSY_TIMEOUT_MS": "1000"}
        )
    finally:
        holder.close()
    line = one_line_error(result)
    assert result.returncode == 1
    assert str(tmp_path / "kidx.db") in line
    assert "locked" in line and "another process holds the write lock" in line


def test_a_corrupt_database_is_one_line_naming_it(kidx_process, tmp_path):
    """It opens (its schema is whole), but the items' table is not: SQLite says so on the
    first read of it."""
    db = tmp_path / "kidx.db"
    kidx_process.add("T", "--text", "words")
    conn = apsw.Connection(str(db))
    [(size,)] = conn.execute("PRAGMA page_size")
    [(root,)] = conn.execute("SELECT rootpage FROM sqlite_master WHERE name = 'knowledge_items'")
    conn.close()
    with db.open("r+b") as f:
        f.seek((root - 1) * size)
        f.write(b"\xa5" * size)
    result = kidx_process("status", "--json")
    line = one_line_error(result)
    assert result.returncode == 1
    assert str(db) in line and "corrupt" in line


def test_a_broker_that_is_down_is_one_line_naming_it_without_its_password(kidx_process):
    url = f"redis://:broker-pw-42@127.0.0.1:{free_port()}/0"  # nothing listens there
    result = kidx_process("cancel", "abc", env={"KIDX_BROKER_URL": url})
    line = one_line_error(result)
    assert result.returncode == 1
    assert "broker-pw-42" not in result.stderr
    assert "redis://***@127.0.0.1:" in line and "unreachable" in line


def test_a_bug_is_one_line_and_verbose_shows_its_traceback(kidx, monkeypatch):
    def broken(*args: Any, **kwargs: Any) -> int:
        raise TypeError("a bug in add_item")

    monkeypatch.setattr("worker.store.items.add_item", broken)
    line = one_line_error(kidx("add", "note", "--title", "T", "--text", "words"))
    assert "TypeError: a bug in add_item" in line and "--verbose" in line
    verbose = run_kidx(("add", "note", "--title", "T", "--text", "w", "-v"), kidx.env, kidx.cwd)
    assert "Traceback" in verbose.stderr and verbose.returncode != 0


# -- a quiet first run: progress on a terminal, logs in a file, tables in 80 columns ---------


def test_a_run_logs_to_its_file_and_says_on_stderr_only_what_is_asked(kidx, tmp_path):
    """Below warning, a command's log records go to $KIDX_DATA_DIR/log/kidx.log, not the
    terminal; `--verbose` (or KIDX_LOG_LEVEL) brings them back to stderr."""
    data = tmp_path / "data"
    data.mkdir()  # (one that is not there is not made for the log)
    env = {"KIDX_DATA_DIR": str(data)}
    kidx.add("Traits", "--file", str(CHAPTER))
    quiet = kidx.ok("index", "--all", "--inline", env=env)
    assert "[KI Embed]" not in quiet.stderr and "[Chunk]" not in quiet.stderr, quiet.stderr
    records = [json.loads(x) for x in (data / "log" / "kidx.log").read_text().splitlines()]
    assert any(r["event"] == "[KI Embed] indexed" and r["level"] == "info" for r in records)
    assert API_KEY not in (data / "log" / "kidx.log").read_text()
    for asked in ({"KIDX_DATA_DIR": str(data)}, {**env, "KIDX_LOG_LEVEL": "info"}):
        args = (
            "index",
            "--all",
            "--inline",
            *(["--verbose"] if "KIDX_LOG_LEVEL" not in asked else []),
        )
        loud = kidx.ok(*args, env=asked)
        assert "[KI Embed] indexed" in loud.stderr, loud.stderr


def test_every_table_fits_80_columns_and_never_cuts_a_cell(kidx, standin):
    """Piped at 80 columns (a terminal's width is its own): the index results, the states, the
    jobs, a search and the chunks; the least useful columns go, free text wraps, and a
    status, a method or a number is never cut to `index…`."""
    for n in range(3):
        kidx.add(f"Chapter copy {n} with a title long enough to wrap", "--file", str(CHAPTER))
    env = {"COLUMNS": "80"}
    outputs = {
        "index": kidx.ok("index", "--all", "--inline", env=env).stdout,
        "status": kidx.ok("status", env=env).stdout,
        "search": kidx.ok("search", "traits and generic types", "-k", "3", env=env).stdout,
        "chunks": kidx.ok("chunks", "1", env=env).stdout,
    }
    for name, text in outputs.items():
        lines = text.splitlines()
        assert lines, name
        assert max(len(x) for x in lines) <= 80, f"{name}:\n{text}"
        assert "…" not in text, f"{name}:\n{text}"
    assert outputs["index"].count(" indexed ") == 3 and "structure" in outputs["status"]


def test_on_a_terminal_index_shows_a_progress_bar_and_a_summary(tmp_path, standin):
    """`kidx index --all --inline` as a new user runs it first, in a terminal (a pty here):
    a progress bar (items, chunks, rate, time left) while it runs, then one summary line, and
    no log line."""
    import pty
    import select

    env = base_env(tmp_path / "kidx.db", standin.base_url) | {
        "KIDX_DATA_DIR": str(tmp_path / "data"),
        "COLUMNS": "80",
        "TERM": "xterm",
    }
    for n in range(4):
        subprocess.run(
            [str(KIDX), "add", "note", "--title", f"T{n}", "--file", str(CHAPTER)],
            env=env,
            cwd=tmp_path,
            check=True,
            capture_output=True,
        )
    standin.delay = 0.05  # a few frames of the bar
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [str(KIDX), "index", "--all", "--inline"],
        env=env,
        cwd=tmp_path,
        stdin=follower,
        stdout=follower,
        stderr=follower,
    )
    os.close(follower)
    screen = b""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([leader], [], [], 1)
        if ready:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the process ended and closed its side
                break
            if not chunk:
                break
            screen += chunk
        elif proc.poll() is not None:
            break
    os.close(leader)
    assert proc.wait(timeout=30) == 0
    text = screen.decode("utf-8", "replace")
    assert "indexing" in text and "items," in text and "chunks" in text, text
    assert re.search(
        r"4 items in \d+\.\d s: 4 indexed; \d+ chunks \(\d+ embedded, 0 reused\)", text
    )
    assert "[KI Embed]" not in text and '{"' not in text, text


def test_an_item_asked_to_run_again_during_an_inline_run_runs_again_only_if_it_changed(
    db, embedder, tmp_path
):
    """`kidx index --inline` runs once more the items another run asked for while it held
    them: it compared the indexed hash `get_state` never returns, so every item asked ran
    again, a URL fetched again, though nothing had changed."""
    from ops.cli.engine import _changed
    from worker.bulk import index_item
    from worker.store.items import add_item

    still = add_item(db, kind="note", title="Still", content="Nothing changes here.")
    edited = add_item(db, kind="note", title="Edited", content="The first text.")
    renamed = add_item(db, kind="note", title="Renamed", content="A title is embedded too.")
    for item in (still, edited, renamed):
        assert index_item(db, item, embedder=embedder).status == "indexed"
    path = tmp_path / "f.txt"
    path.write_text("a file's text is read by its run")
    file = add_item(db, kind="file", title="f.txt", content="", source=str(path))
    db.execute("UPDATE knowledge_items SET content = 'The second text.' WHERE id = ?", (edited,))
    db.execute("UPDATE knowledge_items SET title = 'Named anew' WHERE id = ?", (renamed,))
    assert [_changed(db, i) for i in (still, edited, renamed, file, 10**6)] == [
        False,
        True,
        True,
        True,
        False,
    ]


def test_kidx_chunk_target_sets_the_size_structural_chunking_aims_at(kidx):
    """`KIDX_CHUNK__TARGET` (650 by default; 200 to 1500): the same chapter in fewer, larger
    chunks at 1500, each within the seed's bounds; a value outside them is refused at start."""
    a = kidx.add("Default", "--file", str(CHAPTER))
    b = kidx.add("Large", "--file", str(CHAPTER))
    [default] = kidx.json("index", str(a), "--inline")
    [large] = kidx.json("index", str(b), "--inline", env={"KIDX_CHUNK__TARGET": "1500"})
    assert default["chunks"] > large["chunks"] * 1.3 > 0  # (its sections stay whole)
    sizes = {i: [c["length"] for c in kidx.json("chunks", str(i))] for i in (a, b)}
    assert max(sizes[b]) <= 1500 and max(sizes[b]) > max(sizes[a])
    refused = kidx("status", env={"KIDX_CHUNK__TARGET": "100"})
    assert refused.returncode != 0 and "KIDX_CHUNK__TARGET" in refused.stderr


def test_a_note_from_a_file_is_decoded_as_a_text_file_is(kidx, tmp_path):
    """`add note --file` kept a UTF-8 byte-order mark at the note's start (`add file` drops
    it), and refused a UTF-16 file with its mark as "not UTF-8"."""
    import apsw

    kidx.ok("init")
    marked = tmp_path / "marked.md"
    marked.write_bytes(b"\xef\xbb\xbf# Marked\n\nWords.\r\n")
    wide = tmp_path / "wide.md"
    wide.write_bytes("# Wide\n\nMore words.\n".encode("utf-16"))
    binary = tmp_path / "binary.md"
    binary.write_bytes(b"# Binary\n\x00\x01\x02")
    ids = [kidx.add(p.stem, "--file", str(p)) for p in (marked, wide)]
    conn = apsw.Connection(str(tmp_path / "kidx.db"))
    texts = [
        conn.execute("SELECT content FROM knowledge_items WHERE id = ?", (i,)).fetchone()[0]
        for i in ids
    ]
    conn.close()
    assert texts == ["# Marked\n\nWords.\n", "# Wide\n\nMore words.\n"]
    refused = kidx("add", "note", "--title", "B", "--file", str(binary))
    assert refused.returncode != 0 and "binary" in one_line_error(refused)
