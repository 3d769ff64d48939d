"""A prefork worker left on the old embedding model after another process switched the index
(a rolling restart): its item runs, its reconcile sweep and its memory run are refused in one
line naming both models, with no provider call, as an expected failure (Celery's `throws`: no
traceback in the worker's log), and the item keeps its place in the queue of work (`pending`)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from stack import Stack, running_stack, wait_for
from tasks.producer import enqueue
from worker.app import EMBED_MEMORIES, RECONCILE
from worker.settings import EmbeddingSettings
from worker.store import connect

pytestmark = [pytest.mark.stack]

NEW_MODEL = "standin-embed-v2"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("mixed"), Stack) as s:
        yield s


def celery_lines(stack: Stack, task_id: str) -> list[dict]:
    return [
        json.loads(x)
        for x in stack.worker.log.splitlines()
        if x.startswith("{") and task_id in x and "raised" in x
    ]


def test_a_worker_left_on_the_old_model_refuses_its_work_in_one_line(stack: Stack) -> None:
    first = stack.note("Before the switch", "A note the old model indexes.")
    assert (
        stack.app.AsyncResult(enqueue(stack.db, first, app=stack.app)).get(timeout=60)["status"]
        == "indexed"
    )
    new = EmbeddingSettings(
        provider="openai", model=NEW_MODEL, base_url=stack.standin.base_url, dimensions=64
    )
    connect(stack.db_path, embedding=new).close()  # a worker of the new model starts
    asked = stack.standin.requests

    second = stack.note("After the switch", "A note only the new model may index.")
    result = stack.app.AsyncResult(enqueue(stack.db, second, app=stack.app))
    with pytest.raises(Exception) as refused:
        result.get(timeout=60)
    said = str(refused.value)
    assert NEW_MODEL in said and "standin-embed (64 dimensions)" in said and "\n" not in said
    assert stack.state(second)["status"] == "pending"  # left for a worker of the new model
    lines = wait_for(lambda: celery_lines(stack, result.id), 30, "the run's line")
    assert not any("exception" in x for x in lines), lines

    for name in (RECONCILE, EMBED_MEMORIES):
        sent = stack.app.send_task(name)
        with pytest.raises(Exception) as refused:
            sent.get(timeout=60)
        assert type(refused.value).__name__ == "StaleConfig", name
        assert NEW_MODEL in str(refused.value) and "\n" not in str(refused.value)
        lines = wait_for(lambda s=sent: celery_lines(stack, s.id), 30, f"{name}'s line")
        assert all("raised expected" in x["event"] for x in lines), lines
        assert not any("exception" in x for x in lines), lines
    assert stack.standin.requests == asked  # nothing was embedded by the old model
