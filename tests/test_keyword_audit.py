"""The keyword index against an audit's findings (2026-12-03): words beyond ASCII, text in
decomposed Unicode, a keyword row left under a reused chunk id, and FTS5 tables a host damaged
so that FTS5 cannot open them."""

from __future__ import annotations

import unicodedata

import apsw
import pytest

from conftest import FakeEmbedder, integrity, keyword_rows_problems
from host import host
from worker.bulk import index_item
from worker.errors import StoreError
from worker.reconcile import reconcile
from worker.retrieval import search_chunks
from worker.store import connect
from worker.store.fts import (
    CHECKED,
    DAMAGED,
    NOTES,
    PHRASE_MAX,
    ROW_TITLE_MAX,
    ROWS_MADE,
    fts_counts,
    fts_intact,
    identifier_parts,
    keyword_query,
    sync_fts,
)
from worker.store.items import add_item


@pytest.fixture
def fake() -> FakeEmbedder:
    return FakeEmbedder()


def titles(db, query: str) -> list[str]:
    return [h.title for h in search_chunks(db, query, None, k=5, mode="keyword").hits]


def add(db, fake, title: str, content: str) -> int:
    item = add_item(db, kind="note", title=title, content=content)
    assert index_item(db, item, embedder=fake).status == "indexed"
    return item


def test_a_capitalised_word_beyond_ascii_is_one_word_not_its_ascii_fragments(db, fake):
    add(db, fake, "Trip", "We visited Zürich in May.")
    add(db, fake, "Wealth", "How the rich invest their money.")
    add(db, fake, "Math", "The sum of two numbers.")
    add(db, fake, "Jobs", "Send your Résumé today.")
    add(db, fake, "Lang", "Tiếng Việt is spoken here.")
    assert titles(db, "Zürich") == ["Trip"]
    assert titles(db, "rich") == ["Wealth"]
    assert titles(db, "Résumé") == ["Jobs"]
    assert titles(db, "sum") == ["Math"]
    assert keyword_query("Tiếng Việt") == '"tiếng" OR "việt"'
    assert db.all("SELECT parts FROM note_chunks_fts WHERE parts != ''") == []
    # CamelCase of any script is still split, and never inside a run of lowercase letters.
    assert identifier_parts("ZürichTrip ÉcoleNormale MÜNCHENStadt") == (
        "zürich trip école normale münchen stadt"
    )
    assert identifier_parts(unicodedata.normalize("NFD", "RésuméBuilder")) == "résumé builder"


def test_rows_made_by_the_ascii_only_split_are_made_again_once_by_the_sweep(db, fake):
    """A database indexed before the fix holds `z rich` for `Zürich`: the sweep's first
    `sync_fts` compares the rows of text beyond ASCII with the rows made now."""
    trip = add(db, fake, "Trip", "We visited Zürich in May.")
    add(db, fake, "Wealth", "How the rich invest their money.")
    chunk = db.scalar("SELECT id FROM note_chunks WHERE item_id = ?", (trip,))
    db.execute("UPDATE note_chunks_fts SET parts = 'z rich' WHERE rowid = ?", (chunk,))
    db.execute("DELETE FROM index_meta WHERE key = ?", ROWS_MADE[:1])
    assert titles(db, "rich") == ["Wealth", "Trip"]  # as an old database answered

    assert sync_fts(db, verify=True) == {"note_chunks_fts rewritten": 1}
    assert titles(db, "rich") == ["Wealth"]
    assert db.scalar("SELECT value FROM index_meta WHERE key = ?", ROWS_MADE[:1]) == "2"
    assert sync_fts(db, verify=True) == {}  # once: the next sweeps compare text only
    assert integrity(db) == "ok"


def test_a_query_in_decomposed_unicode_finds_both_forms(db, fake):
    nfd = unicodedata.normalize("NFD", "résumé 한국어")
    nfc = unicodedata.normalize("NFC", nfd)
    assert nfd != nfc
    add(db, fake, "nfd", f"zzfiller {nfd} zzfiller")
    add(db, fake, "nfc", f"zzfiller {nfc} zzfiller")
    for query in (nfd, nfc, "resume"):
        assert sorted(titles(db, query)) == ["nfc", "nfd"], ascii(query)
    for query in ("한국어", unicodedata.normalize("NFD", "한국어")):
        assert sorted(titles(db, query)) == ["nfc", "nfd"], ascii(query)
    # A mark with no precomposed letter stays in its word, as unicode61 keeps it.
    add(db, fake, "mark", "the q\u0303uery word")
    assert titles(db, "q\u0303uery") == ["mark"]


