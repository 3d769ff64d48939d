"""Adding files, URLs, code and memories. An item that names a source already added is the same
item (its id is reused, and it is indexed again; a --title given replaces its title), so adding
twice never duplicates."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
from rich.markup import escape

from ops.cli.base import Ctx, command, err, fail
from ops.cli.engine import add, index_inline
from worker.errors import InvalidInput

# Items `kidx add code` writes in one transaction: 100,000 files, each its own, took minutes;
# all in one would hold the writers off for as long.
ADD_BATCH = 500


def _item_for(db: Any, kind: str, title: str, source: str, *, retitle: bool = False) -> int:
    """The item of this source (a new one if none). `retitle`: the title was given (--title),
    so an item already there takes it, as `kidx update --title` would give it: an explicit
    title silently kept the old one."""
    from worker.store.items import NOW, add_item
    from worker.store.text import given_text

    # The title as bytes: a host's TEXT there that is not UTF-8 failed the add as a bug.
    row = db.one(
        "SELECT id, CAST(title AS BLOB) FROM knowledge_items WHERE kind = ? AND source = ?",
        (kind, source),
    )
    if row is None:
        return add_item(db, kind=kind, title=title, content="", source=source)
    item_id = int(row[0])
    if retitle and row[1] != title.encode("utf-8"):
        with db.atomic():  # a trigger makes the item pending: the index takes the new title
            db.execute(
                f"UPDATE knowledge_items SET title = ?, updated_at = {NOW} WHERE id = ?",
                (given_text(title, "title"), item_id),
            )
    return item_id


def _index_or_send(ctx: Ctx, db: Any, ids: list[int], inline: bool) -> list[dict[str, Any]]:
    if inline:
        return index_inline(ctx, db, ids)
    from ops.cli.queue import send_items

    return send_items(ctx, ids, "added")


def _report(
    ctx: Ctx,
    ids: list[int],
    results: list[dict[str, Any]],
    skipped: list[dict[str, str]] | None = None,
) -> None:
    def human() -> None:
        for item_id in ids:
            click.echo(item_id)

    shown = " ".join(map(str, ids[:10])) + (" ..." if len(ids) > 10 else "")
    ctx.done = f"item {shown} was added" if len(ids) == 1 else f"items {shown} were added"

    ctx.emit({"ids": ids, "results": results} | ({"skipped": skipped} if skipped else {}), human)
    # Each failed item its line (only the first was said: fail() exits), then status 1.
    lines = [
        f"item {r['item_id']} was added, but indexing failed: {r['error']}"
        for r in results
        if r.get("status") == "failed"
    ]
    for line in lines[:-1]:
        err.print(f"[red]error:[/red] {escape(ctx.say(line))}", markup=True, highlight=False)
    if lines:
        fail(lines[-1], 1, ctx.redact)


def shown_path(path: Path) -> str:
    """A path as text that can be printed and stored as JSON: a byte of its name that is not
    UTF-8 is shown as `\\xe9`."""
    return str(path).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


@command(add, "file")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--title", help="A title (default: the file's name).")
@click.option("--inline", is_flag=True, help="Index it now, in this process.")
def add_file(ctx: Ctx, path: Path, title: str | None, inline: bool) -> None:
    """Add a file (Markdown, text, HTML, PDF, DOCX) under KIDX_FILES__ROOTS; prints its id."""
    from worker.sources.files import read_file

    read_file(path, ctx.settings.files)  # refused now, not later in a worker, and nothing written
    with ctx.store(create=True, claim=inline) as db:
        item_id = _item_for(
            db, "file", title or path.name, str(path.resolve()), retitle=title is not None
        )
        results = _index_or_send(ctx, db, [item_id], inline)
    _report(ctx, [item_id], results if inline else [])


@command(add, "url")
@click.argument("url")
@click.option("--title", help="A title (default: the URL).")
@click.option("--inline", is_flag=True, help="Fetch and index it now, in this process.")
def add_url(ctx: Ctx, url: str, title: str | None, inline: bool) -> None:
    """Add a web page (fetched by the worker, safely); prints its id."""
    from worker.sources.urls import check_url

    check_url(url)  # refused now (credentials in it included), and nothing written
    with ctx.store(create=True, claim=inline) as db:
        item_id = _item_for(db, "url", title or url, url, retitle=title is not None)
        results = _index_or_send(ctx, db, [item_id], inline)
    _report(ctx, [item_id], results if inline else [])


@command(add, "code")
@click.argument("path", type=click.Path(path_type=Path))
@click.option("--inline", is_flag=True, help="Index it now, in this process.")
def add_code(ctx: Ctx, path: Path, inline: bool) -> None:
    """Add a source file, or every source file of a folder (honouring .gitignore) under
    KIDX_FILES__ROOTS; prints ids."""
    from worker.sources.code import list_code_files, read_code
    from worker.sources.files import resolve_under_roots

    resolve_under_roots(path, ctx.settings.files)  # refused now, and nothing written
    found: list[tuple[Path, str]] = []
    # The workers' limit (KIDX_FILES__MAX_BYTES), not the listing's default.
    files = list_code_files(path, max_bytes=ctx.settings.files.max_bytes, skipped=found)
    base = path.resolve() if path.is_dir() else path.resolve().parent
    # Each path resolved once, before any transaction (13 ms a time 1,000 folders deep); one
    # whose folder on its way was replaced since the listing is no longer under it.
    real = {f: f.resolve() for f in files}
    found += [
        (f, f"it left {path} during the listing") for f in files if base not in real[f].parents
    ]
    files = [f for f in files if base in real[f].parents]
    skipped = [{"path": shown_path(p), "reason": reason} for p, reason in found]
    if not ctx.json:  # with --json, in the output's "skipped"
        for s in skipped:
            err.print(ctx.say(f"skipped {s['path']}: {s['reason']}"), markup=False, highlight=False)
    if path.is_file():  # named directly: refused now if a worker would refuse it
        read_code(path, ctx.settings.files)
    if not files:
        # (with --json, the reasons were to go in the output's "skipped", never printed)
        reasons = "; ".join(f"{s['path']}: {s['reason']}" for s in skipped[:3])
        more = f" ({len(skipped)} skipped: {reasons}{'; ...' if len(skipped) > 3 else ''})"
        raise InvalidInput(f"no source files under {path}{more if skipped else ''}")
    with ctx.store(create=True, claim=inline) as db:
        ids = []
        for start in range(0, len(files), ADD_BATCH):  # a transaction a batch, not an item
            with db.atomic():
                for f in files[start : start + ADD_BATCH]:
                    title = str(real[f].relative_to(base))
                    ids.append(_item_for(db, "code", title, str(real[f])))
        results = _index_or_send(ctx, db, ids, inline)
    _report(ctx, ids, results if inline else [], skipped)


@command(add, "memory")
@click.argument("text")
def add_memory(ctx: Ctx, text: str) -> None:
    """Add a memory: a short text embedded whole, found by `kidx search --memories`."""
    from worker.indexers.memories import add_memory as store_memory

    with ctx.store(create=True, claim=True) as db:
        embedder = ctx.embedder(db)
        if embedder is None:
            raise InvalidInput("memories need an embedding provider (KIDX_EMBEDDING__PROVIDER)")
        try:
            memory_id = store_memory(db, text, embedder)
        finally:
            embedder.close()
    ctx.done = f"memory {memory_id} was added"
    ctx.emit({"id": memory_id}, lambda: click.echo(memory_id))
