"""What a stray file or process did to the operator's tools: a process whose arguments merely
mention a component (`tail -f flower.log`) was reported running and stopped by ops.stack; a
directory or a FIFO where a pid file goes crashed `stop` or hung `status`; a path setting with
a NUL or bytes that are not UTF-8 was "a bug in kidx"; a FIFO at the log file's path hung every
command; load_corpus.py hung on a FIFO named *.md and ended with a traceback on a file that is
not UTF-8. No Redis, worker or Flower is started here."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_settings_audit import clean_env as clean_env  # (autouse here too)
from test_stack_pids import make_stack

from ops import stack as ops_stack
from stack import ROOT
from worker.errors import ConfigError
from worker.settings import Settings, load_settings

KIDX = Path(sys.executable).with_name("kidx")
WAITS = "import sys; print('up', flush=True); sys.stdin.read()"


def child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KIDX_", "FLOWER_"))}
    env.update(KIDX_DATA_DIR=str(tmp_path / "data"), PYTHONPATH=str(ROOT), **extra)
    return env


# -- 1. a component is what runs it, not what mentions it ----------------------------------------


@pytest.fixture
def bystanders(tmp_path: Path) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """For each component, a process in a session of its own whose arguments mention its mark:
    a log file named after it, as `tail -f` or `less` has one."""
    log = tmp_path / "data" / "log"
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for name, mark in ops_stack.MARKS.items():
            procs[name] = subprocess.Popen(
                [sys.executable, "-c", WAITS, "-f", str(log / f"{mark}.log"), f"{name}.log"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                start_new_session=True,
            )
        for proc in procs.values():
            assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
        yield procs
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)
            for f in (proc.stdin, proc.stdout):
                if f:
                    f.close()


def test_a_process_that_mentions_a_component_is_neither_running_nor_stopped(
    tmp_path: Path,
    bystanders: dict[str, subprocess.Popen[bytes]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`tail -f flower.log` whose pid the pid file held was "flower running" and got SIGTERM."""
    if not Path("/proc/self").exists():
        pytest.skip("no /proc here")
    stack = make_stack(tmp_path)
    for name, proc in bystanders.items():
        stack.pid_file(name).write_text(f"{proc.pid}\n")
        assert stack.pid(name) is None, (name, ops_stack.MARKS[name])
    ops_stack.status(stack)
    out = capsys.readouterr().out
    for name in ops_stack.PROCESSES:
        assert f"{name:<7} stopped" in out, out
    ops_stack.stop(stack)
    out = capsys.readouterr().out
    for name, proc in bystanders.items():
        assert proc.poll() is None, f"{name}'s bystander was signalled: {out}"
        assert f"{name:<7} not running (stale pid file removed)" in out, out


def test_the_components_own_command_lines_are_recognised() -> None:
    """The commands `start` runs (and a prefork child's: the same), redis-server as it
    retitles itself; not what only names them."""
    settings = Settings(db=Path("/srv/kidx/kidx.db"), data_dir=Path("/srv/kidx/data"))
    for name, cmd in ops_stack.commands(settings, Path("/srv/kidx/data"), demo=True).items():
        assert ops_stack.runs(b"\0".join(a.encode() for a in cmd) + b"\0", ops_stack.MARKS[name])
    redis = ops_stack.MARKS["redis"]
    assert ops_stack.runs(b"/usr/bin/redis-server 127.0.0.1:6379\0\0\0", redis)
    assert ops_stack.runs(b"redis-server\0--port\x006379\0", redis)
    celery_title = b"[celeryd: kidx@h:MainProcess] -active- (-A worker.app worker --pool=prefork)"
    assert ops_stack.runs(celery_title, "worker.app")  # with setproctitle installed
    for cmdline, mark in [
        (b"tail\0-f\0/d/log/flower.log\0", "ops.flower"),
        (b"tail\0-f\0/d/log/flower.log\0", "flower"),
        (b"tail\0-f\0/d/log/redis-server.log\0", redis),
        (b"tail\0redis-server\0", redis),  # a program's name counts as the program only
        (b"less\0/d/worker.app.log\0", "worker.app"),
        (b"vim\0ops/flower.py\0", "ops.flower"),
        (b"worker.app\0", "worker.app"),  # a dotted name counts only as an argument
        (b"", "worker.app"),
    ]:
        assert not ops_stack.runs(cmdline, mark), (cmdline, mark)


