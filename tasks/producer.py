"""The producer API a host application calls: write the row, then send the task.

Any Celery client can equally send the tasks by name, with nothing of kidx installed:

    Celery(broker="redis://127.0.0.1:6379/0").send_task("GenerateEmbedding", args=[item_id])

Sending through these functions adds a durable `queued` record and, for Flower's kwargs column,
the item's kind and title (`kwargsrepr`).
"""

from __future__ import annotations

import heapq
import math
import os
import uuid
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import redis
from celery import Celery
from celery.exceptions import SoftTimeLimitExceeded
from kombu.exceptions import KombuError
from redis.exceptions import RedisError

from tasks import GROUP, KNOWLEDGE_ITEM, NOTE, TASK_FOR_KIND
from tasks.redis_at import redis_at
from worker.errors import BrokerUnavailable, InvalidInput, ItemNotFound, WrongTaskKind
from worker.sources.urls import check_url, safe_url
from worker.store import Database
from worker.store.items import add_item, check_item_id, get_item
from worker.store.jobs import (
    BATCH_KINDS,
    abort_batch,
    create_batch,
    forget_queued,
    get_batch,
    group_job_id,
    record_queued,
    record_queued_many,
)
from worker.store.removal import delete_items
from worker.store.text import given_text
from worker.store.text import shown as shown_text


def _default_app() -> Celery:
    from worker.app import app

    return app


# What the tasks take (tasks.run.bad_arguments): refused here, before any row is written, rather
# than sent to fail in a worker.
MAX_ROWID = 2**63


def _check_reason(reason: object) -> None:
    if reason is not None:
        given_text(reason, "reason")


def _check_batch(db: Database, batch_id: object) -> None:
    if batch_id is None:
        return
    if type(batch_id) is not int or not 0 < batch_id < MAX_ROWID:
        raise InvalidInput(f"the batch id must be a positive integer, not {batch_id!r:.60}")
    if get_batch(db, batch_id) is None:
        raise InvalidInput(f"no batch with id {batch_id}")


def _check_countdown(app: Celery, countdown: object) -> None:
    """A countdown the broker can hold: a number of seconds, finite, not negative, and (with
    kidx's settings) within the visibility timeout less the hard time limit, past which a
    Redis broker hands the task out twice (`tasks.run.longest_countdown`)."""
    if countdown is None:
        return
    if isinstance(countdown, bool) or not isinstance(countdown, (int, float)):
        raise InvalidInput(f"countdown must be a number of seconds, not {countdown!r:.60}")
    settings = getattr(app, "kidx_settings", None)
    longest = (
        float(settings.tasks.visibility_timeout - settings.tasks.time_limit)
        if settings is not None
        else 365 * 86400.0  # no visibility timeout known: at most a year (no overflow)
    )
    # compared first: an int past a float's range (10**400) is no float for isfinite
    if not (0 <= countdown <= longest and math.isfinite(countdown)):
        raise InvalidInput(
            f"countdown must be from 0 to {longest:g} seconds, not {countdown!r:.60}"
        )


def _check_flag(structure_only: object) -> None:
    if not isinstance(structure_only, bool):
        raise InvalidInput(f"structure_only must be True or False, not {structure_only!r:.60}")


def _send(
    db: Database,
    app: Celery | None,
    name: str | None,
    item_id: int,
    *,
    reason: str | None,
    batch_id: int | None = None,
    countdown: float | None = None,
    structure_only: bool = False,
    kind: str | None = None,
    promise: bool = True,
) -> str:
    """`name`: the task (None: the one for the item's kind); one of another kind is refused
    (WrongTaskKind), as its worker would refuse it. `kind`: the item's kind as the caller read
    it (a batch, in `_sizes`): the item may have been deleted since, and its task goes all the
    same (its run reports it refused, and the batch counts it); without it, an unknown item is
    ItemNotFound and nothing is sent. `promise`: a refused send says what becomes of the item
    (a batch says what becomes of the batch instead). Bad arguments are InvalidInput, before
    any row is written."""
    item_id = check_item_id(item_id)  # (a numpy id as an int: its JSON and its row)
    _check_reason(reason)
    _check_batch(db, batch_id)
    app = app or _default_app()
    _check_countdown(app, countdown)
    _check_flag(structure_only)
    if kind is None:
        item = get_item(db, item_id, content=False)
        kind, title = item.kind, item.title
    else:
        title = _first_title(db, [item_id])
    wanted = TASK_FOR_KIND.get(kind)
    if wanted is None:
        raise WrongTaskKind(f"item {item_id} is of kind {kind!r:.40}, which no task indexes")
    if name is not None and name != wanted:
        raise WrongTaskKind(
            f"item {item_id} is a {kind} item: {name} does not index it ({wanted} does)"
        )
    name = wanted
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
    with _sending(db, app, [task_id], item_id if promise else None):
        app.send_task(
            name,
            args=[item_id],
            kwargs=kwargs,
            task_id=task_id,
            kwargsrepr=repr(shown),
            countdown=countdown,
        )
    return task_id


