"""`kidx` on a database a careless host application wrote with plain SQL (foreign keys off, CHECK
constraints not enforced, any value in any column): TEXT that is not UTF-8 in kidx's state, job,
batch, chunk and index_meta rows and in an item's kind or title, infinity (SQLite stores it) in
integer columns, a state row of no item, an item at the largest id. The read-only commands
(`status`, `jobs`, `chunks`, `search`, `doctor`) show what is there, with U+FFFD for what is not
text, and `--json` stays JSON a strict parser takes; `init`, `add`, `retry --failed` and
`reindex --all` do their work beside such rows, or say what is wrong (`reindex --wait` too, over
a batch row rewritten or deleted while it waits); none fails with "unexpected UnicodeDecodeError
... (a bug in kidx)". The console script in a subprocess (`test_cli.Kidx`: no traceback on any
stream); the HTTP stand-in as the provider; the host's writes through a bare apsw connection;
tasks sent go to a Redis database of the tests' own (SPARE_DB), emptied after each.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import apsw
import pytest
from test_cli import KIDX, Kidx, base_env

from stack import SPARE_DB, broker_url, flush, wait_for

BAD = "CAST(x'ff41' AS TEXT)"  # TEXT whose first byte is no UTF-8: apsw cannot decode it


@pytest.fixture
def kidx(tmp_path: Path, standin) -> Kidx:
    work = tmp_path / "work"
    work.mkdir()
    env = base_env(tmp_path / "kidx.db", standin.base_url) | {"KIDX_FILES__ROOTS": str(tmp_path)}
    return Kidx(work, env, process=True)


def host(db: Path, *statements: str) -> None:
    """Plain SQL as a host runs it: foreign keys off, CHECK constraints not enforced."""
    conn = apsw.Connection(str(db))
    try:
        conn.execute("PRAGMA foreign_keys = OFF")
        conn.execute("PRAGMA ignore_check_constraints = ON")
        for sql in statements:
            conn.execute(sql)
    finally:
        conn.close()


def strict_json(text: str) -> Any:
    """JSON as a strict parser reads it: `Infinity` and `NaN` are no JSON."""

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def clean(result: Any, args: tuple[str, ...]) -> str:
    """The run ended well, with no bug message; its stdout."""
    shown = f"kidx {' '.join(args)}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    assert result.returncode == 0, shown
    assert "bug in kidx" not in result.stderr, shown
    return result.stdout


def test_status_and_jobs_show_state_job_and_batch_text_that_is_not_utf8(kidx, tmp_path):
    """A host's TEXT that is not UTF-8 in `item_index_state` (last_error, model, chunk_method,
    even chunk_count), `index_jobs` and a running `index_batches` row: every listing failed
    as a bug, for one bad row. Each is shown with U+FFFD; the rows beside it as they are."""
    db = tmp_path / "kidx.db"
    bad_item = kidx.add("Bad", "--text", "hello damaged state")
    good_item = kidx.add("Good", "--text", "hello intact state")
    host(
        db,
        f"UPDATE item_index_state SET status = 'failed', last_error = {BAD}, model = {BAD}, "
        f"chunk_method = {BAD}, chunk_count = {BAD}, dimensions = 64 WHERE item_id = {bad_item}",
        f"INSERT INTO index_batches(id, kind, state, total, abort_reason) "
        f"VALUES (7, {BAD}, 'running', {BAD}, {BAD})",
        "INSERT INTO index_jobs(task_id, attempt, task_name, item_id, batch_id, state, error, "
        f"started_at) VALUES ({BAD}, 0, {BAD}, {bad_item}, 7, 'failed', {BAD}, '2026-01-02')",
        "INSERT INTO index_jobs(task_id, attempt, task_name, item_id, state, queued_at) "
        f"VALUES ('queued-task', 0, 'GenerateEmbedding', {good_item}, 'queued', '2026-01-01')",
    )
    for args in (("status",), ("status", str(bad_item)), ("jobs",), ("jobs", "--batch", "7")):
        assert "\ufffdA" in clean(kidx(*args), args), args

    every = strict_json(clean(kidx("status", "--json"), ("status", "--json")))
    states = {s["item_id"]: s for s in every}
    assert states[bad_item]["last_error"] == "\ufffdA"
    assert states[bad_item]["status"] == "failed"
    assert states[good_item]["status"] == "pending"
    one = strict_json(clean(kidx("status", str(bad_item), "--json"), ("status", "--json")))
    assert one["model"] == "\ufffdA" and one["chunk_count"] == "\ufffdA"
    counts = strict_json(clean(kidx("status", "--summary", "--json"), ("status", "--summary")))
    assert counts["by_model"] == {"\ufffdA (64)": 1}
    assert counts["by_chunk_method"].get("\ufffdA") == 1
    [running] = counts["running_batches"]
    assert running["kind"] == "\ufffdA" and running["total"] == "\ufffdA"

    jobs = strict_json(clean(kidx("jobs", "--json"), ("jobs", "--json")))
    # A job not started yet comes first (newest first, as before); the host's row after it.
    assert [j["task_id"] for j in jobs] == ["queued-task", "\ufffdA"]
    assert jobs[1]["error"] == "\ufffdA" and jobs[1]["item_id"] == bad_item
    batch = strict_json(clean(kidx("jobs", "--batch", "7", "--json"), ("jobs", "--batch")))
    assert batch["batch"]["abort_reason"] == "\ufffdA"
    assert [j["task_id"] for j in batch["jobs"]] == ["\ufffdA"]


def test_chunks_and_keyword_search_pass_over_a_chunk_place_that_is_not_utf8(kidx, tmp_path):
    """A chunk whose offsets (or a code chunk whose lines) a host overwrote with TEXT that is
    not UTF-8: `kidx chunks` failed as a bug, and so did every keyword search that ranked the
    chunk, whatever else it found. `chunks` shows the value with U+FFFD; search leaves that
    chunk out (it has no place to show it at) and returns the others."""
    db = tmp_path / "kidx.db"
    bad_item = kidx.add("Damaged", "--text", "lantern keeper of the damaged note", inline=True)
    good_item = kidx.add("Intact", "--text", "lantern keeper of the intact note", inline=True)
    source = tmp_path / "lamp.py"
    source.write_text("def lantern():\n    return 'keeper'\n", encoding="utf-8")
    code_item = int(kidx.ok("add", "code", str(source), "--inline").stdout)
    host(
        db,
        f"UPDATE note_chunks SET start_offset = {BAD}, chunk_index = {BAD} "
        f"WHERE item_id = {bad_item}",
        f"UPDATE code_chunks SET start_line = {BAD} WHERE item_id = {code_item}",
    )
    rows = strict_json(clean(kidx("chunks", str(bad_item), "--json"), ("chunks",)))
    assert [(r["chunk_index"], r["start_offset"]) for r in rows] == [("\ufffdA", "\ufffdA")]
    assert "\ufffdA" in clean(kidx("chunks", str(bad_item)), ("chunks",))
    [code] = strict_json(clean(kidx("chunks", str(code_item), "--json"), ("chunks", "code")))
    assert code["summary"].endswith(":\ufffdA-2"), code
    for chunks in ((), ("--chunks",)):
        args = ("search", "lantern", "--mode", "keyword", *chunks, "--json")
        hits = strict_json(clean(kidx(*args), args))
        assert [h["item_id"] for h in hits] == [good_item], hits


def test_json_output_stays_json_when_a_host_stored_infinity(kidx, tmp_path):
    """SQLite keeps 9e999 as infinity in an INTEGER column; `--json` wrote it as `Infinity`
    (Python's json), which no strict JSON parser takes. It is null, as JSON.stringify makes
    it; the table shows it as Python does (`inf`)."""
    db = tmp_path / "kidx.db"
    item = kidx.add("Endless", "--text", "a note that took forever", inline=True)
    host(
        db,
        f"UPDATE item_index_state SET duration_ms = 9e999, dimensions = -9e999 "
        f"WHERE item_id = {item}",
        f"UPDATE note_chunks SET end_offset = 9e999 WHERE item_id = {item}",
        "INSERT INTO index_batches(id, kind, state, total) VALUES (3, 'reindex', 'running', 9e999)",
        "INSERT INTO index_jobs(task_id, attempt, task_name, item_id, batch_id, state, "
        f"duration_ms) VALUES ('t', 0, 'GenerateEmbedding', {item}, 3, 'failed', 9e999)",
    )
    state = strict_json(clean(kidx("status", str(item), "--json"), ("status",)))
    assert state["duration_ms"] is None and state["dimensions"] is None
    strict_json(clean(kidx("status", "--json"), ("status",)))
    counts = strict_json(clean(kidx("status", "--summary", "--json"), ("status", "--summary")))
    assert counts["running_batches"][0]["total"] is None
    [chunk] = strict_json(clean(kidx("chunks", str(item), "--json"), ("chunks",)))
    assert chunk["end_offset"] is None and chunk["length"] is None
    jobs = strict_json(clean(kidx("jobs", "--json"), ("jobs",)))
    [job] = [j for j in jobs if j["task_id"] == "t"]
    assert job["duration_ms"] is None
    batch = strict_json(clean(kidx("jobs", "--batch", "3", "--json"), ("jobs", "--batch")))
    assert batch["batch"]["total"] is None
    assert "inf" in clean(kidx("status", str(item)), ("status",))


@pytest.mark.parametrize("key", ["schema_version", "instance"])
def test_index_meta_text_that_is_not_utf8_is_said_not_raised(kidx, tmp_path, key):
    """`index_meta`'s schema_version or instance overwritten with TEXT that is not UTF-8:
    every command that opens the database failed as a bug, `kidx init` too. A schema_version
    that is no number is refused naming it, as a number spelled wrong was; an instance name is
    used as shown (every process decodes it alike, so all name the same Redis keys)."""
    db = tmp_path / "kidx.db"
    item = kidx.add("Note", "--text", "hello meta")
    host(db, f"UPDATE index_meta SET value = {BAD} WHERE key = '{key}'")
    for args in (("init",), ("status",), ("jobs",), ("search", "hello", "--mode", "keyword")):
        result = kidx(*args)
        assert "bug in kidx" not in result.stderr, (args, result.stderr)
        if key == "schema_version":
            assert result.returncode == 1, (args, result.stderr)
            assert "has schema_version '\ufffdA' in index_meta, not a number" in result.stderr
        else:
            assert result.returncode == 0, (args, result.stderr)
    if key == "instance":
        [state] = strict_json(clean(kidx("status", "--json"), ("status",)))
        assert state["item_id"] == item


def test_retry_failed_passes_over_a_failed_state_row_of_no_item(kidx, tmp_path):
    """A host's `item_index_state` row marked failed for an item that is not there (written by
    hand, foreign keys off): `kidx retry --failed` refused the whole retry with "no item with
    id 999" and sent nothing. The failed items that are there are sent; the row is the
    sweep's. (The tasks go to a Redis database of this test's own, emptied after it.)"""
    db = tmp_path / "kidx.db"
    item = kidx.add("Failed", "--text", "hello failed")
    host(
        db,
        f"UPDATE item_index_state SET status = 'failed' WHERE item_id = {item}",
        "INSERT INTO item_index_state(item_id, status) VALUES (999, 'failed')",
    )
    broker = {"KIDX_BROKER_URL": broker_url(SPARE_DB)}
    try:
        sent = strict_json(clean(kidx("retry", "--failed", "--json", env=broker), ("retry",)))
    finally:
        flush(SPARE_DB)
    assert sent["items"] == 1, sent
    [job] = strict_json(clean(kidx("jobs", "--json"), ("jobs",)))
    assert job["item_id"] == item and job["state"] == "queued"


def test_reindex_all_sends_a_batch_beside_an_item_whose_kind_is_not_utf8(kidx, tmp_path):
    """An item whose `kind` a host overwrote with TEXT that is not UTF-8 (CHECK constraints
    not enforced): `kidx reindex --all` failed as a bug before any batch was made, for every
    item. The batch is sent; that item goes to a group, which refuses it and counts it."""
    db = tmp_path / "kidx.db"
    bad = kidx.add("Bad kind", "--text", "hello kind")
    kidx.add("Good kind", "--text", "hello note")
    host(db, f"UPDATE knowledge_items SET kind = {BAD} WHERE id = {bad}")
    broker = {"KIDX_BROKER_URL": broker_url(SPARE_DB)}
    try:
        sent = strict_json(clean(kidx("reindex", "--all", "--json", env=broker), ("reindex",)))
    finally:
        flush(SPARE_DB)
    assert sent["items"] == 2 and sent["tasks"] >= 1, sent


def test_add_again_of_a_source_whose_title_is_not_utf8_reuses_its_item(kidx, tmp_path):
    """A URL item whose title a host wrote as TEXT that is not UTF-8: adding the URL again
    (`kidx add url`, with or without --title) failed as a bug. The item is the same one; a
    --title given replaces the title."""
    db = tmp_path / "kidx.db"
    url = "https://example.com/host-title"
    kidx.ok("init")
    host(
        db,
        f"INSERT INTO knowledge_items(id, kind, title, source) VALUES (5, 'url', {BAD}, '{url}')",
    )
    broker = {"KIDX_BROKER_URL": broker_url(SPARE_DB)}
    try:
        again = clean(kidx("add", "url", url, env=broker), ("add", "url"))
        titled = clean(kidx("add", "url", url, "--title", "Fixed", env=broker), ("add", "url"))
    finally:
        flush(SPARE_DB)
    assert again.split() == ["5"] and titled.split() == ["5"]
    conn = apsw.Connection(str(db))
    try:
        assert conn.execute("SELECT title FROM knowledge_items WHERE id = 5").fetchall() == [
            ("Fixed",)
        ]
    finally:
        conn.close()


def test_doctor_reports_failed_and_stuck_items_whose_rows_hold_text_that_is_not_utf8(
    kidx, tmp_path
):
    """A failed item whose last_error a host wrote as TEXT that is not UTF-8, and a job row
    started long ago whose item id is such TEXT: `kidx doctor`'s `failed` and `stuck` checks
    said "UnicodeDecodeError: ... see the message" in place of what they check. They count the
    failed item (its error with U+FFFD) and the stuck run."""
    db = tmp_path / "kidx.db"
    item = kidx.add("Failed", "--text", "hello doctor")
    host(
        db,
        f"UPDATE item_index_state SET status = 'failed', last_error = {BAD} WHERE item_id = {item}",
        "INSERT INTO index_jobs(task_id, attempt, task_name, item_id, state, started_at) "
        f"VALUES ('stuck', 0, 'GenerateEmbedding', {BAD}, 'started', '2000-01-01')",
    )
    result = kidx("doctor", "--json", "--timeout", "1", env={"KIDX_FLOWER__PORT": "1"})
    checks = {c["check"]: c for c in strict_json(result.stdout)}
    assert checks["failed"]["detail"] == "1 item failed to index (last: \ufffdA)", checks["failed"]
    assert checks["stuck"]["detail"].startswith("stuck: 1 run started"), checks["stuck"]


def test_add_after_a_host_took_the_largest_id_says_ids_are_used_up_not_the_disk(kidx, tmp_path):
    """A host's item at id 2**63 - 1 leaves AUTOINCREMENT no id to give: `kidx add note`
    failed with "the disk holding ... is full", and the disk had room. It says the ids are used
    up and what to do; done, the next add works."""
    db = tmp_path / "kidx.db"
    kidx.add("First", "--text", "hello first")
    host(
        db,
        "INSERT INTO knowledge_items(id, kind, title, content) "
        f"VALUES ({2**63 - 1}, 'note', 'Last', 'hello last')",
    )
    result = kidx("add", "note", "--title", "Next", "--text", "hello next")
    assert result.returncode == 1, result.stderr
    assert "no item id left to give" in result.stderr and "disk" not in result.stderr
    host(
        db,
        f"UPDATE knowledge_items SET id = 1000 WHERE id = {2**63 - 1}",
        "UPDATE sqlite_sequence SET seq = (SELECT max(id) FROM knowledge_items) "
        "WHERE name = 'knowledge_items'",
    )
    assert kidx.add("Next", "--text", "hello next") == 1001


def test_code_search_passes_over_a_code_chunk_whose_lines_are_not_utf8(kidx, tmp_path):
    """A code chunk whose start line a host overwrote with TEXT that is not UTF-8: `kidx search
    --code` failed as a bug whenever it ranked that chunk. It is left out (no place to show it
    at, as for any line that is no integer); the other chunks are found."""
    db = tmp_path / "kidx.db"
    for name in ("damaged", "intact"):
        (tmp_path / f"{name}.py").write_text(
            f"def lantern_{name}():\n    return 'keeper'\n", encoding="utf-8"
        )
    ids = [
        int(kidx.ok("add", "code", str(tmp_path / f"{n}.py"), "--inline").stdout)
        for n in ("damaged", "intact")
    ]
    host(db, f"UPDATE code_chunks SET start_line = {BAD} WHERE item_id = {ids[0]}")
    args = ("search", "--code", "lantern keeper", "--json")
    hits = strict_json(clean(kidx(*args), args))
    assert [h["item_id"] for h in hits] == [ids[1]], hits


def _waiting_reindex(kidx: Kidx, db: Path, broker: dict[str, str]) -> subprocess.Popen:
    """`kidx reindex --all --wait` with no worker to run its tasks: it waits, polling the
    batch row, until the test ends the batch by hand (or 60 s pass)."""
    proc = subprocess.Popen(
        [str(KIDX), "reindex", "--all", "--wait", "--timeout", "60"],
        env={**kidx.env, **broker},
        cwd=kidx.cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    conn = apsw.Connection(str(db))
    try:
        wait_for(
            lambda: conn.execute("SELECT count(*) FROM index_batches").fetchone()[0] == 1,
            30,
            "the batch row",
        )
    finally:
        conn.close()
    return proc


@pytest.mark.parametrize("count", ["'x'", BAD, "9e999"], ids=["text", "bytes", "infinity"])
def test_reindex_wait_reads_a_batch_whose_counts_a_host_rewrote(kidx, tmp_path, count):
    """A host rewrote the counts of the batch `kidx reindex --wait` watches: the wait failed as
    a bug (adding text to a number). It goes on, counting such a value 0, and ends with the
    batch."""
    db = tmp_path / "kidx.db"
    kidx.add("Waited", "--text", "hello wait")
    broker = {"KIDX_BROKER_URL": broker_url(SPARE_DB)}
    try:
        proc = _waiting_reindex(kidx, db, broker)
        host(db, f"UPDATE index_batches SET ok = {count}, failed = {count}, skipped = {count}")
        host(db, "UPDATE index_batches SET state = 'aborted', abort_reason = 'by hand'")
        out, errs = proc.communicate(timeout=60)
    finally:
        flush(SPARE_DB)
    assert proc.returncode == 1, errs  # aborted: not done
    assert "bug in kidx" not in errs and "Traceback" not in errs, errs
    assert "aborted" in out and "why: by hand" in out, out


def test_reindex_wait_says_when_a_host_deleted_its_batch(kidx, tmp_path):
    db = tmp_path / "kidx.db"
    kidx.add("Waited", "--text", "hello wait")
    broker = {"KIDX_BROKER_URL": broker_url(SPARE_DB)}
    try:
        proc = _waiting_reindex(kidx, db, broker)
        host(db, "DELETE FROM index_batches")
        _, errs = proc.communicate(timeout=60)
    finally:
        flush(SPARE_DB)
    assert proc.returncode == 1, errs
    assert "bug in kidx" not in errs and "Traceback" not in errs, errs
    assert "was deleted while waiting for it" in errs, errs


def test_update_text_of_a_file_item_whose_source_a_host_emptied_names_no_none(kidx, tmp_path):
    """`kidx update --text` on a file item is refused (its text comes from its source); with
    the source a host set to NULL, the refusal read "its source (None)"."""
    db = tmp_path / "kidx.db"
    (tmp_path / "a.md").write_text("# A\n\nA file's words.\n", encoding="utf-8")
    added = kidx("add", "file", str(tmp_path / "a.md"))
    assert added.returncode == 0, added.stderr
    item = int(added.stdout)
    host(db, f"UPDATE knowledge_items SET source = NULL WHERE id = {item}")
    result = kidx("update", str(item), "--text", "new words")
    assert result.returncode == 1, result.stderr
    assert "None" not in result.stderr, result.stderr
    assert f"item {item} is a file item: its text comes from its source, read again" in (
        result.stderr
    )
