"""A run's cancel check against a Redis that accepts and never answers (tasks/cancel.py).

Each look waited its socket timeout, and a provider's answer being read looks every quarter
second: a call of one second took many times its socket timeout. After Redis did not answer,
the check now carries on without looking for `AWAY_S`. (The `mute` server: conftest.)
"""

from __future__ import annotations

import time

from tasks import cancel
from tasks.cancel import CancelToken
from tasks.runtime import redis_client
from worker.settings import load_settings


def test_a_redis_that_never_answers_is_not_asked_at_every_wait(mute, monkeypatch, tmp_path):
    client = redis_client(
        load_settings(db=tmp_path / "k.db", broker_url=mute.url, tasks={"lock_ttl": 3})
    )
    token = CancelToken(client, "t-1", poll=0.0)  # a look at every call, while Redis answers
    assert token() is False  # waited its socket timeout: not cancelled, the run goes on
    mute.wait_for(1)
    for _ in range(5):
        assert token() is False
    assert mute.connections == 1

    monkeypatch.setattr(cancel, "AWAY_S", 0.0)  # past the pause: it looks again
    token._checked = time.monotonic() - 1
    assert token() is False
    mute.wait_for(2)
    assert mute.connections == 2
    client.close()
