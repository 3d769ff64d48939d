"""Embedding what is not reused, shared by every kind of item: batches, a failing batch retried
text by text (one bad input costs one vector, not the batch), and two failure counts, each of
which aborts the run at three in a row (with the cause and whether a retry may help): failed
vectors (an input the provider refuses, a vec write), and failed provider requests, a
`Streak` that the runs of a batch share (tasks/ keeps it in Redis), so that a dead provider
stops the whole batch after three requests, not three a run."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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
    waiting: int = 0  # texts queued or in flight (EmbedQueue, on the caller's thread)

    def done(self) -> bool:
        """Whether every chunk has its vector or its failure."""
        return len(self.vectors) + len(self.failed) >= len(self.chunks)


class Streak:
    """Consecutive failed provider requests and the last one's cause. This one is a run's own;
    a batch's runs share one that keeps the same three methods elsewhere (tasks/streak.py)."""

    def __init__(self) -> None:
        self.n, self.cause = 0, ""

    def current(self) -> tuple[int, str]:
        return self.n, self.cause

    def failed(self, cause: str) -> int:
        """Count a failed request; the count now."""
        self.n, self.cause = self.n + 1, cause
        return self.n

    def ok(self) -> None:
        self.n = 0


class Requests:
    """The provider-request count of a run: a request that failed as a whole (not one input
    refused) counts, a request that succeeded resets it; at the limit the run is aborted, and
    no request goes once the shared count is there (another run of the batch reached it)."""

    def __init__(self, limit: int, streak: Streak | None = None) -> None:
        self.limit = limit
        self.streak = streak or Streak()

    def _abort(self, cause: str, error: Exception | None = None) -> IndexAborted:
        return IndexAborted(
            f"{self.limit} consecutive failures of the provider's requests, last: {cause}",
            transient=error is None or isinstance(error, TransientProviderError),
            retry_after=getattr(error, "retry_after", None),
            provider_down=True,
        )

    def before(self) -> None:
        n, cause = self.streak.current()
        if n >= self.limit:
            raise self._abort(cause)

    def ok(self) -> None:
        self.streak.ok()

    def failed(self, error: ProviderError) -> None:
        if isinstance(error, PermanentProviderError) and error.per_input:
            return  # one input refused: the vector count has it
        if self.streak.failed(str(error)) >= self.limit:
            raise self._abort(str(error), error)


class FailureCounter:
    """Counts vector failures; the third in a row aborts the run."""

    def __init__(self, limit: int, log_: object) -> None:
        self.limit = limit
        self.in_a_row = 0
        self.log = log_

    def ok(self) -> None:
        self.in_a_row = 0

    def fail(
        self,
        chunk_index: int,
        cause: str,
        error: Exception | None = None,
        *,
        item_id: int | None = None,
    ) -> None:
        self.in_a_row += 1
        where = {"chunk_index": chunk_index} | ({"item_id": item_id} if item_id is not None else {})
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


class EmbedQueue:
    """The texts of several plans, embedded in full batches with one request in flight on a
    background thread, so that the caller chunks and writes other items meanwhile (a process
    that did both in turn would leave the provider idle while it works, and wait on it
    otherwise). A plan is only read by the caller: its `waiting` count is kept here, on the
    caller's thread, and it is ready once every text it queued has come back, as a vector or a
    failure. One request at a time keeps the failure count in order (three in a row abort).
    `cancel` is called from that thread too: it must be thread-safe (CancelToken is)."""

    def __init__(
        self,
        embedder: EmbeddingModel,
        cancel: CancelCheck | None,
        counter: FailureCounter,
        requests: Requests | None = None,
    ) -> None:
        self.embedder, self.cancel, self.counter = embedder, cancel, counter
        self.requests = requests or Requests(counter.limit)
        self.todo: deque[tuple[Plan, int]] = deque()
        self._inflight: tuple[Future[None], list[tuple[Plan, int]]] | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kidx-embed")

    def add(self, plan: Plan) -> None:
        missing = [(plan, i) for i in range(len(plan.chunks)) if i not in plan.reuse]
        plan.waiting += len(missing)
        self.todo.extend(missing)

    def full(self) -> bool:
        """Whether a full batch is queued."""
        return len(self.todo) >= self.embedder.batch_size

    def send(self) -> None:
        """Send the next batch (up to the batch size), once the request in flight is back.
        Raises what a request raised (IndexAborted, PermanentProviderError) and Cancelled."""
        check(self.cancel)
        batch = [self.todo.popleft() for _ in range(min(self.embedder.batch_size, len(self.todo)))]
        self.wait()
        self.requests.before()  # the batch's provider is down: nothing more is sent
        future = self._pool.submit(
            embed_batch, batch, self.embedder, self.cancel, self.counter, self.requests
        )
        self._inflight = (future, batch)

    def wait(self) -> None:
        """Wait for the request in flight, if any; its plans' texts are then back."""
        if self._inflight is None:
            return
        future, batch = self._inflight
        self._inflight = None
        future.result()
        for p, _ in batch:
            p.waiting -= 1

    def close(self) -> None:
        """Stop sending; a request still in flight ends on its own (nobody reads its plans)."""
        self._inflight = None
        self._pool.shutdown(wait=False, cancel_futures=True)


def embed_batch(
    batch: Sequence[tuple[Plan, int]],
    embedder: EmbeddingModel,
    cancel: CancelCheck | None,
    counter: FailureCounter,
    requests: Requests,
) -> None:
    """One request of up to the batch size; a failing batch is retried text by text, so that
    one bad input costs one vector, not the batch. Raises IndexAborted (N failed vectors or
    requests in a row) and PermanentProviderError (refused as a whole)."""
    check(cancel)
    try:
        vectors = embedder.embed_checked([p.input_of(i) for p, i in batch])
    except ProviderError as e:
        requests.failed(e)
        if isinstance(e, PermanentProviderError) and not e.per_input:
            raise
        _one_by_one(batch, embedder, cancel, counter, requests, e)
    else:
        for (p, i), vector in zip(batch, vectors, strict=True):
            p.vectors[i] = to_blob(vector)
        requests.ok()
        counter.ok()


def none_embedded(p: Plan) -> IndexAborted | None:
    """Why a plan must not be written: texts were to be embedded and not one came back."""
    if not p.failed or len(p.failed) != len(p.chunks) - len(p.reuse):
        return None
    return IndexAborted(
        f"no chunk could be embedded: {next(iter(p.failed.values()))}",
        transient=isinstance(p.last_error, TransientProviderError),
        retry_after=getattr(p.last_error, "retry_after", None),
    )


def _one_by_one(
    batch: Sequence[tuple[Plan, int]],
    embedder: EmbeddingModel,
    cancel: CancelCheck | None,
    counter: FailureCounter,
    requests: Requests,
    error: ProviderError,
) -> None:
    if len(batch) == 1:
        _failed(*batch[0], counter, error)
        return
    for p, i in batch:
        check(cancel)
        requests.before()
        try:
            vectors = embedder.embed_checked([p.input_of(i)])
        except ProviderError as e:
            requests.failed(e)
            if isinstance(e, PermanentProviderError) and not e.per_input:
                raise
            _failed(p, i, counter, e)
        else:
            p.vectors[i] = to_blob(vectors[0])
            requests.ok()
            counter.ok()


def _failed(plan: Plan, i: int, counter: FailureCounter, error: ProviderError) -> None:
    plan.failed[i] = str(error)
    plan.last_error = error
    counter.fail(plan.chunks[i].index, str(error), error, item_id=plan.item_id)
