"""The `kidx` command: engine commands (`ops.cli.engine`) and queue commands (`ops.cli.queue`)."""

from ops.cli import backup, doctor, engine, items, queue  # noqa: F401 - register commands
from ops.cli.base import cli


def main() -> None:
    cli(prog_name="kidx")
