"""A provider's error that quotes a lone surrogate (JSON-escaped "\\ud800", which json.loads
keeps): the item failed with UnicodeEncodeError where its error was stored, and no reason was
recorded. Over real HTTP, the stand-in answering the error."""

from __future__ import annotations

import pytest

from conftest import corpus_text
from worker.bulk import index_item
from worker.errors import IndexAborted
from worker.providers.http import shorten
from worker.store.items import add_item, get_state


@pytest.mark.parametrize("status", [400, 503])
def test_an_error_quoting_a_lone_surrogate_is_stored_as_the_items_reason(
    db, embedder, standin, status
):
    item = add_item(db, kind="note", title="Traits", content=corpus_text("ch10-02-traits.md"))
    standin.fail_status, standin.error_code = status, "bad\ud800code"
    try:
        index_item(db, item, embedder=embedder)
    except IndexAborted as aborted:  # a dead provider aborts; the item is failed all the same
        assert "bad\ufffdcode" in str(aborted)
    state = get_state(db, item)
    assert state["status"] == "failed"
    assert "bad\ufffdcode" in state["last_error"] and f"HTTP {status}" in state["last_error"]
    assert db.scalar("SELECT count(*) FROM note_chunks") == 0


def test_shorten_leaves_no_lone_surrogate_and_keeps_a_pair():
    assert shorten("a\udfff b\ud800") == "a\ufffd b\ufffd"
    assert shorten("\U0001f600 x") == "\U0001f600 x"  # a whole character beyond the BMP
    assert shorten("sk-secret\ud800", ["sk-secret"]) == "***\ufffd"