def test_a_keyword_row_left_under_a_reused_chunk_id_is_made_again_by_the_sweep(db, db_path, fake):
    """A host deletes an item (its trigger deletes the chunks, the keyword row stays) and
    writes a chunk of its own, which takes the freed id: the sweep compares the row's text."""
    add(db, fake, "other", "harmless text")
    secret = add(db, fake, "secret", "uniquezebra launch codes")
    freed = db.scalar("SELECT id FROM note_chunks WHERE item_id = ?", (secret,))
    out = host(
        db_path,
        ("DELETE FROM knowledge_items WHERE id = ?", [secret]),
        (
            "INSERT INTO knowledge_items(kind, title, content) "
            "VALUES ('note', 'host note', 'shopping list') RETURNING id",
            [],
        ),
        (
            "INSERT INTO note_chunks(item_id, chunk_index, content, method, start_offset, "
            "end_offset, embed_hash) SELECT max(id), 0, 'shopping list', 'structure', 0, 13, "
            "'h' FROM knowledge_items RETURNING id",
            [],
        ),
    )
    assert out[2] == [[freed]]  # the deleted chunk's id, given again
    assert titles(db, "uniquezebra") == ["host note"]  # before the sweep

    assert sync_fts(db, verify=True) == {"note_chunks_fts rewritten": 1}
    assert titles(db, "uniquezebra") == []
    assert titles(db, "shopping") == ["host note"]
    assert keyword_rows_problems(db) == [] and integrity(db) == "ok"
    assert sync_fts(db, verify=True) == {}


@pytest.mark.parametrize(
    "damage",
    [
        "UPDATE note_chunks_fts_config SET v = 99 WHERE k = 'version'",
        "DROP TABLE note_chunks_fts_config",
        "DROP TABLE note_chunks_fts_config; DROP TABLE note_chunks_fts_data",
    ],
)
def test_a_keyword_table_fts5_cannot_open_is_rebuilt_by_the_sweep(
    db, db_path, emb_settings, fake, damage
):
    """A host's write to FTS5's `_config` leaves a table that no query, no integrity check and
    no DROP TABLE can open (a connection that had opened it keeps its cached state): the sweep
    removes it with its shadow tables and builds it again; the other connection sees the new
    one."""
    for n in range(3):
        add(db, fake, f"filler {n}", f"nothing about it here, number {n}")
    target = add(db, fake, "target", "the pelican migrates in spring")
    assert titles(db, "pelican") == ["target"]
    schema = db.all("SELECT type, name, sql FROM sqlite_master ORDER BY name")
    host(db_path, *[(sql, []) for sql in damage.split("; ")])
    sweep = connect(db_path, embedding=emb_settings)
    try:
        with pytest.raises(apsw.SQLError, match=r"fts5|vtable"):
            sweep.all("SELECT rowid FROM note_chunks_fts WHERE note_chunks_fts MATCH 'pelican'")
        assert fts_counts(sweep)["note_chunks_fts"] == {"stale": 0, "missing": 4}
        assert not fts_intact(sweep, NOTES)  # what `kidx doctor` reports, not a crash
        changed = sync_fts(sweep, verify=True)
        assert changed["note_chunks_fts rebuilt"] == 1
        assert changed["note_chunks_fts missing"] == 4
        assert titles(sweep, "pelican") == ["target"]
    finally:
        sweep.close()
    assert titles(db, "pelican") == ["target"]  # the long-lived connection, too
    assert db.all("SELECT type, name, sql FROM sqlite_master ORDER BY name") == schema
    assert keyword_rows_problems(db) == [] and integrity(db) == "ok"
    assert sync_fts(db, verify=True) == {}
    assert db.scalar("SELECT item_id FROM note_chunks WHERE content LIKE '%pelican%'") == target


