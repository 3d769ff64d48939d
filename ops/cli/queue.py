"""Queue commands: enqueue, reindex, jobs, retry, cancel. They talk to the workers through the
broker (KIDX_BROKER_URL); the durable record of every run is in the database (`index_jobs`)."""

from __future__ import annotations

import re
import sys
import time
from typing import Any

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ops.cli.base import BATCH, ID, Ctx, Seconds, cli, command, err
from worker.errors import InvalidInput, StoreError

JOB_SHOWN = (
    "task_id",
    "attempt",
    "task_name",
    "item_id",
    "batch_id",
    "state",
    "duration_ms",
    "error",
)


def _workers_online(app: Any) -> int:
    try:
        return len(app.control.ping(timeout=1.0) or [])
    except Exception:
        return 0


def send_items(
    ctx: Ctx, ids: list[int], reason: str, *, structure_only: bool = False
) -> list[dict[str, Any]]:
    """Send the right task for each item (an id given twice, once); what was sent, for
    printing."""
    from tasks.producer import enqueue, the_rest
    from worker.errors import BrokerUnavailable
    from worker.store.items import get_item

    ids = list(dict.fromkeys(ids))
    app = ctx.app()
    with ctx.store() as db:
        for item_id in ids:
            get_item(db, item_id)  # unknown ids fail before anything is sent
        sent = []
        for n, item_id in enumerate(ids):
            try:
                task_id = enqueue(
                    db, item_id, app=app, reason=reason, structure_only=structure_only
                )
            except BrokerUnavailable as e:  # said of every item, not only of this one
                done = [s["item_id"] for s in sent]
                raise BrokerUnavailable(
                    f"{e}{the_rest(db, done, ids[n + 1 :])}", item_id=item_id
                ) from None
            sent.append({"item_id": item_id, "task_id": task_id})
    if not ctx.json and not _workers_online(app):
        err.print(
            "note: no worker answered; the tasks wait in the queue until one starts "
            "(celery -A worker.app worker)"
        )
    return sent


def show_sent(ctx: Ctx, sent: list[dict[str, Any]]) -> None:
    ctx.done = f"{len(sent)} tasks were sent"
    ctx.emit(
        sent, lambda: ctx.table(("item", "task"), ((s["item_id"], s["task_id"]) for s in sent))
    )


@command(cli)
@click.argument("items", type=ID, nargs=-1, required=True)
def enqueue(ctx: Ctx, items: tuple[int, ...]) -> None:
    """Send the right task (GenerateEmbedding or GenerateKnowledgeItemEmbedding) per item (an id
    given twice is sent once)."""
    show_sent(ctx, send_items(ctx, list(dict.fromkeys(items)), "enqueue"))


WAIT = click.option("--wait", is_flag=True, help="Show progress until the batch ends.")
TIMEOUT = click.option(
    "--timeout", type=Seconds(), default=None, help="Stop waiting after this many seconds."
)


@command(cli)
@click.option("--all", "all_items", is_flag=True, required=True, help="Every item.")
@WAIT
@TIMEOUT
def reindex(ctx: Ctx, all_items: bool, wait: bool, timeout: float | None) -> None:
    """Re-index every item as one batch (it aborts after consecutive failures)."""
    from worker.store.items import all_item_ids

    with ctx.store() as db:
        ids = all_item_ids(db)
    if not ids:
        raise InvalidInput("there are no items to index")
    _send_batch(ctx, ids, "reindex", wait, timeout)


def _send_batch(ctx: Ctx, ids: list[int], kind: str, wait: bool, timeout: float | None) -> None:
    """`ids` as one batch of `kind`; with `wait`, a progress bar until it ends (or `timeout`
    passes), then its summary: exit 1 when it did not end `done` (aborted, or still running
    at the timeout) or an item failed; items `skipped` (no provider) are not failures."""
    from tasks.producer import send_batch
    from worker.store.jobs import BatchState, get_batch

    app = ctx.app()
    with ctx.store() as db:
        batch_id, task_ids = send_batch(db, ids, kind=kind, app=app)
    ctx.done = f"batch {batch_id} was sent"
    if not wait:
        ctx.emit(
            {"batch_id": batch_id, "items": len(ids), "tasks": len(task_ids)},
            lambda: click.echo(f"batch {batch_id}: {len(ids)} items in {len(task_ids)} tasks sent"),
        )
        return
    if not _workers_online(app):
        err.print("note: no worker answered yet; waiting for one to start")
    deadline = None if timeout is None else time.monotonic() + timeout
    timed_out = False
    with (
        ctx.store() as db,
        Progress(
            TextColumn(f"batch {batch_id}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[detail]}"),
            TimeElapsedColumn(),
            console=err,
            disable=ctx.json,
            transient=False,
        ) as progress,
    ):
        bar = progress.add_task(kind, total=len(ids), detail="")
        while True:
            batch = get_batch(db, batch_id)
            if batch is None:  # a host's DELETE while this waited: nothing more to show
                raise StoreError(
                    f"batch {batch_id} was deleted while waiting for it; its tasks go on, "
                    "`kidx jobs` shows them"
                )
            ok, failed, skipped = (_count(batch[k]) for k in ("ok", "failed", "skipped"))
            done = ok + failed + skipped
            detail = f"ok {ok} failed {failed} skipped {skipped}"
            progress.update(bar, completed=done, detail=detail)
            if batch["state"] != BatchState.RUNNING and (
                batch["state"] == BatchState.ABORTED or done >= len(ids)
            ):
                break
            if deadline is not None and time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.25)
    _summary(ctx, batch, timeout if timed_out else None)


def _count(value: Any) -> int:
    """A batch's count as progress reads it: what a host wrote in its place (text, NULL, a
    float) counts 0, where it failed the wait as a bug."""
    return value if type(value) is int else 0


