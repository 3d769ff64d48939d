"""The keyword index: SQLite FTS5 over each chunk's text, with its item's title and heading path,
one table for prose (notes, files, URLs) and one for code; the row id is the chunk's id.

Written in the chunk writer's transaction and deleted with the chunks, like the vec rows; what a
host's plain-SQL delete leaves (or a dropped table) is mended by `sync_fts`, which the reconcile
sweep runs: it needs no provider, the text is all in the chunk rows.

The tables keep their own copy of the text (plain FTS5): a contentless table that can delete
rows needs SQLite 3.43, and a host whose SQLite is older (Python 3.11's own is 3.40) could then
not even delete an item (it fails on the unknown option).

Identifiers. FTS5's unicode61 tokenizer splits at anything that is not a letter or a digit, so
`response_model_exclude_unset`, `os.path.join` and `--no-deps` are indexed as their parts, and a
query for the whole is a phrase of those parts (`keyword_query`). CamelCase is one token to it
(`BackgroundTasks` -> `backgroundtasks`): the `parts` column adds the words of every such
identifier, so `tasks` finds it too.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Iterable
from dataclasses import dataclass

import apsw

from worker.chunking.markdown import clip_title
from worker.store.db import Database, meta_cursor, set_meta
from worker.store.text import integer_or_null, shown

# The porter stemmer over unicode61 (diacritics folded): `moves` meets `move`. Measured on the
# Chroma chunking benchmark end to end (target 600, top 5, hybrid): recall 85.6 with porter,
# 84.7 with unicode61 alone, 83.9 with trigram (keyword alone: 83.9, 83.2, 82.7).
TOKENIZE = "porter unicode61 remove_diacritics 2"


@dataclass(frozen=True)
class FtsTable:
    name: str
    chunks: str  # the chunk table it indexes
    rows: str  # SELECT id, title, headings, content of its chunks (of live items)

    def stale(self, what: str) -> str:
        """SELECT `what` of the rows no live chunk has."""
        return f"SELECT {what} FROM {self.name} WHERE rowid NOT IN (SELECT id FROM ({self.rows}))"

    def missing(self, what: str) -> str:
        """SELECT `what` of the live chunks that have no row."""
        return f"SELECT {what} FROM ({self.rows}) WHERE id NOT IN (SELECT rowid FROM {self.name})"


NOTES = FtsTable(
    "note_chunks_fts",
    "note_chunks",
    "SELECT c.id, CAST(i.title AS BLOB) AS title, CAST(c.headings AS BLOB) AS headings, "
    "CAST(c.content AS BLOB) AS content FROM note_chunks c "
    "JOIN knowledge_items i ON i.id = c.item_id",
)
CODE = FtsTable(
    "code_chunks_fts",
    "code_chunks",
    "SELECT c.id, CAST(c.path AS BLOB) AS title, CAST('' AS BLOB) AS headings, "
    "CAST(c.content AS BLOB) AS content FROM code_chunks c "
    "JOIN knowledge_items i ON i.id = c.item_id",
)
FTS_TABLES = (NOTES, CODE)


def create_sql(name: str) -> str:
    return (
        f"CREATE VIRTUAL TABLE IF NOT EXISTS {name} USING fts5(title, headings, content, parts, "
        f"tokenize='{TOKENIZE}')"
    )


# A token as unicode61 sees it (letters and digits; `_` separates), and the words of a
# CamelCase or letters-and-digits token. Text is made NFC first (`_nfc`); a combining mark
# that is left (no precomposed letter: `q̃`) stays in its token, as unicode61 keeps it there:
# cut at the mark, a query's word became a phrase of two that the index never holds.
_MARKS = "\u0300-\u036f\u1ab0-\u1aff\u1dc0-\u1dff\u20d0-\u20ff\ufe20-\ufe2f"
# Private use (category Co) is part of a word to unicode61 ("L* N* Co"): `build\uf8ffstatus`
# is one token in the index, and a query cut there found nothing.
_PRIVATE = "\ue000-\uf8ff\U000f0000-\U000ffffd\U00100000-\U0010fffd"
_TOKEN = re.compile(rf"(?:[^\W_]|[{_MARKS}{_PRIVATE}])+")
_WORDS = re.compile(r"[A-Z]+(?=[A-Z][a-z])|[A-Z]?[a-z]+|[A-Z]+|\d+")
# The same words beyond ASCII, found in a token's shape (`_Shapes`): an upper- or lowercase
# letter of any script, a digit, a mark (with the letter before it). An ASCII-only split cut
# `Zürich` at `ü` and indexed `z rich`: `rich` found it.
_SHAPE_WORDS = re.compile(r"(?:Am*)+(?=Am*a)|(?:Am*)?(?:am*)+|(?:Am*)+|(?:0m*)+")


class _Shapes(dict[int, str]):
    """A character's shape for `_SHAPE_WORDS` (`str.translate` table, filled as met): `A`
    uppercase, `a` lowercase, `0` a decimal digit, `m` a combining mark, ` ` anything else."""

    def __missing__(self, code: int) -> str:
        c = chr(code)
        if c.isupper():
            shape = "A"
        elif c.islower():
            shape = "a"
        elif c.isdecimal():
            shape = "0"
        elif unicodedata.category(c).startswith("M"):
            shape = "m"
        else:
            shape = " "
        self[code] = shape
        return shape


_SHAPES = _Shapes()


def _nfc(text: str) -> str:
    """Text as the keyword index holds it and a query is cut: NFC, so that `résumé` typed
    decomposed (NFD: `e` and U+0301, as macOS writes file names) meets it composed."""
    return text if text.isascii() else unicodedata.normalize("NFC", text)


# ASCII letters and digits, and every byte of a character beyond ASCII, kept; every other byte
# a space: `bytes.translate` + `split` cut tokens at C speed where `_TOKEN.findall` runs at
# about 30 MB/s (measured: identifier_parts twice as fast over ../shared/corpus, the same words).
_KEEP = bytes(
    b if (48 <= b <= 57 or 65 <= b <= 90 or 97 <= b <= 122 or b >= 128) else 32 for b in range(256)
)


def identifier_parts(text: str) -> str:
    """The words inside CamelCase tokens (`BackgroundTasks` -> `Background Tasks`), once each."""
    seen: dict[str, None] = {}
    text = _nfc(text)
    for raw in dict.fromkeys(text.encode("utf-8", "surrogatepass").translate(_KEEP).split()):
        if raw.isascii():
            if raw.islower() or raw.isupper() or raw.isdigit():
                continue
            if raw[1:].isalpha() and raw[1:].islower():
                continue  # `Hello`: one word (a fifth of the tokens of prose, no regex)
            _add_words(_WORDS.findall(raw.decode()), seen)
        else:  # a character beyond ASCII may be a letter or not: unicode61's view decides
            for token in _TOKEN.findall(raw.decode("utf-8", "surrogatepass")):
                if not (token.islower() or token.isupper() or token.isdigit()):
                    spans = _SHAPE_WORDS.finditer(token.translate(_SHAPES))
                    _add_words([token[m.start() : m.end()] for m in spans], seen)
    return " ".join(seen)


def _add_words(words: list[str], seen: dict[str, None]) -> None:
    if len(words) > 1:
        seen.update((w.lower(), None) for w in words)


# Every chunk's keyword row holds its item's title (a code chunk's: its path), cut to this:
# a host's 10 MB title was written whole into each of the item's rows, 10 MB of index a
# chunk. A title is a line; the item keeps it whole, and its chunks' embedder input holds
# less (CONTEXT_CHARS).
ROW_TITLE_MAX = 1_000


def _title(title: str) -> str:
    return _nfc(title if len(title) <= ROW_TITLE_MAX else clip_title(title, ROW_TITLE_MAX))


def _fields(title: object, headings: object, content: object) -> list[str]:
    """Text columns a host may have written as any bytes are read as text to show (NFC)."""
    return [_title(shown(title)), _nfc(shown(headings)), _nfc(shown(content))]


def _row(chunk_id: int, title: object, headings: object, content: object) -> tuple:
    fields = _fields(title, headings, content)
    return (chunk_id, *fields, identifier_parts(" ".join(fields)))


def chunk_parts(headings: str, content: str) -> str:
    """A chunk's share of its keyword row's `parts` (`keyword_row` adds its title's): made
    when the chunk is cut, so that a writer holding the write lock does not (a sixth of a
    bulk run's time under the lock)."""
    return identifier_parts(f"{headings} {content}")


def keyword_row(chunk_id: int, title: str, headings: str, content: str, parts: str | None) -> tuple:
    """`_row`, from the chunk's `chunk_parts` when they are made (None: not): the same row
    (tokens never cross the space between two fields, so the parts of the whole are those of
    the title, then the others' not already there)."""
    if parts is None:
        return _row(chunk_id, title, headings, content)
    title = _title(title)
    merged = dict.fromkeys(identifier_parts(title).split())
    merged.update(dict.fromkeys(parts.split()))
    return (chunk_id, title, _nfc(headings), _nfc(content), " ".join(merged))


def fts_delete(db: Database, table: FtsTable, chunk_ids: Iterable[int]) -> None:
    db.executemany(f"DELETE FROM {table.name} WHERE rowid = ?", [(i,) for i in chunk_ids])


def fts_insert(db: Database, table: FtsTable, rows: list[tuple]) -> None:
    """Rows made by `_row` or `keyword_row`, under ids that have none."""
    db.executemany(
        f"INSERT INTO {table.name}(rowid, title, headings, content, parts) VALUES (?, ?, ?, ?, ?)",
        rows,
    )


def fts_write(
    db: Database, table: FtsTable, rows: Iterable[tuple[int, object, object, object]]
) -> None:
    """(chunk id, title, headings, content) rows, replacing what those ids had."""
    made = [_row(*r) for r in rows]
    fts_delete(db, table, [r[0] for r in made])
    fts_insert(db, table, made)


def fts_write_item(db: Database, table: FtsTable, item_id: int, old_ids: Iterable[int]) -> None:
    """An item's chunks as they are now, in the caller's transaction; `old_ids`: the chunk ids
    it had before (their rows go). A dropped table is left to the sweep (`sync_fts`): the
    keyword index must not stop the chunks from being written."""
    if not db.table_exists(table.name):
        return
    fts_delete(db, table, old_ids)
    fts_write(db, table, db.all(f"{table.rows} WHERE c.item_id = ?", (item_id,)))


def fts_ready(db: Database) -> bool:
    return all(db.table_exists(t.name) for t in FTS_TABLES)


def fts_counts(db: Database) -> dict[str, dict[str, int]]:
    """Per table: rows with no live chunk (`stale`), live chunks with no row (`missing`). A
    table FTS5 cannot open (`fts_intact` says so) holds no row that search can find: every
    live chunk is missing, as with no table."""
    out = {}
    for t in FTS_TABLES:
        if db.table_exists(t.name):
            try:
                out[t.name] = {
                    "stale": int(db.scalar(t.stale("count(*)"))),
                    "missing": int(db.scalar(t.missing("count(*)"))),
                }
                continue
            except apsw.SQLError:
                pass
        out[t.name] = {"stale": 0, "missing": int(db.scalar(f"SELECT count(*) FROM ({t.rows})"))}
    return out


def refresh_fts(db: Database, tables: tuple[FtsTable, ...] = FTS_TABLES) -> None:
    """Make this connection's FTS5 tables read their index state again. FTS5's integrity check
    (`PRAGMA integrity_check` too) uses the state a connection cached at its last query, not
    what other connections have written since: on a long-lived connection it then reports a
    `checksum mismatch` that is not there (SQLite 3.54). Any query on the table refreshes it."""
    for t in tables:
        if db.table_exists(t.name):
            db.all(f"SELECT rowid FROM {t.name} WHERE {t.name} MATCH '\"kidx\"' LIMIT 1")


# What a write refused by a damaged keyword table says (worker.pipeline.store_failure): a failed
# item's error holding it makes the reconcile sweep run FTS5's integrity check (`check_due`).
DAMAGED = "a keyword index a host damaged"
# When the last integrity check of the keyword tables found them whole (index_meta), and how
# often the reconcile sweep runs one without a reason to: it is an INSERT command, so it holds
# the write lock, for about 1 s a 100k chunks (measured: 0.85 s at 99k), which every sweep
# (5 minutes) made every worker wait for; damage it alone finds (a host's write into FTS5's
# `_data`) is looked for hourly, or at once when a write failed on it.
CHECKED = "fts_checked_at"
CHECK_EVERY_S = 3600.0


def check_due(db: Database) -> bool:
    """Whether the reconcile sweep runs FTS5's integrity check now: none recorded (or not a
    time), the last one an hour ago or more (or in the future), or an item failed on a
    damaged keyword table since."""
    age = db.scalar(
        "SELECT abs(julianday('now') - julianday(CAST(value AS TEXT))) * 86400 "
        "FROM index_meta WHERE key = ?",
        (CHECKED,),
    )
    if not isinstance(age, float) or age >= CHECK_EVERY_S:
        return True
    return bool(
        db.scalar(
            "SELECT 1 FROM item_index_state WHERE status IN ('failed', 'partial') "
            "AND instr(last_error, ?) > 0 LIMIT 1",
            (DAMAGED,),
        )
    )


FTS5_VERSION = 4  # the `version` FTS5 keeps in `_config` (SQLite 3.54)


def _shape(sql: str) -> str:
    return " ".join(sql.replace(" IF NOT EXISTS", "").split()).lower()


def fts_present(db: Database, table: FtsTable) -> bool:
    """Whether a keyword table is kidx's (its declaration: a host's `fts5(a)`, or a
    contentless one, made every sweep and every write fail on a column it lacks), has every
    shadow table and the file format FTS5 writes (what a host's DROP or `_config` write
    breaks), looked at without FTS5's integrity check."""
    return fts_problem(db, table) is None


def fts_problem(db: Database, table: FtsTable) -> str | None:
    """What `fts_present` finds wrong, as words for a search's reason: `is missing`, `is not
    kidx's` (another declaration), `is damaged`; None when nothing is."""
    declared = db.scalar(
        "SELECT CAST(sql AS BLOB) FROM sqlite_schema WHERE type = 'table' AND name = ?",
        (table.name,),
    )
    if declared is None:
        return "is missing"
    if not isinstance(declared, bytes) or _shape(declared.decode("utf-8", "replace")) != _shape(
        create_sql(table.name)
    ):
        return "is not kidx's"
    shadows = [f"{table.name}_{s}" for s in _SHADOWS]
    have = db.scalar(
        f"SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name IN "
        f"({', '.join('?' * len(shadows))})",
        shadows,
    )
    if have != len(shadows):
        return "is damaged"
    try:
        # (typed in SQL: a host's text that is not UTF-8 raised in apsw, at every sweep)
        version = db.scalar(
            f"SELECT {integer_or_null('v')} FROM {table.name}_config WHERE k = 'version'"
        )
    except apsw.Error:
        return "is damaged"
    return None if version == FTS5_VERSION else "is damaged"


def fts_intact(db: Database, table: FtsTable) -> bool:
    """FTS5's own check of its index against its text (about 1 s at 100k chunks). A table FTS5
    cannot open at all (a host wrote or dropped its `_config`), or that is not kidx's
    (`fts_present`), is not intact either."""
    if not fts_present(db, table):
        return False
    try:
        refresh_fts(db, (table,))
        db.execute(f"INSERT INTO {table.name}({table.name}) VALUES ('integrity-check')")
    except (apsw.CorruptError, apsw.SQLError):
        return False
    return True


_SHADOWS = ("data", "idx", "content", "docsize", "config")


def _drop(db: Database, table: FtsTable) -> None:
    """Drop a keyword table, in the caller's transaction. One that FTS5 cannot open (`invalid
    fts5 file format`, `vtable constructor failed`) DROP TABLE cannot drop either: its shadow
    tables, plain tables, are dropped as such, then its own schema row (a virtual table's
    holds no page) is deleted with writable_schema and the schema read again. The caller
    creates the table again, which moves the schema cookie: other connections see it."""
    if db.scalar("SELECT 1 FROM sqlite_master WHERE type = 'view' AND name = ?", (table.name,)):
        db.execute(f"DROP VIEW {table.name}")  # a host's, in the table's place
        return
    try:
        with db.atomic():
            db.execute(f"DROP TABLE {table.name}")
        return
    except (apsw.CorruptError, apsw.SQLError):
        pass
    for suffix in _SHADOWS:
        name = f"{table.name}_{suffix}"
        if db.scalar("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)):
            db.execute(f"DROP TABLE {name}")
    db.execute("PRAGMA writable_schema = ON")
    try:
        db.execute(
            "DELETE FROM sqlite_master WHERE type = 'table' AND name = ? AND rootpage = 0 "
            "AND sql LIKE 'CREATE VIRTUAL TABLE%'",
            (table.name,),
        )
    finally:
        db.execute("PRAGMA writable_schema = RESET")  # off, and this connection's schema reread


# How the keyword rows are made, kept in `index_meta` by the sweep's `sync_fts`: "2", NFC text
# and CamelCase words of any script. Rows made before (an ASCII-only split indexed `Zürich` as
# `z rich`) are compared with the rows made now once, those of text beyond ASCII (the only
# ones that can differ), and rewritten where they differ.
ROWS_MADE = ("fts_rows", "2")


def _unlike(
    db: Database, table: FtsTable, *, every: bool, most: int | None = None
) -> tuple[list[tuple], bool]:
    """The live chunks whose keyword row is not the one `_row` makes of them now: a row whose
    text is not its chunk's (a host's chunk under the id of a deleted one, whose row stayed:
    the chunk table has no AUTOINCREMENT) or, with `every`, any row of text beyond ASCII.
    `most` of them at most (a host's rename of every title made 400k rows to rewrite in one
    sweep, 9 s under the write lock); and whether that was all."""
    # A title longer than ROW_TITLE_MAX (its bytes, a bound on its characters) is held cut:
    # such rows are compared in Python, as `_row` cuts it.
    differs = " OR ".join(
        [f"length(c.title) > {ROW_TITLE_MAX}"]
        + [f"CAST(f.{c} AS BLOB) IS NOT c.{c}" for c in ("title", "headings", "content")]
    )
    sql = (
        "SELECT c.id, c.title, c.headings, c.content, CAST(f.title AS BLOB), "
        "CAST(f.headings AS BLOB), CAST(f.content AS BLOB), CAST(f.parts AS BLOB), "
        f"{differs} FROM ({table.rows}) c JOIN {table.name} f ON f.rowid = c.id"
    )
    out = []
    for row in db.execute(sql if every else f"{sql} WHERE {differs}"):
        chunk, held, text_differs = row[:4], list(row[4:8]), row[8]
        if not text_differs and all(v is None or v.isascii() for v in chunk[1:]):
            continue  # its chunk's ASCII text: made as now
        fields = [v.encode("utf-8", "surrogatepass") for v in _fields(*chunk[1:])]
        if not every and fields == held[:3]:
            # the text as the row holds it (NFC, a long title cut): its parts are made of it.
            # (Making the parts too took 35 us a chunk of NFD text, 120 us with a long title,
            # at every sweep, under the write lock, for rows that were right.)
            continue
        made = [v.encode("utf-8", "surrogatepass") for v in _row(*chunk)[1:]]
        if made != held:  # compared as bytes: a host's may not be UTF-8
            if most is not None and len(out) >= most:
                return out, False
            out.append(tuple(chunk))
    return out, True


# Keyword rows a sweep compares whole, their identifier parts too, a table at a time, from
# where the last sweep stopped, round and round: `_unlike` compares a row's text only (making
# every row's parts again costs 35 us a chunk), and a `parts` a host wrote was never mended.
WHOLE_SLICE = 2_000


def _unlike_whole(db: Database, table: FtsTable, n: int) -> list[tuple]:
    """The chunks, of the next `n` that have a keyword row, whose row is not the one `_row`
    makes of them now, in whole (`WHOLE_SLICE`); the cursor moved on."""
    if n <= 0:
        return []
    cursor = f"fts_compared:{table.name}"
    after = meta_cursor(db, cursor)
    rows = db.all(
        "SELECT c.id, c.title, c.headings, c.content, CAST(f.title AS BLOB), "
        "CAST(f.headings AS BLOB), CAST(f.content AS BLOB), CAST(f.parts AS BLOB) "
        f"FROM ({table.rows}) c JOIN {table.name} f ON f.rowid = c.id "
        f"WHERE {'1' if after is None else 'c.id > :after'} ORDER BY c.id LIMIT :n",
        {"after": after, "n": n},
    )
    if len(rows) < n:
        db.execute("DELETE FROM index_meta WHERE key = ?", (cursor,))
    else:
        set_meta(db, cursor, str(rows[-1][0]))
    out = []
    for row in rows:
        made = [v.encode("utf-8", "surrogatepass") for v in _row(*row[:4])[1:]]
        if made != list(row[4:8]):
            out.append(tuple(row[:4]))
    return out


def sync_fts(
    db: Database, *, verify: bool = False, check: bool = True, most: int | None = None
) -> dict[str, int]:
    """Make each keyword table hold exactly the live chunks: create a missing table, delete
    rows no live chunk has, add the chunks that have none. In one transaction; what changed.

    `verify` (the reconcile sweep): FTS5's own integrity check first; an index that does not
    match its text (a host wrote into its shadow tables), or a table FTS5 cannot open, is
    built again from the chunks: derived data, so mended, not lost. Then each row's text is
    compared with its chunk's, and a row that is not the chunk's is made again. `check`: with
    `verify`, FTS5's integrity check too (else only `fts_present`'s look: `check_due`); one
    that found the tables whole is recorded (`CHECKED`). `most` (the sweep): rows deleted
    and added a table at most, the rest left to the next sweep: a dropped table of 200k chunks
    was refilled in one transaction (21 s under the write lock, 300 MB of text at once)."""
    changed: dict[str, int] = {}
    # Checked before the transaction, each in its own: once FTS5 found its index corrupt (a
    # host dropped its `_idx`), every later statement of that transaction failed the same way,
    # the DROP below included, and the sweep failed at every run.
    # Without `verify` (a process's connect) the look of `fts_present` still: a `_config` a
    # host wrote made FTS5 refuse the table, and every command failed as it opened the file.
    broken = {
        t.name
        for t in FTS_TABLES
        if db.table_exists(t.name)
        and not (fts_intact(db, t) if verify and check else fts_present(db, t))
    }
    with db.atomic():
        every = verify and not db.scalar(  # as bytes: a host's value may not be UTF-8
            "SELECT 1 FROM index_meta WHERE key = ? AND CAST(value AS BLOB) = ?",
            (ROWS_MADE[0], ROWS_MADE[1].encode()),
        )
        every_done = True  # (`every` rewrote what it found, not capped by `most`)
        for t in FTS_TABLES:
            if t.name in broken and db.table_exists(t.name):
                _drop(db, t)  # refilled below from the chunks
                changed[f"{t.name} rebuilt"] = 1
            if not db.table_exists(t.name):
                db.execute(create_sql(t.name))
                changed.setdefault(f"{t.name} created", 1)
            cap = "" if most is None else f" LIMIT {int(most)}"
            stale = [r[0] for r in db.all(t.stale("rowid") + cap)]
            fts_delete(db, t, stale)
            missing = db.all(t.missing("*") + cap)
            fts_write(db, t, missing)
            unlike: list[tuple] = []
            if verify:
                unlike, whole = _unlike(db, t, every=every, most=most)
                every_done = every_done and whole
                seen = {row[0] for row in unlike}
                unlike += [r for r in _unlike_whole(db, t, WHOLE_SLICE) if r[0] not in seen]
            fts_write(db, t, unlike)
            if stale:
                changed[f"{t.name} stale"] = len(stale)
            if missing:
                changed[f"{t.name} missing"] = len(missing)
            if unlike:
                changed[f"{t.name} rewritten"] = len(unlike)
        if every and every_done:
            set_meta(db, *ROWS_MADE)
        if verify and check:  # (what was broken is made again above: whole now)
            set_meta(db, CHECKED, db.scalar("SELECT strftime('%Y-%m-%dT%H:%M:%fZ')"))
    return changed


# Keyword rows a sweep deletes or adds a table at most (`sync_fts`'s `most`): some 20 MB of
# text and a second or two under the write lock; the next sweep goes on.
SWEEP_ROWS = 20_000


# -- queries ---------------------------------------------------------------------------------

# Words that carry no keyword signal in a question, dropped from a query that has others: each
# matches a large share of all chunks, and BM25 must score every chunk a term matches (at 100k
# chunks a question's common words cost most of a keyword search; bench/search_modes.py).
_STOP_WORDS = (
    "a about above after again against all also am an and any are as at be because been before "
    "being below between both but by can could did do does doing down during each few for from "
    "further had has have having he her here hers him his how i if in into is it its itself just "
    "me more most my no nor not now of off on once only or other our out over own same she "
    "should so some such than that the their theirs them then there these they this those "
    "through to too under until up very was we were what when where which while who whom why "
    "will with would you your yours many much according regarding given give gives used use "
    "using make made get got way well"
)
_STOP = frozenset(_STOP_WORDS.split())
MAX_TERMS = 64
# The most words a token of several parts is searched as a phrase of: an identifier has a few
# (`response_model_exclude_unset`: 4). A phrase's cost grows faster than its length, and a
# query of 12,000 characters of `alpha.alpha.…` took 7 s over 20,000 chunks (96,000: 4 min);
# a longer token is searched by its words alone.
PHRASE_MAX = 16


def keyword_query(text: str) -> str | None:
    """An FTS5 MATCH expression for any user text, or None when it has no indexable word.

    Every term is a quoted string, so nothing the user typed is an operator (`AND`, `NEAR`,
    `-`, `*`, `^`, `:`, parentheses, quotes); terms are OR-ed and BM25 ranks. A token of several
    parts (`response_model_exclude_unset`, `os.path`) is also searched as a phrase, the whole
    identifier; a CamelCase token also by its words."""
    terms: dict[str, None] = {}
    words: dict[str, None] = {}
    for raw in _nfc(text).split():
        tokens = [t.lower() for t in _TOKEN.findall(raw)]
        if 1 < len(tokens) <= PHRASE_MAX:
            terms['"' + " ".join(tokens) + '"'] = None
        for t in tokens:
            words[t] = None
        words.update((w, None) for w in identifier_parts(raw).split())
    # One letter or digit alone (the `s` of "Biden's", split off by the tokenizer) matches
    # everything and means nothing; the phrase keeps it where it belongs.
    kept = [w for w in words if w not in _STOP and len(w) > 1] or list(words)
    terms.update((f'"{w}"', None) for w in kept)
    chosen = list(terms)[:MAX_TERMS]
    return " OR ".join(chosen) if chosen else None
