"""Engine commands: init, add, update, index, chunks, search, status."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import apsw
import click
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)
from rich.text import Text

from ops.cli.base import ID, Ctx, cli, command, err, fail, out, printable, read_text
from worker.errors import InvalidInput, KidxError

# -- init ------------------------------------------------------------------------------------


@command(cli)
def init(ctx: Ctx) -> None:
    """Create the database (or bring it up to date) and show what it runs with."""
    from worker.store.schema import schema_version

    with ctx.store(create=True, adopt=True) as db:
        info = {
            "db": str(ctx.settings.db),
            "schema_version": schema_version(db),  # the file's, as connect() left it
            "sqlite_vec": db.vec_version,
            "vec_error": db.vec_error,
            "dimensions": db.dimensions,
            "dimensions_from": db.resolution.source,
            "provider": ctx.settings.embedding.provider,
            "model": ctx.settings.embedding.model,
        }

    def human() -> None:
        vec = info["sqlite_vec"] or f"unavailable ({info['vec_error']})"
        # as given, not as rich markup: a path or a model name holding [red] or [/x] was
        # read as a style (or failed as a bug), a [link=...] made a terminal hyperlink
        for line in (
            f"database {info['db']} (schema {info['schema_version']})",
            f"sqlite-vec {vec}; {info['dimensions']} dimensions ({info['dimensions_from']})",
            f"embedding provider {info['provider']}, model {info['model']}",
        ):
            out.print(printable(line), markup=False)

    ctx.done = f"the database {info['db']} is ready"
    ctx.emit(info, human)


# -- add / update ----------------------------------------------------------------------------


@cli.group()
def add() -> None:
    """Add an item."""


@command(add, "note")
@click.option("--title", required=True, help="The note's title.")
@click.option("--text", help="The note's text.")
@click.option("--file", "file", type=click.Path(path_type=Path), help="Read the text from a file.")
@click.option("--inline", is_flag=True, help="Index it now, in this process.")
def add_note(ctx: Ctx, title: str, text: str | None, file: Path | None, inline: bool) -> None:
    """Add a note; prints its id."""
    from worker.store.items import add_item

    content = read_text(text, file, ctx.settings.files.max_bytes)
    with ctx.store(create=True, claim=inline) as db:
        item_id = add_item(db, kind="note", title=title, content=content)
        results = index_inline(ctx, db, [item_id]) if inline else []
    ctx.done = f"item {item_id} was added"
    ctx.emit({"id": item_id, "index": results or None}, lambda: out.print(item_id))
    for r in results:
        if r["status"] == "failed":
            fail(f"item {item_id} was added, but indexing failed: {r['error']}", 1, ctx.redact)


@command(cli)
@click.argument("item", type=ID)
@click.option("--text", help="The new text (a note's only).")
@click.option("--file", "file", type=click.Path(path_type=Path), help="Read the text from a file.")
@click.option("--title", help="A new title.")
def update(ctx: Ctx, item: int, text: str | None, file: Path | None, title: str | None) -> None:
    """Replace a note's text, or any item's title (index it again to see the change in
    search). A file's, a URL's or a code item's text comes from its source: edit that."""
    from worker.store.items import NOW, get_item, update_content

    if text is None and file is None:
        if title is None:
            raise InvalidInput("give --title, or exactly one of --text and --file")
        content = None
    else:
        content = read_text(text, file, ctx.settings.files.max_bytes)
    with ctx.store() as db:
        found = get_item(db, item, content=False)
        if content is None:
            with db.atomic():  # the title alone (a trigger makes the item pending)
                db.execute(
                    f"UPDATE knowledge_items SET title = ?, updated_at = {NOW} WHERE id = ?",
                    (title, item),
                )
        elif found.kind != "note":
            # (a host may have left a file's or URL's source NULL: there is none to name)
            where = f" ({found.source})" if found.source else ""
            raise InvalidInput(
                f"item {item} is a {found.kind} item: its text comes from its source{where}, "
                "read again at each index; edit that (--title alone is fine)"
            )
        else:
            update_content(db, item, content, title=title)
    ctx.done = f"item {item} was updated"
    ctx.emit({"id": item, "updated": True}, lambda: out.print(f"item {item} updated"))


@command(cli)
@click.argument("items", type=ID, nargs=-1, required=True)
def delete(ctx: Ctx, items: tuple[int, ...]) -> None:
    """Delete items with their chunks, vectors and index state, in one transaction (all of
    them or, if an id is unknown, none). A run under way for one of them writes nothing."""
    from worker.store.removal import delete_items

    with ctx.store() as db:
        deleted = delete_items(db, items)
    ctx.done = "deleted " + " ".join(map(str, deleted))
    ctx.emit({"deleted": deleted}, lambda: out.print("deleted " + " ".join(map(str, deleted))))


