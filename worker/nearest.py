"""Nearest vectors in one vec0 table, or by exact cosine over its relational mirror when
sqlite-vec, the table or its dimension is missing: for memories and code, which are searched
each on their own (note search, with its one-hit-per-item merge, is `worker.retrieval`)."""

from __future__ import annotations

import itertools
import json
import operator
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import apsw
import numpy as np

from worker import hamming
from worker.store.db import Database
from worker.store.text import blob_or_null, integer_or_null
from worker.store.vec import VecTable, sound, vec_behind, vec_table_dimensions

BLOCK = 20_000


def unavailable(db: Database, table: VecTable, dims: int) -> str | None:
    """Why the vec0 path cannot serve this table now, or None. A database marked `vec_behind`
    since this connection opened (a worker without sqlite-vec wrote vectors, or one could not
    write its vec row) may hold an old vector under a live key: a deleted memory's, under the
    id SQLite gave the next one, ranked that one first for the deleted text. A connection
    opened read-only checks the mark once (store.connect); a long-lived one, each search."""
    if not db.vec_loaded:
        return f"sqlite-vec is not loaded ({db.vec_error or 'unknown reason'})"
    if vec_behind(db):
        return (
            "vectors were written while the vec tables could not be (vec_behind): "
            "a writer or the sweep rebuilds them"
        )
    have = vec_table_dimensions(db)[table.name]
    if have is None:
        return f"{table.name} is missing"
    if have != dims:
        return f"{table.name} has {have} dimensions, the query has {dims}"
    return None


# What makes a vector of each table live: its row's owner still exists (a host's plain-SQL
# delete leaves vec rows, and with foreign keys off relational ones, until the sweep), and is
# still of its kind (an item a host turned into a note keeps its code chunks until the sweep:
# code search does not show them, and they must not take a candidate's place).
LIVE = {
    "vec_work_code_chunks": "JOIN code_chunks c ON c.id = r.chunk_id "
    "JOIN knowledge_items i ON i.id = c.item_id AND i.kind = 'code'",
    "vec_memories": "JOIN memories m ON m.id = r.memory_id",
}
KNN_MAX = 4096  # sqlite-vec 0.1's limit on k


class VecUnreadable(Exception):
    """sqlite-vec cannot answer from a vec0 table as its storage is now (a host wrote into its
    shadow tables): the exact path serves, with this as the reason."""


def vec_failed(table: str, error: apsw.SQLError) -> str:
    """Why the exact path serves when sqlite-vec fails reading `table` (`vectors blob size
    doesn't match`, `no such table: main.{table}_chunks`: a host's writes into its storage)."""
    return f"sqlite-vec could not read {table} ({error})"


def knn_ended(db: Database, table: VecTable, dims: int, rows: int) -> None:
    """A KNN that ended after `rows` rows, fewer than it asked for, has seen every row of
    `table`, which mirrors each sound vector of its dimension: raise VecUnreadable when the
    relational table holds more. sqlite-vec answers from storage a host emptied (its
    `_chunks` table) with no row and no error; a count of at most `rows` + 1 rows tells."""
    more = db.scalar(
        f"SELECT count(*) FROM (SELECT 1 FROM {table.source} r "
        f"WHERE r.dimensions = ? AND {sound('r')} LIMIT ?)",
        (dims, rows + 1),
    )
    if more > rows:
        raise VecUnreadable(
            f"{table.name} holds fewer vectors than {table.source} (its storage was damaged, "
            "or written behind): the sweep mends it"
        )


T = TypeVar("T")


def widening(first: int, limit: int, attempt: Callable[[int], tuple[T, bool] | None]) -> T | None:
    """`attempt(fetch)` with four times as many rows each time, from `first` up to `limit`,
    until it says it has enough (or that the source has no more): what it found then. None
    when `limit` rows were not enough, or when `attempt` gives up (None).

    A nearest-neighbour query fetches a few more rows than it needs, since some may not pass
    (a dead item's, another model's, a filter's): usually once; when many fail, growing
    fourfold keeps the number of queries logarithmic."""
    fetch = min(first, limit)
    while True:
        answer = attempt(fetch)
        if answer is None:
            return None
        found, enough = answer
        if enough:
            return found
        if fetch >= limit:
            return None
        fetch = min(fetch * 4, limit)


