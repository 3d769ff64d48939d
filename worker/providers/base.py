"""The one interface every embedding model implements: `embed_batch(texts)`.

Like simonw/llm: a model implements one method; batching and validation live here, reuse and
writing live in the pipeline, so every provider gets them the same way.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from worker.errors import BadAnswer


@dataclass(frozen=True)
class Hooks:
    """What the caller gives a provider when it builds it, rather than patching a built one:
    how to wait before a retry (a wait that a cancellation can end), whether the run is
    cancelled (`cancelled()`: a call in flight then ends within a fraction of a second rather
    than at the provider's timeout) and where the time of each call goes (`observe(kind,
    seconds)`, kind `embedding` or `chat`: metrics)."""

    sleep: Callable[[float], None] = time.sleep
    observe: Callable[[str, float], None] | None = None
    cancelled: Callable[[], bool] | None = None


class EmbeddingModel(ABC):
    """An embedding model. Subclasses implement `embed_batch`; callers use `embed`."""

    #: the model's name, recorded with every vector (reuse is keyed on it)
    model_id: str = ""
    #: how many texts one call may carry
    batch_size: int = 64
    #: the dimension every vector must have (None: learn it from the first answer)
    dimensions: int | None = None
    #: the caller's waits and metrics (set by the constructor)
    hooks: Hooks = Hooks()

    @abstractmethod
    def embed_batch(self, texts: list[str]) -> Sequence[Sequence[float]] | np.ndarray:
        """Embed at most `batch_size` texts, in order."""

    def reads_whole(self, text: str) -> tuple[int, int] | None:
        """(tokens of `text`, tokens the model reads of a text), for a model that cuts what it
        is given past a limit a caller that embeds a text whole must check (a memory); None
        for one that does not say (the APIs read thousands of tokens)."""
        return None

    def batches(self, texts: Sequence[str]) -> Iterator[list[str]]:
        for i in range(0, len(texts), self.batch_size):
            yield list(texts[i : i + self.batch_size])

    def embed_checked(self, texts: list[str]) -> np.ndarray:
        """One batch, validated: the right count, the right dimension, finite values."""
        started = time.perf_counter()
        try:
            answer = self.embed_batch(texts)
        finally:
            if self.hooks.observe is not None:
                self.hooks.observe("embedding", time.perf_counter() - started)
        if isinstance(answer, list) and not all(map(_numbers_only, answer)):
            raise BadAnswer(
                f"{self.model_id}: a vector holds values that are not numbers", per_input=True
            )
        try:
            vectors = np.asarray(answer, dtype=np.float32)
        except (ValueError, TypeError):  # (numpy's message quotes the value: a key, 200 KB)
            raise BadAnswer(
                f"{self.model_id}: vectors of unequal length or not numbers", per_input=True
            ) from None
        except OverflowError:  # a JSON integer written out in 400 digits: no float holds it
            raise BadAnswer(
                f"{self.model_id}: the answer contains a number too large for a float",
                per_input=True,
            ) from None
        if vectors.ndim != 2 or vectors.shape[0] != len(texts):
            got = vectors.shape[0] if vectors.ndim >= 1 else 0
            raise BadAnswer(
                f"{self.model_id}: asked for {len(texts)} vectors, got {got}", per_input=True
            )
        if self.dimensions is not None and vectors.shape[1] != self.dimensions:
            raise BadAnswer(
                f"{self.model_id}: vectors have {vectors.shape[1]} dimensions, the index expects "
                f"{self.dimensions} (set KIDX_EMBEDDING__DIMENSIONS to the model's dimension, "
                "or switch back to the model the index was built with)"
            )
        if not np.isfinite(vectors).all():
            raise BadAnswer(
                f"{self.model_id}: the answer contains NaN or infinite values", per_input=True
            )
        if vectors.shape[1] == 0:
            raise BadAnswer(f"{self.model_id}: empty vectors")
        # A vector of zeros has no direction, and one whose squared length passes float32 has
        # none sqlite-vec can compute (it would sort every search by a NULL distance).
        with np.errstate(over="ignore", under="ignore"):
            lengths = np.einsum("ij,ij->i", vectors, vectors)
        if not (np.isfinite(lengths) & (lengths > 0)).all():
            raise BadAnswer(
                f"{self.model_id}: the answer contains a vector of zeros, or one too long to "
                "measure in float32",
                per_input=True,
            )
        return vectors

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """All texts, in batches, validated; an (n, d) float32 array."""
        if not texts:
            return np.zeros((0, self.dimensions or 0), dtype=np.float32)
        return np.concatenate([self.embed_checked(b) for b in self.batches(texts)])

    def close(self) -> None:  # noqa: B027 - optional hook, most models hold nothing
        """Release connections or models (optional)."""


def _numbers_only(vector: object) -> bool:
    """Whether a vector given as a list holds numbers only: numpy reads "0.5" and true as 0.5
    and 1.0, and a server's strings and booleans were stored as a vector."""
    if not isinstance(vector, list):
        return True  # an array (decoded base64, a local model's), or numpy's to refuse
    return all(
        issubclass(kind, int | float | np.number) and kind is not bool
        for kind in set(map(type, vector))
    )


def to_blob(vector: np.ndarray) -> bytes:
    """float32 little-endian, the layout sqlite-vec reads (float64 would be read as 2x dims)."""
    return np.asarray(vector, dtype="<f4").tobytes()


def from_blob(blob: bytes) -> np.ndarray:
    return np.frombuffer(blob, dtype="<f4")


def backoff_delay(attempt: int, base: float, cap: float, rand: float) -> float:
    """Exponential backoff with full jitter: uniform in [0, min(cap, base * 2**attempt)]."""
    return rand * min(cap, base * math.pow(2, attempt))