# -- index -----------------------------------------------------------------------------------


RESULT_COLUMNS = (
    "item_id",
    "status",
    "chunk_method",
    "chunks",
    "reused",
    "embedded",
    "failed",
    "duration_ms",
    "error",
)


def show_results(ctx: Ctx, results: list[dict[str, Any]], seconds: float | None = None) -> None:
    """Print index results; exit status 1 when any item failed. On a terminal, a summary and
    the items that did not end `indexed`; piped, a row per item (`--json`: every field)."""

    def rows(shown: list[dict[str, Any]]) -> None:
        ctx.table(
            RESULT_COLUMNS,
            ([r.get(k) for k in RESULT_COLUMNS] for r in shown),
            drop=("reused", "embedded", "failed", "chunk_method", "duration_ms"),
        )

    def summary() -> None:
        counts: dict[str, int] = {}
        for r in results:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        total = {k: sum(int(r.get(k) or 0) for r in results) for k in ("chunks", "embedded")}
        reused = sum(int(r.get("reused") or 0) for r in results)
        took = f" in {seconds:.1f} s" if seconds is not None else ""
        out.print(
            f"{len(results)} items{took}: "
            + ", ".join(f"{n} {status}" for status, n in sorted(counts.items()))
            + f"; {total['chunks']} chunks ({total['embedded']} embedded, {reused} reused)",
            highlight=False,
        )
        if others := [r for r in results if r["status"] != "indexed"]:
            rows(others)

    indexed = sum(r["status"] == "indexed" for r in results)
    ctx.done = f"the run ended: {indexed} of {len(results)} items indexed"
    ctx.emit(results, summary if out.is_terminal else lambda: rows(results))
    if any(r["status"] == "failed" for r in results):
        sys.exit(1)


class RateColumn(ProgressColumn):
    """Items a second, once rich has measured it."""

    def render(self, task: Any) -> Text:
        return Text(f"{task.speed:.1f}/s" if task.speed else "", style="progress.data.speed")