@pytest.mark.parametrize("shadow", ["idx", "data", "docsize", "content", "config"])
def test_a_dropped_shadow_table_degrades_search_and_the_sweep_rebuilds_it(
    db, db_path, emb_settings, fake, shadow
):
    """A host's DROP TABLE note_chunks_fts_idx: FTS5 opens the table but finds its index
    corrupt, and from then on every statement of that transaction failed alike. A search
    raised CorruptError at its read's COMMIT, and the sweep, which checked the index inside
    its transaction, failed at the DROP that rebuilds it, at every run, for good."""
    for n in range(3):
        add(db, fake, f"filler {n}", f"nothing about it here, number {n}")
    target = add(db, fake, "target", "the pelican migrates in spring")
    host(db_path, (f"DROP TABLE note_chunks_fts_{shadow}", []))
    other = connect(db_path, embedding=emb_settings)
    try:
        for mode in ("keyword", "hybrid"):  # found or not, never an exception
            found = search_chunks(other, "pelican", fake, k=5, mode=mode).hits
            assert [h.item_id for h in found] in ([], [target]) or mode == "hybrid"
        late = add_item(other, kind="note", title="late", content="the heron waits")
        try:
            refused = index_item(other, late, embedder=fake).status != "indexed"
        except StoreError as e:  # refused while the index was damaged: it says why
            assert "keyword index a host damaged is rebuilt by the reconcile sweep" in str(e)
            refused = True
        changed = sync_fts(other, verify=True)
        assert changed.get("note_chunks_fts rebuilt") == 1 or changed.get("note_chunks_fts created")
        if refused:
            assert index_item(other, late, embedder=fake).status == "indexed"
        assert titles(other, "pelican") == ["target"] and titles(other, "heron") == ["late"]
    finally:
        other.close()
    assert keyword_rows_problems(db) == [] and integrity(db) == "ok"
    assert sync_fts(db, verify=True) == {}


def sweep(db) -> dict[str, int]:
    """The reconcile sweep's mend of the keyword tables: what it changed."""
    return reconcile(db, model="fake", max_items=100).repaired["keyword_rows"]


def test_fts5_s_integrity_check_runs_hourly_or_once_a_write_failed_on_it(db, db_path, fake) -> None:
    """The check is an INSERT command: it holds the write lock (0.85 s at 99k chunks), and every
    sweep ran it. Damage only it finds (a host's write into `_docsize`) is now looked for
    hourly, or at the next sweep once an item failed on the damaged table."""
    for n in range(3):
        add(db, fake, f"note {n}", f"the pelican number {n} migrates in spring")
    assert sweep(db) == {}  # the first sweep checks, and records it
    damage = (
        "DELETE FROM note_chunks_fts_docsize "
        "WHERE id = (SELECT min(id) FROM note_chunks_fts_docsize)"
    )
    host(db_path, (damage, []))
    assert not fts_intact(db, NOTES)
    assert sweep(db) == {}  # checked within the hour: not looked for
    item = db.scalar("SELECT min(item_id) FROM item_index_state")
    db.execute(  # as a write refused by the damaged table leaves its item
        "UPDATE item_index_state SET status = 'failed', last_error = ? WHERE item_id = ?",
        (f"the database refused the write (CorruptError: ...): {DAMAGED} is rebuilt", item),
    )
    assert sweep(db).get("note_chunks_fts rebuilt") == 1
    assert fts_intact(db, NOTES) and keyword_rows_problems(db) == []

    host(db_path, (damage, []))
    db.execute("UPDATE item_index_state SET status = 'indexed', last_error = NULL")
    assert sweep(db) == {}
    db.execute(  # the last check two hours ago
        "UPDATE index_meta SET value = strftime('%Y-%m-%dT%H:%M:%fZ', 'now', '-2 hours') "
        "WHERE key = ?",
        (CHECKED,),
    )
    assert sweep(db).get("note_chunks_fts rebuilt") == 1
    assert integrity(db) == "ok"


def test_a_dropped_shadow_table_is_rebuilt_by_a_sweep_that_does_not_check(
    db, db_path, fake
) -> None:
    add(db, fake, "target", "the pelican migrates in spring")
    assert sweep(db) == {}
    host(db_path, ("DROP TABLE note_chunks_fts_idx", []))
    assert sweep(db).get("note_chunks_fts rebuilt") == 1  # seen without FTS5's check
    assert titles(db, "pelican") == ["target"]


