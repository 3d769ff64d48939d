"""Search over prose (notes, files, URLs): `search_chunks()`, the one function every caller uses
(the CLI, host applications, the benchmarks). Code and memories keep their own tables and their
own search (`worker.indexers.code`, `worker.indexers.memories`).

Three modes:

* `vector`: the nearest chunk vectors (sqlite-vec KNN; exact cosine in memory over the
  relational vectors when sqlite-vec, a vec table or the dimension is missing: `fallback`).
* `keyword`: FTS5 BM25 over each chunk's text, title and heading path (`worker.store.fts`);
  needs no embedder and no sqlite-vec.
* `hybrid` (the default): both candidate lists fused by reciprocal rank; a query with no
  indexable word is served by vectors alone.

Filters (kind, item ids, source prefix) are applied inside the candidate search, never by
fetching k and dropping: a filter that matches at least k chunks returns k hits.

Each hit is a chunk with its full text, offsets and heading path, and says which paths found
it (`via`: `vec`, `fts`, `fallback`, joined by `+`). `per_item=True` keeps the best chunk of each
item (a UI's note list); `search()` is that, vector-only, in the older result shape.
"""

from __future__ import annotations

import enum
import json
import numbers
import operator
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import apsw
import numpy as np

from worker.chunking import heading_titles
from worker.errors import InvalidInput
from worker.hamming import nearest_bits
from worker.nearest import (
    KNN_MAX,
    NO_DIRECTION,
    VecUnreadable,
    by_distance,
    distances,
    exact_nearest,
    knn_ended,
    past_ties,
    rescored,
    unavailable,
    undirected,
    vec_failed,
    widening,
)
from worker.providers.base import EmbeddingModel
from worker.settings import SearchSettings
from worker.store.db import Database
from worker.store.fts import NOTES, fts_problem, keyword_query
from worker.store.text import given_text, integer_or_null, shown
from worker.store.vec import VEC, sound, vec_table_dimensions

SNIPPET = 160
MAX_K = 1000
# Hybrid: each side's candidate list is at least this deep, and the fusion scores this many of
# each, whatever k, so that a chunk's fused score (and so one item's best chunk, and the order
# of the first hits) does not depend on k; deeper candidates (k over a quarter of it) are
# ordered by their best rank after the scored ones.
HYBRID_DEPTH = 40
# Reciprocal rank fusion: rank r in a list scores weight / (RRF_K + r). Measured on the Chroma
# chunking benchmark (bench/retrieval.py, all-MiniLM-L6-v2, top 5): keyword search alone beats
# the small model there (recall 83.9 vs 74.9), and the fusion does best trusting it more and
# the top ranks more than Cormack et al.'s K=60 does (recall 85.6 vs 83.2 with 60 and equal
# weights; a min-max score blend peaked at the same recall as the plain fusion).
RRF_K = 10
WEIGHTS = {"fts": 1.0, "vec": 0.5, "fallback": 0.5}
# A filter matching at most this many chunks is searched exactly over its own chunks; a wider
# one through KNN, asking for more rows until k pass the filter.
FILTER_EXACT = 20_000
# Two passes rescore at most this many candidates; a filter that needs more is served by the
# float table's KNN (or exactly).
TWO_PASS_MAX = 65_536
PROSE_KINDS = ("note", "file", "url")


class Mode(enum.StrEnum):
    HYBRID = "hybrid"
    VECTOR = "vector"
    KEYWORD = "keyword"