@contextlib.contextmanager
def inline_progress(ctx: Ctx, total: int) -> Iterator[Callable[[int, Any], None] | None]:
    """A progress bar on stderr when it is a terminal (items, chunks, rate, time left): the
    `on_done` of each item's outcome; None when piped or with `--json`."""
    if ctx.json or not err.is_terminal:
        yield None
        return
    from worker.pipeline import IndexResult

    with Progress(
        TextColumn("indexing"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("items, {task.fields[chunks]} chunks"),
        RateColumn(),
        TimeRemainingColumn(),
        console=err,
        transient=False,  # the last frame stays: how many, how fast
    ) as progress:
        bar = progress.add_task("index", total=total, chunks=0)
        chunks = 0

        def done(item_id: int, outcome: Any) -> None:
            nonlocal chunks
            chunks += outcome.chunks if isinstance(outcome, IndexResult) else 0
            progress.update(bar, advance=1, chunks=chunks)

        yield done


def index_inline(
    ctx: Ctx,
    db: Any,
    ids: list[int],
    *,
    structure_only: bool = False,
    on_done: Callable[[int, Any], None] | None = None,
) -> list[dict[str, Any]]:
    """The pipeline here, a group at a time as the workers run a batch (texts of several items
    share embedding requests): one result per item, a failure as its reason. Each group's
    items are locked as a worker locks them (a busy item is reported `coalesced`, and its
    holder runs it once more), so that two runs never embed one item twice."""
    from worker.providers import build_chat

    embedder = ctx.embedder(db)
    chat = build_chat(ctx.settings.chunk)
    client = ctx.broker_redis()
    size = ctx.settings.tasks.group_size
    results: dict[int, dict[str, Any]] = {}
    try:
        for start in range(0, len(ids), size):
            part = ids[start : start + size]
            results |= _locked_group(ctx, db, client, part, embedder, chat, structure_only, on_done)
    finally:
        for closable in (embedder, chat, client):
            if closable is not None:
                closable.close()
    return [results[i] for i in ids if i in results]


def _locked_group(
    ctx: Ctx,
    db: Any,
    client: Any,
    ids: list[int],
    embedder: Any,
    chat: Any,
    structure_only: bool,
    on_done: Callable[[int, Any], None] | None = None,
) -> dict[int, dict[str, Any]]:
    from tasks.lock import LockSet
    from worker.bulk import index_items
    from worker.indexers import IndexOptions
    from worker.pipeline import IndexResult
    from worker.store.items import mark_not_run

    options = IndexOptions(
        chat=chat,
        reader=ctx.reader(),
        chunk_window=ctx.settings.chunk.window,
        chunk_deadline=ctx.settings.chunk.deadline,
        chunk_target=ctx.settings.chunk.target,
        structure_only=structure_only,
        context_chars=ctx.settings.embedding.context_chars,
    )

    def run(item_ids: list[int]) -> None:
        outcomes = index_items(db, item_ids, embedder=embedder, options=options, on_done=on_done)
        for item_id, outcome in outcomes.items():
            results[item_id] = (
                outcome.as_dict()
                if isinstance(outcome, IndexResult)
                else {"item_id": item_id, "status": "failed", "error": str(outcome)}
            )

    results: dict[int, dict[str, Any]] = {}
    if client is None:  # no broker: no lock to take (and no worker to meet)
        run(ids)
        return results
    owner = f"inline:{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
    locks = LockSet(client, db.instance(), ids, owner, ctx.settings.tasks.lock_ttl)
    held, busy = locks.acquire()
    busy_note = "being indexed by another run, which runs it once more"
    for item_id, problem in locks.refused.items():  # another program's value at its key
        results[item_id] = {"item_id": item_id, "status": "failed", "error": problem}
        with contextlib.suppress(KidxError, apsw.Error):
            mark_not_run(db, item_id, owner, owner, problem)
    for item_id in busy:
        results[item_id] = {"item_id": item_id, "status": "coalesced", "error": busy_note}
    try:
        run(held)
    finally:
        asked = locks.release()
    if again := [i for i in asked if _changed(db, i)]:  # edited while this ran: once more
        run(again)
    return results


# An item another run asked to run again while this one held it, that still needs it: what the
# reconcile sweep calls `changed` or `pending` (an edit's trigger clears `content_hash` and sets
# the state `pending`; a title is in what is embedded), or any item but a note (a file's or
# URL's text is read only by its run). `get_state` has no `indexed_hash`: every item asked was
# run again, a URL fetched again, though nothing had changed.
_STILL_WANTED = """SELECT 1 FROM knowledge_items i LEFT JOIN item_index_state s ON s.item_id = i.id
    WHERE i.id = ? AND (CAST(i.kind AS BLOB) IS NOT CAST('note' AS BLOB)
    OR coalesce(CAST(s.status AS BLOB), CAST('pending' AS BLOB)) IS NOT CAST('indexed' AS BLOB)
    OR i.content_hash IS NULL OR s.indexed_hash IS NULL
    OR CAST(i.content_hash AS BLOB) IS NOT CAST(s.indexed_hash AS BLOB))"""


def _changed(db: Any, item_id: int) -> bool:
    return db.one(_STILL_WANTED, (item_id,)) is not None


@command(cli)
@click.argument("items", type=ID, nargs=-1)
@click.option("--all", "all_items", is_flag=True, help="Every item.")
@click.option("--inline", is_flag=True, help="Run the pipeline here (no broker); else enqueue.")
@click.option(
    "--structure", is_flag=True, help="Structural chunking for this run (no chunk model)."
)
def index(ctx: Ctx, items: tuple[int, ...], all_items: bool, inline: bool, structure: bool) -> None:
    """Index items: chunk, embed, write."""
    from worker.store.items import all_item_ids, get_item

    if bool(items) == all_items:
        raise InvalidInput("give item ids or --all (not both)")
    ids = list(dict.fromkeys(items))  # an id given twice is one item, run once
    if not inline:
        from ops.cli.queue import send_items, show_sent

        if all_items:
            with ctx.store() as db:
                ids = all_item_ids(db)
        if not ids:  # as `kidx reindex --all` says
            raise InvalidInput("there are no items to index")
        show_sent(ctx, send_items(ctx, ids, "index", structure_only=structure))
        return
    with ctx.store(claim=True) as db:
        if all_items:
            ids = all_item_ids(db)
        if not ids:
            raise InvalidInput("there are no items to index")
        for item_id in ids:
            get_item(db, item_id)  # unknown ids fail before any work
        started = time.monotonic()
        with inline_progress(ctx, len(ids)) as on_done:
            results = index_inline(ctx, db, ids, structure_only=structure, on_done=on_done)
    show_results(ctx, results, time.monotonic() - started)


# -- chunks / search / status ----------------------------------------------------------------


def reading_store(ctx: Ctx) -> Any:
    """The database for a command that only reads (chunks, search, status): it must exist, and
    its vec tables are kept as they are (`connect(read_only=True)`): a reader still configured
    with the old model during a model switch would otherwise rebuild them back, and mark the
    items the workers have re-indexed `pending`."""
    from worker.store import open_store

    return open_store(ctx.settings, create=False, read_only=True)


@command(cli)
@click.argument("item", type=ID)
def chunks(ctx: Ctx, item: int) -> None:
    """An item's chunks: index, method, has_embedding, summary, offsets, length (a code
    item's: `path:first-last` line as the summary, no offsets)."""
    from worker.store.items import list_chunks

    with reading_store(ctx) as db:
        rows = list_chunks(db, item)

    ctx.emit(
        rows,
        lambda: ctx.table(
            ("#", "method", "vector", "start", "end", "length", "summary"),
            (
                (
                    r["chunk_index"],
                    r["chunk_method"],
                    "yes" if r["has_embedding"] else "no",
                    r["start_offset"],
                    r["end_offset"],
                    r["length"],
                    r["summary"],
                )
                for r in rows
            ),
            drop=("start", "end"),
        ),
    )


@command(cli)
@click.argument("query")
@click.option("-k", "k", type=click.IntRange(1, 1000), default=10, show_default=True)
@click.option("--chunks", is_flag=True, help="The best chunks (several may share an item).")
@click.option(
    "--mode",
    type=click.Choice(["hybrid", "vector", "keyword"]),
    default="hybrid",
    show_default=True,
    help="hybrid: vectors and keywords fused; keyword needs no embedding provider.",
)
@click.option("--kind", "kinds", multiple=True, type=click.Choice(["note", "file", "url"]))
@click.option("--item", "items", multiple=True, type=ID, help="Only these items (repeatable).")
@click.option("--source", help="Only items whose source starts with this (a folder, a site).")
@click.option("--code", "code", is_flag=True, help="Search code items only.")
@click.option("--memories", is_flag=True, help="Search memories only.")
def search(
    ctx: Ctx,
    query: str,
    k: int,
    chunks: bool,
    mode: str,
    kinds: tuple[str, ...],
    items: tuple[int, ...],
    source: str | None,
    code: bool,
    memories: bool,
) -> None:
    """The best matches for QUERY in notes, files and URLs: one hit per item, or with --chunks
    the best chunks, each with its text; --code: code chunks; --memories: memories."""
    from worker.retrieval import Filters, search_chunks

    if code and memories:
        raise InvalidInput("give --code or --memories, not both")
    filters = Filters(kinds=kinds, item_ids=items, source_prefix=_source_prefix(source))
    if (code or memories) and (filters.active or chunks or mode != "hybrid"):
        raise InvalidInput("--code and --memories take only -k and --json")
    with reading_store(ctx) as db:
        db.map_for_reading()
        embedder = ctx.embedder(db) if mode != "keyword" else None
        if embedder is None and (code or memories):  # (they take no --mode: no keyword-only)
            raise InvalidInput(
                f"{'--code' if code else '--memories'} search needs an embedding provider "
                "(KIDX_EMBEDDING__PROVIDER)"
            )
        if embedder is None and mode != "keyword":
            raise InvalidInput(
                "search needs an embedding provider (KIDX_EMBEDDING__PROVIDER); "
                "--mode keyword needs none"
            )
        try:
            if code or memories:
                return _search_other(ctx, db, query, embedder, k, code=code)
            result = search_chunks(
                db,
                query,
                embedder,
                k=k,
                mode=mode,
                filters=filters,
                per_item=not chunks,
                tuning=ctx.settings.search,
            )
        finally:
            if embedder is not None:
                embedder.close()
    for note in result.notes:
        err.print(f"note: {escape(ctx.say(note))}")
    if chunks:
        ctx.emit([h.as_dict() for h in result.hits], lambda: _print_hits(ctx, result.hits))
        return
    ctx.emit(
        [h.as_dict() for h in result.hits],
        lambda: ctx.table(
            ("score", "item", "kind", "title", "chunk", "snippet"),
            (
                (f"{h.score:.3f}", h.item_id, h.kind, h.title, h.chunk_index, h.snippet)
                for h in result.hits
            ),
            drop=("kind", "chunk"),
        ),
    )


def _print_hits(ctx: Ctx, hits: list[Any]) -> None:
    """Each hit: a line of score, item, chunk, title and heading path, then its text, wrapped
    to the terminal (80 columns when not a terminal). Control characters a document holds
    (an escape sequence would drive the terminal) are shown as U+FFFD; secrets are masked."""
    import textwrap

    width = max(40, min(out.width, 100))
    for n, h in enumerate(hits, 1):
        where = " > ".join([h.title, *h.headings])
        head = ctx.say(
            f"{n:>2}. {h.score:.3f}  item {h.item_id} #{h.chunk_index} [{h.via}] {where}"
        )
        click.echo(head if len(head) <= width else head[: width - 1] + "…")
        text = ctx.say(" ".join(h.content.split()))
        for line in textwrap.wrap(text, width - 4, max_lines=3, placeholder=" …"):
            click.echo("    " + line)


def _source_prefix(given: str | None) -> str | None:
    """A folder as `kidx add file` keeps a file's source (resolved: absolute, no `..`, no
    link), so that `--source docs/` finds what `add file docs/a.md` added. Only what reads as
    a path (from `/`, `.` or `~`, or there on disk): a URL, a host's own `sample:` or any
    other prefix is as given."""
    if not given or "\0" in given:  # (Filters says what is wrong with it)
        return given
    try:
        path = Path(given).expanduser()
        if not (given.startswith(("/", ".", "~")) or path.exists()):
            return given
        resolved = str(path.resolve())
    except (OSError, RuntimeError, ValueError):  # (a link loop, a name too long): as given
        return given
    return resolved + os.sep if given.endswith(("/", os.sep)) and resolved != os.sep else resolved


def _search_other(ctx: Ctx, db: Any, query: str, embedder: Any, k: int, *, code: bool) -> None:
    if code:
        from worker.indexers.code import search_code

        hits, served, reason = search_code(db, query, embedder, k=k)
        headers = ("score", "item", "path", "lines", "snippet")
        rows = [
            (f"{h.score:.3f}", h.item_id, h.path, f"{h.start_line}-{h.end_line}", h.snippet)
            for h in hits
        ]
    else:
        from worker.indexers.memories import search_memories

        hits, served, reason = search_memories(db, query, embedder, k=k)
        headers = ("score", "memory", "content")
        rows = [(f"{h.score:.3f}", h.memory_id, h.content) for h in hits]
    if reason:  # (code search's keyword side says its own problem where vectors served)
        fell_back = "served by the in-memory fallback: " if "fallback" in served else ""
        err.print(f"note: {fell_back}{escape(ctx.say(reason))}")
    ctx.emit([h.as_dict() for h in hits], lambda: ctx.table(headers, rows))


@command(cli)
@click.argument("item", type=ID, required=False)
@click.option("--summary", is_flag=True, help="Only the counts (with --json: an object).")
def status(ctx: Ctx, item: int | None, summary: bool) -> None:
    """The index state of one item; without one, the counts (per status, chunk method and
    model), the last sweeps, the running batches, and every item."""
    from worker.reconcile import last_sweeps
    from worker.store.items import STATE_COLUMNS, get_state, list_states
    from worker.store.items import summary as counts

    if summary and item is not None:
        raise InvalidInput("--summary is the counts of every item: give it without an ITEM")
    with reading_store(ctx) as db:
        data: Any = get_state(db, item) if item is not None else list_states(db)
        overview = counts(db) | {"last_sweeps": last_sweeps(db)} if item is None else None
    rows = [data] if isinstance(data, dict) else data

    def human() -> None:
        if overview is not None:
            _print_overview(ctx, overview)
        if not summary:
            ctx.table(
                STATE_COLUMNS,
                ([r[c] for c in STATE_COLUMNS] for r in rows),
                drop=("dimensions", "model", "duration_ms", "chunk_method", "chunk_count"),
            )

    ctx.emit(overview if summary else data, human)


def _print_overview(ctx: Ctx, o: dict[str, Any]) -> None:
    """The counts; a model's name, a kind or a time is the database's: shown by `ctx.echo`."""

    def line(label: str, values: dict[str, int]) -> None:
        shown = ", ".join(f"{k}: {v}" for k, v in values.items()) or "none"
        ctx.echo(f"{label:<10} {shown}")

    ctx.echo(f"{'items':<10} {o['items']}")
    line("status", o["by_status"])
    line("method", o["by_chunk_method"])
    line("model", o["by_model"])
    line(f"memories {o['memories']}".ljust(10), o["memories_by_model"])
    for kind, sweep in o["last_sweeps"].items():
        ctx.echo(f"{'last ' + kind:<10} {sweep.get('at')} (sent {sweep.get('sent', 0)})")
    for b in o["running_batches"]:
        ctx.echo(
            f"batch {b['id']:<4} {b['kind']} running: {b['ok']} ok, {b['failed']} failed, "
            f"{b['skipped']} skipped of {b['total']}"
        )
