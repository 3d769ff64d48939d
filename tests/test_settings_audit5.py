"""Settings against a review of what the documents promise: `--db store/` made a file named
`store` (KIDX_DB=store/ is refused); an empty metrics address (every interface, as Flower
takes it) started no endpoint; a chunk deadline past half the soft time limit was said only
by `kidx doctor`; errors named a variable that is no setting (`KIDX_FILES__ROOTS__1`) or
said `Value error,`."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import urllib.request

import pytest
from test_cli import Kidx, base_env

from stack import free_port, wait_for
from worker.errors import ConfigError
from worker.settings import load_settings


def test_db_given_as_a_folder_is_refused_as_kidx_db_is(tmp_path, standin) -> None:
    (tmp_path / "work").mkdir()
    kidx = Kidx(tmp_path / "work", base_env(tmp_path / "kidx.db", standin.base_url))
    for given in ("./store/", ""):
        result = kidx("init", "--db", given)
        assert result.returncode == 2, (given, result.stderr)
        assert "KIDX_DB: must name the database file" in result.stderr
    assert sorted(p.name for p in (tmp_path / "work").iterdir()) == []


def test_an_empty_metrics_address_serves_on_every_interface(tmp_path) -> None:
    port = free_port()
    script = textwrap.dedent(
        f"""
        import sys, time, types
        from worker.settings import load_settings
        import tasks.metrics as m
        s = load_settings(data_dir={str(tmp_path)!r}, metrics={{"port": {port}, "address": ""}})
        m._start(types.SimpleNamespace(app=types.SimpleNamespace(kidx_settings=s)))
        print("up", flush=True)
        sys.stdin.read()  # until the test is done with it
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "KIDX_LOG_LEVEL": "info"},
    )
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(2)]  # its log line, then "up"
        assert "metrics endpoint not started" not in "".join(lines), lines
        assert lines[-1].strip() == "up", lines

        def answer() -> int | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    return int(r.status)
            except OSError:
                return None

        assert wait_for(answer, 10, "the metrics endpoint") == 200
    finally:
        proc.communicate(input="", timeout=30)


def test_a_chunk_deadline_past_half_the_soft_time_limit_is_said_not_refused() -> None:
    """Said by `kidx doctor` and at a worker's start; refused, it stopped every CLI command of
    an inline setup (no time limit there) and an operator's lower soft limit alone."""
    from worker.settings import deadline_problem

    chunk = {"model": "m", "base_url": "http://127.0.0.1:9/v1"}
    lowered = load_settings(chunk=chunk, tasks={"soft_time_limit": 300, "time_limit": 360})
    assert "KIDX_CHUNK__DEADLINE (240 s) is not under half" in (deadline_problem(lowered) or "")
    assert deadline_problem(load_settings(chunk=chunk)) is None  # the defaults: 240 < 300
    assert deadline_problem(load_settings(chunk={"deadline": 3000})) is None  # no model


def test_an_error_in_a_list_names_the_variable_that_holds_it() -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(files={"roots": ["/srv/a", 1]})
    assert str(e.value).startswith("invalid settings: KIDX_FILES__ROOTS: entry 2 ('1'): ")
    assert "__1" not in str(e.value)
