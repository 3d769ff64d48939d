"""The producer API a host application calls: write the row, then send the task.

Any Celery client can equally send the tasks by name, with nothing of kidx installed:

    Celery(broker="redis://127.0.0.1:6379/0").send_task("GenerateEmbedding", args=[item_id])

Sending through these functions adds a durable `queued` record and, for Flower's kwargs column,
the item's kind and title (`kwargsrepr`).
"""

from __future__ import annotations

import heapq
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from kombu.exceptions import KombuError
from redis.exceptions import RedisError

from tasks import GROUP, KNOWLEDGE_ITEM, NOTE, TASK_FOR_KIND
from worker.errors import BrokerUnavailable, ItemNotFound
from worker.sources.urls import check_url, safe_url
from worker.store import Database
from worker.store.items import add_item, get_item
from worker.store.jobs import (
    abort_batch,
    create_batch,
    forget_queued,
    group_job_id,
    record_queued,
    record_queued_many,
)
from worker.store.removal import delete_items


def _default_app() -> Celery:
    from worker.app import app

    return app


def _send(
    db: Database,
    app: Celery | None,
    name: str,
    item_id: int,
    *,
    reason: str | None,
    batch_id: int | None = None,
    countdown: float | None = None,
    structure_only: bool = False,
    kind: str | None = None,
) -> str:
    """`kind`: the item's kind as the caller read it (a batch, in `_sizes`): the item may have
    been deleted since, and its task goes all the same (its run reports it refused, and the
    batch counts it); without it, an unknown item is ItemNotFound and nothing is sent."""
    if kind is None:
        item = get_item(db, item_id, content=False)
        kind, title = item.kind, item.title
    else:
        title = _first_title(db, [item_id])
    task_id = str(uuid.uuid4())
    record_queued(db, task_id, name, item_id, batch_id, reason)
    kwargs: dict[str, Any] = {"reason": reason}
    if batch_id is not None:
        kwargs["batch_id"] = batch_id
    if structure_only:
        kwargs["structure_only"] = True
    shown = {"kind": kind, "title": title[:60], "reason": reason}
    if batch_id is not None:
        shown["batch"] = batch_id
    app = app or _default_app()
    with _sending(db, app, [task_id], item_id):
        app.send_task(
            name,
            args=[item_id],
            kwargs=kwargs,
            task_id=task_id,
            kwargsrepr=repr(shown),
            countdown=countdown,
        )
    return task_id


@contextmanager
def _sending(db: Database, app: Celery, task_ids: list[str], item_id: int | None) -> Iterator[None]:
    """A send that the broker refuses (down, or silent past KIDX_TASKS__BROKER_PATIENCE)
    leaves no `queued` record, and says so: BrokerUnavailable, naming the broker.

    The broker is asked first, once, within the patience: Celery's send subscribes to the
    task's result before it publishes, and retries that 20 times a second apart (a producer
    waited 19 s on a Redis that was down, and left its `queued` row behind).

    A broker URL that redis-py or kombu cannot use (a ValueError: a host's own app, not checked
    by kidx's settings) is refused the same way, its `queued` rows forgotten."""
    try:
        _ping(app)
        yield
    except (KombuError, RedisError, OSError, RuntimeError, ValueError) as e:
        # (RuntimeError: Celery's "Retry limit exceeded ... reconnect to the result store")
        forget_queued(db, task_ids)
        where = safe_url(str(app.conf.broker_url))
        unusable = isinstance(e, ValueError) and not isinstance(e, KombuError)
        kept = (
            f"; item {item_id} is saved, and the reconcile sweep sends it once the broker "
            + ("URL is fixed" if unusable else "is back")
            if item_id is not None
            else ""
        )
        cause = " ".join(f"{type(e).__name__}: {e}".split())
        what = "is not usable" if unusable else "did not take the task"
        raise BrokerUnavailable(
            f"the broker at {where} {what} ({cause}){kept}", item_id=item_id
        ) from None


def _ping(app: Celery) -> None:
    """PING the broker's Redis on a client kept with the app, that gives up within the
    patience (one round trip on a kept connection)."""
    client = getattr(app, "_kidx_ping", None)
    if client is None:
        settings = getattr(app, "kidx_settings", None)
        patience = settings.tasks.broker_patience if settings is not None else 5.0
        client = redis.Redis.from_url(
            str(app.conf.broker_url), socket_timeout=patience, socket_connect_timeout=patience
        )
        app._kidx_ping = client  # type: ignore[attr-defined]
    client.ping()


