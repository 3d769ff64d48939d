"""A host application in another language, as far as kidx can tell: Python's own `sqlite3`
module, no kidx code, foreign keys off (SQLite's default), in a process of its own (two SQLite
libraries in one process crashed here).

    python tests/host_sql.py DB < statements.json

stdin: a JSON list of [sql, params]; a parameter {"hex": "ff00"} is bound as bytes (a BLOB).
stdout: a JSON list with each statement's rows (bytes as {"hex": ...}).
"""

from __future__ import annotations

import json
import sqlite3
import sys
from typing import Any


def _param(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"hex"}:
        return bytes.fromhex(value["hex"])
    return value


def _out(value: Any) -> Any:
    return {"hex": value.hex()} if isinstance(value, bytes) else value


def main() -> None:
    con = sqlite3.connect(sys.argv[1], isolation_level=None, timeout=30)
    con.text_factory = bytes  # read what is there, whatever it is
    results = []
    for sql, params in json.load(sys.stdin):
        rows = con.execute(sql, [_param(p) for p in params]).fetchall()
        results.append([[_out(v) for v in row] for row in rows])
    con.close()
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
