"""The producer with a broker it cannot use: nothing is left `queued`, and one clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
from celery import Celery

from tasks.producer import add_note, send_group
from worker.errors import BrokerUnavailable
from worker.store import connect
from worker.store.items import add_item


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
