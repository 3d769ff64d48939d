"""Embedding what is not reused, shared by every kind of item: batches, a failing batch retried
text by text (one bad input costs one vector, not the batch), and the failure count (three in a
row abort the run, with the cause and whether a retry may help)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker.errors import (
    Cancelled,
    IndexAborted,
    PermanentProviderError,
    ProviderError,
    TransientProviderError,
)
from worker.log import KI_EMBED
from worker.providers.base import EmbeddingModel, to_blob

CancelCheck = Callable[[], bool]


@dataclass
class Plan:
    """Which chunk gets which vector: reused (old chunk id, vector) or newly embedded.

    The embedder inputs are made again when a batch is sent rather than kept: for a 20 MB note
    they would be another copy of the whole text."""

    chunks: Sequence[Any]  # anything with an `.index`: note chunks, code chunks
    input_of: Callable[[int], str]  # the embedder input of chunk i, made when needed
    hashes: list[str]
    reuse: dict[int, tuple[int, bytes]] = field(default_factory=dict)
    vectors: dict[int, bytes] = field(default_factory=dict)
    failed: dict[int, str] = field(default_factory=dict)
    last_error: ProviderError | None = None
    item_id: int | None = None  # named in the failure log lines of a batch spanning items

    def done(self) -> bool:
        """Whether every chunk has its vector or its failure."""
        return len(self.vectors) + len(self.failed) >= len(self.chunks)


class FailureCounter:
    """Counts vector failures; the third in a row aborts the run."""

    def __init__(self, limit: int, log_: object) -> None:
        self.limit = limit
        self.in_a_row = 0
        self.log = log_

    def ok(self) -> None:
        self.in_a_row = 0

    def fail(
        self, chunk_index: int, cause: str, error: Exception | None = None, *,
        item_id: int | None = None,
    ) -> None:  # fmt: skip
        self.in_a_row += 1
        where = {"chunk_index": chunk_index} | ({"item_id": item_id} if item_id else {})
        self.log.warning(f"{KI_EMBED} vector failed", **where, reason=cause)
        if self.in_a_row >= self.limit:
            raise IndexAborted(
                f"{self.limit} consecutive vector failures, last: {cause}",
                transient=isinstance(error, TransientProviderError),
                retry_after=getattr(error, "retry_after", None),
            )


def check(cancel: CancelCheck | None) -> None:
    if cancel is not None and cancel():
        raise Cancelled("cancelled")


def embed_missing(
    plan: Plan, embedder: EmbeddingModel, cancel: CancelCheck | None, counter: FailureCounter
) -> None:
    """Embed what one item does not reuse. Raises IndexAborted when not one vector came back."""
    if aborted := embed_plans([plan], embedder, cancel, counter):
        raise aborted[0]


def embed_plans(
    plans: Sequence[Plan], embedder: EmbeddingModel, cancel: CancelCheck | None,
    counter: FailureCounter,
) -> dict[int, IndexAborted]:  # fmt: skip
    """Embed what the plans do not reuse, in batches filled across them (a batch of items costs
    the requests of their texts, not one request an item); a failing batch is retried text by
    text, so that one bad input costs one vector, not the batch. Returns the plans (by position)
    of which not one new vector came back: writing those would replace a working index with a
    useless one. When the counter aborts (N failures in a row), every plan with a failure or
    not complete gets its IndexAborted; only those with every vector may be written."""
    todo = [(p, i) for p in plans for i in range(len(p.chunks)) if i not in p.reuse]
    try:
        for start in range(0, len(todo), embedder.batch_size):
            check(cancel)
            batch = todo[start : start + embedder.batch_size]
            try:
                vectors = embedder.embed_checked([p.input_of(i) for p, i in batch])
            except ProviderError as e:
                if isinstance(e, PermanentProviderError) and not e.per_input:
                    raise
                _one_by_one(batch, embedder, cancel, counter, e)
            else:
                for (p, i), vector in zip(batch, vectors, strict=True):
                    p.vectors[i] = to_blob(vector)
                counter.ok()
    except IndexAborted as stop:
        return {k: stop for k, p in enumerate(plans) if p.failed or not p.done()}
    aborted = {}
    for k, p in enumerate(plans):
        if _none_new(p):
            aborted[k] = IndexAborted(
                f"no chunk could be embedded: {next(iter(p.failed.values()))}",
                transient=isinstance(p.last_error, TransientProviderError),
                retry_after=getattr(p.last_error, "retry_after", None),
            )
    return aborted


def _none_new(p: Plan) -> bool:
    return bool(p.failed) and len(p.failed) == len(p.chunks) - len(p.reuse)


def _one_by_one(
    batch: Sequence[tuple[Plan, int]],
    embedder: EmbeddingModel,
    cancel: CancelCheck | None,
    counter: FailureCounter,
    error: ProviderError,
) -> None:
    if len(batch) == 1:
        _failed(*batch[0], counter, error)
        return
    for p, i in batch:
        check(cancel)
        try:
            vectors = embedder.embed_checked([p.input_of(i)])
        except ProviderError as e:
            if isinstance(e, PermanentProviderError) and not e.per_input:
                raise
            _failed(p, i, counter, e)
        else:
            p.vectors[i] = to_blob(vectors[0])
            counter.ok()


def _failed(plan: Plan, i: int, counter: FailureCounter, error: ProviderError) -> None:
    plan.failed[i] = str(error)
    plan.last_error = error
    counter.fail(plan.chunks[i].index, str(error), error, item_id=plan.item_id)
