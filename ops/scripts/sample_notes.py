"""Write a few sample notes: the demo's material when ../shared/corpus/rustbook is absent.

    python ops/scripts/sample_notes.py [--db PATH]

Each note has a fixed source (`sample:<name>`), so running it again changes nothing unless the
text below changed.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ops.cli.base import one_line_errors
from worker.log import configure_logging
from worker.settings import Settings, load_settings
from worker.store import open_store
from worker.store.items import keep_note

NOTES = {
    "Ownership": "# Ownership\n\nEach value has one owner. Assigning a String to another "
    "variable moves it: the first variable can no longer be used, and the heap data is freed "
    "once, when the new owner goes out of scope.",
    "Borrowing": "# Borrowing\n\nA reference lends a value without moving it. Any number of "
    "shared references, or exactly one mutable reference, may exist at a time.",
    "Shopping": "# Shopping\n\nMilk, eggs, a loaf of bread and coffee.",
    "Sourdough": "# Sourdough\n\nFeed the starter the night before; mix flour, water and salt; "
    "fold every half hour; bake at 250 °C in a covered pot.",
    "Bicycle": "# Bicycle\n\nPump the tyres to 4 bar, oil the chain, check the brake pads.",
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--db", type=Path)
    args = ap.parse_args()
    with one_line_errors():
        settings = load_settings(**({"db": args.db} if args.db else {}))
    configure_logging(fmt=settings.log_format, level="warning", secrets=settings.secrets())
    with one_line_errors(settings.db):
        add_notes(settings)


def add_notes(settings: Settings) -> None:
    added = updated = 0
    # (not created here: `kidx init` does that, and a mistyped --db is no new database)
    with open_store(settings, create=False) as db:
        for title, text in NOTES.items():
            done = keep_note(db, title=title, text=text, source=f"sample:{title.lower()}")
            added += done == "added"
            updated += done == "updated"
    print(f"{added} sample notes added, {updated} updated, of {len(NOTES)}")


if __name__ == "__main__":
    main()
