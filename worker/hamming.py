"""The first pass of a large vector search: hamming distances over a bit mirror, in numpy.

sqlite-vec's KNN over a `bit[N]` vec0 table costs more the more candidates it is asked for (100k
realistic vectors: 15 ms for 40, 74 ms for 400), and exact rescoring needs thousands of
candidates for a recall@10 of 0.98 at a million chunks (bench/search.py). So the table's own
storage is read instead: vec0 keeps the vectors of each 1024 rows in one blob
(`{table}_vector_chunks00`), their ids and a validity bitmap in `{table}_chunks`. A search
process keeps what it read (one bit a dimension: 48 MB a million chunks at 384 dimensions) and
reads it again when the database has changed since (`Database.change_version`). The layout is
sqlite-vec 0.1's; anything else (another version, lengths that do not add up) returns None, and
the caller asks vec0's KNN instead.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from worker.store.db import Database
from worker.store.text import blob_or_null, integer_or_null

_SHADOW = {
    "chunks": 'CREATE TABLE "{t}_chunks"(chunk_id INTEGER PRIMARY KEY AUTOINCREMENT,'
    "size INTEGER NOT NULL,validity BLOB NOT NULL,rowids BLOB NOT NULL)",
    "vector_chunks00": 'CREATE TABLE "{t}_vector_chunks00"'
    "(rowid PRIMARY KEY,vectors BLOB NOT NULL)",
}
_FAR = np.int32(1 << 30)


@dataclass
class _Bits:
    version: tuple[int, ...]  # Database.change_version() when read
    ids: np.ndarray  # int64, one per slot
    words: np.ndarray  # uint64, (words per vector, slots): a column a word, for speed
    valid: np.ndarray  # bool, one per slot


_CACHE: weakref.WeakKeyDictionary[Database, dict[str, _Bits]] = weakref.WeakKeyDictionary()


def nearest_bits(db: Database, table: str, query_bits: bytes, fetch: int) -> list[int] | None:
    """The ids of the `fetch` rows of `table` nearest to `query_bits` by hamming distance
    (ties at the cut by id: twins, the same text many times, are all at one distance, and
    every other path returns the lowest ids of them), or None when the table's layout is
    not the known one."""
    bits = _load(db, table, len(query_bits))
    if bits is None:
        return None
    if not len(bits.ids):
        return []
    q = np.frombuffer(query_bits, dtype="<u8")
    distance = np.zeros(len(bits.ids), dtype=np.int32)
    for word, qword in zip(bits.words, q, strict=True):
        distance += np.bitwise_count(word ^ qword)
    distance[~bits.valid] = _FAR
    live = int(bits.valid.sum())
    fetch = min(fetch, live)
    if fetch <= 0:
        return []
    if fetch < len(distance):
        cut = np.partition(distance, fetch - 1)[fetch - 1]
        below = np.flatnonzero(distance < cut)
        tied = np.flatnonzero(distance == cut)
        tied = tied[np.argsort(bits.ids[tied], kind="stable")[: fetch - len(below)]]
        top = np.concatenate([below, tied])
    else:
        top = np.arange(len(distance))
    ids = bits.ids[top]
    return ids[distance[top] < _FAR].tolist()


def known_layout(db: Database, table: str) -> bool:
    """Whether vec0 table `table` keeps its vectors as sqlite-vec 0.1 does (one vector column):
    its shadow tables are read directly only then."""
    for part, sql in _SHADOW.items():
        have = db.scalar("SELECT sql FROM sqlite_master WHERE name = ?", (f"{table}_{part}",))
        if have != sql.format(t=table):
            return False
    return True


def _load(db: Database, table: str, nbytes: int) -> _Bits | None:
    if nbytes % 8:
        return None  # dimensions not a multiple of 64: vec0's KNN serves
    version = db.change_version()
    cached = _CACHE.get(db, {}).get(table)
    if cached is not None and cached.version == version:
        return cached
    if not known_layout(db, table):
        return None
    rows = db.all(
        f"SELECT {integer_or_null('c.size')}, {blob_or_null('c.validity')}, "
        f'{blob_or_null("c.rowids")}, {blob_or_null("v.vectors")} FROM "{table}_chunks" c '
        f'JOIN "{table}_vector_chunks00" v ON v.rowid = c.chunk_id ORDER BY c.chunk_id'
    )
    for size, validity, rowids, vectors in rows:
        if type(size) is not int or not all(type(b) is bytes for b in (validity, rowids, vectors)):
            return None  # a host's value of another type
        if len(validity) * 8 != size or len(rowids) != 8 * size or len(vectors) != nbytes * size:
            return None
    ids = np.frombuffer(b"".join(r[2] for r in rows), dtype="<i8")
    flags = np.frombuffer(b"".join(r[1] for r in rows), dtype=np.uint8)
    valid = np.unpackbits(flags, bitorder="little").astype(bool)
    # the width given, not inferred: a table with no rows (just rebuilt) is (0, width)
    matrix = np.frombuffer(b"".join(r[3] for r in rows), dtype="<u8").reshape(len(ids), nbytes // 8)
    bits = _Bits(version, ids, np.ascontiguousarray(matrix.T), valid)
    _CACHE.setdefault(db, {})[table] = bits
    return bits