def enqueue_note(
    db: Database, item_id: int, *, app: Celery | None = None, reason: str | None = None
) -> str:
    """Send GenerateEmbedding for a note; returns the task id."""
    return _send(db, app, NOTE, item_id, reason=reason)


def enqueue_knowledge_item(
    db: Database, item_id: int, *, app: Celery | None = None, reason: str | None = None
) -> str:
    """Send GenerateKnowledgeItemEmbedding for a file, URL or code item; returns the task id."""
    return _send(db, app, KNOWLEDGE_ITEM, item_id, reason=reason)


def enqueue(
    db: Database,
    item_id: int,
    *,
    app: Celery | None = None,
    reason: str | None = None,
    batch_id: int | None = None,
    countdown: float | None = None,
    structure_only: bool = False,
) -> str:
    """Send the right task for the item's kind; returns the task id. `structure_only`: no chunk
    model for this run."""
    name = TASK_FOR_KIND[get_item(db, item_id, content=False).kind]
    return _send(
        db,
        app,
        name,
        item_id,
        reason=reason,
        batch_id=batch_id,
        countdown=countdown,
        structure_only=structure_only,
    )


def send_batch(
    db: Database,
    item_ids: Iterable[int],
    *,
    kind: str = "reindex",
    app: Celery | None = None,
    reason: str | None = None,
    group_size: int | None = None,
) -> tuple[int, list[str]]:
    """A batch (three consecutive failures abort it): its id and the task ids. Its items go in
    groups (`plan_groups`) of at most `group_size` (default: KIDX_TASKS__GROUP_SIZE), one
    `kidx.index_group` task a group, their texts sharing embedding requests; a group of one is
    the item's own task, and a group size of 1 sends one task an item. An item a host deletes
    while the batch is being sent is sent all the same (its run reports it refused, which the
    batch counts); a send that fails part-way aborts the batch with the cause, then raises (the
    items not sent would never be counted, and the batch would stay running for good)."""
    ids = list(dict.fromkeys(item_ids))
    sizes, kinds = _sizes(db, ids)
    batch_id = create_batch(db, kind, len(ids))
    app = app or _default_app()
    kidx_settings = getattr(app, "kidx_settings", None)
    if group_size is None:
        group_size = kidx_settings.tasks.group_size if kidx_settings else 1
    processes = kidx_settings.tasks.concurrency if kidx_settings else 1
    reason = reason or kind
    sent: list[str] = []
    groups = plan_groups(sizes, group_size, processes)
    try:
        for g in groups:
            if len(g) > 1:
                sent.append(send_group(db, app, g, batch_id, reason))
            else:
                name = TASK_FOR_KIND[kinds[g[0]]]
                sent.append(
                    _send(db, app, name, g[0], reason=reason, batch_id=batch_id, kind=kinds[g[0]])
                )
    except BaseException as e:
        # The items not sent would never be counted: the batch would stay running for good.
        # It ends aborted, with why (what was sent ends skipped, for `kidx retry --failed`).
        if isinstance(e, BrokerUnavailable):
            why = f"the broker did not take its tasks: {e}"
        else:
            cause = " ".join(f"{type(e).__name__}: {e}".split())
            why = f"sending stopped after {len(sent)} of {len(groups)} tasks ({cause})"
        with suppress(Exception):  # a database that refuses this too: the cause is raised
            abort_batch(db, batch_id, why)
        raise
    return batch_id, sent


