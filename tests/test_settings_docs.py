"""The README's table of settings names every setting, and no setting that is not there."""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import BaseModel

from worker.settings import Settings

README = Path(__file__).resolve().parents[1] / "README.md"


def documented() -> set[str]:
    """The variables of the table's rows: `KIDX_X__A`, `__B` names KIDX_X__A and KIDX_X__B."""
    names: set[str] = set()
    for line in README.read_text(encoding="utf-8").splitlines():
        if not line.startswith("| `KIDX_"):
            continue
        prefix = None
        for token in re.findall(r"`([A-Z_]+)`", line.split("|")[1]):
            if token.startswith("KIDX_"):
                names.add(token)
                prefix = token.split("__")[0] if "__" in token else None
            elif token.startswith("__") and prefix is not None:
                names.add(prefix + token)
    return names


def variables() -> set[str]:
    names: set[str] = set()
    for name, field in Settings.model_fields.items():
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            names.update(f"KIDX_{name.upper()}__{sub.upper()}" for sub in kind.model_fields)
        else:
            names.add(f"KIDX_{name.upper()}")
    return names


def test_every_setting_is_in_the_readme():
    assert sorted(variables() - documented()) == []


def test_the_readme_names_no_setting_that_is_not_there():
    assert sorted(documented() - variables()) == []