# The item states the reconcile sweep sends by itself (worker.reconcile.FINDINGS: no state row,
# pending, partial on its backoff, cancelled): of an item in another state, a send the broker
# refused is lost unless sent again.
SWEPT = ("pending", "partial", "cancelled")


def _swept(db: Database, item_id: int) -> bool:
    try:
        row = db.one("SELECT status FROM item_index_state WHERE item_id = ?", (item_id,))
    except Exception:  # a database that cannot say: no promise
        return False
    return row is None or row[0] in SWEPT


def the_rest(db: Database, sent: list[int], unsent: list[int]) -> str:
    """What a refused send of several items adds about the others (BrokerUnavailable names
    the item it failed on): those sent before it, and of those after, which the reconcile
    sweep sends once the broker is back and which the command must send again."""

    def ids(group: list[int]) -> str:
        shown = " ".join(map(str, group[:20])) + (" ..." if len(group) > 20 else "")
        return f"item {shown}" if len(group) == 1 else f"items {shown}"

    swept = [i for i in unsent if _swept(db, i)]
    again = [i for i in unsent if i not in swept]
    out = f"; {ids(sent)} {'was' if len(sent) == 1 else 'were'} sent before it" if sent else ""
    if swept:
        out += f"; {ids(swept)} {'is' if len(swept) == 1 else 'are'} saved too, for the sweep"
    if again:
        out += f"; {ids(again)} {'was' if len(again) == 1 else 'were'} not sent: run it again"
    return out


# Celery's RuntimeError when the result store does not answer while a send subscribes to it
RESULT_STORE = "result store"


@contextmanager
def _sending(db: Database, app: Celery, task_ids: list[str], item_id: int | None) -> Iterator[None]:
    """A send that fails for any reason leaves no `queued` record. The broker or the result
    backend down, silent past KIDX_TASKS__BROKER_PATIENCE, or unusable (a URL that redis-py,
    kombu or Celery cannot use, which a host's own app may hold: any error their code raises)
    is said in one line naming which of the two failed: BrokerUnavailable. Anything else (a
    bug) is raised as it is.

    Both are asked first, once each, within the patience: Celery's send subscribes to the
    task's result before it publishes, and retries that 20 times a second apart (a producer
    waited 19 s on a Redis that was down, and left its `queued` row behind). `item_id`: the
    item whose send this is, for the message to say what becomes of it."""
    what = "broker"
    try:
        _ping(app)
        what = "result backend"
        _ping_backend(app)
        what = "broker"
        yield
    except BaseException as e:
        forget_queued(db, task_ids)
        if not isinstance(e, Exception) or isinstance(e, SoftTimeLimitExceeded):
            raise  # an interruption (a worker's soft time limit), not the send's failure
        if what == "broker" and not _messaging_error(e):
            raise  # not the broker's nor Celery's: a bug, raised as it is (its rows forgotten)
        if isinstance(e, RuntimeError) and RESULT_STORE in str(e):
            what = "result backend"
        raise BrokerUnavailable(_refusal(db, app, what, e, item_id), item_id=item_id) from None


# The libraries that talk to the broker and the result backend: an error of any type they
# raise (a TypeError for a URL parameter redis-py does not take) is theirs, not kidx's.
MESSAGING = frozenset({"amqp", "celery", "kombu", "redis", "vine"})