# -- 2. pid files that are no regular files -------------------------------------------------------


def run_bounded(stack: ops_stack.Stack, action: str, fifos: list[Path]) -> bool:
    """`action` on `stack` in a thread; False if it blocked for 10 s (then freed: a writer
    opens and closes each FIFO, so that a read blocked there sees its end)."""
    thread = threading.Thread(target=getattr(ops_stack, action), args=(stack,), daemon=True)
    thread.start()
    thread.join(timeout=10)
    blocked = thread.is_alive()
    while thread.is_alive():
        for fifo in fifos:
            with contextlib.suppress(OSError):  # no reader (yet)
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(timeout=0.2)
    return not blocked


def test_a_fifo_pid_file_hangs_neither_status_nor_stop(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = make_stack(tmp_path)
    fifos = [stack.pid_file(name) for name in (*ops_stack.PROCESSES, "redis")]
    for fifo in fifos:
        os.mkfifo(fifo)
    assert run_bounded(stack, "status", fifos), "status blocked on a FIFO pid file"
    out = capsys.readouterr().out
    for name in ops_stack.PROCESSES:
        assert f"{name:<7} stopped" in out, out
    assert run_bounded(stack, "stop", fifos), "stop blocked on a FIFO pid file"
    out = capsys.readouterr().out
    for name in (*ops_stack.PROCESSES, "redis"):
        assert f"{name:<7} not running (stale pid file removed)" in out, out
        assert not os.path.lexists(stack.pid_file(name))


def test_a_directory_pid_file_is_said_by_stop_not_a_crash(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`stop` crashed with IsADirectoryError; now each is one clear line, and the others are
    still stopped (an empty directory is removed; one with files cannot be, which is said)."""
    stack = make_stack(tmp_path)
    for name in (*ops_stack.PROCESSES, "redis"):
        stack.pid_file(name).mkdir()
        (stack.pid_file(name) / "keep").write_text("x")
    ops_stack.status(stack)
    assert "running" not in capsys.readouterr().out
    ops_stack.stop(stack)
    out = capsys.readouterr().out
    for name in (*ops_stack.PROCESSES, "redis"):
        line = next(s for s in out.splitlines() if s.split()[:1] == [name])
        assert line.startswith(f"{name:<7} not running ("), out
        assert f"{stack.pid_file(name)} is no pid file and cannot be removed" in line, out
        assert stack.pid_file(name).is_dir()  # left as it was


def test_read_pid_takes_only_a_small_regular_file(tmp_path: Path) -> None:
    path = tmp_path / "x.pid"
    path.write_text("4242\n")
    assert ops_stack.read_pid(path) == 4242
    path.write_text("4242" + " " * 100 + "\n")  # no pid file of ours
    assert ops_stack.read_pid(path) is None
    link = tmp_path / "link.pid"
    link.symlink_to(tmp_path / "elsewhere")
    (tmp_path / "elsewhere").write_text("4242\n")
    assert ops_stack.read_pid(link) is None
    path.unlink()
    path.mkdir()
    assert ops_stack.read_pid(path) is None


def test_start_clears_what_is_no_pid_file_before_it_writes_one(tmp_path: Path) -> None:
    """A FIFO would hang the pid's write, a symbolic link send it elsewhere (and never be
    read back: the component started again at every start)."""
    stack = make_stack(tmp_path)
    os.mkfifo(stack.pid_file("worker"))
    stack.pid_file("beat").symlink_to(tmp_path / "elsewhere")
    stack.pid_file("flower").mkdir()
    stack.pid_file("redis").write_text("4242\n")
    for name in (*ops_stack.PROCESSES, "redis"):
        ops_stack.clear_odd_pid_file(stack.pid_file(name))
    for name in ops_stack.PROCESSES:
        assert not os.path.lexists(stack.pid_file(name)), name
    assert stack.pid_file("redis").read_text() == "4242\n"
    stack.pid_file("flower").mkdir()
    (stack.pid_file("flower") / "keep").write_text("x")
    with pytest.raises(SystemExit):
        ops_stack.clear_odd_pid_file(stack.pid_file("flower"))


# -- 3. path settings that no path can be ---------------------------------------------------------

PATH_VARIABLES = {
    "KIDX_DB": "/tmp/kidx-x/{}.db",
    "KIDX_DATA_DIR": "/tmp/kidx-x/{}",
    "KIDX_VEC_PATH": "/tmp/kidx-x/{}.so",
    "KIDX_FILES__ROOTS": "/tmp/kidx-x/{}",
}


@pytest.mark.parametrize("variable", sorted(PATH_VARIABLES))
def test_a_path_setting_that_is_not_utf8_is_a_config_error(
    monkeypatch: pytest.MonkeyPatch, variable: str
) -> None:
    """Set from the bytes b'\\xfe' (Python reads a lone surrogate): it was a UnicodeEncodeError
    at the first use, "a bug in kidx"."""
    monkeypatch.setenv(variable, PATH_VARIABLES[variable].format("\udcfe"))
    with pytest.raises(ConfigError) as e:
        load_settings()
    line = str(e.value)
    assert "\n" not in line and f"{variable}: " in line and "not UTF-8" in line, line
    line.encode("utf-8")  # printable: the value is not in it


@pytest.mark.parametrize("field", ["db", "data_dir", "vec_path"])
def test_a_path_setting_with_a_nul_is_a_config_error(field: str, tmp_path: Path) -> None:
    """Given as an override (load_corpus.py --db) or in .env: a ValueError at first use."""
    with pytest.raises(ConfigError) as e:
        load_settings(**{field: f"{tmp_path}/a\0b"})
    assert f"KIDX_{field.upper()}: " in str(e.value) and "NUL" in str(e.value), e.value
    (tmp_path / ".env").write_text(f"KIDX_{field.upper()}={tmp_path}/a\0b\n")
    with pytest.raises(ConfigError) as e:
        load_settings()
    assert f"KIDX_{field.upper()}: " in str(e.value), e.value


def test_kidx_with_a_db_path_that_is_not_utf8_says_one_line(tmp_path: Path) -> None:
    if not KIDX.exists():
        pytest.skip("the kidx command is not installed in this environment")
    env = child_env(tmp_path, KIDX_DB=f"{tmp_path}/x/\udcfe.db")  # passed on as b'\xfe'
    result = subprocess.run(
        [str(KIDX), "init"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: invalid settings: KIDX_DB: "), lines
    assert "bug in kidx" not in result.stderr


# -- 4. a FIFO where the log file goes ------------------------------------------------------------

HANDLERS = """
import logging, sys
from pathlib import Path
from worker.log import configure_logging
configure_logging(fmt="json", file=Path(sys.argv[1]))
logging.getLogger("kidx.test").warning("hello")
print(",".join(type(h).__name__ for h in logging.getLogger().handlers), flush=True)
"""


def configure_in_child(tmp_path: Path, file: Path) -> list[str]:
    """The root handlers a process that logs to `file` has; fails if it blocked."""
    result = subprocess.run(
        [sys.executable, "-c", HANDLERS, str(file)],
        env=child_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(",")


def test_a_fifo_log_file_is_left_out_without_blocking(tmp_path: Path) -> None:
    """With no reader, open() for writing waited for one: every command hung. With one, the
    records went into whatever read the FIFO."""
    fifo = tmp_path / "data" / "log" / "kidx.log"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    try:
        handlers = configure_in_child(tmp_path, fifo)
    except subprocess.TimeoutExpired:
        pytest.fail("configure_logging blocked on a FIFO log file")
    assert handlers == ["StreamHandler"], handlers
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert configure_in_child(tmp_path, fifo) == ["StreamHandler"]
        assert os.read(reader, 100) == b""  # nothing was written into it
    finally:
        os.close(reader)


def test_a_regular_or_new_log_file_is_still_written(tmp_path: Path) -> None:
    """(No regression: the log file is made, then appended to.)"""
    new = tmp_path / "data" / "log" / "kidx.log"
    assert len(configure_in_child(tmp_path, new)) == 2
    assert '"hello"' in new.read_text()
    assert len(configure_in_child(tmp_path, new)) == 2
    assert new.read_text().count('"hello"') == 2
    (tmp_path / "dir.log").mkdir()
    assert configure_in_child(tmp_path, tmp_path / "dir.log") == ["StreamHandler"]


def test_kidx_with_a_fifo_at_its_log_file_does_not_hang(tmp_path: Path) -> None:
    if not KIDX.exists():
        pytest.skip("the kidx command is not installed in this environment")
    fifo = tmp_path / "data" / "log" / "kidx.log"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    env = child_env(tmp_path, KIDX_DB=str(tmp_path / "kidx.db"))
    try:
        result = subprocess.run(
            [str(KIDX), "init"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        pytest.fail("kidx init hung on a FIFO at $KIDX_DATA_DIR/log/kidx.log")
    assert result.returncode == 0, result.stderr


# -- 5. load_corpus.py on a folder with odd *.md entries ------------------------------------------


def load_corpus(tmp_path: Path, folder: Path) -> subprocess.CompletedProcess[str]:
    """The script, into a database `kidx init` made (the script makes none)."""
    from worker.store import connect

    connect(tmp_path / "kidx.db", vec=False).close()
    cmd = [sys.executable, str(ROOT / "ops/scripts/load_corpus.py"), str(folder)]
    cmd += ["--db", str(tmp_path / "kidx.db")]
    try:
        return subprocess.run(
            cmd, env=child_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=90
        )
    except subprocess.TimeoutExpired:
        pytest.fail("load_corpus.py hung")


def test_load_corpus_does_not_wait_on_a_fifo_named_md(tmp_path: Path) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    os.mkfifo(folder / "a-fifo.md")
    (folder / "b-good.md").write_text("# Good\n", encoding="utf-8")
    result = load_corpus(tmp_path, folder)
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == f"skipped {folder / 'a-fifo.md'}: not a regular file"
    assert result.stdout.startswith("1 notes added"), result.stdout


def test_load_corpus_skips_what_is_no_utf8_markdown_file_in_one_line_each(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a-good.md").write_text("# Good\n\nSome text.\n", encoding="utf-8")
    (folder / "b-latin1.md").write_bytes("# Caf\u00e9\n".encode("latin-1"))
    os.mkfifo(folder / "c-fifo.md")
    (folder / "d-dir.md").mkdir()
    (folder / "e-good.md").write_text("# Also good\n", encoding="utf-8")
    result = load_corpus(tmp_path, folder)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.returncode == 0, result.stderr
    skipped = [line for line in result.stderr.splitlines() if line.startswith("skipped ")]
    assert skipped == [
        f"skipped {folder / 'b-latin1.md'}: not UTF-8 (byte 0xe9 at position 5)",
        f"skipped {folder / 'c-fifo.md'}: not a regular file",
        f"skipped {folder / 'd-dir.md'}: not a regular file",
    ], result.stderr
    assert "2 notes added" in result.stdout and "3 skipped" in result.stdout, result.stdout


def test_load_corpus_keeps_its_own_note_beside_a_file_item_and_reads_any_stored_bytes(
    tmp_path: Path,
) -> None:
    """The note of a source was looked up by source alone: after `kidx add file` of the same
    file, the script wrote the note's text into the file item and added no note; and a note a
    host had left holding bytes that are not UTF-8 ended the script with a traceback."""
    import apsw

    folder = tmp_path / "notes"
    folder.mkdir()
    (folder / "a.md").write_text("# A\n\nThe first note.\n", encoding="utf-8")
    (folder / "b.md").write_text("# B\n\nThe second note.\n", encoding="utf-8")
    a, b = (str((folder / n).resolve()) for n in ("a.md", "b.md"))
    from worker.store import connect

    connect(tmp_path / "kidx.db", vec=False).close()
    host = apsw.Connection(str(tmp_path / "kidx.db"))
    host.execute(  # `kidx add file` of the same file, first
        "INSERT INTO knowledge_items(kind, title, source, content) VALUES ('file', 'a.md', ?, '')",
        (a,),
    )
    host.close()
    assert load_corpus(tmp_path, folder).stdout.startswith("2 notes added")
    host = apsw.Connection(str(tmp_path / "kidx.db"))
    host.execute(
        "UPDATE knowledge_items SET content = CAST(X'C328' AS TEXT) WHERE source = ?", (b,)
    )
    host.close()
    result = load_corpus(tmp_path, folder)
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stdout.startswith("0 notes added, 1 updated, 1 unchanged"), result.stdout
    check = apsw.Connection(str(tmp_path / "kidx.db"))
    kinds = check.execute(
        "SELECT kind, CAST(content AS BLOB) FROM knowledge_items WHERE source = ? ORDER BY id", (a,)
    ).fetchall()
    check.close()
    assert kinds == [("file", b""), ("note", b"# A\n\nThe first note.\n")]
