"""Any OpenAI-compatible `/v1/embeddings` (OpenAI, Ollama, vLLM, text-embeddings-inference,
LM Studio) over httpx; the retry policy is `worker.providers.http`'s."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import httpx

from worker.errors import BadAnswer
from worker.log import KI_EMBED
from worker.providers.base import EmbeddingModel
from worker.providers.http import (  # noqa: F401 - re-exported for callers and tests
    PER_INPUT,
    RETRYABLE,
    USER_AGENT,
    JSONClient,
    ProviderHTTPError,
    RetryLater,
    parse_retry_after,
)
from worker.settings import EmbeddingSettings


class OpenAIEmbeddings(EmbeddingModel):
    """Embeddings from an OpenAI-compatible server."""

    def __init__(
        self,
        settings: EmbeddingSettings,
        *,
        dimensions: int | None,
        client: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.settings = settings
        self.model_id = settings.model
        self.batch_size = settings.batch_size
        self.dimensions = dimensions
        self.http = JSONClient(
            settings, model=settings.model, log_prefix=KI_EMBED, client=client, sleep=sleep,
            rand=rand,
        )  # fmt: skip
        self._where = self.http.where

    @property
    def sleep(self) -> Callable[[float], None]:
        return self.http.sleep

    @sleep.setter
    def sleep(self, value: Callable[[float], None]) -> None:
        self.http.sleep = value

    def embed_batch(self, texts: list[str]) -> list[list[float]]:
        body: dict[str, Any] = {"model": self.model_id, "input": texts, "encoding_format": "float"}
        if self.settings.sends_dimensions():
            body["dimensions"] = self.settings.dimensions
        return self._parse(self.http.post("/embeddings", body), len(texts))

    def _parse(self, answer: Any, count: int) -> list[list[float]]:
        data = answer.get("data") if isinstance(answer, dict) else None
        if not isinstance(data, list):
            raise BadAnswer(f"{self._where}: the answer has no 'data' list")
        by_index: dict[int, list[float]] = {}
        for position, item in enumerate(data):
            if not isinstance(item, dict) or not isinstance(item.get("embedding"), list):
                raise BadAnswer(f"{self._where}: item {position} of 'data' has no embedding")
            index = item.get("index", position)
            if not isinstance(index, int) or isinstance(index, bool) or index in by_index:
                raise BadAnswer(f"{self._where}: bad or repeated index {index!r} in 'data'")
            by_index[index] = item["embedding"]
        if len(by_index) != count or set(by_index) != set(range(count)):
            raise BadAnswer(
                f"{self._where}: asked for {count} vectors, got {len(by_index)}", per_input=True
            )
        return [by_index[i] for i in range(count)]

    @property
    def client(self) -> httpx.Client:
        return self.http.client

    def close(self) -> None:
        self.http.close()
