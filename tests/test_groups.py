"""Bulk runs in groups (`kidx.index_group`, tasks/group.py) against real processes: Redis,
prefork workers, the HTTP stand-in. A group's items share embedding requests and each keeps
what a single run gives it: its lock, its own transaction, its job row, its count in the batch."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from stack import Stack, running_stack, wait_for
from tasks import GROUP
from tasks.lock import ItemLock, lock_key
from tasks.producer import plan_groups, send_batch, send_group
from worker.chunking import chunk_structure
from worker.store.items import update_content

# Real worker processes (not in make test-quick); one xdist worker runs the whole module, so
# its module-scoped stack starts once.
pytestmark = [pytest.mark.stack]

BATCH = 4  # the stack's KIDX_EMBEDDING__BATCH_SIZE


def sections(tag: str, n: int = 4) -> str:
    """n sections of about 600 characters: n chunks (two would exceed the chunker's target)."""
    words = " ".join(f"{tag}word{k}" for k in range(120))
    return "\n\n".join(f"## {tag} part {j}\n\n{words[: 590 - j]}." for j in range(n))


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Half the soft time limit is a group's deadline: 2.5 s here.
    env = {"KIDX_TASKS__SOFT_TIME_LIMIT": "5", "KIDX_TASKS__TIME_LIMIT": "8"}
    with running_stack(
        tmp_path_factory.mktemp("groups"), lambda tmp, si: Stack(tmp, si, env=env)
    ) as s:
        yield s


@pytest.fixture(autouse=True)
def _fresh_standin(stack: Stack) -> None:
    stack.standin.reset()


def jobs(stack: Stack, item_id: int) -> list[tuple[str, str]]:
    return stack.db.all(
        "SELECT task_id, state FROM index_jobs WHERE item_id = ? ORDER BY rowid", (item_id,)
    )


def test_a_batch_goes_in_groups_whose_requests_are_filled_across_items(stack):
    texts = {stack.note(f"Grouped {n}", sections(f"g{n}", 1 + n % 3)): n for n in range(12)}
    ids = list(texts)
    batch_id, task_ids = send_batch(stack.db, ids, app=stack.app)
    assert len(task_ids) == 2  # one group for each of the worker's two processes
    results = [stack.app.AsyncResult(t).get(timeout=60) for t in task_ids]
    assert sorted(r["items"] for r in results) == [6, 6]
    assert sum(r.get("indexed", 0) for r in results) == 12
    assert {stack.state(i)["status"] for i in ids} == {"indexed"}
    batch = stack.db.dicts("SELECT * FROM index_batches WHERE id = ?", (batch_id,))[0]
    assert (batch["state"], batch["ok"], batch["failed"]) == ("done", 12, 0)
    # Each group's requests are full but its last: one request an item would send 12 or more.
    per_group = sum(len(chunk_structure(sections(f"g{n}", 1 + n % 3))) for n in range(12))
    sizes = [len(b["input"]) for b in stack.standin.bodies]
    assert sum(sizes) == per_group == 24
    assert sorted(sizes, reverse=True)[: len(sizes) - 2] == [BATCH] * (len(sizes) - 2)
    assert len(sizes) <= per_group // BATCH + 2 < len(ids)
    # Every item has its own job row, `<group task id>:<item id>`, ended `success`.
    for i in ids:
        ((job_id, state),) = jobs(stack, i)
        assert job_id.split(":")[0] in task_ids and job_id.endswith(f":{i}")
        assert state == "success"
    out = stack.kidx("jobs", "--batch", str(batch_id), "--json")
    assert out.returncode == 0 and len(json.loads(out.stdout)["jobs"]) == 12


def test_a_busy_item_in_a_group_is_coalesced_and_the_others_indexed(stack):
    busy, *others = [stack.note(f"Busy {n}", sections(f"b{n}", 2)) for n in range(3)]
    holder = ItemLock(stack.redis, stack.db.instance(), busy, "another-run", ttl=30)
    assert holder.acquire()
    try:
        task_id = send_group(stack.db, stack.app, [busy, *others], None, "test")
        result = stack.app.AsyncResult(task_id).get(timeout=60)
    finally:
        holder.release()
    statuses = {r["item_id"]: r["status"] for r in result["results"]}
    assert statuses == {busy: "coalesced", others[0]: "indexed", others[1]: "indexed"}
    assert stack.state(busy)["status"] == "pending"  # untouched: its holder covers it
    assert holder.take_rerun()  # the holder was asked to run once more
    assert jobs(stack, busy)[-1][1] == "coalesced"
    assert not any(stack.redis.exists(lock_key(stack.db.instance(), i)) for i in others)


def test_cancelling_a_group_by_an_item_job_id_keeps_every_previous_index(stack):
    ids = [stack.note(f"Cancel {n}", sections(f"c{n}", 4)) for n in range(6)]
    first = send_group(stack.db, stack.app, ids, None, "first")
    stack.app.AsyncResult(first).get(timeout=60)
    before = {
        i: stack.db.all("SELECT content FROM note_chunks WHERE item_id = ?", (i,)) for i in ids
    }
    for i in ids:
        update_content(stack.db, i, sections(f"x{i}", 4))
    stack.standin.delay = 0.7
    task_id = send_group(stack.db, stack.app, ids, None, "second")
    wait_for(lambda: stack.standin.requests >= 1, 30, "the group to reach the provider")
    out = stack.kidx("cancel", f"{task_id}:{ids[3]}")  # an item's job id cancels its group
    assert out.returncode == 0, out.stderr
    wait_for(lambda: stack.app.AsyncResult(task_id).state == "REVOKED", 15, "REVOKED")
    states = {i: stack.state(i)["status"] for i in ids}
    assert "cancelled" in states.values() and set(states.values()) <= {"cancelled", "indexed"}
    for i in ids:
        now = stack.db.all("SELECT content FROM note_chunks WHERE item_id = ?", (i,))
        if states[i] == "cancelled":
            assert now == before[i]  # the previous index, whole
        else:
            assert [c for (c,) in now] == [c.content for c in chunk_structure(sections(f"x{i}"))]
    revoked = [i for i in ids if jobs(stack, i)[-1][1] == "revoked"]
    assert revoked == [i for i in ids if states[i] == "cancelled"]
    assert not any(stack.redis.exists(lock_key(stack.db.instance(), i)) for i in ids)


def test_a_group_past_its_deadline_sends_the_rest_on_and_all_get_indexed(stack):
    ids = [stack.note(f"Slow {n}", sections(f"s{n}", BATCH)) for n in range(10)]
    stack.standin.delay = 0.5  # a request an item: a group reads about five in its 2.5 s
    task_id = send_group(stack.db, stack.app, ids, None, "slow")
    first = stack.app.AsyncResult(task_id).get(timeout=60)
    sent_on = [r for r in first["results"] if r["status"] == "sent on"]
    assert 0 < len(sent_on) < len(ids) and first.get("indexed", 0) == len(ids) - len(sent_on)
    follow = sent_on[0]["next"]
    assert {r["next"] for r in sent_on} == {follow}
    wait_for(lambda: {stack.state(i)["status"] for i in ids} == {"indexed"}, 60, "every item")
    for i in ids:  # each item indexed once, by one group or the next
        assert [s for _, s in jobs(stack, i) if s == "success"] == ["success"]
    assert all(stack.state(i)["chunk_count"] == BATCH for i in ids)


def test_items_a_host_gave_id_zero_or_below_are_indexed_with_the_others(stack):
    """SQLite takes any 64-bit rowid, and the sweep finds such rows: a group with them runs
    every item, where one such id made the group refuse its whole list, sweep after sweep."""
    stack.db.execute(
        "INSERT INTO knowledge_items(id, kind, title, content) VALUES "
        "(0, 'note', 'zero', 'Host note zero.'), (-7, 'note', 'neg', 'Host note minus seven.')"
    )
    ids = [-7, 0, stack.note("Positive", "A note with a kidx id.")]
    task_id = send_group(stack.db, stack.app, ids, None, "sweep")
    assert stack.app.AsyncResult(task_id).get(timeout=30)["indexed"] == 3
    assert [stack.state(i)["status"] for i in ids] == ["indexed"] * 3


def test_a_group_with_bad_arguments_fails_clearly_and_the_worker_serves_on(stack):
    for args in (["12"], [[1, "x"]], [[1.5]], [[]], [[2**70]]):
        result = stack.app.send_task(GROUP, args=args)
        with pytest.raises(Exception, match="item ids must be a list of 64-bit integers"):
            result.get(timeout=30)
    item = stack.note("After", sections("after", 1))
    task_id = send_group(stack.db, stack.app, [item, stack.note("Also", "Short note.")], None, "x")
    assert stack.app.AsyncResult(task_id).get(timeout=30)["indexed"] == 2
    # An unknown item fails alone, by name; the others in its group are indexed.
    other = stack.note("Beside", sections("beside", 1))
    result = stack.app.send_task(GROUP, args=[[other, 987654]])
    with pytest.raises(Exception, match=r"1 failed .*item 987654: no item with id 987654"):
        result.get(timeout=30)
    assert stack.state(other)["status"] == "indexed"


# -- how a batch is cut into groups (no processes) ------------------------------------------


def test_groups_are_a_multiple_of_the_processes_and_even_in_text():
    sizes = {i: 1000 for i in range(112)}
    assert [len(g) for g in plan_groups(sizes, 64, 2)] == [56, 56]
    assert [len(g) for g in plan_groups(sizes, 32, 2)] == [28] * 4
    assert [len(g) for g in plan_groups(sizes, 32, 3)] == [19, 19, 19, 19, 18, 18]
    skewed = {0: 90_000, **{i: 1000 for i in range(1, 91)}}  # one big item, ninety small
    groups = plan_groups(skewed, 100, 2)
    loads = [sum(skewed[i] for i in g) for g in groups]
    assert groups[0] == [0] and loads == [90_000, 90_000]
    assert plan_groups({5: 1}, 64, 2) == [[5]]


@given(
    st.dictionaries(st.integers(1, 10**6), st.integers(1, 10**5), min_size=1, max_size=300),
    st.integers(1, 100),
    st.integers(1, 8),
)
def test_groups_hold_every_item_once_in_order_within_the_size(sizes, group_size, processes):
    groups = plan_groups(sizes, group_size, processes)
    order = list(sizes)
    assert sorted(i for g in groups for i in g) == sorted(order)
    assert all(0 < len(g) <= group_size for g in groups)
    assert all(g == sorted(g, key=order.index) for g in groups)
    n, needed = len(sizes), -(-len(sizes) // group_size)
    # As many as a multiple of the processes (when there are items enough), never an empty one.
    rounded = -(-needed // processes) * processes if n >= processes else needed
    assert len(groups) == min(n, rounded)


def test_a_run_delivered_again_is_counted_once_in_its_batch(stack):
    """A process killed after a run recorded its outcome but before the broker had the
    acknowledgement: the run comes again (same task id); the batch counts it once."""
    from tasks import NOTE
    from worker.store.jobs import create_batch, get_batch

    ids = [stack.note(f"Again {n}", sections(f"a{n}", 2)) for n in range(3)]
    batch = create_batch(stack.db, "reindex", len(ids) + 1)
    runs = {"redelivered-group-0001": (GROUP, [ids]), "redelivered-single-0001": (NOTE, [ids[0]])}

    def finished() -> list:
        return stack.db.all(
            "SELECT task_id, finished_at FROM index_jobs WHERE task_id LIKE 'redelivered-%' "
            "ORDER BY task_id"
        )

    for delivery in range(2):  # the same messages twice, as a redelivery brings them
        before = finished()
        for task_id, (name, args) in runs.items():
            stack.app.send_task(name, args=args, kwargs={"batch_id": batch}, task_id=task_id)
        # (the results backend already holds the first run's result: wait on the job rows)
        wait_for(
            lambda b=before: (
                len(finished()) == 4
                and all(f is not None and (not b or f != dict(b)[t]) for t, f in finished())
            ),
            60,
            f"delivery {delivery + 1} to end",
        )
    counts = get_batch(stack.db, batch)
    assert (counts["ok"], counts["failed"], counts["skipped"]) == (4, 0, 0)
    assert counts["state"] == "done"


def test_an_item_sent_to_retry_leaves_the_group_so_its_retry_runs_meanwhile(stack):
    """An item whose provider failed for now gets a run of its own in seconds; the group lets
    its lock go, or that run would find the item locked and only ask for a re-run."""
    others = [stack.note(f"Slow other {n}", sections(f"o{n}", BATCH)) for n in range(6)]
    flaky = stack.note("Flaky", sections("flakyword", 2))
    stack.standin.poison, stack.standin.poison_status = "flakyword", 503
    stack.standin.delay = 0.4  # a request an item: the group outlasts the retry's countdown
    task_id = send_group(stack.db, stack.app, [flaky, *others], None, "test")
    wait_for(
        lambda: jobs(stack, flaky) and jobs(stack, flaky)[-1][1] == "retry",
        30,
        "the flaky item to be sent to retry",
    )
    stack.standin.poison = None  # the provider is back for the retry
    result = stack.app.AsyncResult(task_id).get(timeout=60)
    retry = next(r for r in result["results"] if r["item_id"] == flaky)
    assert retry["status"] == "retry"
    # It ran, rather than finding the item locked (its job row ends after the item's write).
    wait_for(
        lambda: dict(jobs(stack, flaky)).get(retry["next"]) == "success",
        30,
        "the retry to index it",
    )
    assert stack.state(flaky)["status"] == "indexed"
    assert stack.db.scalar("SELECT count(*) FROM note_chunks WHERE item_id = ?", (flaky,)) == 2
