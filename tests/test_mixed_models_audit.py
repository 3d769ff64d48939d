"""Processes of different embedding configurations on one database at the same time: a rolling
restart (a worker still on the old model while one on the new model starts), or a shell with a
stale .env. Two connections of different settings stand for two processes (each worker holds
one connection for its life, tasks.runtime); the CLI runs as the real console script."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from test_cli import CLI_BROKER, Kidx, base_env

from conftest import FakeEmbedder, mirror_problems
from worker.bulk import index_item, index_items
from worker.errors import StaleConfig, StoreError
from worker.indexers.memories import add_memory
from worker.reconcile import reconcile
from worker.retrieval import search_chunks
from worker.settings import EmbeddingSettings
from worker.store import Database, connect, vec_table_dimensions
from worker.store.items import add_item, get_state

NOWHERE = "http://127.0.0.1:9"  # never reached: FakeEmbedder embeds


def config(model: str, dims: int, base_url: str = NOWHERE) -> EmbeddingSettings:
    return EmbeddingSettings(
        provider="openai", model=model, dimensions=dims, api_key="x", base_url=base_url
    )


def notes(db: Database, n: int, first: int = 0) -> list[int]:
    return [
        add_item(db, kind="note", title=f"n{i}", content=f"Note {i} is about topic {i} only.")
        for i in range(first, first + n)
    ]


def vectors(db: Database) -> dict[int, tuple[str, int]]:
    """Each item's chunk vectors: (model, dimensions)."""
    return {
        item: (model, dims)
        for item, model, dims in db.all(
            "SELECT c.item_id, e.model, e.dimensions FROM note_chunks c "
            "JOIN note_chunk_embeddings e ON e.chunk_id = c.id"
        )
    }


def refused(e: pytest.ExceptionInfo[StoreError], old: str, new: str) -> None:
    """One line naming both models and what to do."""
    line = str(e.value)
    assert "\n" not in line
    assert old in line and new in line and "restart" in line


def behind(db: Database) -> bool:
    return db.scalar("SELECT 1 FROM index_meta WHERE key = 'vec_behind'") is not None


def test_a_worker_still_on_the_old_model_neither_writes_nor_sweeps_after_the_switch(tmp_path):
    """Worker A (m1, 64) kept running after B (m2, 32) started: A's runs wrote 64-dimension
    vectors (marking the mirror behind), and A's sweep then rebuilt the vec tables back to 64,
    marked the items B had re-indexed `pending` and sent them to be embedded again by m1; B's
    sweep rebuilt them to 32 again, for as long as both ran. A now refuses, in one line
    naming both models, and touches nothing: B's index stands, m1's vectors are kept."""
    path = tmp_path / "kidx.db"
    a = connect(path, embedding=config("m1", 64))
    ids = notes(a, 4)
    for i in ids:
        index_item(a, i, embedder=FakeEmbedder(64, "m1"))
    b = connect(path, embedding=config("m2", 32))  # the new worker: rebuilt at 32
    try:
        for i in ids[:2]:
            index_item(b, i, embedder=FakeEmbedder(32, "m2"))
        before = vectors(b)

        with pytest.raises(StoreError) as run:
            index_item(a, ids[2], embedder=FakeEmbedder(64, "m1"))
        refused(run, "m1 (64 dimensions)", "m2 (32 dimensions)")
        assert get_state(a, ids[2])["status"] == "pending"  # for a worker of m2
        with pytest.raises(StoreError) as sweep:
            reconcile(a, model="m1", max_items=10)
        refused(sweep, "m1 (64 dimensions)", "m2 (32 dimensions)")
        with pytest.raises(StoreError):  # a memory's vector goes the same way
            add_memory(a, "a memory of m1", FakeEmbedder(64, "m1"))

        assert a.scalar("SELECT count(*) FROM memories") == 0
        assert not behind(b)
        assert set(vec_table_dimensions(b).values()) == {32}
        assert [get_state(b, i)["status"] for i in ids] == ["indexed"] * 2 + ["pending"] * 2
        assert vectors(b) == before  # m1's vectors of items 3 and 4 kept, for a switch back
        assert before[ids[2]] == ("m1", 64)
        drift = reconcile(b, model="m2", max_items=10)
        assert drift.to_index == ids[2:] and drift.repaired["tables_rebuilt"] == {}
        assert mirror_problems(b) == []
    finally:
        a.close()
        b.close()


