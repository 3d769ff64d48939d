"""Which task messages a Redis broker holds: queued (kombu's lists, one per queue and priority
step) or delivered and not yet acknowledged (kombu's `unacked` hash: running, or reserved
with a countdown, since tasks are acknowledged late). A task recorded as queued that is in
neither was lost: a Redis restarted without persistence, a flushed database, a host deleting
keys. Read in kombu's own layout (kombu.transport.redis: `_q_for_pri`, `unacked_key`)."""

from __future__ import annotations

import json
from typing import Any

import redis

PRIORITY_STEPS = (0, 3, 6, 9)  # kombu's defaults: the lists `queue`, `queue\x06\x163`, ...
SEP = "\x06\x16"
UNACKED = "unacked"
# Read at most this many messages (a kidx task's message is 1-2 kB: about 20 MB and 0.2 s for
# a sweep every few minutes); with more queued, nothing is called lost: the visibility timeout
# still holds.
MAX_MESSAGES = 10_000


def live_task_ids(client: redis.Redis, queues: list[str]) -> set[str] | None:
    """The ids of every task message the broker holds now, or None when it holds too many to
    read (the caller then calls nothing lost)."""
    keys = [q if not step else f"{q}{SEP}{step}" for q in queues for step in PRIORITY_STEPS]
    with client.pipeline(transaction=True) as pipe:  # one snapshot of every list and the hash
        for key in keys:
            pipe.llen(key)
        pipe.hlen(UNACKED)
        sizes = pipe.execute()
    if sum(sizes) > MAX_MESSAGES:
        return None
    with client.pipeline(transaction=True) as pipe:
        for key in keys:
            pipe.lrange(key, 0, -1)
        pipe.hvals(UNACKED)
        *lists, unacked = pipe.execute()
    ids = {_task_id(raw) for raw in (m for messages in lists for m in messages)}
    ids |= {_task_id(raw, delivered=True) for raw in unacked}
    ids.discard(None)
    return ids  # type: ignore[return-value]


def _task_id(raw: bytes, *, delivered: bool = False) -> str | None:
    """A message's task id (protocol 2: `headers.id`); an unacked entry is `[message, exchange,
    routing key]`. Anything else (another application's keys) has none."""
    try:
        value: Any = json.loads(raw)
        if delivered:
            value = value[0]
        task_id = value["headers"]["id"]
    except (ValueError, TypeError, KeyError, IndexError):
        return None
    return task_id if isinstance(task_id, str) else None
