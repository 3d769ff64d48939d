"""Any OpenAI-compatible `/v1/embeddings` (OpenAI, Ollama, vLLM, text-embeddings-inference,
LM Studio) over httpx; the retry policy is `worker.providers.http`'s."""

from __future__ import annotations

import base64
import binascii
import random
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np

from worker.errors import BadAnswer
from worker.log import KI_EMBED, get_logger
from worker.providers.base import EmbeddingModel, Hooks
from worker.providers.http import (  # noqa: F401 - re-exported for callers and tests
    MAX_ANSWER_BYTES,
    PER_INPUT,
    RETRYABLE,
    USER_AGENT,
    AnswerTooLarge,
    JSONClient,
    ProviderHTTPError,
    RetryLater,
    parse_retry_after,
)
from worker.settings import EmbeddingSettings

# What one vector can take as JSON, to bound an answer by what its request can need: a float
# is at most ~25 bytes ("-1.2345678901234567e-05,"), 32 leaves room for an indented answer;
# each item adds its envelope ({"object":"embedding","index":N,"embedding":[...]}), and the
# answer its own ("model", "usage", whatever a server adds). Measured by the JSON form even
# when base64 was asked for: some servers ignore `encoding_format` and send floats.
FLOAT_JSON_BYTES = 32
ITEM_JSON_BYTES = 512
ENVELOPE_BYTES = 1 << 20
MAX_DIMENSIONS = 16000  # KIDX_EMBEDDING__DIMENSIONS' own bound: for a model of unknown size


class OpenAIEmbeddings(EmbeddingModel):
    """Embeddings from an OpenAI-compatible server."""

    def __init__(
        self,
        settings: EmbeddingSettings,
        *,
        dimensions: int | None,
        hooks: Hooks | None = None,
        client: httpx.Client | None = None,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.settings = settings
        self.model_id = settings.model
        self.batch_size = settings.batch_size
        self.dimensions = dimensions
        self.hooks = hooks or Hooks()
        self.http = JSONClient(
            settings,
            model=settings.model,
            log_prefix=KI_EMBED,
            client=client,
            sleep=self.hooks.sleep,
            cancel=self.hooks.cancelled,
            rand=rand,
            # a batch of float vectors may be big (2048 x 16000 dimensions as JSON numbers)
            max_answer_bytes=max(MAX_ANSWER_BYTES, self.batch_size * (dimensions or 16000) * 24),
        )
        self._where = self.http.where
        # base64: a quarter of the bytes of a JSON list of floats, decoded without parsing
        # them (what the OpenAI SDKs ask for); a server that refuses it gets "float".
        self.encoding_format = settings.encoding_format

    def embed_batch(self, texts: list[str]) -> list[list[float] | np.ndarray]:
        body: dict[str, Any] = {"model": self.model_id, "input": texts}
        if self.encoding_format == "base64":
            body["encoding_format"] = "base64"
        if self.settings.sends_dimensions():
            body["dimensions"] = self.settings.dimensions
        cap = self.answer_cap(len(texts))
        try:
            # a batch that times out goes again in halves (worker.embedding), not whole again
            answer = self.http.post(
                "/embeddings", body, max_answer_bytes=cap, retry_timeouts=len(texts) == 1
            )
        except AnswerTooLarge as e:
            if e.limit != cap:  # the client's own bound, not this request's
                raise
            raise BadAnswer(
                f"{e}, what {len(texts)} vector(s) of {self._dims()} dimensions can take "
                "(is that the model's dimension? KIDX_EMBEDDING__DIMENSIONS)"
            ) from None
        except ProviderHTTPError as e:
            # A server that knows only floats: ask again, and from then on, as floats.
            if "encoding_format" not in body or not _refuses_base64(str(e)):
                raise
            self.encoding_format = "float"
            log.info(
                f"{KI_EMBED} the server refuses base64 vectors: asking for floats",
                provider=self._where,
            )
            return self.embed_batch(texts)
        return self._parse(answer, len(texts))

    def _dims(self) -> int:
        return self.dimensions or self.settings.model_dimensions() or MAX_DIMENSIONS

    def answer_cap(self, count: int) -> int:
        """The most bytes an answer of `count` vectors can need: parsed, a JSON float costs
        ~32 bytes of memory, so a cap of what was asked for, not the client's generic 64 MB,
        bounds the memory of an answer (760 MB for a 63 MB answer of "0.1,0.1,...")."""
        return ENVELOPE_BYTES + count * (ITEM_JSON_BYTES + self._dims() * FLOAT_JSON_BYTES)

    def _parse(self, answer: Any, count: int) -> list[list[float] | np.ndarray]:
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list):
            error = answer.get("error") if isinstance(answer, dict) else None
            if error:  # a gateway's upstream failure, sent as a 200: its words, and transient
                # (a permanent BadAnswer failed every item of a bulk run, those never sent too)
                said = (
                    (error.get("message") or error.get("code")) if isinstance(error, dict) else None
                )
                raise RetryLater(
                    f"{self._where}: the answer is an error: {self.http.shown(str(said or error))}"
                )
            raise BadAnswer(f"{self._where}: the answer has no 'data' list")
        by_index: dict[int, list[float] | np.ndarray] = {}
        for position, item in enumerate(data):
            vector = item.get("embedding") if isinstance(item, dict) else None
            if isinstance(vector, str):  # base64 of little-endian float32, as OpenAI sends it
                vector = _from_base64(vector, self._where, position)
            elif not isinstance(vector, list):
                raise BadAnswer(f"{self._where}: item {position} of 'data' has no embedding")
            index = item.get("index", position)
            if not isinstance(index, int) or isinstance(index, bool) or index in by_index:
                shown = self.http.shown(repr(index))  # a server's text: masked, cut
                raise BadAnswer(f"{self._where}: bad or repeated index {shown} in 'data'")
            by_index[index] = vector
        if len(by_index) != count:
            raise BadAnswer(
                f"{self._where}: asked for {count} vectors, got {len(by_index)}", per_input=True
            )
        if set(by_index) != set(range(count)):
            raise BadAnswer(
                f"{self._where}: the answer's indexes are not 0 to {count - 1}", per_input=True
            )
        return [by_index[i] for i in range(count)]

    @property
    def client(self) -> httpx.Client:
        return self.http.client

    def close(self) -> None:
        self.http.close()


log = get_logger("kidx.providers")


def _refuses_base64(message: str) -> bool:
    return "encoding_format" in message or "base64" in message


def _from_base64(value: str, where: str, position: int) -> np.ndarray:
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise BadAnswer(
            f"{where}: item {position} of 'data' is not base64", per_input=True
        ) from None
    if len(raw) % 4:
        raise BadAnswer(
            f"{where}: item {position} of 'data' is {len(raw)} bytes, not float32s", per_input=True
        )
    return np.frombuffer(raw, dtype="<f4")
