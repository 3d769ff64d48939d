"""Code: chunked along top-level definitions (with path and line range), written to
`code_chunks`, `code_chunk_embeddings` and `vec_work_code_chunks` only, so that code never
crowds out the notes' nearest neighbours; searched on its own (`search_code`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import apsw
import numpy as np

from worker.chunking import ChunkMethod, text_hash
from worker.chunking.code import CodeChunk, chunk_code
from worker.embedding import FailureCounter
from worker.errors import InvalidInput
from worker.indexers.base import Indexer, IndexOptions, Planned, mirror_chunks, plan_vectors
from worker.log import CHUNK
from worker.nearest import nearest
from worker.providers.base import EmbeddingModel
from worker.retrieval import check_query, fuse
from worker.store.db import Database
from worker.store.fts import CODE, fts_problem, fts_write_item, keyword_query
from worker.store.items import Item
from worker.store.repair import repair_vectors
from worker.store.text import integer_or_null, shown
from worker.store.vec import VEC, mirror_ready, vec_delete

SNIPPET = 160
# Candidates each side of a code search gives the fusion (as deep as prose search goes).
CANDIDATES = 50

# A stray vector under a new chunk's id (rows a host deleted by hand) is replaced, not a
# constraint error (REPLACE: as prose.INSERT_VECTOR, no UPDATE that migration 15's trigger
# would take for a host's).
_UPSERT_VECTOR = (
    "INSERT OR REPLACE INTO code_chunk_embeddings(chunk_id, model, dimensions, vector) "
    "VALUES (?, ?, ?, ?)"
)


def _reuse_key(chunk: CodeChunk, path: str, context: int) -> str:
    """The embedder input without the chunk's line range (0-0 in its place): an edit that adds
    or removes a line moves every chunk below it, and keyed on their lines each of those was
    embedded again (LESSONS.md's trap). A vector made for the same code at other lines is as
    good: a question names a path, a symbol or code, not line numbers."""
    return text_hash(chunk._replace(start_line=0, end_line=0).embedding_input(path, context))


class Code(Indexer):
    """Code items."""

    def plan(
        self, db: Database, item: Item, text: str, model: str, options: IndexOptions, ilog: Any
    ) -> Planned:
        """Reuse a vector wherever the same path, symbol and content was embedded."""
        chunks = chunk_code(text, item.source or item.title)
        if not chunks:
            raise InvalidInput(f"{item.title}: no code to index")
        ilog.info(
            f"{CHUNK} chunked",
            chunk_method=str(ChunkMethod.STRUCTURE),
            chunk_count=len(chunks),
            dimensions=db.dimensions,
        )
        title, context = item.title, options.context_chars
        plan = plan_vectors(
            db,
            item,
            chunks,
            model,
            options,
            chunks_table="code_chunks",
            vectors_table="code_chunk_embeddings",
            key=lambda c: _reuse_key(c, title, context),
            # rows keyed on the whole input (as kidx wrote them before): an upgrade embeds
            # nothing again
            older_key=lambda c: text_hash(c.embedding_input(title, context)),
        )
        return Planned(plan)

    def write(
        self,
        db: Database,
        item: Item,
        planned: Planned,
        model: str,
        options: IndexOptions,
        ilog: Any,
        *,
        orphans: bool,
    ) -> tuple[int, int]:
        """Replace the item's code chunks, in the caller's transaction: (vec rows repaired,
        vec writes that failed; why each failed goes in `plan.unmirrored`)."""
        plan, dims = planned.plan, db.dimensions
        counter = FailureCounter(options.max_consecutive_failures, ilog)
        mirror = mirror_ready(db, dims)
        old = [r[0] for r in db.all("SELECT id FROM code_chunks WHERE item_id = ?", (item.id,))]
        if mirror:
            vec_delete(db, "vec_work_code_chunks", old)
        db.execute("DELETE FROM code_chunks WHERE item_id = ?", (item.id,))
        vectors: list[tuple[int, int, bytes]] = []  # (position in the plan, chunk id, vector)
        for i, c in enumerate(plan.chunks):
            chunk_id = db.scalar(
                "INSERT INTO code_chunks(item_id, chunk_index, path, start_line, end_line, "
                "content, embed_hash) VALUES (?, ?, ?, ?, ?, ?, ?) RETURNING id",
                (item.id, c.index, item.title, c.start_line, c.end_line, c.content, plan.hashes[i]),
            )
            vector = plan.vectors.get(i)
            if vector is None:  # no vector left under its id (a chunk deleted by hand) is its
                db.execute("DELETE FROM code_chunk_embeddings WHERE chunk_id = ?", (chunk_id,))
                if mirror:
                    vec_delete(db, "vec_work_code_chunks", [chunk_id])
                continue
            db.execute(_UPSERT_VECTOR, (chunk_id, model, dims, vector))
            vectors.append((i, chunk_id, vector))
        if mirror and vectors:
            plan.unmirrored = mirror_chunks(db, "vec_work_code_chunks", vectors, plan, counter)
        fts_write_item(db, CODE, item.id, old)
        # kept=(): every vector of the item was just written (a point lookup each was all the
        # restore did, and read the stray row that the write could not replace)
        repaired = repair_vectors(db, dims, item_id=item.id, orphans=orphans, kept=()).total
        return repaired, len(plan.unmirrored)

    def search(self, db: Database, query: str, embedder: EmbeddingModel, *, k: int = 10) -> Any:
        return search_code(db, query, embedder, k=k)


@dataclass
class CodeHit:
    item_id: int
    path: str
    start_line: int
    end_line: int
    score: float
    snippet: str
    via: str

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def search_code(
    db: Database, query: str, embedder: EmbeddingModel, *, k: int = 10
) -> tuple[list[CodeHit], str, str | None]:
    """The k best code chunks for `query` (code only: notes are never returned here): the
    vector side and the keyword side (FTS5 over the path and the code, identifiers split as
    unicode61 and `identifier_parts` split them) fused as prose search fuses them
    (worker.retrieval: RRF, the keyword side trusted twice as much), since a query naming an
    identifier is what code search is asked most. `score`: the cosine similarity when only
    the vector side serves, else the fused score; the paths that served, joined by `+`."""
    k = check_query(query, k)
    vector = embedder.embed([query])[0]
    with db.reading():  # one snapshot from ranking to the rows read (retrieval's reason)
        return _search_code(db, query, vector, embedder.model_id, k)


def _search_code(
    db: Database, query: str, vector: np.ndarray, model: str, k: int
) -> tuple[list[CodeHit], str, str | None]:
    """Candidates to a depth, deeper while rows that cannot be shown (a host's TEXT in a line
    number, until the sweep writes them again) leave fewer than k hits and more are left:
    prose search refills so; code search returned 49 hits for k=50."""
    depth = max(k, CANDIDATES)
    while True:
        hits, served, reason, more = _ranked(db, query, vector, model, k, depth)
        if len(hits) >= k or not more:
            return hits, served, reason
        depth *= 2


def _ranked(
    db: Database, query: str, vector: np.ndarray, model: str, k: int, depth: int
) -> tuple[list[CodeHit], str, str | None, bool]:
    """`_search_code` to `depth` candidates a side; and whether either side had more."""
    found, via, reason = nearest(db, VEC["vec_work_code_chunks"], vector, depth, model)
    similarity = {chunk_id: round(1 - distance, 6) for chunk_id, distance in found}
    match = keyword_query(query)
    keyword: list[int] = []
    if match is not None and (problem := fts_problem(db, CODE)) is not None:
        unusable = f"{CODE.name} {problem} (the sweep rebuilds it): no keyword hit"
        reason = f"{reason}; {unusable}" if reason else unusable
    elif match is not None:
        try:
            keyword = [
                r[0]
                for r in db.all(
                    f"SELECT f.rowid FROM {CODE.name} f JOIN code_chunks c ON c.id = f.rowid "
                    "JOIN knowledge_items i ON i.id = c.item_id AND i.kind = 'code' "
                    f"WHERE {CODE.name} MATCH ? ORDER BY bm25({CODE.name}), f.rowid LIMIT ?",
                    (match, depth),
                )
            ]
        except (apsw.CorruptError, apsw.SQLError):  # a host wrote into its shadow tables
            # (corrupt, or `invalid fts5 file format`): vectors serve
            damaged = f"{CODE.name} is damaged (the sweep rebuilds it): no keyword hit"
            reason = f"{reason}; {damaged}" if reason else damaged
    if keyword:
        # Scored to a fixed depth, as prose search does: the order of the first hits
        # does not depend on k.
        order, fused, paths = fuse([([c for c, _ in found], via), (keyword, "fts")], CANDIDATES)
        served = f"{via}+fts" if found else "fts"
    else:
        order, fused, paths = [c for c, _ in found], similarity, {c: via for c in similarity}
        served = via
    hits = []
    for chunk_id in order:
        if len(hits) == k:
            break
        row = db.one(  # an item a host turned into a note keeps these until the sweep
            # A line that is no integer as NULL: a host's TEXT there that is not UTF-8, which
            # apsw cannot read, failed the whole search
            "SELECT c.item_id, CAST(c.path AS BLOB), "
            f"{integer_or_null('c.start_line')}, {integer_or_null('c.end_line')}, "
            "CAST(c.content AS BLOB) FROM code_chunks c "
            "JOIN knowledge_items i ON i.id = c.item_id AND i.kind = 'code' WHERE c.id = ?",
            (chunk_id,),
        )
        if row is not None:
            item_id, path, start, end, content = row
            if not (type(start) is int and type(end) is int):
                continue  # a host wrote something else there: no place to show it at
            path = shown(path)
            snippet = " ".join(shown(content).split())[:SNIPPET]
            score = round(fused[chunk_id], 6)
            hits.append(CodeHit(item_id, path, start, end, score, snippet, paths[chunk_id]))
    return hits, served, reason, len(found) >= depth or len(keyword) >= depth