@dataclass(frozen=True)
class Filters:
    """Which chunks a search may return: of these kinds, of these items, whose item's source
    starts with this prefix (a folder, a site). Empty (or None) means no restriction: any
    prose item, never code (an item a host turned into code keeps its prose chunks until the
    sweep re-indexes it, and they are not prose search's to show)."""

    kinds: tuple[str, ...] = ()
    item_ids: tuple[int, ...] = ()
    source_prefix: str | None = None

    def __post_init__(self) -> None:
        # A caller in any language may pass anything: a string for a list would be read a
        # letter at a time, bytes for the prefix would never match.
        for name in ("kinds", "item_ids"):
            value = getattr(self, name)
            if value is None:
                value = ()
            if isinstance(value, str | bytes) or not isinstance(value, Iterable):
                raise InvalidInput(f"{name} must be a list, not {value!r:.60}")
            object.__setattr__(self, name, tuple(value))
        prefix = self.source_prefix
        if prefix is not None and not isinstance(prefix, str):
            raise InvalidInput(f"the source prefix must be a string, not {prefix!r:.60}")
        if prefix is not None and not prefix.isascii():
            try:
                prefix.encode("utf-8")
            except UnicodeEncodeError:
                raise InvalidInput(
                    "the source prefix is not UTF-8 text (a lone surrogate)"
                ) from None
        for kind in self.kinds:
            if kind not in PROSE_KINDS:
                raise InvalidInput(
                    f"kind {kind!r} is not searched here: give one of {', '.join(PROSE_KINDS)}"
                    + (" (code has its own search: --code)" if kind == "code" else "")
                )
        ids = []
        for item_id in self.item_ids:
            value = integer(item_id)  # a numpy integer too: as an int, never bound as bytes
            if value is None or not -(2**63) <= value < 2**63:
                raise InvalidInput(f"an item id is a 64-bit integer, not {item_id!r}")
            ids.append(value)
        object.__setattr__(self, "item_ids", tuple(ids))
        if self.source_prefix is not None and not self.source_prefix:
            raise InvalidInput("the source prefix is empty")

    @property
    def active(self) -> bool:
        return bool(self.kinds or self.item_ids or self.source_prefix)

    def where(self) -> tuple[str, list[Any]]:
        """SQL conditions over `c` (note_chunks) and `i` (knowledge_items), and their values."""
        kinds = self.kinds or PROSE_KINDS
        sql = f" AND i.kind IN ({','.join('?' * len(kinds))})"
        params: list[Any] = list(kinds)
        if self.item_ids:  # one value, however many ids (SQLite binds 32,766 at most)
            sql += " AND c.item_id IN (SELECT value FROM json_each(?))"
            params.append(json.dumps(list(self.item_ids)))
        if self.source_prefix:
            # Compared as UTF-8 bytes: SQL's text functions stop at a NUL (a prefix holding
            # one never matched), and a host's source may be a BLOB of the same bytes.
            prefix = self.source_prefix.encode("utf-8")
            sql += " AND substr(CAST(i.source AS BLOB), 1, ?) = ?"
            params += [len(prefix), prefix]
        return sql, params


