"""Embedding what is not reused, shared by every kind of item: batches, a failing batch retried
text by text (one bad input costs one vector, not the batch), and the failure count (three in a
row abort the run, with the cause and whether a retry may help)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

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


class FailureCounter:
    """Counts vector failures; the third in a row aborts the run."""

    def __init__(self, limit: int, log_: object) -> None:
        self.limit = limit
        self.in_a_row = 0
        self.log = log_

    def ok(self) -> None:
        self.in_a_row = 0

    def fail(self, chunk_index: int, cause: str, error: Exception | None = None) -> None:
        self.in_a_row += 1
        self.log.warning(f"{KI_EMBED} vector failed", chunk_index=chunk_index, reason=cause)
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
    """Embed what is not reused, in batches; a failing batch is retried text by text, so that
    one bad input costs one vector, not the batch."""
    todo = [i for i in range(len(plan.chunks)) if i not in plan.reuse]
    if not todo:
        return
    for start in range(0, len(todo), embedder.batch_size):
        check(cancel)
        batch = todo[start : start + embedder.batch_size]
        try:
            vectors = embedder.embed_checked([plan.input_of(i) for i in batch])
        except ProviderError as e:
            if isinstance(e, PermanentProviderError) and not e.per_input:
                raise
            _one_by_one(plan, batch, embedder, cancel, counter, e)
        else:
            _store(plan, batch, vectors)
            counter.ok()
    if len(plan.failed) == len(todo):
        # Not one new vector: the provider is down or refuses everything. Writing chunks
        # without vectors would replace a working index with a useless one.
        raise IndexAborted(
            f"no chunk could be embedded: {next(iter(plan.failed.values()))}",
            transient=isinstance(plan.last_error, TransientProviderError),
            retry_after=getattr(plan.last_error, "retry_after", None),
        )


def _one_by_one(
    plan: Plan,
    batch: Sequence[int],
    embedder: EmbeddingModel,
    cancel: CancelCheck | None,
    counter: FailureCounter,
    error: ProviderError,
) -> None:
    if len(batch) == 1:
        _failed(plan, batch[0], counter, error)
        return
    for i in batch:
        check(cancel)
        try:
            vectors = embedder.embed_checked([plan.input_of(i)])
        except ProviderError as e:
            if isinstance(e, PermanentProviderError) and not e.per_input:
                raise
            _failed(plan, i, counter, e)
        else:
            _store(plan, [i], vectors)
            counter.ok()


def _failed(plan: Plan, i: int, counter: FailureCounter, error: ProviderError) -> None:
    plan.failed[i] = str(error)
    plan.last_error = error
    counter.fail(plan.chunks[i].index, str(error), error)


def _store(plan: Plan, batch: Sequence[int], vectors: np.ndarray) -> None:
    for i, vector in zip(batch, vectors, strict=True):
        plan.vectors[i] = to_blob(vector)