def test_the_same_dimension_and_another_model_never_overwrites_the_new_vectors(tmp_path):
    """m1 and m2 both of 64 dimensions: no rebuild tells A of the switch. A's run of an item
    B had indexed embedded it again with m1 over m2's vector, and A's sweep sent every m2
    item to be embedded again (and B's every m1 item): endless churn of provider calls. A
    refuses now; reuse and search never mix the two models."""
    path = tmp_path / "kidx.db"
    a = connect(path, embedding=config("m1", 64))
    ids = notes(a, 3)
    for i in ids:
        index_item(a, i, embedder=FakeEmbedder(64, "m1"))
    b = connect(path, embedding=config("m2", 64))
    try:
        m2 = FakeEmbedder(64, "m2")
        result = index_item(b, ids[0], embedder=m2)
        assert (result.reused, result.embedded) == (0, 1)  # m1's vector is not m2's
        m1 = FakeEmbedder(64, "m1")
        with pytest.raises(StoreError) as run:
            index_item(a, ids[0], embedder=m1)
        refused(run, "m1 (64 dimensions)", "m2 (64 dimensions)")
        assert m1.calls == []  # refused before any provider call
        with pytest.raises(StoreError):
            reconcile(a, model="m1", max_items=10)
        assert vectors(b)[ids[0]] == ("m2", 64)
        assert get_state(b, ids[0])["status"] == "indexed"
        found = search_chunks(b, "Note 1 is about topic 1 only.", m2, k=5, mode="vector")
        assert {h.item_id for h in found.hits} == {ids[0]}  # m1's vectors are not searched
        assert reconcile(b, model="m2", max_items=10).to_index == ids[1:]
        assert mirror_problems(b) == []
    finally:
        a.close()
        b.close()


def test_alternating_restarts_rebuild_consistently_and_the_older_process_is_refused(tmp_path):
    """Processes of m1 (64) and m2 (32) started in turn, each while the other still runs:
    each start rebuilds the tables at its dimension from the relational vectors of it (every
    vec table holds exactly those), no vector of either model is lost, and the process
    started before it refuses to write, where it wrote its vectors over the other's."""
    path = tmp_path / "kidx.db"
    configs = [("m1", 64), ("m2", 32)]
    ids = []
    older: Database | None = None
    try:
        for round_ in range(8):
            model, dims = configs[round_ % 2]
            db = connect(path, embedding=config(model, dims))
            assert set(vec_table_dimensions(db).values()) == {dims}
            assert mirror_problems(db) == []
            ids += notes(db, 1, first=round_)
            for i in ids[-2:]:  # the new item, and the last one the other model indexed
                assert index_item(db, i, embedder=FakeEmbedder(dims, model)).status == "indexed"
            assert mirror_problems(db) == [] and not behind(db)
            if older is not None:
                other, other_dims = configs[(round_ + 1) % 2]
                with pytest.raises(StoreError) as run:
                    index_item(older, ids[-1], embedder=FakeEmbedder(other_dims, other))
                refused(run, f"{other} ({other_dims}", f"{model} ({dims}")
                older.close()
            older = db
        assert older is not None
        kept = vectors(older)
        assert len(kept) == len(ids)  # every item has the vector its last run wrote
        assert {m for m, _ in kept.values()} == {"m1", "m2"}
    finally:
        if older is not None:
            older.close()


def test_a_shell_with_a_stale_env_does_not_switch_the_workers_index_back(tmp_path, standin):
    """After the workers switched to m2 (32), `kidx add note` and `kidx search` run with the
    old .env (standin-embed, 64): the add rebuilt the vec tables back to 64 and marked every
    item the workers had re-indexed `pending`. A command that embeds nothing leaves the index
    as it is and says, in one line, which model it is kept for."""
    path: Path = tmp_path / "kidx.db"
    work = tmp_path / "work"
    work.mkdir()
    kidx = Kidx(work, base_env(path, standin.base_url), process=True)  # standin-embed, 64
    kidx.ok("init")
    first = kidx.add("old", "--text", "A note the old model indexed.", inline=True)
    workers = connect(path, embedding=config("m2", 32, standin.base_url))
    try:
        index_item(workers, first, embedder=FakeEmbedder(32, "m2"))
        added = kidx.ok("add", "note", "--title", "t", "--text", "Added from a stale shell.")
        assert set(vec_table_dimensions(workers).values()) == {32}
        assert get_state(workers, first)["status"] == "indexed"
        said = [line for line in added.stderr.splitlines() if "kept for m2" in line]
        assert len(said) == 1 and "standin-embed (64 dimensions)" in said[0]
        found = kidx.ok("search", "old model", "--mode", "vector")
        assert "kept for m2 (32 dimensions)" in found.stderr
        item = int(added.stdout.split()[-1])
        index_item(workers, item, embedder=FakeEmbedder(32, "m2"))  # the workers go on
        assert mirror_problems(workers) == []
    finally:
        workers.close()


