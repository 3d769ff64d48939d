"""`kidx` at its edges: what the database holds reaching a terminal, closed and non-UTF-8
streams, arguments and file names that are not UTF-8, odd numbers and widths, a closed pipe.

Runs go through `test_cli.Kidx` (in this process, or the console script where the process itself
is what is tested), whose checks hold for each: no API key and no traceback on any stream. The
broker is a port where nothing listens: nothing here reaches one.
"""

from __future__ import annotations

from pathlib import Path

import apsw
import pytest
from test_cli import NOWHERE, Kidx, base_env, one_line_error

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


# -- 4. settings ---------------------------------------------------------------------------------


def test_a_settings_group_that_is_not_json_is_a_configuration_error(offline, tmp_path):
    result = offline("init", env={"KIDX_EMBEDDING": '{"provider":1'})
    line = one_line_error(result)
    assert result.returncode == 2, line
    assert "KIDX_EMBEDDING" in line and "JSON" in line and "a bug" not in line
    assert not (tmp_path / "kidx.db").exists()
