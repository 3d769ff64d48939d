"""The producer with a broker it cannot use: nothing is left `queued`, and one clear error; a
batch whose items are deleted, or whose sends fail, while it is being sent."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from stack import broker_url, flush
from tasks.broker import live_task_ids
from tasks.producer import add_note, plan_groups, send_batch, send_group
from worker.errors import BrokerUnavailable
from worker.store import Database, connect
from worker.store.items import add_item
from worker.store.jobs import get_batch
from worker.store.removal import delete_items


def test_a_broker_url_that_does_not_parse_leaves_no_queued_row(tmp_path: Path) -> None:
    """A host's own Celery app (kidx's settings never checked its URL): redis-py's ValueError
    was not caught, so every send left its `queued` row behind for good."""
    app = Celery("host", broker="notaurl")
    db = connect(tmp_path / "kidx.db")
    try:
        for _ in range(3):
            with pytest.raises(BrokerUnavailable, match=r"notaurl is not usable \(ValueError"):
                add_note(db, "A note", "Its task cannot be sent.", app=app)
        items = [add_item(db, kind="note", title=f"n{i}", content="text") for i in range(2)]
        with pytest.raises(BrokerUnavailable, match="not usable"):
            send_group(db, app, items, None, "reindex")
        assert db.scalar("SELECT count(*) FROM index_jobs") == 0
    finally:
        db.close()
        app.close()


@pytest.fixture
def broker_app() -> Iterator[Celery]:
    """A host's Celery app on this test process's Redis database (tests/stack.py), no worker."""
    flush()
    app = Celery("host", broker=broker_url())
    yield app
    ping = getattr(app, "_kidx_ping", None)
    if ping is not None:
        ping.close()
    app.close()
    flush()


def _batch_of_five(db: Database) -> tuple[list[int], list[list[int]]]:
    ids = [add_item(db, kind="note", title=f"n{i}", content="Same size. " * 20) for i in range(5)]
    groups = plan_groups(dict.fromkeys(ids, 1), 2, 1)
    assert [len(g) for g in groups] == [2, 2, 1]
    return ids, groups


def test_items_deleted_while_a_batch_is_sent_are_sent_all_the_same(
    tmp_path: Path, broker_app: Celery
) -> None:
    """A host deleted items after send_batch had checked them: the title lookup for Flower
    raised ItemNotFound half-way, the rest of the batch was never sent, and the batch (its
    total every item) stayed running for good. Now every group goes (a deleted item's run
    reports it refused, which the batch counts)."""
    db = connect(tmp_path / "kidx.db")
    try:
        ids, (_, second, alone) = _batch_of_five(db)
        real = broker_app.send_task
        shown: list[str] = []

        def send_task(name: str, *args: Any, **kw: Any) -> Any:
            if not shown:  # while the first group is sent, the host deletes two items
                delete_items(db, [second[0], alone[0]])
            shown.append(kw["kwargsrepr"])
            return real(name, *args, **kw)

        broker_app.send_task = send_task  # type: ignore[method-assign]
        batch_id, sent = send_batch(db, ids, app=broker_app, group_size=2)
        assert len(sent) == 3
        client = redis.Redis.from_url(broker_url())
        try:
            assert live_task_ids(client, ["celery"]) == set(sent)
        finally:
            client.close()
        assert f"'first': 'n{ids.index(second[1])}'" in shown[1]  # the first still there
        assert "'title': '(deleted)'" in shown[2]
        batch = get_batch(db, batch_id)
        assert batch is not None
        assert (batch["state"], batch["total"]) == ("running", 5)
        assert db.scalar("SELECT count(*) FROM index_jobs WHERE state = 'queued'") == 5
    finally:
        db.close()


def test_a_batch_whose_send_fails_part_way_is_aborted_with_the_cause(
    tmp_path: Path, broker_app: Celery
) -> None:
    """Any error part-way through the sends (not only the broker's refusal) left the batch
    running, waiting for items never sent: `kidx status` listed it for good. It ends aborted,
    saying why, and the error is raised."""
    db = connect(tmp_path / "kidx.db")
    try:
        ids, _ = _batch_of_five(db)
        real = broker_app.send_task
        calls: list[str] = []

        def send_task(name: str, *args: Any, **kw: Any) -> Any:
            calls.append(name)
            if len(calls) == 2:
                raise TypeError("an unexpected failure")
            return real(name, *args, **kw)

        broker_app.send_task = send_task  # type: ignore[method-assign]
        with pytest.raises(TypeError, match="unexpected"):
            send_batch(db, ids, app=broker_app, group_size=2)
        [batch] = db.dicts("SELECT state, abort_reason FROM index_batches")
        assert batch["state"] == "aborted"
        assert batch["abort_reason"] == (
            "sending stopped after 1 of 3 tasks (TypeError: an unexpected failure)"
        )
    finally:
        db.close()