def test_a_huge_title_is_cut_in_each_keyword_row_and_kept_whole_in_its_item(db, db_path, fake):
    """Every chunk's keyword row carries its item's title: a host's 200 KB title went whole
    into each, 200 KB of index a chunk. The row holds its first ROW_TITLE_MAX characters, the
    way every writer makes it (the run, the sweep's refill), and the sweep leaves it so."""
    title = " ".join(f"w{n}" for n in range(40_000))  # ~230 KB
    body = "\n\n".join(f"Paragraph {n} about zebras. " * 30 for n in range(6))
    item = add(db, fake, title, body)
    rows = db.all("SELECT rowid, title FROM note_chunks_fts")
    assert len(rows) > 1
    for _, held in rows:
        assert len(held) <= ROW_TITLE_MAX and held.startswith("w0 w1 w2") and held.endswith("…")
    assert db.scalar("SELECT title FROM knowledge_items WHERE id = ?", (item,)) == title
    assert titles(db, "w5") == [title] * min(5, len(rows))  # every chunk, found by its title
    assert titles(db, "w39999") == []  # beyond the cut: not in the index
    assert sync_fts(db, verify=True) == {}  # as the sweep makes them: nothing to rewrite
    host(db_path, ("DELETE FROM note_chunks_fts", []))
    assert sync_fts(db, verify=True) == {"note_chunks_fts missing": len(rows)}
    assert db.all("SELECT rowid, title FROM note_chunks_fts ORDER BY rowid") == sorted(rows)
    host(db_path, ("UPDATE note_chunks_fts SET title = ?", [title]))  # as before the cut
    assert sync_fts(db, verify=True) == {"note_chunks_fts rewritten": len(rows)}
    assert db.all("SELECT rowid, title FROM note_chunks_fts ORDER BY rowid") == sorted(rows)


def test_a_token_of_thousands_of_parts_is_searched_by_its_words_not_as_one_phrase(db, fake):
    """`alpha.alpha.…` of 12,000 characters was one FTS5 phrase of 2,000 words: 7 s over
    20,000 chunks (96,000 characters: 4 minutes), holding a read snapshot all along."""
    item = add_item(db, kind="note", title="T", content="alpha beta gamma, alpha.beta here.")
    index_item(db, item, embedder=fake)
    query = keyword_query("alpha." * 16_000 + " alpha.beta")
    assert query is not None
    phrases = [t for t in query.split(" OR ") if " " in t]
    assert phrases == ['"alpha beta"']  # the identifier's phrase stays
    assert max(len(t.split()) for t in query.split(" OR ")) <= PHRASE_MAX
    hits = search_chunks(db, "alpha." * 16_000, None, k=3, mode="keyword").hits
    assert [h.item_id for h in hits] == [item]


@pytest.mark.parametrize(
    "declared",
    [
        "fts5(a)",  # another application's columns
        "fts5(title, headings, content, parts, content='')",  # contentless: no DELETE
        "fts5(title, headings, content, parts)",  # another tokenizer
    ],
)
def test_a_keyword_table_a_host_made_again_otherwise_is_rebuilt_by_the_sweep(
    db, db_path, fake, declared
):
    """FTS5's integrity check passed on a host's table of another declaration, so it was
    kept: every sweep failed (`no column named title`, `cannot DELETE from contentless`),
    and every new note's write with it."""
    target = add(db, fake, "target", "the pelican migrates in spring")
    schema = db.all("SELECT type, name, sql FROM sqlite_master ORDER BY name")
    host(
        db_path,
        ("DROP TABLE note_chunks_fts", []),
        (f"CREATE VIRTUAL TABLE note_chunks_fts USING {declared}", []),
    )
    for _ in range(2):
        assert reconcile(db, model=fake.model_id, max_items=100).to_index == []
    assert db.all("SELECT type, name, sql FROM sqlite_master ORDER BY name") == schema
    assert titles(db, "pelican") == ["target"]
    assert add(db, fake, "later", "a heron waits in the reeds") > target
    assert titles(db, "heron") == ["later"] and keyword_rows_problems(db) == []


def test_rows_that_are_right_are_not_made_again_in_python_at_every_sweep(db, fake, monkeypatch):
    """Text beyond ASCII that the row holds otherwise (NFD made NFC, a title over 1,000 bytes
    cut) failed the SQL comparison every time, and each such row's keyword parts were made
    again to compare: 35 us a chunk of NFD text, 120 us with a long title, at every sweep,
    under the write lock, for rows that were right."""
    import unicodedata as ud

    from worker.store import fts

    add(
        db,
        fake,
        "t" * 1_200 + " \u00e9t\u00e9",
        ud.normalize("NFD", "Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e."),
    )
    add(db, fake, "plain", ud.normalize("NFD", "R\u00e9sum\u00e9 of a na\u00efve co\u00f6perator."))
    assert sync_fts(db, verify=True) == {}  # (the first: every row compared, once)
    made: list[str] = []
    real = fts.identifier_parts
    monkeypatch.setattr(fts, "identifier_parts", lambda text: made.append(text) or real(text))
    monkeypatch.setattr(fts, "WHOLE_SLICE", 0)  # (rows compared whole: a bounded slice, apart)
    assert sync_fts(db, verify=True) == {}
    assert made == []
    monkeypatch.setattr(fts, "WHOLE_SLICE", 1)  # one row whole a sweep, round and round
    assert sync_fts(db, verify=True) == {} and len(made) == 1
