"""The reconcile sweep sends items that fell back to structure for the chunk model again, through
a real prefork worker: one probe while the model is taken for down (its breaker shared in
Redis), then the rest once the probe's answer has put it up."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from conftest import corpus_text
from stack import Stack, running_stack, wait_for
from tasks.producer import enqueue_note

pytestmark = [pytest.mark.stack]

TEXT = corpus_text("ch04-03-slices.md")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    def make(tmp, standin) -> Stack:
        env = {
            "KIDX_CHUNK__MODEL": "standin-chat",
            "KIDX_CHUNK__BASE_URL": standin.base_url,
            "KIDX_CHUNK__MAX_RETRIES": "0",
            "KIDX_CHUNK__TIMEOUT": "5",
            "KIDX_CHUNK__DOWN_AFTER": "2",
            "KIDX_CHUNK__COOL_DOWN": "0",  # a probe asks at once
            "KIDX_SCHEDULER__RETRY_BACKOFF": "0",
        }
        return Stack(tmp, standin, worker="rechunk", env=env)

    with running_stack(tmp_path_factory.mktemp("rechunk"), make) as s:
        yield s


def indexed(stack: Stack, title: str) -> int:
    item = stack.note(title, TEXT)
    assert stack.app.AsyncResult(enqueue_note(stack.db, item, app=stack.app)).get(timeout=60)
    return item


def sweep(stack: Stack) -> dict:
    summary = stack.app.send_task("kidx.reconcile").get(timeout=60)
    wait_for(
        lambda: (
            not stack.db.scalar(
                "SELECT count(*) FROM index_jobs WHERE state IN ('queued', 'started')"
            )
        ),
        60,
        "the sweep's batch to end",
        every=0.1,
    )
    return summary


def test_items_that_fell_back_are_chunked_by_the_model_after_it_comes_back(stack):
    stack.standin.chat.fail_status = 503
    first, second = indexed(stack, "One"), indexed(stack, "Two")
    for item in (first, second):
        state = stack.state(item)
        assert state["chunk_method"] == "structure" and "HTTP 503" in state["last_error"]
    stack.standin.chat.fail_status = None
    asked = stack.standin.chat.requests

    # two failed calls in a row: taken for down by every process, so one item goes, the oldest
    probe = sweep(stack)
    assert (probe["found"]["fell_back"], probe["sent"]) == (1, 1), probe
    assert stack.standin.chat.requests > asked
    assert stack.state(first)["chunk_method"] == "llm"
    assert stack.state(first)["last_error"] is None
    assert stack.state(second)["chunk_method"] == "structure"

    # its answer put the model up: the rest go
    rest = sweep(stack)
    assert rest["found"]["fell_back"] == 1, rest
    assert stack.state(second)["chunk_method"] == "llm"
    methods = stack.db.all("SELECT DISTINCT method FROM note_chunks")
    assert methods == [("llm",)]
    assert sweep(stack)["found"]["fell_back"] == 0
