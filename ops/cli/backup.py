"""`kidx backup DEST`: SQLite's online backup, safe while workers write (WAL; the copy is a
consistent snapshot, taken in steps so that writers are never blocked for long)."""

from __future__ import annotations

import time
from pathlib import Path

import apsw
import click

from ops.cli.base import Ctx, cli, command
from worker.errors import InvalidInput

PAGES_PER_STEP = 1024


@command(cli)
@click.argument("dest", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--force", is_flag=True, help="Replace DEST if it exists.")
def backup(ctx: Ctx, dest: Path, force: bool) -> None:
    """Copy the database to DEST while it is in use (SQLite's online backup)."""
    source = Path(ctx.settings.db)
    if not source.is_file():
        raise InvalidInput(f"no database at {source}")
    if dest.exists() and not force:
        raise InvalidInput(f"{dest} exists (use --force to replace it)")
    if dest.resolve() == source.resolve():
        raise InvalidInput("the backup cannot be the database itself")
    dest.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    src = apsw.Connection(str(source), flags=apsw.SQLITE_OPEN_READONLY)
    src.set_busy_timeout(ctx.settings.busy_timeout_ms)
    out = apsw.Connection(str(dest))
    try:
        with out.backup("main", src, "main") as b:
            while not b.done:
                b.step(PAGES_PER_STEP)
                time.sleep(0.001)  # let writers in between steps
        check = out.execute("PRAGMA integrity_check").fetchall()
    finally:
        out.close()
        src.close()
    ok = check == [("ok",)]
    info = {
        "backup": str(dest),
        "bytes": dest.stat().st_size,
        "integrity": "ok" if ok else check,
        "seconds": round(time.monotonic() - started, 3),
    }
    ctx.emit(
        info,
        lambda: click.echo(
            f"backed up {source} to {dest} ({info['bytes']} bytes, "
            f"integrity {info['integrity']}, {info['seconds']} s)"
        ),
    )
    if not ok:
        raise InvalidInput(f"the copy at {dest} failed its integrity check: {check}")
