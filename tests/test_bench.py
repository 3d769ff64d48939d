"""The benchmark commands start: each script that takes options answers `--help` (a script
whose imports broke, as bench/search_modes.py's did when a helper it imported was removed as
unused, fails here rather than at the end of a long run). Nothing is measured here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if "argparse" in p.read_text(encoding="utf-8"))


def test_there_are_benchmarks_to_start() -> None:
    assert {"throughput.py", "search.py", "search_modes.py", "write_path.py"} <= {
        p.name for p in SCRIPTS
    }


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.stem for p in SCRIPTS])
def test_a_benchmark_answers_help(script: Path) -> None:
    out = subprocess.run(
        [sys.executable, str(script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=BENCH.parent,
    )
    assert out.returncode == 0 and "usage" in out.stdout, out.stderr[-2000:]