def integer(value: object) -> int | None:
    """`value` as an int when it is an integer (a numpy one too; never a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return operator.index(value)


@dataclass
class ChunkHit:
    item_id: int
    title: str
    kind: str
    source: str | None
    chunk_index: int
    headings: list[str]
    start_offset: int
    end_offset: int
    content: str
    # vector: cosine similarity; keyword: -BM25; hybrid: the fused score, or the one list's
    # own score when only one served (no keyword term, or no usable keyword index)
    score: float
    via: str  # the paths that found it: vec, fts, fallback, joined by "+"
    chunk_id: int

    @property
    def snippet(self) -> str:
        return " ".join(self.content.split())[:SNIPPET]

    def as_dict(self) -> dict[str, object]:
        return asdict(self) | {"snippet": self.snippet}


@dataclass
class ChunkSearch:
    hits: list[ChunkHit]
    mode: Mode
    via: str  # the paths that served: vec, fts, fallback, joined by "+"
    reason: str | None = None  # why the fallback served, or what the answer cannot include
    notes: list[str] = field(default_factory=list)


# The longest query taken: embedders read a few hundred tokens of it; a 10 MB one made the
# local model's tokenizer take 1.5 GB, to give the answer its first 256 tokens give.
QUERY_MAX = 100_000


def check_query(query: object, k: object) -> int:
    """Every search's arguments, as a caller in any language may send them: a non-empty
    string, and k from 1 to MAX_K (k=-1 would slice all hits but the last), returned as an
    int (a numpy integer is one too: bound as an int, never as its bytes)."""
    if not isinstance(query, str):
        raise InvalidInput(f"the query must be a string, not {type(query).__name__}")
    if len(query) > QUERY_MAX:  # a model reads a few hundred tokens; 10 MB took 1.5 GB
        raise InvalidInput(f"the query is {len(query)} characters long: at most {QUERY_MAX}")
    given_text(query, "query")  # (a lone surrogate: the local model's tokenizer raised)
    if not query.strip():
        raise InvalidInput("the query is empty")
    whole = integer(k)
    if whole is None or not 1 <= whole <= MAX_K:
        raise InvalidInput(f"k must be an integer from 1 to {MAX_K}, not {k!r}")
    return whole


def search_chunks(
    db: Database,
    query: str,
    embedder: EmbeddingModel | None,
    *,
    k: int = 10,
    mode: Mode | str = Mode.HYBRID,
    filters: Filters | None = None,
    per_item: bool = False,
    tuning: SearchSettings | None = None,
) -> ChunkSearch:
    """The k chunks best matching `query` (with `per_item`: the best chunk of each of k items).
    `tuning`: the two-pass vector search's settings (`KIDX_SEARCH__*`; default: the defaults)."""
    k = check_query(query, k)
    if filters is not None and not isinstance(filters, Filters):
        raise InvalidInput(
            "filters must be a worker.retrieval.Filters(kinds=..., item_ids=..., "
            f"source_prefix=...), not a {type(filters).__name__}"
        )
    if tuning is not None and not isinstance(tuning, SearchSettings):
        raise InvalidInput(
            "tuning must be a worker.settings.SearchSettings (KIDX_SEARCH__*), not a "
            f"{type(tuning).__name__}"
        )
    if not isinstance(per_item, bool | np.bool_):  # ("no" is true)
        raise InvalidInput(f"per_item must be True or False, not {per_item!r:.60}")
    try:
        mode = Mode(mode)
    except ValueError:
        raise InvalidInput(f"mode must be one of {', '.join(Mode)}, not {mode!r}") from None
    filters = filters or Filters()
    tuning = tuning or SearchSettings()
    notes: list[str] = []
    match = keyword_query(query) if mode != Mode.VECTOR else None
    if mode == Mode.KEYWORD and match is None:
        notes.append("the query has no word to search for: no keyword hit")
    # Not only there: kidx's (a host's `fts5(content)` in its place matched the host's rows
    # and gave their rowids as chunks that hold none of the query's words)
    if match is not None and (problem := fts_problem(db, NOTES)) is not None:
        notes.append(f"{NOTES.name} {problem} (the sweep rebuilds it): no keyword search")
        match = None
    vector = None
    if mode != Mode.KEYWORD:
        if embedder is None:
            raise InvalidInput(
                "vector search needs an embedding provider (KIDX_EMBEDDING__PROVIDER); "
                "--mode keyword needs none"
            )
        vector = embedder.embed([query])[0]
        behind = _not_on(db, embedder.model_id, len(vector))
        if behind:  # during a model switch: say what the answer cannot include yet
            notes.append(
                f"{behind} items are not indexed with {embedder.model_id} yet and are "
                "not searched by vector"
            )

    with db.reading():  # one snapshot from ranking to the rows read
        return _search(db, vector, match, embedder, k, mode, filters, per_item, tuning, notes)


def _search(
    db: Database,
    vector: np.ndarray | None,
    match: str | None,
    embedder: EmbeddingModel | None,
    k: int,
    mode: Mode,
    filters: Filters,
    per_item: bool,
    tuning: SearchSettings,
    notes: list[str],
) -> ChunkSearch:
    # Candidates: the n best chunks of each side (hybrid: more than k, for the fusion). One hit
    # per item: the same lists, longer until they hold k items or all there is; and longer
    # when a candidate's row could not be shown (a host's offsets) and k hits were not left.
    n = k if mode != Mode.HYBRID else max(4 * k, HYBRID_DEPTH)
    while True:
        ranked: list[tuple[list[int], str]] = []  # chunk ids best first, and their path
        own: list[dict[int, float]] = []  # each list's own scores, in the same order
        more = False
        if vector is not None and embedder is not None:
            found, via, reason = _vector(db, vector, n, embedder.model_id, filters, tuning)
            ranked.append(([c for c, _ in found], via))
            own.append({c: 1.0 - d for c, d in found})
            more |= len(found) == n
        if match is not None:
            found_kw = _keyword(db, match, n, filters)
            if found_kw is None:  # a host wrote into its shadow tables: vectors serve
                notes.append(f"{NOTES.name} is damaged (the sweep rebuilds it): no keyword hit")
                match = None
            else:
                ranked.insert(0, ([c for c, _ in found_kw], "fts"))
                own.insert(0, {c: -s for c, s in found_kw})
                more |= len(found_kw) == n
        if len(ranked) > 1:
            order, scores, paths = fuse(ranked, HYBRID_DEPTH)
        else:  # one list served (a hybrid search too, when the other could not): its scores
            order = ranked[0][0] if ranked else []
            scores = own[0] if own else {}
            paths = {c: ranked[0][1] for c in order}
        if not per_item or not more or _items_in(db, order) >= k:
            hits = _load(db, order, scores, paths, k, per_item)
            if len(hits) == k or not more:
                break
        n *= 4
    if vector is not None and reason:
        notes.append(f"served by the in-memory fallback: {reason}")
    served = "+".join(dict.fromkeys(p for _, p in ranked))
    return ChunkSearch(hits, mode, served, "; ".join(notes) or None, notes)


