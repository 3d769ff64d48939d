"""One item's failed vectors are its own: a document the provider refuses fails alone, whoever
shared its embedding requests (a bulk run, a group task, a batch), and an edit whose new chunks
are refused keeps the rest of its index. A real SQLite file with sqlite-vec and the HTTP
stand-in; the batch through a real prefork worker."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import pytest

from stack import Stack, running_stack
from tasks.producer import send_batch
from worker.bulk import index_item, index_items
from worker.chunking import chunk_structure
from worker.errors import IndexAborted
from worker.store.items import add_item, get_state, update_content
from worker.store.jobs import get_batch


def sections(tag: str, n: int, poisoned: Iterable[int] = ()) -> str:
    """n sections of about 600 characters, a chunk each; those in `poisoned` hold the word the
    stand-in refuses (a section's chunk has no text of its neighbours)."""
    words = " ".join(f"{tag}word{k}" for k in range(120))
    bad = set(poisoned)
    return "\n\n".join(
        f"## {tag} part {j}\n\n{(('POISON ' if j in bad else '') + words)[: 590 - j]}."
        for j in range(n)
    )


def sent(standin: Any) -> list[list[str]]:
    """The inputs of every request the stand-in received, refused ones included."""
    return [[b["input"]] if isinstance(b["input"], str) else b["input"] for b in standin.bodies]


def vec_rows(db: Any, item_id: int) -> int:
    return db.scalar(
        "SELECT count(*) FROM vec_chunk_embeddings WHERE chunk_id IN "
        "(SELECT id FROM note_chunks WHERE item_id = ?)",
        (item_id,),
    )


def chunks(db: Any, item_id: int) -> list[tuple[Any, ...]]:
    """The item's chunks: (index, content, has a relational vector), in order."""
    return db.all(
        "SELECT c.chunk_index, c.content, e.chunk_id IS NOT NULL FROM note_chunks c "
        "LEFT JOIN note_chunk_embeddings e ON e.chunk_id = c.id WHERE c.item_id = ? "
        "ORDER BY c.chunk_index",
        (item_id,),
    )


# -- a bulk run (`kidx index --all --inline`, a group task's engine) ------------------------


def test_a_document_refused_three_times_in_a_row_fails_alone_in_a_bulk_run(db, embedder, standin):
    healthy = [
        add_item(db, kind="note", title=f"Healthy {n}", content=sections(f"h{n}", 3))
        for n in range(4)
    ]
    bad = add_item(db, kind="note", title="Bad", content=sections("bad", 6, poisoned=range(1, 6)))
    ids = [healthy[0], bad, *healthy[1:]]
    standin.poison = "POISON"
    results = index_items(db, ids, embedder=embedder)
    # The bad document aborts itself, as it does in a run of its own, with no index written.
    assert isinstance(results[bad], IndexAborted)
    assert "3 consecutive vector failures" in str(results[bad])
    state = get_state(db, bad)
    assert state["status"] == "failed" and "HTTP 400" in state["last_error"]
    assert chunks(db, bad) == []
    # Every other item is indexed, its texts having shared requests with the bad one's.
    for item in healthy:
        assert getattr(results[item], "status", None) == "indexed", results[item]
        assert get_state(db, item)["status"] == "indexed" and vec_rows(db, item) == 3
    requests = sent(standin)
    assert any(any("POISON" in t for t in r) and any("h0word" in t for t in r) for r in requests), (
        "the bad document's texts did not share a request with a healthy one"
    )
    # Its texts past the third refusal in a row are not sent: tried alone, three were refused.
    assert len([r for r in requests if len(r) == 1 and "POISON" in r[0]]) == 3
    assert not any("bad part 5" in t for r in requests for t in r)


def test_a_provider_refusing_every_text_stops_a_bulk_run_after_three_items(db, embedder, standin):
    """Not a cascade: a provider that embeds nothing (a 400 for each input, which the count of
    failed requests does not see) stops the run once three items got not one vector, rather
    than being asked for every item's texts; each of those items fails with its own cause."""
    ids = [
        add_item(db, kind="note", title=f"Refused {n}", content=sections(f"r{n}", 2))
        for n in range(12)
    ]
    standin.poison = "word"  # in every text
    results = index_items(db, ids, embedder=embedder)
    assert all(isinstance(results[i], IndexAborted) for i in ids), results
    own = [i for i in ids if "no chunk could be embedded" in str(results[i])]
    stopped = [i for i in ids if "the provider embedded no text of" in str(results[i])]
    assert len(own) >= 3 and own + stopped == ids
    assert {get_state(db, i)["status"] for i in ids} == {"failed"}
    assert db.scalar("SELECT count(*) FROM note_chunks") == 0
    # The run stopped: the last items were never read, nor their texts sent.
    assert not any("r11word" in t for r in sent(standin) for t in r)


# -- an edit (the item keeps what a single run gives it) ------------------------------------


def test_an_edit_whose_one_new_chunk_is_refused_is_written_partial(db, embedder, standin):
    item = add_item(db, kind="note", title="Edited", content=sections("doc", 10))
    assert index_item(db, item, embedder=embedder).status == "indexed"
    # One paragraph edited; the provider refuses it: the item is written, that chunk bare.
    previous = db.all(
        "SELECT start_offset, content FROM note_chunks WHERE item_id = ? ORDER BY chunk_index",
        (item,),
    )
    edited = sections("doc", 10, poisoned={4})
    update_content(db, item, edited)
    standin.poison = "POISON"
    result = index_item(db, item, embedder=embedder)
    assert (result.status, result.embedded, result.failed) == ("partial", 0, 1)
    assert result.reused == result.chunks - 1 >= 8 and "HTTP 400" in (result.error or "")
    state = get_state(db, item)
    assert state["status"] == "partial"
    assert state["last_error"].startswith(f"1 of {result.chunks} chunks have no vector")
    rows = chunks(db, item)  # the new version, the refused chunk without a vector
    assert [c for _, c, _ in rows] == [
        c.content for c in chunk_structure(edited, previous=previous)
    ]
    assert [("POISON" in c, has) for _, c, has in rows if "POISON" in c or not has] == [
        (True, False)
    ]
    assert vec_rows(db, item) == result.chunks - 1
    # Once the provider takes it, the next run embeds that chunk alone.
    standin.poison = None
    standin.texts.clear()
    assert index_item(db, item, embedder=embedder).status == "indexed"
    assert len(standin.texts) == 1 and "POISON" in standin.texts[0]
    # Three new chunks refused in a row still abort the edit, the previous index intact.
    before = chunks(db, item)
    update_content(db, item, sections("doc", 10, poisoned={1, 2, 3, 4}))
    standin.poison = "POISON"
    with pytest.raises(IndexAborted, match="3 consecutive vector failures"):
        index_item(db, item, embedder=embedder)
    assert chunks(db, item) == before and get_state(db, item)["status"] == "failed"


# -- a batch through a real worker (`kidx reindex`: groups of `kidx.index_group`) -----------


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    with running_stack(tmp_path_factory.mktemp("isolation"), lambda tmp, si: Stack(tmp, si)) as s:
        yield s


def finish(stack: Stack, task_ids: list[str]) -> None:
    for task_id in task_ids:
        stack.app.AsyncResult(task_id).get(timeout=60, propagate=False)


@pytest.mark.stack
def test_a_refused_document_in_a_batch_fails_alone_and_three_in_a_row_still_abort_it(stack):
    stack.standin.reset()
    stack.standin.poison = "POISON"
    bad = stack.note("Bad", sections("bad", 6, poisoned=range(1, 6)))
    healthy = [stack.note(f"Healthy {n}", sections(f"h{n}", 3)) for n in range(5)]
    batch_id, task_ids = send_batch(stack.db, [bad, *healthy], app=stack.app)
    assert len(task_ids) < 6  # groups: the bad document shares a run with healthy ones
    finish(stack, task_ids)
    assert [stack.state(i)["status"] for i in healthy] == ["indexed"] * 5
    state = stack.state(bad)
    assert state["status"] == "failed" and "3 consecutive vector failures" in state["last_error"]
    batch = get_batch(stack.db, batch_id)
    assert (batch["state"], batch["ok"], batch["failed"], batch["skipped"]) == ("done", 5, 1, 0)
    # Items failing in a row, each alone, still abort their batch at the third.
    refused = [stack.note(f"Refused {n}", f"POISON note {n}, one chunk.") for n in range(5)]
    batch_id, task_ids = send_batch(stack.db, refused, app=stack.app, group_size=1)
    finish(stack, task_ids)
    batch = get_batch(stack.db, batch_id)
    assert batch["state"] == "aborted" and "3 consecutive failures" in batch["abort_reason"]
    assert batch["failed"] >= 3 and batch["failed"] + batch["skipped"] == 5


def test_refusals_that_are_not_in_a_row_leave_the_item_partial(db, embedder, standin):
    """The seed: three *consecutive* failures abort. Chunks 1, 3 and 5 refused, each followed
    by one that embeds: three in all, none two in a row; the item is written, `partial`."""
    text = sections("doc", 8, poisoned={1, 3, 5})
    item = add_item(db, kind="note", title="Spread", content=text)
    standin.poison = "POISON"
    result = index_item(db, item, embedder=embedder)
    assert (result.status, result.failed, result.embedded) == ("partial", 3, result.chunks - 3)
    assert get_state(db, item)["status"] == "partial"
    assert [i for i, _, has in chunks(db, item) if not has] == [1, 3, 5]