_UNDIRECTED: weakref.WeakKeyDictionary[Database, dict[str, tuple[tuple[int, ...], bool]]] = (
    weakref.WeakKeyDictionary()
)


def undirected(db: Database, table: str) -> bool:
    """Whether vec0 table `table` holds a vector without a direction (zeros, NaN, infinite, or
    too large or small to square in float32), which a host may write. sqlite-vec's cosine
    distance to one is NaN, and its KNN then ranks every query wrongly, not only that row: it
    takes a NaN it meets first in a chunk for the nearest, and merging chunks then leaves the
    better rows behind it out (one such row among 2,048 made k=1 answer a row at distance 0.84
    where one at 0.005 was). Read from the table's own storage (worker.hamming's layout; False
    for another), once a change of the database: about the cost of one KNN."""
    version = db.change_version()
    cached = _UNDIRECTED.get(db, {}).get(table)
    if cached is not None and cached[0] == version:
        return cached[1]
    found = False
    if hamming.known_layout(db, table):
        cursor = db.execute(
            f"SELECT {integer_or_null('c.size')}, {blob_or_null('c.validity')}, "
            f'{blob_or_null("v.vectors")} FROM "{table}_chunks" c '
            f'JOIN "{table}_vector_chunks00" v ON v.rowid = c.chunk_id'
        )
        try:
            for size, validity, vectors in cursor:  # a chunk at a time: 1.5 MB at 384 dims
                if type(size) is not int or type(validity) is not bytes:
                    continue  # a host's value of another type: vec0 serves (or says why not)
                if not size or len(validity) * 8 != size or type(vectors) is not bytes:
                    continue
                if len(vectors) % (4 * size):
                    continue  # not the layout after all: vec0 serves as before
                matrix = np.frombuffer(vectors, dtype="<f4").reshape(size, -1)
                valid = np.unpackbits(np.frombuffer(validity, np.uint8), bitorder="little")
                with np.errstate(over="ignore", invalid="ignore"):
                    squares = np.einsum("ij,ij->i", matrix, matrix)  # float32, as sqlite-vec
                    directed = np.isfinite(squares) & (squares > 0)
                if (valid.astype(bool) & ~directed).any():
                    found = True
                    break
        finally:
            cursor.close()
    _UNDIRECTED.setdefault(db, {})[table] = (version, found)
    return found


def past_ties(rows: Sequence[Sequence[Any]], found: list[tuple[int, float]], n: int) -> bool:
    """Whether `found`, the n best of the (key, distance, ...) `rows` a KNN fetched, are the
    table's n best: sqlite-vec cuts its rows anywhere in a tie (twins: the same text twice),
    and a left-out twin may have a lower key, the one every other path puts first. Enough
    only once the rows reach past the n-th's distance (else: fetch more, or the table ends)."""
    return len(found) >= n and max(r[1] for r in rows) > found[-1][1]


# sqlite-vec's distance to a vector of zeros (a host's row) is NULL: 1, as the exact path
# scores it (a zero row stays zero, its dot product 0), rather than a crash of the search. (Its
# KNN misranks the other rows too while the table holds one: see `undirected`.)
NO_DIRECTION = "ifnull(v.distance, 1.0)"


