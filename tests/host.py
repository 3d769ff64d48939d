"""Plain SQL as a host application runs it, in a process of its own (tests/host_sql.py): this
module imports no SQLite library, so a test process never holds two."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

HOST = Path(__file__).with_name("host_sql.py")


def host(db: Path, *statements: tuple[str, list[Any]]) -> list[list[list[Any]]]:
    """Run statements as a host application would: plain SQL, foreign keys off."""
    out = subprocess.run(
        [sys.executable, str(HOST), str(db)],
        input=json.dumps(statements),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        raise AssertionError(f"the host's SQL failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)
