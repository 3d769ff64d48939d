"""Memories without a vector of the configured model (written by a host with plain SQL,
changed since, or embedded by a model used before) embedded by a worker: the reconcile sweep
sends this task when it finds some. One run at a time per database (a Redis lock, not
waited for: a second run has nothing to add)."""

from __future__ import annotations

from typing import Any

from celery import Task, shared_task

from tasks.base import KidxTask
from tasks.lock import memories_key, only_one
from tasks.runtime import runtime
from worker.app import EMBED_MEMORIES
from worker.errors import InvalidInput, KeyConflict, StaleConfig
from worker.indexers.memories import embed_memories
from worker.pipeline import NO_PROVIDER


def no_arguments(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse, in one line, the arguments of a task that takes none (InvalidInput)."""
    if args or kwargs:
        given = [repr(a)[:40] for a in args] + [f"{k!s:.40}=..." for k in sorted(kwargs)]
        shown = ", ".join(given[:5]) + (", ..." if len(given) > 5 else "")
        raise InvalidInput(f"{name} takes no arguments, not ({shown})")


# A run embeds at most this many memories (a request a batch); the next sweep sends the rest.
RUN_LIMIT = 512


@shared_task(
    base=KidxTask, name=EMBED_MEMORIES, bind=True, throws=(KeyConflict, InvalidInput, StaleConfig)
)
def embed_memories_task(self: Task, /, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Embed what memories lack a vector; what was done (`MemoryBackfill`: `embedded`,
    `left`, `refused`, `unreadable`, `too_long`, `error`). It takes no argument: one sent
    (`celery call --args`, a host's send) is refused in one line, not a TypeError."""
    no_arguments(EMBED_MEMORIES, args, kwargs)
    rt = runtime(self.app)
    if rt.embedder is None:
        return {"skipped": NO_PROVIDER}
    key = memories_key(rt.db.instance())
    with only_one(rt.redis, key, rt.settings.tasks.visibility_timeout) as alone:
        if not alone:
            return {"skipped": "another run is embedding memories"}
        return embed_memories(rt.db, rt.embedder, limit=RUN_LIMIT).as_dict()