def _items_in(db: Database, chunk_ids: list[int]) -> int:
    """How many items these chunks come from."""
    return len({r[0] for r in _rows(db, "c.item_id", chunk_ids)})


def fuse(
    ranked: Sequence[tuple[list[int], str]], depth: int
) -> tuple[list[int], dict[int, float], dict[int, str]]:
    """Reciprocal rank fusion: each list gives weight / (RRF_K + rank) to each of its first
    `depth` chunks. Deeper ranks (the lists grow when one hit per item needs more items) only order
    what no list scored, by their best rank: the fused order of the first `depth` does not
    depend on how deep the lists went."""
    scores: dict[int, float] = {}
    best_rank: dict[int, int] = {}
    paths: dict[int, list[str]] = {}
    for ids, path in ranked:
        for rank, chunk_id in enumerate(ids, 1):
            if rank <= depth:
                scores[chunk_id] = scores.get(chunk_id, 0.0) + WEIGHTS[path] / (RRF_K + rank)
            else:
                scores.setdefault(chunk_id, 0.0)
            best_rank[chunk_id] = min(rank, best_rank.get(chunk_id, rank))
            paths.setdefault(chunk_id, []).append(path)
    order = sorted(scores, key=lambda c: (-scores[c], best_rank[c], c))
    return order, scores, {c: "+".join(p) for c, p in paths.items()}


def _keyword(db: Database, match: str, n: int, filters: Filters) -> list[tuple[int, float]] | None:
    """The n best chunks by BM25 (lower is better) that pass the filter, in one query; None
    when the keyword index is damaged (a host wrote into FTS5's shadow tables: SQLite calls
    it corrupt, or `invalid fts5 file format`, or BM25 comes out NULL)."""
    where, params = filters.where()
    sql = (
        f"SELECT f.rowid, bm25({NOTES.name}) AS s FROM {NOTES.name} f "
        "JOIN note_chunks c ON c.id = f.rowid JOIN knowledge_items i ON i.id = c.item_id "
        f"WHERE {NOTES.name} MATCH ?{where} ORDER BY s, f.rowid LIMIT ?"
    )
    try:
        rows = db.all(sql, (match, *params, n))
    except (apsw.CorruptError, apsw.SQLError):
        return None
    if any(s is None for _, s in rows):
        return None
    return [(int(c), float(s)) for c, s in rows]


# -- vector ----------------------------------------------------------------------------------


def _vector(
    db: Database,
    vector: np.ndarray,
    n: int,
    model: str,
    filters: Filters,
    tuning: SearchSettings,
) -> tuple[list[tuple[int, float]], str, str | None]:
    """The n nearest live chunks of `model` that pass the filter (cosine distance); which path
    served; why the fallback did."""
    reason = unavailable(db, VEC["vec_chunk_embeddings"], len(vector))
    if reason is None:
        if filters.active and _count(db, model, filters) <= FILTER_EXACT:
            return _exact(db, vector, n, model, filters, tuning), "vec", None
        try:
            found, reason = _indexed(db, vector, n, model, filters, tuning)
        except VecUnreadable as unreadable:  # a host wrote into sqlite-vec's storage
            found, reason = None, str(unreadable)
        if found is not None:
            return found, "vec", None
    return _exact(db, vector, n, model, filters, tuning), "fallback", reason


