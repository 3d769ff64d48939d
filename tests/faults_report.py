"""The fault suite's figures (tests/test_faults_*.py), printed at the end of the run by the
`pytest_terminal_summary` hook in conftest.py: one line per fault class."""

from __future__ import annotations

from typing import Any

CLASSES = ("crash", "provider chaos", "total outage", "edit storm", "hostile input", "security")
COLUMNS = ("runs", "kills", "faults injected", "items checked", "items lost")

FIGURES: dict[str, dict[str, int]] = {}


def record(fault: str, *, kills: int = 0, faults: int = 0, checked: int = 0, lost: int = 0) -> None:
    """Add one run of a fault class to the figures (called by each test, pass or fail)."""
    row = FIGURES.setdefault(fault, dict.fromkeys(COLUMNS, 0))
    row["runs"] += 1
    row["kills"] += kills
    row["faults injected"] += faults
    row["items checked"] += checked
    row["items lost"] += lost


def merge(figures: dict[str, dict[str, int]]) -> None:
    """Add the figures another test process recorded (pytest-xdist: each worker has its own)."""
    for fault, row in figures.items():
        mine = FIGURES.setdefault(fault, dict.fromkeys(COLUMNS, 0))
        for col in COLUMNS:
            mine[col] += row.get(col, 0)


def lines() -> list[str]:
    known = [c for c in CLASSES if c in FIGURES] + sorted(set(FIGURES) - set(CLASSES))
    width = max((len(c) for c in known), default=0)
    return [
        f"{fault:<{width}}  " + ", ".join(f"{col} {FIGURES[fault][col]}" for col in COLUMNS)
        for fault in known
    ]


def summary(terminalreporter: Any) -> None:
    if not FIGURES:
        return
    terminalreporter.write_sep("=", "fault suite: figures per fault class")
    for line in lines():
        terminalreporter.write_line(line)
