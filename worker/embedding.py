"""Embedding what is not reused, shared by every kind of item: batches, a failing batch retried
text by text (one bad input costs one vector, not the batch), and two failure counts, each of
which aborts at three in a row (with the cause and whether a retry may help): failed vectors
(an input the provider refuses), counted for each item (`Plan`) on its own, so that one bad
document aborts itself and never the items whose texts shared its requests; and failed
provider requests, a `Streak` that the runs of a batch share (tasks/ keeps it in Redis), so
that a dead provider stops the whole batch after three requests, not three a run."""

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
    TimedOut,
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
    # stored vectors whose vec row could not be written, and why (the indexer's write)
    unmirrored: dict[int, str] = field(default_factory=dict)
    last_error: ProviderError | None = None
    item_id: int | None = None  # named in the failure log lines of a batch spanning items
    waiting: int = 0  # texts queued or in flight (EmbedQueue, on the caller's thread)
    in_a_row: int = 0  # its vectors that failed in a row (the embedding thread's)
    aborted: IndexAborted | None = None  # N failed in a row: its other texts are not sent
    # a request that carried its texts brought back others' vectors (EmbedQueue): what of
    # its own failed was refused for itself, the provider works
    beside_embedded: bool = False

    def done(self) -> bool:
        """Whether every chunk has its vector or its failure."""
        return len(self.vectors) + len(self.failed) >= len(self.chunks)

    def first_failure(self) -> str | None:
        """Why the first vector that failed did: its embedding, else its vec write."""
        return next(iter(self.failed.values()), None) or next(iter(self.unmirrored.values()), None)


class Streak:
    """Consecutive failed provider requests and the last one's cause. This one is a run's own
    (the chat model keeps one too); a batch's runs share one that keeps the same three methods
    elsewhere (tasks/streak.py)."""

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

    def since_failure(self) -> float | None:
        """Seconds since the last failed request was counted, when a shared count knows (None:
        the caller's own clock is all there is)."""
        return None


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


def too_many(limit: int, cause: str, error: Exception | None) -> IndexAborted:
    """The abort of `limit` vectors failed in a row; transient when the last one was."""
    return IndexAborted(
        f"{limit} consecutive vector failures, last: {cause}",
        transient=isinstance(error, TransientProviderError),
        retry_after=getattr(error, "retry_after", None),
    )


def _log_failed(log_: Any, chunk_index: int, cause: str, item_id: int | None) -> None:
    where = {"chunk_index": chunk_index} | ({"item_id": item_id} if item_id is not None else {})
    log_.warning(f"{KI_EMBED} vector failed", **where, reason=cause)


class FailureCounter:
    """Counts the vector failures of one thing, the third in a row aborting it: an item's vec
    writes (worker.indexers.prose), a memory run's refused texts. An embedding run of items
    counts each item's apart (`PlanFailures`)."""

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
        _log_failed(self.log, chunk_index, cause, item_id)
        if self.in_a_row >= self.limit:
            raise too_many(self.limit, cause, error)


class PlanFailures:
    """Vector failures counted for each plan on its own: the Nth in a row of one plan aborts
    that plan (`Plan.aborted`; its texts not yet sent are dropped), not the requests' other
    plans. A run of many items shares its requests: one count for all made a bad document
    abort every item not yet written, in every run it was part of. Used on the embedding
    thread only."""

    def __init__(self, limit: int, log_: Any) -> None:
        self.limit, self.log = limit, log_

    def ok(self, plan: Plan) -> None:
        plan.in_a_row = 0

    def fail(self, plan: Plan, i: int, error: ProviderError) -> None:
        plan.failed[i] = str(error)
        plan.last_error = error
        plan.in_a_row += 1
        _log_failed(self.log, plan.chunks[i].index, str(error), plan.item_id)
        if plan.in_a_row >= self.limit and plan.aborted is None:
            plan.aborted = too_many(self.limit, str(error), error)


def check(cancel: CancelCheck | None) -> None:
    if cancel is not None and cancel():
        raise Cancelled("cancelled")


class EmbedQueue:
    """The texts of several plans, embedded in full batches with one request in flight on a
    background thread, so that the caller chunks and writes other items meanwhile (a process
    that did both in turn would leave the provider idle while it works, and wait on it
    otherwise). A plan is only read by the caller: its `waiting` count is kept here, on the
    caller's thread, and it is ready once every text it queued has come back, as a vector or a
    failure, or was dropped (the plan aborted). One request at a time keeps each plan's failure
    count in order (three in a row abort that plan). `cancel` is called from that thread too:
    it must be thread-safe (CancelToken is)."""

    def __init__(
        self,
        embedder: EmbeddingModel,
        cancel: CancelCheck | None,
        failures: PlanFailures,
        requests: Requests | None = None,
    ) -> None:
        self.embedder, self.cancel, self.failures = embedder, cancel, failures
        self.requests = requests or Requests(failures.limit)
        self.todo: deque[tuple[Plan, int]] = deque()
        self.embedded = 0  # texts that came back as a vector
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
        self.wait()  # first: a plan that request aborted has no text in the next
        if not self.todo:
            return
        self.requests.before()  # the batch's provider is down: nothing more is sent
        batch = [self.todo.popleft() for _ in range(min(self.embedder.batch_size, len(self.todo)))]
        future = self._pool.submit(
            embed_batch, batch, self.embedder, self.cancel, self.failures, self.requests
        )
        self._inflight = (future, batch)

    def wait(self) -> None:
        """Wait for the request in flight, if any; its plans' texts are then back, and the
        queued texts of a plan it aborted are dropped."""
        if self._inflight is None:
            return
        future, batch = self._inflight
        self._inflight = None
        future.result()
        embedded = any(i in p.vectors for p, i in batch)
        for p, i in batch:
            p.waiting -= 1
            self.embedded += i in p.vectors
            p.beside_embedded |= embedded
        if any(p.aborted is not None for p, _ in batch):
            kept: deque[tuple[Plan, int]] = deque()
            for p, i in self.todo:
                if p.aborted is None:
                    kept.append((p, i))
                else:
                    p.waiting -= 1
            self.todo = kept

    def close(self) -> None:
        """Stop sending; a request still in flight ends on its own (nobody reads its plans)."""
        self._inflight = None
        self._pool.shutdown(wait=False, cancel_futures=True)