def _indexed(
    db: Database,
    vector: np.ndarray,
    n: int,
    model: str,
    filters: Filters,
    tuning: SearchSettings,
) -> tuple[list[tuple[int, float]] | None, str | None]:
    """Through the vec tables: two passes over the bit mirror, or sqlite-vec's KNN; None and
    why not (the exact path serves). VecUnreadable when their storage cannot be read."""
    table = "vec_chunk_bits"
    try:
        if _quantized(db, len(vector), tuning):
            found = _two_pass(db, vector, n, model, filters, tuning.oversample)
            if found is not None:
                return found, None
        table = "vec_chunk_embeddings"
        if undirected(db, table):
            return None, "a vec row has no direction (a host's: zeros or NaN), sqlite-vec misranks"
        found = _knn(db, vector, n, model, filters)
    except apsw.SQLError as error:
        raise VecUnreadable(vec_failed(table, error)) from None
    if found is None:
        return None, f"the best {n} need more than {KNN_MAX} nearest chunks"
    return found, None


def _quantized(db: Database, dims: int, tuning: SearchSettings) -> bool:
    """The bit mirror is there, and the chunk vectors are many enough for two passes to pay.
    Their number is read as the highest chunk id (one B-tree step; a count is a scan): an
    upper bound, so a table that shrank a lot may take two passes a little early."""
    if vec_table_dimensions(db).get("vec_chunk_bits") != dims:
        return False
    top = db.scalar("SELECT max(chunk_id) FROM note_chunk_embeddings")
    return top is not None and int(top) >= tuning.exact_below


def _two_pass(
    db: Database, vector: np.ndarray, n: int, model: str, filters: Filters, oversample: int
) -> list[tuple[int, float]] | None:
    """The n * oversample nearest by hamming distance over the bit mirror (worker.hamming),
    rescored exactly by cosine over their float vectors; more candidates until n * oversample
    (at least 32) pass (live, this model, the filter), or the table has no more, or, at
    TWO_PASS_MAX candidates, n pass. None when they do not, or when the mirror holds no row
    (just rebuilt for a new model, or emptied by a host): the float table's KNN then answers,
    as for fewer chunks."""
    blob = np.asarray(vector, dtype="<f4").tobytes()
    query_bits = bytes(db.scalar(f"SELECT {VEC['vec_chunk_bits'].value('?1')}", (blob,)))

    def attempt(fetch: int) -> tuple[list[tuple[int, float]], bool] | None:
        candidates = nearest_bits(db, "vec_chunk_bits", query_bits, fetch)
        if candidates is None:  # not the storage layout worker.hamming knows: vec0's KNN
            if fetch > KNN_MAX:
                return None
            candidates = [
                int(r[0])
                for r in db.all(
                    "SELECT chunk_id FROM vec_chunk_bits WHERE embedding MATCH vec_bit(?) "
                    "AND k = ?",
                    (query_bits, fetch),
                )
            ]
        if not candidates:  # fetch is at least 32: the mirror holds nothing
            return None
        if len(candidates) < fetch:  # every row seen: as many as the vectors it mirrors?
            # (a host's DELETE of one of its storage chunks left the first pass a part of
            # the vectors, and the wrong hits, with no word)
            knn_ended(db, VEC["vec_chunk_bits"], len(vector), len(candidates))
        passing = _rescore(db, vector, candidates, model, filters)
        # Enough once the full oversample of candidates passed: stopping at n of them gave a
        # filter only its share of it (a filter of a fifth of the chunks: recall 0.70 where
        # the same search unfiltered had 0.77; 1.0 with this).
        enough = len(passing) >= pool or (fetch >= TWO_PASS_MAX and len(passing) >= n)
        return _best(passing, n), enough or len(candidates) < fetch

    pool = max(n * oversample, 32)
    return widening(pool, TWO_PASS_MAX, attempt)


def _rescore(
    db: Database, vector: np.ndarray, chunk_ids: list[int], model: str, filters: Filters
) -> list[tuple[int, float]]:
    """Exact cosine distances of these chunks that are live, of `model` and pass the filter."""
    where, params = filters.where()
    rows = db.all(
        f"SELECT r.chunk_id, r.vector FROM note_chunk_embeddings r {_LIVE}{where} "
        "AND r.dimensions = ? AND r.chunk_id IN (SELECT value FROM json_each(?))",
        (model, *params, len(vector), json.dumps(chunk_ids)),
    )
    if not rows:
        return []
    matrix = np.frombuffer(b"".join(r[1] for r in rows), dtype="<f4").reshape(len(rows), -1)
    return list(zip((int(r[0]) for r in rows), distances(matrix, vector).tolist(), strict=True))


