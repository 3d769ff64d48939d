"""The two versions of a corpus that bench/incremental.py writes: `before/` and `after/` (the
same file names; some files edited). Shared by the peers; imports nothing of kidx or a peer."""

from __future__ import annotations

from pathlib import Path


def read_pair(before: Path, after: Path) -> tuple[dict[str, str], dict[str, str], list[str]]:
    """(texts before, texts after, names of the files that changed), by file name."""
    old = {p.name: p.read_text(encoding="utf-8") for p in sorted(before.glob("*.md"))}
    new = {p.name: p.read_text(encoding="utf-8") for p in sorted(after.glob("*.md"))}
    old = {k: v for k, v in old.items() if v.strip()}
    new = {k: v for k, v in new.items() if v.strip()}
    changed = sorted(k for k in new if old.get(k) != new[k])
    return old, new, changed


def source_of(name: str) -> str:
    """The source id every peer gives a file: its name, the same in both versions."""
    return name