def _summary(ctx: Ctx, batch: dict[str, Any], timed_out: float | None = None) -> None:
    """`timed_out`: the --timeout after which this stopped waiting (the batch goes on)."""
    from worker.store.jobs import BatchState

    def human() -> None:
        ctx.echo(
            f"batch {batch['id']} {batch['state']}: {batch['ok']} ok, {batch['failed']} failed, "
            f"{batch['skipped']} skipped of {batch['total']}"
        )
        if batch["abort_reason"]:
            ctx.echo(f"why: {batch['abort_reason']}")
        if timed_out is not None:
            ctx.echo(
                f"stopped waiting after {timed_out:g} s (--timeout): the batch goes on; "
                f"`kidx jobs --batch {batch['id']}` shows it"
            )

    shown = batch if timed_out is None else batch | {"timed_out": True}
    ctx.emit(shown, human)
    if batch["state"] != BatchState.DONE or batch["failed"]:
        sys.exit(1)


@command(cli)
@click.option("--failed", is_flag=True, help="Only failed runs.")
@click.option("--batch", "batch_id", type=BATCH, help="Only the runs of this batch.")
@click.option("--limit", type=click.IntRange(1, 100_000), default=200, show_default=True)
def jobs(ctx: Ctx, failed: bool, batch_id: int | None, limit: int) -> None:
    """Task runs, newest first: state, duration, error."""
    from worker.store import open_store
    from worker.store.jobs import get_batch, list_jobs

    # It only reads: opened as the other reading commands open it (engine.reading_store), the
    # vec tables left as they are (a model switch half-way is not undone).
    with open_store(ctx.settings, create=False, read_only=True) as db:
        batch = get_batch(db, batch_id) if batch_id is not None else None
        if batch_id is not None and batch is None:
            raise InvalidInput(f"no batch with id {batch_id}")
        rows = list_jobs(db, failed=failed, batch_id=batch_id, limit=limit)

    def human() -> None:
        if batch is not None:
            ctx.echo(
                f"batch {batch['id']} ({batch['kind']}) {batch['state']}: "
                f"{batch['ok']} ok, {batch['failed']} failed, {batch['skipped']} skipped "
                f"of {batch['total']}"
            )
            if batch["abort_reason"]:
                ctx.echo(f"why: {batch['abort_reason']}")
        ctx.table(
            JOB_SHOWN,
            ([r[c] for c in JOB_SHOWN] for r in rows),
            drop=("batch_id", "attempt", "task_name", "duration_ms"),
        )

    ctx.emit({"batch": batch, "jobs": rows} if batch is not None else rows, human)


@command(cli)
@click.argument("items", type=ID, nargs=-1)
@click.option("--failed", is_flag=True, help="Every item whose index is failed.")
@WAIT
@TIMEOUT
def retry(
    ctx: Ctx, items: tuple[int, ...], failed: bool, wait: bool, timeout: float | None
) -> None:
    """Send items again as one `retry` batch, through the queue: the lock rules apply, and a
    provider still down aborts the batch after three failed requests (not every item's run
    and its task retries)."""
    from worker.store.items import get_item

    if bool(items) == failed:
        raise InvalidInput("give item ids or --failed (not both)")
    ids = list(dict.fromkeys(items))
    with ctx.store() as db:
        if failed:
            # The failed items that are there: a state row a host left for no item (written
            # by hand, or its item deleted with the trigger gone) refused the whole retry with
            # "no item with id N"; the reconcile sweep removes such rows.
            ids = [
                r[0]
                for r in db.all(
                    "SELECT s.item_id FROM item_index_state s JOIN knowledge_items i "
                    "ON i.id = s.item_id WHERE s.status = 'failed' ORDER BY s.item_id"
                )
            ]
        for item_id in ids:
            get_item(db, item_id)  # unknown ids fail before anything is sent
    if not ids:
        ctx.emit({"batch_id": None, "items": 0, "tasks": 0}, lambda: click.echo("no failed items"))
        return
    _send_batch(ctx, ids, "retry", wait, timeout)


# The longest task id taken: Celery's are UUIDs (36 characters); a 100,000-character one was
# sent to Redis and to every worker as it was.
TASK_ID_MAX = 255


@command(cli)
@click.argument("task_ids", nargs=-1, required=True)
@click.option("--terminate", is_flag=True, help="Also signal the process running it.")
def cancel(ctx: Ctx, task_ids: tuple[str, ...], terminate: bool) -> None:
    """Cancel tasks: queued ones never run, running ones stop at their next step (a job id
    of a group, `<task id>:<item id>`, cancels its group)."""
    from tasks.cancel import mark_revoked

    for t in task_ids:  # refused before anything is sent: "" or ":" would revoke nothing
        task, colon, item = t.partition(":")
        if (
            not task
            or len(task) > TASK_ID_MAX
            or not task.isprintable()
            or any(c.isspace() for c in task)  # (a pasted "id1 id2" is two, not one)
            or (colon and not re.fullmatch(r"-?[0-9]{1,20}", item))
        ):
            raise InvalidInput(f"not a task id or a job id (<task id>:<item id>): {t!r:.80}")
    client = ctx.redis()
    task_ids = tuple(dict.fromkeys(t.split(":")[0] for t in task_ids))  # a group's job ids
    mark_revoked(client, list(task_ids))  # seen by the task even if no worker is up now
    ctx.app().control.revoke(list(task_ids), terminate=terminate)
    ctx.done = f"the revoke of {len(task_ids)} tasks was sent"
    ctx.emit(
        {"revoked": list(task_ids), "terminate": terminate},
        lambda: click.echo(f"revoke sent for {', '.join(task_ids)}"),
    )
