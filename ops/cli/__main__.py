"""`python -m ops.cli` is the `kidx` command."""

from ops.cli import main

main()