def _messaging_error(e: BaseException) -> bool:
    if isinstance(e, (KombuError, RedisError, OSError, RuntimeError, ValueError)):
        return True
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    module = "" if tb is None else str(tb.tb_frame.f_globals.get("__name__", ""))
    return module.partition(".")[0] in MESSAGING


def _refusal(db: Database, app: Celery, what: str, e: Exception, item_id: int | None) -> str:
    """The one line of a refused send: what refused it, why, and what becomes of the item."""
    url = app.conf.broker_url if what == "broker" else _backend_url(app)
    where = safe_url(str(url))
    # down or silent (connection errors, timeouts, Celery's retries given up); else unusable
    down = isinstance(e, (KombuError, RedisError, OSError, RuntimeError)) and not isinstance(
        e, ValueError
    )
    cause = " ".join(f"{type(e).__name__}: {e}".split())
    verb = (
        "is not usable"
        if not down
        else "did not answer"
        if what != "broker"
        else "did not take the task"
    )
    until = f"once the {what} " + ("is back" if down else "URL is fixed")
    if item_id is None:
        kept = ""
    elif _swept(db, item_id):
        kept = f"; item {item_id} is saved, and the reconcile sweep sends it {until}"
    else:
        kept = f"; item {item_id} was not sent: run the command again {until}"
    return f"the {what} at {where} {verb} ({cause}){kept}"


def _patience(app: Celery) -> float:
    settings = getattr(app, "kidx_settings", None)
    return settings.tasks.broker_patience if settings is not None else 5.0


def _client(url: str, app: Celery) -> redis.Redis:
    patience = _patience(app)
    return redis_at(url, patience)


def _ping(app: Celery) -> None:
    """PING the broker's Redis on a client kept with the app, that gives up within the
    patience (one round trip on a kept connection)."""
    client = getattr(app, "_kidx_ping", None)
    if client is None:
        client = _client(str(app.conf.broker_url), app)
        app._kidx_ping = client  # type: ignore[attr-defined]
    client.ping()


def _backend_url(app: Celery) -> str | None:
    url = app.conf.result_backend
    return None if url is None else str(url)


def _ping_backend(app: Celery) -> None:
    """The result backend: loaded (an unknown scheme fails here, not in the send), and, when it
    is another Redis than the broker's, PINGed within the same patience (a Redis that is down
    would otherwise hold the send 20 s, and be blamed on the broker)."""
    app.backend  # noqa: B018 - loads it: a backend Celery cannot load raises here
    url = _backend_url(app)
    if url is None or url == str(app.conf.broker_url):
        return
    if urlsplit(url).scheme not in ("redis", "rediss", "unix"):
        return  # another kind of backend: Celery's own send reports it
    client = getattr(app, "_kidx_ping_backend", None)
    if client is None:
        client = _client(url, app)
        app._kidx_ping_backend = client  # type: ignore[attr-defined]
    client.ping()


def enqueue_note(
    db: Database, item_id: int, *, app: Celery | None = None, reason: str | None = None
) -> str:
    """Send GenerateEmbedding for a note (another kind of item is WrongTaskKind); returns the
    task id."""
    return _send(db, app, NOTE, item_id, reason=reason)


