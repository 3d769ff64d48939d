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


# -- 4. settings ---------------------------------------------------------------------------------


def test_a_settings_group_that_is_not_json_is_a_configuration_error(offline, tmp_path):
    result = offline("init", env={"KIDX_EMBEDDING": '{"provider":1'})
    line = one_line_error(result)
    assert result.returncode == 2, line
    assert "KIDX_EMBEDDING" in line and "JSON" in line and "a bug" not in line
    assert not (tmp_path / "kidx.db").exists()