def test_doctor_warns_when_the_index_is_kept_for_another_model(tmp_path):
    """`kidx doctor` with the old settings after the switch said "vec tables at another
    dimension ... `kidx init` rebuilds them": the fix that switched the workers' index back.
    It warns now, naming both models, and says nothing of `kidx init`."""
    from ops.doctor import Warn, check_dimensions
    from worker.settings import Settings

    path = tmp_path / "kidx.db"
    connect(path, embedding=config("m1", 64)).close()
    connect(path, embedding=config("m2", 32)).close()  # the workers, switched
    stale = Settings(db=path, embedding=config("m1", 64), _env_file=None)  # type: ignore[call-arg]
    with pytest.raises(Warn) as warned:
        check_dimensions(stale, 5.0)
    assert "m1 (64 dimensions)" in warned.value.detail
    assert "m2 (32 dimensions)" in warned.value.detail
    assert "kidx init" not in warned.value.fix
    current = Settings(db=path, embedding=config("m2", 32), _env_file=None)  # type: ignore[call-arg]
    assert check_dimensions(current, 5.0).startswith("32")


class SwitchedWhileEmbedding(FakeEmbedder):
    """m1's embedder; the first request starts a process of m2 (the switch) meanwhile."""

    def __init__(self, path: Path) -> None:
        super().__init__(64, "m1")
        self.path, self.other = path, None

    def embed_batch(self, texts: list[str]) -> np.ndarray:
        if self.other is None:
            self.other = connect(self.path, embedding=config("m2", 32))
        return super().embed_batch(texts)


def test_a_switch_while_a_run_embeds_leaves_its_items_pending_not_failed(tmp_path):
    """The switch came while an m1 run embedded: its write went in as m1's (pre-fix), or, once
    refused, its items ended `failed` with an attempt spent, waiting for the retry sweep's
    backoff (a few such runs used up their attempts). They end `pending` now, for the sweep of
    the new model's workers, with the reason; the run stops at the first, and nothing of m1
    is written."""
    path = tmp_path / "kidx.db"
    a = connect(path, embedding=config("m1", 64))
    ids = notes(a, 3)
    embedder = SwitchedWhileEmbedding(path)
    try:
        outcomes = index_items(a, ids, embedder=embedder)
        assert all(isinstance(outcomes[i], StaleConfig) for i in ids), outcomes
        for i in ids:
            state = get_state(a, i)
            assert state["status"] == "pending"
            assert "m2 (32 dimensions)" in state["last_error"]
        assert a.all("SELECT DISTINCT attempts FROM item_index_state") == [(0,)]
        assert vectors(a) == {} and not behind(a)
        assert embedder.other is not None
        assert reconcile(embedder.other, model="m2", max_items=10).to_index == ids
    finally:
        a.close()
        if embedder.other is not None:
            embedder.other.close()


def test_a_pool_process_a_worker_of_the_old_model_forks_after_the_switch_does_not_switch_back(
    tmp_path,
):
    """Worker A (m1) started before B (m2) switched the index; then A replaced one of its
    pool processes (max_tasks_per_child, a child killed at the hard time limit): the new
    child, with A's old settings, switched the index back to m1 at its first connection, and
    B's workers were the ones refused. A child whose worker read its settings before the
    switch now leaves the index to m2 and refuses, as A's older children do; a worker
    started after the switch with m1 (an operator switching back) still switches it."""
    from types import SimpleNamespace

    from tasks.runtime import close_runtime, runtime
    from worker.settings import Settings

    path = tmp_path / "kidx.db"

    def worker(model: str, dims: int, configured_at: float) -> SimpleNamespace:
        settings = Settings(  # type: ignore[call-arg]
            db=path, embedding=config(model, dims), broker_url=CLI_BROKER, _env_file=None
        )
        return SimpleNamespace(kidx_settings=settings, kidx_configured_at=configured_at)

    a_started = time.time()
    a = worker("m1", 64, a_started)
    first = runtime(a).db
    ids = notes(first, 2)
    index_item(first, ids[0], embedder=FakeEmbedder(64, "m1"))
    close_runtime(a)
    b = connect(path, embedding=config("m2", 32))  # worker B, started after A
    try:
        a.kidx_runtime = None  # a pool process A forks now: A's settings, a new connection
        child = runtime(a).db
        assert set(vec_table_dimensions(b).values()) == {32}
        with pytest.raises(StaleConfig) as run:
            index_item(child, ids[1], embedder=FakeEmbedder(64, "m1"))
        refused(run, "m1 (64 dimensions)", "m2 (32 dimensions)")
        assert index_item(b, ids[1], embedder=FakeEmbedder(32, "m2")).status == "indexed"
        close_runtime(a)
        back = worker("m1", 64, time.time())  # restarted with m1 on purpose
        assert set(vec_table_dimensions(runtime(back).db).values()) == {64}
        close_runtime(back)
    finally:
        b.close()