def nearest(
    db: Database, table: VecTable, vector: np.ndarray, k: int, model: str
) -> tuple[list[tuple[int, float]], str, str | None]:
    """The k nearest (key, cosine distance) of `model`'s live vectors; which path served; why
    the fallback did, when it did."""
    k = operator.index(k)  # a numpy integer would be bound as bytes
    q = np.asarray(vector, dtype="<f4")
    live = LIVE.get(table.name, "")
    reason = unavailable(db, table, len(q))
    if reason is None:
        try:
            found, reason = _knn(db, table, q, k, model)
        except apsw.SQLError as error:
            found, reason = None, vec_failed(table.name, error)
        except VecUnreadable as unreadable:
            found, reason = None, str(unreadable)
        if found is not None:
            return found, "vec", None
    found = exact_nearest(
        db,
        f"SELECT r.{table.source_key}, r.vector FROM {table.source} r {live} "
        f"WHERE {sound('r')} AND r.model = ? AND r.dimensions = ?",
        model,
        q,
        k,
    )
    return found, "fallback", reason


def _knn(
    db: Database, table: VecTable, q: np.ndarray, k: int, model: str
) -> tuple[list[tuple[int, float]] | None, str | None]:
    """The k nearest through sqlite-vec, or None and why not. Only a row whose relational
    vector is live, of `model`, sound and of the query's dimension counts, as on the exact
    path: a host may make a vector unreadable and leave its vec row. A key it gives twice is
    storage a host wrote into (a `_rowids` row deleted: the next write of that key leaves its
    old vector beside the new one), which answered a memory twice, once by its old text."""
    if undirected(db, table.name):
        return None, f"{table.name} holds a vector without a direction, which sqlite-vec misranks"
    live = LIVE.get(table.name, "")

    def attempt(fetch: int) -> tuple[list[tuple[int, float]], bool]:
        rows = db.all(
            f"SELECT v.{table.key}, {NO_DIRECTION}, r.{table.source_key} IS NOT NULL FROM "
            f"(SELECT {table.key}, distance FROM {table.name} WHERE embedding MATCH ? AND "
            f"k = ?) v LEFT JOIN ({table.source} r {live}) ON r.{table.source_key} = "
            f"v.{table.key} AND r.model = ? AND r.dimensions = ? AND {sound('r')} "
            "ORDER BY 2, 1",
            (q.tobytes(), fetch, model, len(q)),
        )
        if len(rows) < fetch:
            knn_ended(db, table, len(q), len(rows))
        if len({r[0] for r in rows}) < len(rows):
            raise VecUnreadable(
                f"{table.name} gives a key twice (its storage was written behind sqlite-vec): "
                "the sweep mends it"
            )
        found = [(int(key), float(d)) for key, d, ok in rows if ok][:k]
        return found, past_ties(rows, found, k) or len(rows) < fetch

    found = widening(max(2 * k, 32), KNN_MAX, attempt)
    if found is None:
        return None, f"the nearest {k} need more than {KNN_MAX} rows of {table.name}"
    return rescored(db, table, q, found), None


# How far sqlite-vec's distance may be from numpy's for one vector (float32 both ways: about
# 1e-6): further, its storage gave the key another vector.
AGREE = 1e-3


def rescored(
    db: Database, table: VecTable, q: np.ndarray, found: list[tuple[int, float]]
) -> list[tuple[int, float]]:
    """A KNN's hits with the distances of their relational vectors, as the exact path scores
    them (the same scores, to the last decimal, on every path), best first. VecUnreadable when
    sqlite-vec's distance is not the vector's: a host swapped two ids in its storage, and the
    KNN answered the worst match with the best one's score (no sweep saw it: each row's own
    lookup still held)."""
    if not found:
        return found
    rows = db.all(
        f"SELECT {table.source_key}, vector FROM {table.source} WHERE {table.source_key} IN "
        "(SELECT value FROM json_each(?)) AND dimensions = ?",
        (json.dumps([key for key, _ in found]), len(q)),
    )
    vectors = {int(key): vector for key, vector in rows}
    if len(vectors) < len(found):  # (each passed as sound a moment ago, in this transaction)
        raise VecUnreadable(f"{table.source} changed during the search")
    matrix = np.frombuffer(b"".join(vectors[key] for key, _ in found), dtype="<f4")
    exact = distances(matrix.reshape(len(found), -1), q).tolist()
    if any(abs(d - e) > AGREE for (_, d), e in zip(found, exact, strict=True)):
        raise VecUnreadable(
            f"{table.name} gives a key a vector that is not its own (its storage was written "
            "behind sqlite-vec): the sweep's rebuild mends it"
        )
    return sorted(((key, e) for (key, _), e in zip(found, exact, strict=True)), key=by_distance)


