"""`kidx` at its edges: what the database holds reaching a terminal, closed and non-UTF-8
streams, arguments and file names that are not UTF-8, odd numbers and widths, a closed pipe.

Runs go through `test_cli.Kidx` (in this process, or the console script where the process itself
is what is tested), whose checks hold for each: no API key and no traceback on any stream. The
broker is a port where nothing listens: nothing here reaches one.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import apsw
import pytest
from test_cli import KIDX, NOWHERE, Kidx, base_env, one_line_error

NO_BROKER = "redis://127.0.0.1:1/9"
ESC = "\x1b"


def _kidx(tmp_path: Path, base_url: str, *, process: bool = False, **env: str) -> Kidx:
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    return Kidx(
        work,
        base_env(tmp_path / "kidx.db", base_url)
        | {"KIDX_BROKER_URL": NO_BROKER, "KIDX_FILES__ROOTS": str(tmp_path)}
        | env,
        process=process,
    )


@pytest.fixture
def kidx(tmp_path: Path, standin) -> Kidx:
    return _kidx(tmp_path, standin.base_url)


@pytest.fixture
def offline(tmp_path: Path) -> Kidx:
    """No embedding provider: inline runs chunk nothing and send nothing (fast, no model)."""
    return _kidx(tmp_path, NOWHERE, KIDX_EMBEDDING__PROVIDER="none")


def _sql(db: Path, sql: str, *args: object) -> list[tuple]:
    conn = apsw.Connection(str(db))
    try:
        return list(conn.execute(sql, args))
    finally:
        conn.close()


# -- 1. stored control characters --------------------------------------------------------------


def test_escape_sequences_stored_in_the_database_never_reach_the_terminal(kidx, tmp_path):
    """A title, a chunk's text, an item's last error and a batch's abort reason may hold
    anything a host or a document put there; every table cell and every echoed line shows a
    control character as U+FFFD."""
    db = tmp_path / "kidx.db"
    item = kidx.add(f"esc {ESC}[31mRED", "--text", f"hello {ESC}[2J world\tand tab", inline=True)
    _sql(
        db,
        "UPDATE item_index_state SET status = 'failed', last_error = ? WHERE item_id = ?",
        f"boom {ESC}]0;pwned\x07",
        item,
    )
    [(batch,)] = _sql(
        db,
        "INSERT INTO index_batches(kind, state, total, abort_reason) "
        "VALUES ('reindex', 'aborted', 1, ?) RETURNING id",
        f"why {ESC}[2Jcleared",
    )
    runs = {
        "search": kidx("search", "hello", "--mode", "keyword"),
        "search --chunks": kidx("search", "hello", "--mode", "keyword", "--chunks"),
        "status": kidx("status"),
        "jobs": kidx("jobs", "--batch", str(batch)),
        "doctor": kidx("doctor", "--timeout", "0.5", env={"KIDX_FLOWER__PORT": "1"}),
    }
    for name, result in runs.items():
        shown = result.stdout + result.stderr
        assert ESC not in shown and "\x07" not in shown, f"{name}: {shown!r}"
    assert "RED" in runs["search"].stdout and "\ufffd" in runs["search"].stdout
    assert "[2J world" in runs["search --chunks"].stdout
    assert "pwned" in runs["status"].stdout
    assert "why \ufffd[2Jcleared" in runs["jobs"].stdout
    [failed] = [ln for ln in runs["doctor"].stdout.splitlines() if ln.split()[1:2] == ["failed"]]
    assert "boom \ufffd]0;pwned\ufffd" in failed


# -- 2, 3. closed and non-UTF-8 streams --------------------------------------------------------


def test_with_stderr_closed_a_command_runs_and_its_output_is_whole(offline, tmp_path):
    """`kidx ... 2>&-`: Python gives no sys.stderr; the command still runs (its log lines go
    nowhere, its file log still gets them), and the database is intact."""
    args = ("add", "note", "--title", "e", "--text", "closed stderr", "--inline")
    (tmp_path / "data").mkdir()  # (one that is not there is not made for the log)
    env = offline.env | {"KIDX_LOG_LEVEL": "info", "KIDX_DATA_DIR": str(tmp_path / "data")}
    result = subprocess.run(
        ["sh", "-c", 'exec "$0" "$@" 2>&-', str(KIDX), *args],
        env=env,
        cwd=offline.cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (result.returncode, result.stdout) == (0, "1\n"), result
    assert [s["item_id"] for s in offline.json("status")] == [1]
    [(check,)] = _sql(tmp_path / "kidx.db", "PRAGMA integrity_check")
    assert check == "ok"
    assert "[KI Embed] skipped" in (tmp_path / "data" / "log" / "kidx.log").read_text()


def test_a_latin1_stdout_gets_json_and_text_it_can_hold(kidx):
    """PYTHONIOENCODING=latin-1: --json is ASCII (the same JSON), and the people's output
    replaces what latin-1 cannot hold (`…`, curly quotes) rather than fail."""
    text = "\u201cquoted\u201d words \u2026 and more"
    item = kidx.add("caf\u00e9 \u2026", "--text", text, inline=True)

    def latin1(*args: str) -> tuple[str, str]:
        result = subprocess.run(
            [str(KIDX), "search", "quoted", "--mode", "keyword", *args],
            env=kidx.env | {"PYTHONIOENCODING": "latin-1"},
            cwd=kidx.cwd,
            capture_output=True,
            timeout=60,
        )
        stdout, stderr = result.stdout.decode("latin-1"), result.stderr.decode("latin-1")
        assert result.returncode == 0, stderr
        assert "Traceback" not in stderr and "UnicodeEncodeError" not in stderr
        return stdout, stderr

    as_json, _ = latin1("--json")
    assert as_json.isascii()
    [hit] = json.loads(as_json)
    assert (hit["item_id"], hit["title"], hit["content"]) == (item, "caf\u00e9 \u2026", text)
    for extra in ((), ("--chunks",)):  # the table, then each chunk's text
        stdout, _ = latin1(*extra)
        assert "caf\u00e9 ?" in stdout and "?quoted? words ? and more" in stdout, stdout


def test_a_closed_stdout_pipe_ends_quietly_like_git(offline):
    """`kidx status | head -1`, the reader gone before kidx writes: no "Broken pipe" error,
    killed by SIGPIPE's default action (what git, cat or head do; 141 in a shell)."""
    offline.ok("init")
    offline.add("T", "--text", "words")
    read, write = os.pipe()
    os.close(read)  # a reader that has already stopped
    try:
        proc = subprocess.Popen(
            [str(KIDX), "status"],
            env=offline.env,
            cwd=offline.cwd,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
        )
    finally:
        os.close(write)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGPIPE, stderr
    assert stderr == ""


