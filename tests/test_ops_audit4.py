"""The scripts `make run` and `make demo` call, against bad settings and paths: a traceback,
and a database made at a mistyped --db, where every kidx command says one line and makes
nothing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import apsw
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = {
    "sample_notes": [],
    "load_corpus": [str(ROOT.parent / "shared" / "corpus" / "rustbook")],
}


def run(script: str, *args: str, tmp: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "KIDX_DATA_DIR": str(tmp / "data"), "KIDX_DB": str(tmp / "k.db")}
    return subprocess.run(
        [sys.executable, str(ROOT / "ops" / "scripts" / f"{script}.py"), *SCRIPTS[script], *args],
        env={**environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_script_says_a_bad_setting_in_one_line(script: str, tmp_path: Path) -> None:
    done = run(script, tmp=tmp_path, KIDX_CHUNK__TARGET="abc")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.startswith("error: invalid settings: KIDX_CHUNK__TARGET")


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_a_script_makes_no_database_at_a_mistyped_path(script: str, tmp_path: Path) -> None:
    done = run(script, "--db", str(tmp_path / "typo" / "x.db"), tmp=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "no database at" in done.stderr and not (tmp_path / "typo").exists()
    (tmp_path / "notdb.txt").write_text("not a database")
    done = run(script, "--db", str(tmp_path / "notdb.txt"), tmp=tmp_path)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "not a database" in done.stderr


@pytest.mark.parametrize("task_id", ["a b", "x" * 256, "abc:" + "9" * 21])
def test_cancel_refuses_what_is_no_task_id_before_anything_is_sent(task_id: str, tmp_path) -> None:
    """Ids with spaces or of 100,000 characters were sent to Redis and every worker."""
    done = subprocess.run(
        [sys.executable, "-m", "ops.cli", "cancel", task_id],
        # nothing listens at this broker: a refusal comes before any use of it
        env={
            **os.environ,
            "KIDX_DATA_DIR": str(tmp_path),
            "KIDX_BROKER_URL": "redis://127.0.0.1:9/0",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and "not a task id or a job id" in done.stderr


def test_a_table_of_thousands_of_rows_is_printed_plain_and_safe(capsys, monkeypatch) -> None:
    """rich laid out 20,000 rows at once (`kidx status`: 8 s to print them); past PLAIN_ROWS
    a table is a line a row, aligned, free text wrapped to the terminal (it was cut, as the
    README says no cell is), nothing of a host's control characters passed on."""
    from ops.cli import base
    from worker.settings import Settings

    monkeypatch.setattr(base.out, "_width", 80)
    ctx = base.Ctx(Settings(), as_json=False)
    rows = [(n, "indexed", f"title {n}") for n in range(base.PLAIN_ROWS + 1)]
    rows[7] = (7, "failed", "\x1b[31mred\x1b[0m and " + "long " * 40)
    ctx.table(["item_id", "status", "title"], rows)
    lines = capsys.readouterr().out.splitlines()
    assert "\x1b" not in "".join(lines) and "…" not in "".join(lines)
    assert lines[0].split() == ["item_id", "status", "title"]
    assert lines[2 + 1].split() == ["1", "indexed", "title", "1"]
    assert lines[3].index("indexed") == lines[0].index("status")  # aligned
    assert max(len(line) for line in lines) <= 80
    start = lines.index(next(line for line in lines if line.startswith("7 ")))
    end = lines.index(next(line for line in lines if line.startswith("8 ")))
    assert end - start > 1  # its title on lines of its own, under the title column
    column = lines[0].index("title")
    title = " ".join(line[column:].strip() for line in lines[start:end])
    assert title.endswith(" ".join(["long"] * 40)) and "[31mred" in title
    assert all(not line[:column].strip() for line in lines[start + 1 : end])
    assert len(lines) == 2 + len(rows) + (end - start - 1)
    wide = "\u6771" * 40 + " " + "\u0301" * 40 + " tail"  # as many cells as characters
    ctx.table(["item_id", "status", "title"], [*rows[:-1], (9999, "failed", wide)])
    shown = capsys.readouterr().out
    assert shown.count("\u6771") == 40 and "tail" in shown


def test_a_host_s_huge_error_is_one_short_line_of_doctor_and_of_every_echo(tmp_path) -> None:
    """A host's 100 MB last_error was one line of `kidx doctor` (5 s, 700 MB to print); a
    batch's abort reason and a sweep's time were printed whole by `kidx jobs` and `status`."""
    from ops.cli.base import CELL_MAX, Ctx
    from ops.doctor import Fail, check_failed
    from worker.settings import Settings
    from worker.store import connect
    from worker.store.items import add_item

    db_path = tmp_path / "k.db"
    db = connect(db_path)
    item = add_item(db, kind="note", title="t", content="x")
    db.close()
    host = apsw.Connection(str(db_path))
    host.execute(
        "UPDATE item_index_state SET status = 'failed', last_error = ? WHERE item_id = ?",
        ("E" * 5_000_000, item),
    )
    host.close()
    settings = Settings(db=db_path, data_dir=tmp_path / "data")
    with pytest.raises(Fail) as failed:
        check_failed(settings, 5)
    assert 0 < len(str(failed.value)) < 3 * CELL_MAX
    assert len(Ctx(settings, as_json=False).say("why: " + "R" * 1_000_000)) == CELL_MAX


TRACEBACK_SCRIPT = """
import io, logging
from worker.log import configure_logging, get_logger

class Terminal(io.StringIO):
    def isatty(self):
        return True

stream = Terminal()
configure_logging(fmt="console", level="info", stream=stream)
try:
    raise RuntimeError("trigger says: \\x1b]0;PWNED\\x07\\x1b[2J")
except RuntimeError as e:
    logging.getLogger("celery.app.trace").error("raised: %r", e, exc_info=True)
    get_logger("kidx.tasks").exception("[KI Embed] the run failed")
print(repr(stream.getvalue()))
"""


def test_a_traceback_on_the_console_shows_a_host_s_escape_sequences_inert() -> None:
    """The console format cleaned every value but the traceback, whose last line is the
    exception's text: a host trigger's RAISE message in an apsw error reached the terminal's
    escape sequences (a title set, the screen cleared). (In a process of its own: logging is
    configured once a process.)"""
    import ast

    done = subprocess.run(
        [sys.executable, "-c", TRACEBACK_SCRIPT], capture_output=True, text=True, timeout=60
    )
    out = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert "PWNED" in out and "\x1b]0;" not in out and "\x07" not in out
    assert "Traceback (most recent call last):\n" in out  # its line ends kept


@pytest.mark.parametrize(
    ("message", "runtime"),
    [
        ("IndexAborted: item 3 failed (after 0.4 s); the group failed (after 297.3 s)", 297.3),
        ("RetryLater: server says (after 3600 s) (after 1.2 s)", 1.2),
    ],
)
def test_the_tasks_page_takes_a_failure_s_own_runtime(message: str, runtime: float) -> None:
    """The first "(after N s)" in the message was taken: a group's first failed item's, or
    a provider's quoted text, rather than kidx's suffix, which is the last."""
    from types import SimpleNamespace

    from ops.flower import format_task

    task = SimpleNamespace(state="FAILURE", runtime=None, started=None, failed=None)
    task.exception = message
    assert format_task(task).runtime == runtime
