"""`kidx` whose stdout cannot be written: a full device (`> /dev/full`) and a reader that stops
early (`| head -1`). A write error is one line on stderr and status 1, saying what the command
had done (`echo hi > /dev/full`: "write error: No space left on device"); a reader gone is
SIGPIPE's quiet end (status 141 in a shell), with no line at all. The console script in real
processes: what is tested is the process's own streams and exit. No broker, no provider."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
from pathlib import Path

import apsw
import pytest
from test_cli import KIDX, NOWHERE, base_env, is_log_line

NO_BROKER = "redis://127.0.0.1:1/9"  # nothing listens: nothing here reaches a broker
FULL = "write error on stdout: No space left on device"


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    (tmp_path / "work").mkdir()
    return base_env(tmp_path / "kidx.db", NOWHERE) | {
        "KIDX_BROKER_URL": NO_BROKER,
        "KIDX_EMBEDDING__PROVIDER": "none",
    }


def to_full(env: dict[str, str], cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`kidx *args > /dev/full`."""
    with open("/dev/full", "w") as full:
        return subprocess.run(
            [str(KIDX), *args],
            env=env,
            cwd=cwd,
            stdout=full,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
        )


def error_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    return [ln for ln in result.stderr.splitlines() if ln.strip() and not is_log_line(ln)]


def notes(db: Path) -> int:
    conn = apsw.Connection(str(db))
    try:
        return int(conn.execute("SELECT count(*) FROM knowledge_items").fetchone()[0])
    finally:
        conn.close()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_a_full_stdout_is_one_line_saying_what_was_done(env: dict[str, str], tmp_path) -> None:
    """`kidx add note ... > /dev/full` said "error: [Errno 28] No space left on device": the
    words of a full disk under the database, which reads as the note not added (it was, and
    adding it again makes two). `--help` there ended in a traceback."""
    cwd = tmp_path / "work"
    db = tmp_path / "kidx.db"
    added = to_full(env, cwd, "add", "note", "--title", "T", "--text", "some words")
    assert added.returncode == 1
    assert error_lines(added) == [f"error: {FULL} (item 1 was added)"], added.stderr
    assert notes(db) == 1
    as_json = to_full(env, cwd, "add", "note", "--title", "U", "--text", "more", "--json")
    assert as_json.returncode == 1
    assert error_lines(as_json) == [f"error: {FULL} (item 2 was added)"], as_json.stderr
    assert notes(db) == 2
    for args in (("status",), ("status", "--json"), ("--help",), ("add", "note", "--help")):
        result = to_full(env, cwd, *args)
        assert result.returncode == 1, (args, result.stderr)
        assert error_lines(result) == [f"error: {FULL}"], (args, result.stderr)
    assert notes(db) == 2


def test_a_reader_that_stops_after_the_first_line_of_a_long_table_ends_quietly(
    env: dict[str, str], tmp_path: Path
) -> None:
    """`kidx status | head -1` with more rows than the pipe holds: rich's own handling of the
    broken pipe ended the process with status 1 and no word (a failure, to `set -o pipefail`),
    where every other write ended it as git does, by SIGPIPE. The reader goes once the table
    (rich's) is being written, the pipe made small (4 KiB) so that a few hundred rows are
    more than it holds: the table's write is the one that meets the closed pipe."""
    cwd = tmp_path / "work"
    init = subprocess.run(
        [str(KIDX), "init"], env=env, cwd=cwd, capture_output=True, text=True, timeout=60
    )
    assert init.returncode == 0, init.stderr
    conn = apsw.Connection(str(tmp_path / "kidx.db"))
    with conn:  # as a host writes them
        conn.executemany(
            "INSERT INTO knowledge_items (kind, title, content) VALUES ('note', ?, ?)",
            [(f"note {n}", f"words {n}") for n in range(400)],
        )
    conn.close()
    read, write = os.pipe()
    fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, 4096)
    try:
        proc = subprocess.Popen(
            [str(KIDX), "status"], env=env, cwd=cwd, stdout=write, stderr=subprocess.PIPE
        )
    finally:
        os.close(write)
    with os.fdopen(read, "rb") as reader:  # up to the table's header, then the reader goes
        lines = [reader.readline() for _ in range(12)]  # the counts before it, click's
        assert any(b"item_id" in line for line in lines), lines
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGPIPE, stderr
    assert stderr == b""


def test_help_to_a_reader_already_gone_ends_quietly(env: dict[str, str], tmp_path: Path) -> None:
    """`kidx --help | true`: click's own handling of the closed pipe, outside any command,
    ended the process with status 1 and no word, where a command ends by SIGPIPE."""
    for args in (("--help",), ("--version",), ("add", "note", "--help")):
        read, write = os.pipe()
        os.close(read)  # a reader that has already stopped
        try:
            result = subprocess.run(
                [str(KIDX), *args],
                env=env,
                cwd=tmp_path / "work",
                stdout=write,
                stderr=subprocess.PIPE,
                timeout=60,
            )
        finally:
            os.close(write)
        assert result.returncode == -signal.SIGPIPE, (args, result.stderr)
        assert result.stderr == b""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")
def test_a_full_stdout_says_what_init_backup_and_an_inline_run_had_done(
    env: dict[str, str], tmp_path
) -> None:
    """Only the adding commands said what they had done: a backup written, a database made, a
    run that indexed items were each "write error on stdout" alone, which reads as not done."""
    cwd = tmp_path / "work"
    db = tmp_path / "kidx.db"
    init = to_full(env, cwd, "init")
    assert error_lines(init) == [f"error: {FULL} (the database {db} is ready)"], init.stderr
    copy = tmp_path / "copy.db"
    backup = to_full(env, cwd, "backup", str(copy))
    assert error_lines(backup) == [f"error: {FULL} (the backup was written to {copy})"]
    assert copy.is_file()
    added = subprocess.run(
        [str(KIDX), "add", "note", "--title", "T", "--text", "words"],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert added.returncode == 0, added.stderr
    run = to_full(env, cwd, "index", "--all", "--inline")
    assert error_lines(run)[-1].startswith(f"error: {FULL} (the run ended: 0 of 1 items indexed")