# -- 4. settings ---------------------------------------------------------------------------------


def test_a_settings_group_that_is_not_json_is_a_configuration_error(offline, tmp_path):
    result = offline("init", env={"KIDX_EMBEDDING": '{"provider":1'})
    line = one_line_error(result)
    assert result.returncode == 2, line
    assert "KIDX_EMBEDDING" in line and "JSON" in line and "a bug" not in line
    assert not (tmp_path / "kidx.db").exists()


# -- 5, 6. non-UTF-8 arguments and names, the size limit of code -------------------------------


def test_an_argument_that_is_not_utf8_is_refused_naming_it(offline, tmp_path):
    """`--title $'bad\\xff'` arrives as a lone surrogate (surrogateescape): one line naming the
    option (or the argument), and nothing is written."""
    for args, name in [
        (("add", "note", "--title", "bad\udcff", "--text", "x"), "--title"),
        (("add", "note", "--title", "T", "--text", "caf\udce9"), "--text"),
        (("add", "file", str(tmp_path / "n\udce9.md")), "PATH"),
    ]:
        line = one_line_error(offline(*args))
        assert f"error: {name} is not UTF-8 (byte 0x" in line, line
        assert "a bug" not in line
    assert not (tmp_path / "kidx.db").exists()


def test_add_code_skips_names_that_are_not_utf8_and_says_so(offline, tmp_path):
    tree = tmp_path / "src"
    tree.mkdir()
    for name in (b"a.py", b"b\xe9.py", b"c.py"):
        (tree / os.fsdecode(name)).write_text("x = 1\n")
    out = offline.json("add", "code", str(tree), "--inline")
    assert len(out["ids"]) == 2
    assert out["skipped"] == [
        {"path": f"{tree}/b\\xe9.py", "reason": "has a name that is not UTF-8"}
    ]
    titles = sorted(r[0] for r in _sql(tmp_path / "kidx.db", "SELECT title FROM knowledge_items"))
    assert titles == ["a.py", "c.py"]
    human = offline.ok("add", "code", str(tree), "--inline")
    assert human.stdout.split() == [str(i) for i in out["ids"]]  # the same items again
    assert f"skipped {tree}/b\\xe9.py: has a name that is not UTF-8" in human.stderr


