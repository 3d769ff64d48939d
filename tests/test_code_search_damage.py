"""Code search with its keyword index damaged by a host (FTS5's shadow tables written with
plain SQL): vectors serve and the reason says so. An `invalid fts5 file format` (SQLError,
where only CorruptError was caught) crashed it, as it did prose search."""

from __future__ import annotations

from pathlib import Path

from host import host
from worker.bulk import index_item
from worker.indexers import IndexOptions
from worker.indexers.code import search_code
from worker.settings import FilesSettings
from worker.sources import Reader
from worker.store import connect
from worker.store.items import add_item


def test_a_code_keyword_index_fts5_cannot_open_leaves_code_search_to_vectors(
    db, embedder, emb_settings, tmp_path: Path
):
    path = tmp_path / "shapes.py"
    path.write_text(
        "\n\n".join(f"def area_{j}(r):\n    return 3.14 * r * r * {j}\n" for j in range(8))
    )
    item = add_item(db, kind="code", title=path.name, content="", source=str(path))
    reader = Reader(FilesSettings(roots=[tmp_path]))
    index_item(db, item, embedder=embedder, options=IndexOptions(reader=reader))
    vector, _, _ = search_code(db, "zzqq", embedder, k=3)  # no keyword hit: vectors alone
    host(db.path, ("UPDATE code_chunks_fts_config SET v = 99 WHERE k = 'version'", []))
    fresh = connect(db.path, embedding=emb_settings)  # FTS5 reads its config when opened
    try:
        hits, via, reason = search_code(fresh, "area", embedder, k=3)
        again, _, _ = search_code(fresh, "zzqq", embedder, k=3)
    finally:
        fresh.close()
    assert via == "vec" and "code_chunks_fts is damaged" in str(reason)
    assert len(hits) == 3 and [h.start_line for h in again] == [h.start_line for h in vector]