def embed_batch(
    batch: Sequence[tuple[Plan, int]],
    embedder: EmbeddingModel,
    cancel: CancelCheck | None,
    failures: PlanFailures,
    requests: Requests,
) -> int:
    """One request of up to the batch size; a failing batch is retried text by text (in
    halves when refused as too large), so that one bad input costs one vector, not the batch.
    A plan whose vectors fail N times in a row is aborted (`Plan.aborted`), the others go on.
    Raises IndexAborted (N failed requests in a row) and PermanentProviderError (refused as a
    whole). The most texts a request of the batch took, when each got its vector so; else 0."""
    check(cancel)
    try:
        vectors = embedder.embed_checked([p.input_of(i) for p, i in batch])
    except ProviderError as e:
        requests.failed(e)
        if isinstance(e, PermanentProviderError) and not e.per_input:
            raise
        if too_much(e) and len(batch) > 1:
            return _halves(batch, embedder, cancel, failures, requests)
        _one_by_one(batch, embedder, cancel, failures, requests, e)
        return 0
    for (p, i), vector in zip(batch, vectors, strict=True):
        p.vectors[i] = to_blob(vector)
        failures.ok(p)
    requests.ok()
    return len(batch)


def too_much(error: Exception) -> bool:
    """Whether a request failed for what it carried, worth sending again in halves: too large
    for the provider (413), or more than it embeds within the timeout (a CPU server's large
    model: a full batch sent whole again timed out at every attempt)."""
    return getattr(error, "status", None) == 413 or isinstance(error, TimedOut)


def _halves(
    batch: Sequence[tuple[Plan, int]],
    embedder: EmbeddingModel,
    cancel: CancelCheck | None,
    failures: PlanFailures,
    requests: Requests,
) -> int:
    """A batch the provider refused as too large (413) or did not answer in time, sent in two
    halves, each halved again while so: a server whose limit is under the batch size
    (text-embeddings-inference takes 32) cost a refused request and a request a text, for
    every batch. A full batch whose every text then went in requests of at most n makes n the
    batch size of the process (said in the log); inputs refused alone end at themselves, and
    their plans abort as text by text (no part of an aborted plan is sent). As `embed_batch`,
    what went whole."""
    half = (len(batch) + 1) // 2
    took = []
    for part in (batch[:half], batch[half:]):
        part = [(p, i) for p, i in part if p.aborted is None]
        if not part:
            took.append(0)
            continue
        check(cancel)
        requests.before()  # the batch's provider is down: nothing more is sent
        took.append(embed_batch(part, embedder, cancel, failures, requests))
    most = max(took) if all(took) else 0
    learn_batch_size(embedder, len(batch), most, failures.log)
    return most


def learn_batch_size(embedder: EmbeddingModel, refused: int, most: int, log: Any) -> None:
    """A batch of `refused` texts refused as too large (or not answered in time), whose every
    text then went in requests of at most `most` (0: some did not): if the batch was full,
    `most` is the process's batch size from now on, said in the log, rather than a refused
    request before every batch (a last, short batch says less of the limit)."""
    if most and most < embedder.batch_size <= refused:
        log.warning(
            f"{KI_EMBED} the provider refused {refused} texts in one request as too large, or "
            f"did not answer them in time; {most} a request from now on (set "
            "KIDX_EMBEDDING__BATCH_SIZE to what it takes)",
            batch_size=most,
        )
        embedder.batch_size = most


def abort_of(p: Plan) -> IndexAborted | None:
    """Why a plan must not be written: N of its vectors failed in a row, or it would be
    written without a single vector (none reused, not one embedded). Otherwise its failed
    chunks are written without a vector and the item is `partial`: an edit whose one new
    chunk is refused keeps the rest, as the same text indexed anew would."""
    if p.aborted is not None:
        return p.aborted
    if not p.failed or p.vectors:
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
    failures: PlanFailures,
    requests: Requests,
    error: ProviderError,
) -> None:
    if len(batch) == 1:
        failures.fail(*batch[0], error)
        return
    for p, i in batch:
        if p.aborted is not None:
            continue  # aborted earlier in this batch: its other texts are not sent
        check(cancel)
        requests.before()
        try:
            vectors = embedder.embed_checked([p.input_of(i)])
        except ProviderError as e:
            requests.failed(e)
            if isinstance(e, PermanentProviderError) and not e.per_input:
                raise
            failures.fail(p, i, e)
        else:
            p.vectors[i] = to_blob(vectors[0])
            requests.ok()
            failures.ok(p)