def test_a_refused_send_of_several_items_names_every_item(offline, tmp_path):
    """The broker down while a folder's files are sent: the error named the first item only,
    and the others, saved too, were not said (nor were their ids printed)."""
    tree = tmp_path / "src"
    tree.mkdir()
    for n in range(3):
        (tree / f"m{n}.py").write_text(f"def f{n}():\n    return {n}\n")
    line = one_line_error(offline("add", "code", str(tree)))
    ids = sorted(r[0] for r in _sql(tmp_path / "kidx.db", "SELECT id FROM knowledge_items"))
    assert len(ids) == 3 and "did not take the task" in line
    assert f"item {ids[0]} is saved" in line
    assert f"items {ids[1]} {ids[2]} are saved too, for the sweep" in line
    # Indexed already, the sweep does not send them again: the command must.
    offline.ok("index", "--all", "--inline")
    line = one_line_error(offline("enqueue", *map(str, ids)))
    assert f"item {ids[0]} was not sent" in line
    assert f"items {ids[1]} {ids[2]} were not sent: run it again" in line


def test_add_code_takes_the_workers_size_limit_and_names_what_it_skips(offline, tmp_path):
    """A folder's files up to KIDX_FILES__MAX_BYTES (50 MB by default) are added, as a worker
    would read them; a larger one is named on stderr (or in --json's "skipped")."""
    tree = tmp_path / "src"
    tree.mkdir()
    (tree / "big.py").write_text("# " + "a" * 1_200_000 + "\n")  # over the old 1 MB
    (tree / "small.py").write_text("y = 2\n")
    assert len(offline.json("add", "code", str(tree), "--inline")["ids"]) == 2

    small = {"KIDX_FILES__MAX_BYTES": "1000"}
    out = offline.json("add", "code", str(tree), "--inline", env=small)
    assert len(out["ids"]) == 1
    [skip] = out["skipped"]
    assert skip["path"] == str(tree / "big.py") and "larger than 1000 bytes" in skip["reason"]
    human = offline.ok("add", "code", str(tree), "--inline", env=small)
    assert f"skipped {tree / 'big.py'}: is larger than 1000 bytes" in human.stderr


# -- 7. update -----------------------------------------------------------------------------------


def test_update_takes_a_title_alone(offline, tmp_path):
    note = offline.add("Old", "--text", "words")
    assert offline.json("update", str(note), "--title", "New") == {"id": note, "updated": True}
    assert _sql(tmp_path / "kidx.db", "SELECT title, content FROM knowledge_items") == [
        ("New", "words")
    ]


def test_update_refuses_text_for_an_item_read_from_its_source(offline, tmp_path):
    """A file's text is read again at each index: an edit of it here would be lost there."""
    db = tmp_path / "kidx.db"
    source = tmp_path / "doc.md"
    source.write_text("# Doc\n\nThe file's own words.\n")
    [item] = offline.json("add", "file", str(source), "--inline")["ids"]
    row = "SELECT title, content, content_hash FROM knowledge_items WHERE id = ?"
    before = _sql(db, row, item)
    for args in (("--text", "lost words"), ("--file", str(source))):
        line = one_line_error(offline("update", str(item), *args))
        assert "its text comes from its source" in line and str(source) in line
    assert _sql(db, row, item) == before
    offline.ok("update", str(item), "--title", "Renamed")
    assert _sql(db, "SELECT title FROM knowledge_items WHERE id = ?", item) == [("Renamed",)]
    assert offline.json("status", str(item))["status"] == "pending"  # to be indexed again


# -- 8. widths, numbers, --summary ----------------------------------------------------------------


@pytest.mark.parametrize("columns", ["0", "1"])
def test_a_zero_or_tiny_width_shows_tables_at_80_columns(offline, columns):
    offline.add("T", "--text", "words")
    shown = offline.ok("status", env={"COLUMNS": columns}).stdout
    table = shown[shown.index("┏") :]  # below the counts
    assert "item_id" in table and "status" in table, repr(shown)
    assert any(row.split("│")[1:3] == [" 1       ", " pending "] for row in table.splitlines())
    assert max(len(line) for line in table.splitlines()) <= 80


@pytest.mark.parametrize(
    "args",
    [
        ("doctor", "--timeout", "nan"),
        ("reindex", "--all", "--timeout", "nan"),
        ("reindex", "--all", "--timeout", "-1"),
        ("reindex", "--all", "--timeout", "0"),
        ("reindex", "--all", "--timeout", "inf"),
    ],
)
def test_a_timeout_must_be_a_positive_finite_number(offline, args):
    result = offline(*args)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "positive, finite number of seconds" in result.stderr
    assert result.stdout == ""


def test_status_summary_of_one_item_is_an_error(offline):
    item = offline.add("T", "--text", "words")
    for extra in ((), ("--json",)):
        result = offline("status", str(item), "--summary", *extra)
        assert "--summary" in one_line_error(result) and result.stdout == ""


