"""Add (or refresh) every Markdown file of a folder as a note: the demo behind `make run`.

    python ops/scripts/load_corpus.py DIR [--db PATH]

A file already loaded (same path) is updated only when its text changed, so running it again
and then `kidx index --all --inline` re-embeds nothing that did not change.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ops.cli.base import one_line_errors
from worker.log import configure_logging
from worker.regular import read_regular
from worker.settings import Settings, load_settings
from worker.store import open_store
from worker.store.items import keep_note


def title_of(text: str, path: Path) -> str:
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return path.stem


def read_note(path: Path) -> str | None:
    """The text of a Markdown file, or None (said in one line on stderr) for what is none: a
    FIFO named *.md hung the load, a byte that is not UTF-8 ended it with a traceback."""
    try:
        data = read_regular(path, follow=True)  # a FIFO: no wait
    except OSError as e:
        print(f"skipped {path}: cannot be read ({e.strerror or e})", file=sys.stderr)
        return None
    if data is None:
        print(f"skipped {path}: not a regular file", file=sys.stderr)
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        print(
            f"skipped {path}: not UTF-8 (byte 0x{data[e.start]:02x} at position {e.start})",
            file=sys.stderr,
        )
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--db", type=Path)
    args = ap.parse_args()
    if not args.folder.is_dir():
        sys.exit(f"error: not a folder: {args.folder}")
    with one_line_errors():  # one line, status 2, as every kidx command says it
        settings = load_settings(**({"db": args.db} if args.db else {}))
    configure_logging(fmt=settings.log_format, level="warning", secrets=settings.secrets())
    with one_line_errors(settings.db):
        load(args.folder, settings)


def load(folder: Path, settings: Settings) -> None:
    added = updated = same = skipped = 0
    # (not created here: `kidx init` does that, and a mistyped --db is no new database)
    with open_store(settings, create=False) as db:
        for path in sorted(folder.glob("*.md")):
            text = read_note(path)
            if text is None:
                skipped += 1
                continue
            if not text.strip():
                continue
            done = keep_note(db, title=title_of(text, path), text=text, source=str(path.resolve()))
            added += done == "added"
            updated += done == "updated"
            same += done == "unchanged"
    print(
        f"{added} notes added, {updated} updated, {same} unchanged"
        + (f", {skipped} skipped" if skipped else "")
        + f", from {folder}"
    )


if __name__ == "__main__":
    main()