def plan_groups(sizes: dict[int, int], group_size: int, processes: int) -> list[list[int]]:
    """The batch's items (id -> text size, in the batch's order) in groups of at most
    `group_size`: as many groups as a multiple of the worker processes, so that each process
    gets the same share, and as even in text as the sizes allow (largest first, to the lightest
    group); each group keeps the batch's order. Each group's last request is its only one not
    full, so fewer, fuller groups waste less of the provider."""
    n = len(sizes)
    count = -(-n // max(1, group_size))
    if n >= processes:
        count = -(-count // processes) * processes
    count = min(count, n)
    members: list[list[int]] = [[] for _ in range(count)]
    lightest = [(0, k) for k in range(count)]
    for item_id in sorted(sizes, key=lambda i: -sizes[i]):
        load, k = heapq.heappop(lightest)
        members[k].append(item_id)
        if len(members[k]) < group_size:
            heapq.heappush(lightest, (load + sizes[item_id], k))
    order = {item_id: n for n, item_id in enumerate(sizes)}
    return [sorted(m, key=order.__getitem__) for m in members if m]


def _sizes(db: Database, ids: list[int]) -> tuple[dict[int, int], dict[int, str]]:
    """Each item's text size (at least 1: a file not read yet counts as one), in `ids` order,
    and its kind; ItemNotFound for an unknown id."""
    found: dict[int, tuple[int, str]] = {}
    for start in range(0, len(ids), 500):
        part = ids[start : start + 500]
        found.update(
            (item_id, (size, kind))
            for item_id, size, kind in db.all(
                f"SELECT id, length(content), kind FROM knowledge_items WHERE id IN "
                f"({','.join('?' * len(part))})",
                part,
            )
        )
    for i in ids:
        if i not in found:
            raise ItemNotFound(i)
    return {i: max(1, found[i][0] or 0) for i in ids}, {i: found[i][1] for i in ids}


# Flower's title for a task whose items were all deleted after the batch listed them
GONE = "(deleted)"


def _first_title(db: Database, item_ids: list[int]) -> str:
    """The title of the first of these items that still exists (a host may delete one while
    its batch is being sent), else a placeholder: only Flower shows it."""
    for item_id in item_ids:
        try:
            return get_item(db, item_id, content=False).title
        except ItemNotFound:
            continue
    return GONE


def send_group(
    db: Database,
    app: Celery,
    item_ids: list[int],
    batch_id: int | None,
    reason: str,
    *,
    structure_only: bool = False,
) -> str:
    """One `kidx.index_group` task for these items (recorded as queued, one row an item)."""
    task_id = str(uuid.uuid4())
    record_queued_many(
        db, [(group_job_id(task_id, i), i) for i in item_ids], GROUP, batch_id, reason
    )
    first = _first_title(db, item_ids)
    shown = {"items": len(item_ids), "first": first[:60], "reason": reason, "batch": batch_id}
    kwargs: dict[str, Any] = {"reason": reason, "batch_id": batch_id}
    if structure_only:
        kwargs["structure_only"] = True
    with _sending(db, app, [group_job_id(task_id, i) for i in item_ids], None):
        app.send_task(
            GROUP, args=[item_ids], kwargs=kwargs, task_id=task_id, kwargsrepr=repr(shown)
        )
    return task_id


def add_note(db: Database, title: str, text: str, *, app: Celery | None = None) -> tuple[int, str]:
    """Write a note, then send its task: (item id, task id). With the broker away the note
    stays written and BrokerUnavailable (its `item_id`) says so; the sweep sends it later."""
    item_id = add_item(db, kind="note", title=title, content=text)
    return item_id, enqueue_note(db, item_id, app=app, reason="added")


def add_file(
    db: Database, path: str | Path, *, title: str | None = None, app: Celery | None = None
) -> tuple[int, str]:
    """Write a file item (its text is read by the worker), then send its task."""
    source = str(Path(path).resolve())
    item_id = add_item(db, kind="file", title=title or Path(path).name, content="", source=source)
    return item_id, enqueue_knowledge_item(db, item_id, app=app, reason="added")


def add_url(
    db: Database, url: str, *, title: str | None = None, app: Celery | None = None
) -> tuple[int, str]:
    """Write a URL item (the worker fetches it), then send its task. A URL that is not
    http(s) or that carries credentials is refused (InvalidInput), and nothing is written."""
    check_url(url)
    item_id = add_item(db, kind="url", title=title or url, content="", source=url)
    return item_id, enqueue_knowledge_item(db, item_id, app=app, reason="added")


def delete_item(db: Database, item_id: int) -> None:
    """Delete an item with its chunks, vectors and index state, in one transaction
    (ItemNotFound if there is none). A task still queued for it ends with a one-line "no item"
    failure, never retried; one running writes nothing. A host may equally delete the
    `knowledge_items` row with plain SQL: the database's trigger and the sweep do the rest."""
    delete_items(db, [item_id])
