"""Mend the mirror from the truth, with no provider call: vec rows missing for relational vectors
are re-inserted (an interrupted run, vectors written while sqlite-vec was off), and vec rows
without a relational vector of the index's dimension (orphans) are deleted."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker.store.db import Database
from worker.store.vec import VEC, VEC_TABLES, vec_ready

# Per vec table: SQL selecting relational ids of the given item (None: every row).
_ITEM_SCOPE = {
    "vec_note_embeddings": "SELECT item_id FROM note_embeddings WHERE item_id = :item",
    "vec_chunk_embeddings": "SELECT id FROM note_chunks WHERE item_id = :item",
    "vec_memories": None,
    "vec_work_code_chunks": "SELECT id FROM code_chunks WHERE item_id = :item",
}


@dataclass
class RepairReport:
    restored: dict[str, int] = field(default_factory=dict)
    orphans_deleted: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.restored.values()) + sum(self.orphans_deleted.values())


def repair_vectors(db: Database, dimensions: int, *, item_id: int | None = None) -> RepairReport:
    """Restore missing vec rows (of one item, or all) and delete every orphan vec row.

    Runs inside the caller's transaction when there is one (the pipeline's write), else in its
    own. Orphans are looked for in every table: a vec row without its relational row does not
    say which item it belonged to.
    """
    report = RepairReport()
    if not vec_ready(db, dimensions):
        return report
    with db.atomic():
        for t in VEC_TABLES:
            scope = _ITEM_SCOPE[t.name] if item_id is not None else None
            if item_id is not None and scope is None:
                continue
            where = f"AND r.{t.source_key} IN ({scope})" if scope else ""
            missing = db.all(
                f"SELECT r.{t.source_key}, r.vector FROM {t.source} r "
                f"WHERE r.dimensions = :d {where} AND NOT EXISTS "
                f"(SELECT 1 FROM {t.name} v WHERE v.{t.key} = r.{t.source_key})",
                {"d": dimensions, "item": item_id},
            )
            for key, vector in missing:
                db.execute(f"INSERT INTO {t.name}({t.key}, embedding) VALUES (?, ?)", (key, vector))
            if missing:
                report.restored[t.name] = len(missing)
        for t in VEC_TABLES:
            orphans = [
                row[0]
                for row in db.all(
                    f"SELECT v.{t.key} FROM {t.name} v WHERE NOT EXISTS "
                    f"(SELECT 1 FROM {t.source} r WHERE r.{t.source_key} = v.{t.key} "
                    f"AND r.dimensions = :d)",
                    {"d": dimensions},
                )
            ]
            for key in orphans:
                db.execute(f"DELETE FROM {VEC[t.name].name} WHERE {t.key} = ?", (key,))
            if orphans:
                report.orphans_deleted[t.name] = len(orphans)
    return report
