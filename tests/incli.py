"""`kidx` run inside the test process through click's runner, as a `CompletedProcess`.

The same command group, arguments, `KIDX_*` environment and working directory as the console
script, without starting Python for each call (about 0.8 s of imports each, most of the quick
tier's time). An exception that escapes the command is put on stderr as a traceback, as the
interpreter would print it, so the checks made on a real process's stderr hold here too. Tests
about the process itself (its exit, its streams, its first start) keep running the console script.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import traceback
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import structlog
from click.testing import CliRunner

from ops.cli import cli
from ops.cli.base import err, out

CLEARED = ("FORCE_COLOR", "NO_COLOR", "TTY_COMPATIBLE")


@contextlib.contextmanager
def _uncached_loggers() -> Iterator[None]:
    """The command configures structlog as a process does, caching each logger on first use;
    in this process that would freeze the module-level loggers on the command's streams, and
    later tests' `structlog.testing.capture_logs()` would see nothing."""
    real = structlog.configure

    def configure(**kwargs: Any) -> None:
        real(**{**kwargs, "cache_logger_on_first_use": False})

    structlog.configure = configure  # type: ignore[assignment]
    try:
        yield
    finally:
        structlog.configure = real


def run_kidx(
    args: Sequence[str], env: Mapping[str, str], cwd: Path
) -> subprocess.CompletedProcess[str]:
    """`kidx *args` with exactly `env`'s kidx settings (none inherited from this process)."""
    overlay: dict[str, str | None] = {
        k: None for k in os.environ if k.startswith("KIDX_") or k in CLEARED
    }
    overlay.update(env)
    for console in (out, err):  # sized when first imported (an xdist worker: COLUMNS=80)
        console.width = int(overlay.get("COLUMNS") or 80)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        with contextlib.chdir(cwd), _uncached_loggers():
            result = CliRunner().invoke(cli, list(args), env=overlay, prog_name="kidx")
    finally:
        root.handlers, root.level = handlers, level  # the command configured logging on its streams
        structlog.reset_defaults()
    stderr = result.stderr
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        exc = result.exception
        stderr += "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return subprocess.CompletedProcess(["kidx", *args], result.exit_code, result.stdout, stderr)