_LIVE = (
    "JOIN note_chunks c ON c.id = r.chunk_id JOIN knowledge_items i ON i.id = c.item_id "
    f"WHERE {sound('r')} AND r.model = ?"
)


def _count(db: Database, model: str, filters: Filters) -> int:
    """The chunks passing the filter, counted up to FILTER_EXACT + 1 (all that is asked: a
    filter that matched every chunk was counted whole, 88 ms of a 107 ms search at 160k)."""
    where, params = filters.where()
    return int(
        db.scalar(
            f"SELECT count(*) FROM (SELECT 1 FROM note_chunk_embeddings r {_LIVE}{where} LIMIT ?)",
            (model, *params, FILTER_EXACT + 1),
        )
    )


def _best(rows: Sequence[tuple[int, float]], n: int) -> list[tuple[int, float]]:
    """(chunk id, distance) rows to the n nearest (ties by id: the same order on every path)."""
    return sorted(rows, key=by_distance)[:n]


def _knn(
    db: Database, vector: np.ndarray, n: int, model: str, filters: Filters
) -> list[tuple[int, float]] | None:
    """Through sqlite-vec, asking for more rows until n pass (live, this model, a sound vector
    of the query's dimension as on the other paths, the filter) or the table has no more;
    None past sqlite-vec's k limit (the caller scans exactly). VecUnreadable when the table
    ended short of the relational vectors it mirrors (`knn_ended`)."""
    blob = np.asarray(vector, dtype="<f4").tobytes()
    where, params = filters.where()

    def attempt(fetch: int) -> tuple[list[tuple[int, float]], bool]:
        rows = db.all(
            f"SELECT v.chunk_id, {NO_DIRECTION}, (i.id IS NOT NULL AND r.model = ? "
            f"AND r.dimensions = ? AND {sound('r')}{where}) "
            "FROM (SELECT chunk_id, distance FROM vec_chunk_embeddings WHERE embedding MATCH ? "
            "AND k = ?) v LEFT JOIN note_chunks c ON c.id = v.chunk_id "
            "LEFT JOIN note_chunk_embeddings r ON r.chunk_id = v.chunk_id "
            "LEFT JOIN knowledge_items i ON i.id = c.item_id",
            (model, len(vector), *params, blob, fetch),
        )
        if len(rows) < fetch:
            knn_ended(db, VEC["vec_chunk_embeddings"], len(vector), len(rows))
        if len({r[0] for r in rows}) < len(rows):  # (as nearest._knn: one chunk, two hits)
            raise VecUnreadable(
                "vec_chunk_embeddings gives a key twice (its storage was written behind "
                "sqlite-vec): the sweep mends it"
            )
        found = _best([(c, d) for c, d, ok in rows if ok], n)
        return found, len(rows) < fetch or past_ties(rows, found, n)

    found = widening(max(n + n // 8, 32), KNN_MAX, attempt)  # a few more: some may not pass
    return None if found is None else rescored(db, VEC["vec_chunk_embeddings"], vector, found)


def _exact(
    db: Database,
    vector: np.ndarray,
    n: int,
    model: str,
    filters: Filters,
    tuning: SearchSettings,
) -> list[tuple[int, float]]:
    """Exact cosine in memory over the relational vectors of live chunks passing the filter."""
    where, params = filters.where()
    sql = (
        f"SELECT c.id, r.vector FROM note_chunk_embeddings r "
        f"JOIN note_chunks c ON c.id = r.chunk_id JOIN knowledge_items i ON i.id = c.item_id "
        f"WHERE {sound('r')}{where} AND r.model = ? AND r.dimensions = ?"
    )
    return exact_nearest(db, sql, model, vector, n, before=params, hold_mb=tuning.fallback_hold_mb)


def _not_on(db: Database, model: str, dims: int) -> int:
    """Items whose index was built with another model or dimension (one row per item: cheap)."""
    return int(
        db.scalar(
            "SELECT count(*) FROM item_index_state WHERE chunk_count > 0 "
            "AND (model IS NOT ? OR dimensions IS NOT ?)",
            (model, dims),
        )
        or 0
    )


# -- hits ------------------------------------------------------------------------------------


def _load(
    db: Database,
    order: list[int],
    scores: dict[int, float],
    paths: dict[int, str],
    k: int,
    per_item: bool,
) -> list[ChunkHit]:
    """The hits, best first, k of them (one per item with `per_item`): only their rows are
    read whole (a hybrid search ranks hundreds of candidates). A candidate whose row cannot
    be shown (gone, or offsets a host wrote as something else) gives its place to the next
    one, as on every path, rather than leaving fewer than k."""
    item_of = dict(_rows(db, "c.id, c.item_id", order)) if per_item else {}
    loaded: dict[int, ChunkHit] = {}
    unshown: set[int] = set()
    while True:
        chosen: list[int] = []  # the best k not known unshowable (one per item)
        items: set[int] = set()
        for chunk_id in order:
            if chunk_id in unshown:
                continue
            if per_item:
                item = item_of.get(chunk_id)
                if item is None or item in items:
                    continue
                items.add(item)
            chosen.append(chunk_id)
            if len(chosen) == k:
                break
        unread = [c for c in chosen if c not in loaded]
        if not unread:
            return [loaded[c] for c in chosen]
        rows = {int(r[0]): r for r in _rows(db, _HIT_COLUMNS, unread)}
        for chunk_id in unread:
            hit = _hit(rows.get(chunk_id), scores, paths)
            if hit is None:
                unshown.add(chunk_id)
            else:
                loaded[chunk_id] = hit


# A chunk's place as NULL when it is no integer (`_hit` leaves that chunk out): a host's TEXT
# there that is not UTF-8, which apsw cannot read, failed the whole search.
_HIT_COLUMNS = (
    "c.id, c.item_id, CAST(i.title AS BLOB), i.kind, CAST(i.source AS BLOB), "
    f"{integer_or_null('c.chunk_index')}, CAST(c.headings AS BLOB), "
    f"{integer_or_null('c.start_offset')}, "
    f"{integer_or_null('c.end_offset')}, CAST(c.content AS BLOB)"
)


def _hit(
    row: tuple[Any, ...] | None, scores: dict[int, float], paths: dict[int, str]
) -> ChunkHit | None:
    """The hit of a `_HIT_COLUMNS` row, or None when it cannot be shown."""
    if row is None:  # gone since it was ranked
        return None
    chunk_id, item_id, title, kind, source, index, headings, start, end, content = row
    if not all(type(n) is int for n in (index, start, end)):
        return None  # a host wrote something else there: no place to show it at
    path = shown(headings)  # a host's bytes are shown, never raised (store.text)
    return ChunkHit(
        item_id=int(item_id),
        title=shown(title),
        kind=str(kind),
        source=shown(source) if source is not None else None,
        chunk_index=int(index),
        headings=heading_titles(path),
        start_offset=int(start),
        end_offset=int(end),
        content=shown(content),
        score=round(float(scores.get(chunk_id, 0.0)), 6),
        via=paths.get(chunk_id, ""),
        chunk_id=int(chunk_id),
    )


def _rows(db: Database, columns: str, chunk_ids: list[int]) -> list[tuple[Any, ...]]:
    """`columns` of these live chunks (c: note_chunks, i: knowledge_items); the ids are one
    value (a JSON array): SQLite binds 32,766 values at most."""
    return db.all(
        f"SELECT {columns} FROM note_chunks c JOIN knowledge_items i ON i.id = c.item_id "
        "WHERE c.id IN (SELECT value FROM json_each(?))",
        (json.dumps(chunk_ids),),
    )


# -- one hit per item, vector only (the older API) -------------------------------------------


@dataclass
class Hit:
    item_id: int
    title: str
    kind: str
    chunk_index: int
    score: float  # cosine similarity
    snippet: str
    via: str  # "vec" or "fallback"

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class SearchResult:
    hits: list[Hit]
    via: str
    reason: str | None = None  # why the fallback served, when it did


def search(
    db: Database,
    query: str,
    embedder: EmbeddingModel,
    *,
    k: int = 10,
    tuning: SearchSettings | None = None,
) -> SearchResult:
    """The k items nearest to `query`, each by its best chunk (vector search)."""
    found = search_chunks(db, query, embedder, k=k, mode=Mode.VECTOR, per_item=True, tuning=tuning)
    hits = [
        Hit(h.item_id, h.title, h.kind, h.chunk_index, h.score, h.snippet, h.via)
        for h in found.hits
    ]
    return SearchResult(hits, found.via, found.reason)