def by_distance(hit: tuple[int, float]) -> tuple[float, int]:
    """The order of (key, distance) hits on every path: nearest first, ties by key."""
    return hit[1], hit[0]


def unit_rows(matrix: np.ndarray) -> np.ndarray:
    """Each row at unit length (a zero row stays zero; a row a host wrote with infinite values
    comes out NaN, quietly: `_distances` scores it as having no direction)."""
    with np.errstate(over="ignore", invalid="ignore"):
        norms = np.sqrt(np.einsum("ij,ij->i", matrix, matrix))
        norms[norms == 0] = 1.0
        return matrix / norms[:, None]


def distances(matrix: np.ndarray, vector: np.ndarray) -> np.ndarray:
    """Cosine distance of each row to `vector`, as sqlite-vec computes it (a zero row: 1)."""
    return _distances(unit_rows(matrix), _unit(vector))


def _distances(units: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """1 - each row's dot product with `unit`, and 1 where that is not a number: a row a host
    wrote with NaN or infinite values has no direction, like a zero row (sqlite-vec's NULL
    distance, NO_DIRECTION), rather than NaN, which drops every row from a top-k (any
    comparison with it is false) or ranks first in a sort."""
    dist = 1.0 - _dot(units, unit)
    bad = ~np.isfinite(dist)
    if bad.any():
        dist[bad] = 1.0
    return dist


def _unit(vector: np.ndarray) -> np.ndarray:
    q = np.asarray(vector, dtype=np.float32)
    return q / (np.linalg.norm(q) or 1.0)


@dataclass
class _Held:
    version: tuple[int, ...]  # Database.change_version() when read
    keys: np.ndarray
    units: np.ndarray  # the vectors at unit length (a zero vector stays zero)
    nbytes: int  # what it holds, its cache key's parameters included


class _Holding(OrderedDict[tuple[Any, ...], _Held]):
    """What one connection's exact searches read, by their SQL and parameters, the least
    recently used first, all of one change_version (a change leaves none valid), within one
    budget for the connection however many filters its searches use: with a budget for each,
    300 searches with different item ids held 82 MB on a 1 MB setting."""

    def __init__(self) -> None:
        super().__init__()
        self.nbytes = 0

    def fresh(self, version: tuple[int, ...]) -> _Holding:
        """Itself, emptied if what it holds is of another version."""
        if self and next(reversed(self.values())).version != version:
            self.clear()
            self.nbytes = 0
        return self

    def use(self, key: tuple[Any, ...]) -> _Held | None:
        """The entry held for `key`, now the most recently used."""
        entry = self.get(key)
        if entry is not None:
            self.move_to_end(key)
        return entry

    def put(self, key: tuple[Any, ...], entry: _Held, budget: int) -> None:
        """Hold `entry`, dropping the least recently used until all fit in `budget` bytes."""
        if key in self:
            self.nbytes -= self.pop(key).nbytes
        if entry.nbytes > budget:
            return
        while self and self.nbytes + entry.nbytes > budget:
            self.nbytes -= self.popitem(last=False)[1].nbytes
        self[key] = entry
        self.nbytes += entry.nbytes


_HELD: weakref.WeakKeyDictionary[Database, _Holding] = weakref.WeakKeyDictionary()


def exact_nearest(
    db: Database,
    sql: str,
    model: str,
    vector: np.ndarray,
    k: int,
    *,
    before: Sequence[Any] = (),
    hold_mb: int = 0,
) -> list[tuple[int, float]]:
    """The k nearest (key, cosine distance) rows of `sql`, exactly, ties by key. `sql` selects
    (key, vector) from a table aliased `r`, and takes (model, dimensions) as its last
    parameters, after `before`: see `nearest`. Its rows are read in one pass, in whatever
    order SQLite finds them, a block at a time into one matrix scored with one product
    (memory stays bounded; a Python loop per row made this 46x numpy at 100k rows). Paged by
    rowid instead (`rowid > ? ORDER BY rowid LIMIT ?`), each page read and sorted every row
    a filter passes, from the filter's index: 2.4 s against 0.3 s at 160k chunks, growing
    with the square of them.

    `hold_mb`: a search process may keep what it read, up to this many MB for all its searches
    on `db` (the least recently used go first), for its next searches until the database
    changes (`Database.change_version`): reading is most of the cost (SQLite hands over 100k
    1.5 KB blobs in ~200 ms, 30x the product itself), so a process that searches repeatedly
    without sqlite-vec pays it once a change."""
    dims = len(vector)
    unit = _unit(vector)
    budget = hold_mb * 1_000_000
    key = (sql, tuple(before), model, dims)
    version = db.change_version() if hold_mb else ()  # before reading: see the end
    held = _HELD.setdefault(db, _Holding()).fresh(version) if hold_mb else None
    entry = held.use(key) if held is not None else None
    if entry is not None:
        return _top(entry.keys, _distances(entry.units, unit), k)
    keys = np.empty(0, dtype=np.int64)
    dist = np.empty(0, dtype=np.float32)
    # the key's parameters count too: a filter's list of ids can outweigh its few vectors
    size = len(sql) + sum(len(p) if isinstance(p, str | bytes) else 8 for p in before)
    kept_keys: list[np.ndarray] | None = [] if held is not None else None
    kept_units: list[np.ndarray] = []
    cursor = db.execute(sql, (*before, model, dims))
    try:
        for block_keys, matrix in _blocks(cursor, dims):
            units = unit_rows(matrix)
            if kept_keys is not None:
                size += units.nbytes + block_keys.nbytes
                if size > budget:
                    kept_keys = None  # too many to hold: this search only
                    kept_units.clear()
                else:
                    kept_keys.append(block_keys)
                    kept_units.append(units)
            keys = np.concatenate([keys, block_keys])
            dist = np.concatenate([dist, _distances(units, unit).astype(np.float32)])
            if len(keys) > k + BLOCK:  # keep the k best and their ties: no other can win
                keep = dist <= np.partition(dist, k - 1)[k - 1]
                keys, dist = keys[keep], dist[keep]
    finally:
        cursor.close()
    if held is not None and kept_keys is not None:
        all_keys = np.concatenate(kept_keys) if kept_keys else np.empty(0, dtype=np.int64)
        all_units = np.concatenate(kept_units) if kept_units else np.empty((0, dims), np.float32)
        # Held under the version read before the pass: a commit by another connection in
        # between moves it, so what another state was read from is never used.
        held.put(key, _Held(version, all_keys, all_units, size), budget)
    return _top(keys, dist, k)


def _blocks(rows: Iterator[Any], dims: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(keys, vectors as a matrix) of `BLOCK` rows at a time, from one pass over `rows`."""
    while block := list(itertools.islice(rows, BLOCK)):
        matrix = np.frombuffer(b"".join([r[1] for r in block]), dtype="<f4").reshape(-1, dims)
        yield np.fromiter((r[0] for r in block), np.int64, len(block)), matrix


def _dot(matrix: np.ndarray, unit: np.ndarray) -> np.ndarray:
    """Each row's dot product, computed row by row: a BLAS product rounds a row differently by
    the shape of its block, and twins (the same vector twice) must stay ties."""
    return np.einsum("ij,j->i", matrix, unit)


def _top(keys: np.ndarray, dist: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k smallest distances, ties by key."""
    dist = np.asarray(dist, dtype=np.float32)
    if len(keys) > k:
        keep = dist <= np.partition(dist, k - 1)[k - 1]
        keys, dist = keys[keep], dist[keep]
    order = np.lexsort((keys, dist))[:k]
    return [(int(keys[i]), float(dist[i])) for i in order]