def test_items_a_host_gave_id_zero_or_below_are_addressed_after_a_double_dash(offline, tmp_path):
    """A host may write id 0 or below (SQLite takes any 64-bit rowid) and kidx indexes them:
    `kidx status -- -7` and the like name them (before `--`, -7 reads as an option)."""
    offline.add("First", "--text", "words")  # the database, made by kidx
    _sql(
        tmp_path / "kidx.db",
        "INSERT INTO knowledge_items(id, kind, title, content) VALUES (-7, 'note', 'neg', 'x')",
    )
    status = offline.ok("status", "--json", "--", "-7").stdout
    assert json.loads(status)["item_id"] == -7
    offline.ok("index", "--inline", "--", "-7")
    offline.ok("delete", "--", "-7")
    assert _sql(tmp_path / "kidx.db", "SELECT count(*) FROM knowledge_items WHERE id = -7") == [
        (0,)
    ]


def test_a_dotenv_or_a_database_that_is_no_regular_file_is_refused_at_once(tmp_path):
    """A `.env` that is a FIFO hung every command in its folder, and one linked to /dev/zero
    filled the memory; `--db` naming a device was opened as a database, and SQLite left a
    `-journal` file beside it (in /dev, as root)."""
    kidx = _kidx(tmp_path, NOWHERE, process=True, KIDX_EMBEDDING__PROVIDER="none")
    work = tmp_path / "work"
    os.mkfifo(work / ".env")
    line = one_line_error(kidx("status", "--summary"))
    assert ".env is not a regular file" in line and "a bug" not in line
    (work / ".env").unlink()
    (work / ".env").symlink_to("/dev/zero")
    line = one_line_error(kidx("status", "--summary"))
    assert ".env is not a regular file" in line
    (work / ".env").unlink()
    fifo = tmp_path / "db.fifo"
    os.mkfifo(fifo)
    for command in (("status", "--summary"), ("init",)):
        line = one_line_error(kidx(*command, "--db", str(fifo)))
        assert "is not a regular file" in line, command
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("db.")) == ["db.fifo"]


def test_init_prints_a_path_and_a_model_name_as_given_not_as_markup(offline, tmp_path):
    """rich read `[red]` in a path as a style (the path shown was another), `[link=...]` as a
    terminal hyperlink, and `[/x]` in a model name failed the command as a bug."""
    path = tmp_path / "[red]z.db"
    result = offline("init", "--db", str(path), env={"KIDX_EMBEDDING__MODEL": "[/x]"})
    assert result.returncode == 0, result.stderr
    assert f"database {path} (schema" in result.stdout
    assert "model [/x]" in result.stdout and "a bug" not in result.stderr


def test_a_huge_text_a_host_stored_is_cut_in_tables_and_whole_in_json(offline, tmp_path):
    """rich lays a cell out in time that grows faster than its length: a host's 10 MB error
    took `kidx status` 73 s. A table shows a cell's first 2,000 characters; `--json` all."""
    item = offline.add("Doc", "--text", "Some text.")
    error = "why " + "x" * 300_000
    _sql(
        tmp_path / "kidx.db",
        "UPDATE item_index_state SET status = 'failed', last_error = ? WHERE item_id = ?",
        error,
        item,
    )
    shown = offline.ok("status", str(item)).stdout
    assert "why" in shown and "…" in shown and len(shown) < 20_000
    rows = offline.json("status", str(item))
    assert error in json.dumps(rows)


def test_add_code_inline_names_every_item_that_failed(kidx, tmp_path):
    """Only the first was said (fail() exits), the others only in a JSON log line."""
    tree = tmp_path / "src"
    tree.mkdir()
    (tree / "a.py").write_text("a = 1\n")
    for name in ("b.py", "c.py"):  # (past the 8 KB the listing reads: the run refuses them)
        (tree / name).write_bytes(b"x = 1\n" * 2000 + b"# caf\xe9, not UTF-8\n")
    out = kidx("add", "code", str(tree), "--inline")
    assert out.returncode == 1
    failed = [line for line in out.stderr.splitlines() if "indexing failed" in line]
    assert len(failed) == 2 and "b.py" in failed[0] + failed[1] and "c.py" in "".join(failed)


def test_add_code_with_json_says_why_each_file_was_left_out_when_none_is_left(offline, tmp_path):
    tree = tmp_path / "src"
    tree.mkdir()
    (tree / "a.py").write_bytes(b"\x00\x01binary")
    line = one_line_error(offline("add", "code", str(tree), "--json"))
    assert f"{tree}/a.py: is binary" in line, line


def test_adding_a_source_finds_its_item_through_an_index(offline, tmp_path):
    """Each look read the whole table: 40,000 source files took 65 s to add."""
    offline.ok("add", "note", "--title", "T", "--text", "x")
    plan = _sql(
        tmp_path / "kidx.db",
        "EXPLAIN QUERY PLAN SELECT id FROM knowledge_items WHERE kind = ? AND source = ?",
        "code",
        "/a.py",
    )
    assert "knowledge_items_source" in " ".join(str(r) for r in plan), plan
