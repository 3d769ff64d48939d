"""`kidx doctor`: check every part of the stack (`ops.doctor`) and say what to do."""

from __future__ import annotations

import sys

import click

from ops.cli.base import Ctx, Seconds, cli, command


@command(cli)
@click.option(
    "--timeout",
    type=Seconds(0.1, 600),
    default=5.0,  # ops.doctor.DEFAULT_TIMEOUT (imported lazily: slow)
    show_default=True,
    help="Seconds each check may take.",
)
def doctor(ctx: Ctx, timeout: float) -> None:
    """Check the database, sqlite-vec, Redis, workers, beat, Flower, the models and the jobs;
    one line per check. Exit status 0 only when nothing failed (warnings are not failures)."""
    from ops.doctor import run_checks
    from worker.log import configure_logging

    s = ctx.settings
    # Each check reports its own problem; the library's warnings would say it again.
    configure_logging(fmt=s.log_format, level="error", secrets=s.secrets())
    checks = run_checks(s, timeout)

    def human() -> None:
        for c in checks:
            ctx.echo(c.line())  # the failed check quotes an item's last error

    ctx.emit([c.as_dict() for c in checks], human)
    sys.stdout.flush()
    if not all(c.ok for c in checks):
        sys.exit(1)
