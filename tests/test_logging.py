"""Log lines: JSON, the seed's prefixes with their fields, and no secret ever."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap

from conftest import corpus_text
from stack import REDIS_DB, broker_url

SECRET = "sk-log-secret-0123456789"

SCRIPT = textwrap.dedent(
    """
    import sys
    from worker.log import configure_logging
    from worker.settings import load_settings
    settings = load_settings()
    configure_logging(fmt="json", secrets=settings.secrets())
    from worker.indexers import IndexOptions
    from worker.bulk import index_item
    from worker.providers import build_embedder
    from worker.store import open_store
    from worker.store.items import add_item
    db = open_store(settings)
    model = build_embedder(settings.embedding, dimensions=db.dimensions)
    item = add_item(db, kind="note", title="Slices", content=open(sys.argv[1]).read())
    index_item(db, item, embedder=model, options=IndexOptions(task_id="task-123"))
    try:
        index_item(db, item + 1000, embedder=model)
    except Exception as e:
        import structlog
        structlog.get_logger("kidx.test").error("[KI Embed] failed", reason=str(e),
                                                 headers={"Authorization": "Bearer " + sys.argv[2]})
    """
)


def test_log_lines_are_json_with_prefixes_fields_and_no_secret(tmp_path, standin):
    chapter = tmp_path / "chapter.md"
    chapter.write_text(corpus_text("ch04-03-slices.md"))
    standin.fail_status, standin.fail_times = 503, 1  # one retry: its warning must be clean too
    env = {
        "PATH": "/usr/bin:/bin",
        "HF_HUB_OFFLINE": "1",
        "KIDX_DB": str(tmp_path / "log.db"),
        "KIDX_BROKER_URL": broker_url(REDIS_DB),
        "KIDX_EMBEDDING__PROVIDER": "openai",
        "KIDX_EMBEDDING__MODEL": "standin-embed",
        "KIDX_EMBEDDING__BASE_URL": standin.base_url,
        "KIDX_EMBEDDING__DIMENSIONS": "64",
        "KIDX_EMBEDDING__API_KEY": SECRET,
        "KIDX_EMBEDDING__BACKOFF": "0.01",
    }
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(chapter), SECRET],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        cwd=str(tmp_path),
    )
    assert run.returncode == 0, run.stderr
    assert SECRET not in run.stderr and SECRET not in run.stdout
    assert standin.headers and standin.headers[0]["authorization"] == f"Bearer {SECRET}"
    lines = [json.loads(line) for line in run.stderr.splitlines() if line.strip()]
    chunked = [e for e in lines if e["event"].startswith("[Chunk]")]
    indexed = [e for e in lines if e["event"] == "[KI Embed] indexed"]
    assert chunked and indexed
    assert {"item_id", "task_id", "chunk_method", "chunk_count", "dimensions"} <= set(chunked[0])
    assert {
        "item_id",
        "task_id",
        "chunk_method",
        "chunks",
        "reused",
        "embedded",
        "dimensions",
        "model",
        "duration_ms",
    } <= set(indexed[0])
    assert indexed[0]["task_id"] == "task-123" and indexed[0]["dimensions"] == 64
    failed = [e for e in lines if e["event"] == "[KI Embed] failed"]
    assert failed and failed[0]["headers"] == {"Authorization": "***"}
    assert all(e["level"] in {"info", "warning", "error"} and "timestamp" in e for e in lines)


TTY_SCRIPT = textwrap.dedent(
    """
    import io, structlog
    from worker.log import configure_logging

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    out = Terminal()
    configure_logging(fmt="auto", stream=out)
    model = "\\x1b]0;PWNED\\x07\\x1b[2J\\x1b[31mRED\\x1b[0m\\nFORGED line"
    structlog.get_logger("kidx.test").warning(f"kept for {model}", model=model)
    print(repr(out.getvalue()))
    """
)


def test_a_host_s_bytes_reach_a_terminal_s_log_lines_without_their_control_codes():
    """A model name a host wrote into index_meta (or a title, an error) went into console log
    lines as it was: its escape codes set the operator's window title and cleared the screen,
    its line end forged a line. On a terminal they are shown as U+FFFD; JSON escapes them."""
    out = subprocess.run(
        [sys.executable, "-c", TTY_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    shown = ast.literal_eval(out.stdout)  # (the repr printed above)
    assert "PWNED" in shown and "RED" in shown and "FORGED line" in shown
    assert "\x07" not in shown and "]0;" not in shown.replace("\ufffd]0;", "")
    assert "\x1b[2J" not in shown
    assert "\nFORGED" not in shown


FULL_SCRIPT = textwrap.dedent(
    """
    import resource, signal, sys
    from pathlib import Path
    from worker.log import configure_logging, get_logger

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG
    resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))  # as a full disk would
    configure_logging(fmt="json", stream_level="error", file=Path(sys.argv[1]))
    log = get_logger("kidx.test")
    for n in range(500):
        log.info("a record that fills the file", n=n, padding="x" * 100)
    print("ran on")
    """
)


def test_a_log_file_that_cannot_be_written_is_one_line_not_a_traceback_a_record(tmp_path):
    """A full disk (or a rotation refused) printed logging's `--- Logging error ---` and some
    50 lines of traceback for every record, on every command."""
    out = subprocess.run(
        [sys.executable, "-c", FULL_SCRIPT, str(tmp_path / "kidx.log")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and out.stdout == "ran on\n", out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "Logging error" not in out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and "cannot write the log file" in lines[0], out.stderr[-2000:]


BAD_RECORD_SCRIPT = textwrap.dedent(
    """
    import logging, sys
    from pathlib import Path
    from worker.log import configure_logging, get_logger

    configure_logging(fmt="json", stream_level="critical", file=Path(sys.argv[1]))
    logging.getLogger("a.library").warning("%s and %s", "one")  # a record that cannot format
    get_logger("kidx.test").warning("after the bad one")
    """
)


def test_a_record_that_cannot_be_formatted_leaves_the_log_file_on(tmp_path):
    """Only a write that fails turns the file off: a library's record with a bad `%s` took
    the log file away for the rest of the process."""
    log_file = tmp_path / "kidx.log"
    out = subprocess.run(
        [sys.executable, "-c", BAD_RECORD_SCRIPT, str(log_file)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "after the bad one" in log_file.read_text()
    assert "cannot write the log file" not in out.stderr
