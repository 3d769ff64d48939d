"""Add (or refresh) every Markdown file of a folder as a note: the demo behind `make run`.

    python ops/scripts/load_corpus.py DIR [--db PATH]

A file already loaded (same path) is updated only when its text changed, so running it again
and then `kidx index --all --inline` re-embeds nothing that did not change.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from worker.log import configure_logging
from worker.settings import load_settings
from worker.store import open_store
from worker.store.items import add_item, update_content


def title_of(text: str, path: Path) -> str:
    for line in text.splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
    return path.stem


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--db", type=Path)
    args = ap.parse_args()
    if not args.folder.is_dir():
        sys.exit(f"error: not a folder: {args.folder}")
    settings = load_settings(**({"db": args.db} if args.db else {}))
    configure_logging(fmt=settings.log_format, level="warning", secrets=settings.secrets())
    added = updated = same = 0
    with open_store(settings) as db:
        for path in sorted(args.folder.glob("*.md")):
            text = path.read_text(encoding="utf-8")
            if not text.strip():
                continue
            source = str(path.resolve())
            row = db.one("SELECT id, content FROM knowledge_items WHERE source = ?", (source,))
            if row is None:
                add_item(db, kind="note", title=title_of(text, path), content=text, source=source)
                added += 1
            elif row[1] != text:
                update_content(db, row[0], text)
                updated += 1
            else:
                same += 1
    print(f"{added} notes added, {updated} updated, {same} unchanged, from {args.folder}")


if __name__ == "__main__":
    main()