def enqueue_knowledge_item(
    db: Database, item_id: int, *, app: Celery | None = None, reason: str | None = None
) -> str:
    """Send GenerateKnowledgeItemEmbedding for a file, URL or code item (a note is
    WrongTaskKind); returns the task id."""
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
    return _send(
        db,
        app,
        None,
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
    items not sent would never be counted, and the batch would stay running for good). No
    item, or an argument the tasks would refuse, is InvalidInput, and no batch is made."""
    if isinstance(item_ids, (str, bytes)) or not isinstance(item_ids, Iterable):
        raise InvalidInput(f"the item ids must be a list of integers, not {item_ids!r:.60}")
    ids = list(dict.fromkeys(map(check_item_id, item_ids)))
    if not ids:
        raise InvalidInput("a batch needs at least one item")
    if kind not in BATCH_KINDS:  # (the table's CHECK, as a clear error before any write)
        raise InvalidInput(
            f"the batch's kind must be one of {', '.join(BATCH_KINDS)}, not {kind!r:.60}"
        )
    _check_reason(reason)
    if group_size is not None and (type(group_size) is not int or group_size < 1):
        raise InvalidInput(f"group_size must be a positive integer, not {group_size!r:.60}")
    sizes, kinds = _sizes(db, ids)
    app = app or _default_app()
    batch_id = create_batch(db, kind, len(ids))
    kidx_settings = getattr(app, "kidx_settings", None)
    if group_size is None:
        group_size = kidx_settings.tasks.group_size if kidx_settings else 1
    processes = kidx_settings.tasks.concurrency if kidx_settings else 1
    reason = reason or kind
    sent: list[str] = []
    groups = plan_groups(sizes, group_size, processes)
    try:
        for g in groups:
            # (an item of a kind no task indexes, a host's: a group refuses it, and counts it)
            if len(g) > 1 or kinds[g[0]] not in TASK_FOR_KIND:
                sent.append(send_group(db, app, g, batch_id, reason))
            else:
                sent.append(
                    _send(
                        db,
                        app,
                        None,
                        g[0],
                        reason=reason,
                        batch_id=batch_id,
                        kind=kinds[g[0]],
                        promise=False,
                    )
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
        if isinstance(e, BrokerUnavailable):  # and say so: its items were not all sent
            raise BrokerUnavailable(
                f"{e}; batch {batch_id} was aborted, {len(sent)} of its {len(groups)} tasks sent"
            ) from None
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
    and its kind; ItemNotFound for an unknown id. The kind is read as bytes: a host's TEXT
    there that is not UTF-8 failed the whole batch as a bug (apsw cannot read it); shown, it
    is a kind no task indexes, which the item's group refuses and counts."""
    found: dict[int, tuple[int, str]] = {}
    for start in range(0, len(ids), 500):
        part = ids[start : start + 500]
        found.update(
            (item_id, (size, shown_text(kind)))
            for item_id, size, kind in db.all(
                f"SELECT id, length(content), CAST(kind AS BLOB) FROM knowledge_items WHERE id IN "
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


def _check_title(title: object) -> None:
    if title is not None and not isinstance(title, str):
        raise InvalidInput(f"the title must be text (str), not {type(title).__name__}")


def add_file(
    db: Database, path: str | Path, *, title: str | None = None, app: Celery | None = None
) -> tuple[int, str]:
    """Write a file item (its text is read by the worker), then send its task. A path that is
    not a non-empty str or path is InvalidInput, and nothing is written."""
    name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else None
    if not isinstance(name, str) or not name:
        raise InvalidInput(f"the file's path must be a non-empty str or Path, not {path!r:.60}")
    if "\0" in name:  # no file has one: resolve() raised ValueError
        raise InvalidInput(f"the file's path holds a NUL character: {name!r:.80}")
    _check_title(title)
    source = str(Path(name).resolve())
    item_id = add_item(db, kind="file", title=title or Path(name).name, content="", source=source)
    return item_id, enqueue_knowledge_item(db, item_id, app=app, reason="added")


def add_url(
    db: Database, url: str, *, title: str | None = None, app: Celery | None = None
) -> tuple[int, str]:
    """Write a URL item (the worker fetches it), then send its task. A URL that is not
    http(s) or that carries credentials is refused (InvalidInput), and nothing is written."""
    if not isinstance(url, str) or not url:
        raise InvalidInput(f"the URL must be a non-empty str, not {url!r:.60}")
    _check_title(title)
    check_url(url)
    item_id = add_item(db, kind="url", title=title or url, content="", source=url)
    return item_id, enqueue_knowledge_item(db, item_id, app=app, reason="added")


def delete_item(db: Database, item_id: int) -> None:
    """Delete an item with its chunks, vectors and index state, in one transaction
    (ItemNotFound if there is none). A task still queued for it ends with a one-line "no item"
    failure, never retried; one running writes nothing. A host may equally delete the
    `knowledge_items` row with plain SQL: the database's trigger and the sweep do the rest."""
    delete_items(db, [item_id])
