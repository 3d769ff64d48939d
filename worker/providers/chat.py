"""An OpenAI-compatible `/v1/chat/completions` that answers in JSON, for LLM chunking.

Structured output first (`response_format: json_schema`); a server that refuses the schema
(many local servers) is asked again with `json_object`, and remembered. A refusal, an answer
cut off by the length limit, or content that is not JSON raise `BadAnswer`; HTTP failures follow
the shared retry policy (`worker.providers.http`).
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from typing import Any

import httpx

from worker.errors import BadAnswer
from worker.log import CHUNK
from worker.providers.base import Hooks
from worker.providers.http import JSONClient, ProviderHTTPError
from worker.settings import ChunkSettings


class Refused(BadAnswer):
    """The model declined to answer."""


class ChatModel:
    """One chat model; `complete_json` returns the parsed JSON object it answered."""

    def __init__(
        self,
        settings: ChunkSettings,
        *,
        hooks: Hooks | None = None,
        client: httpx.Client | None = None,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.model_id = settings.model
        self.hooks = hooks or Hooks()
        self.http = JSONClient(
            settings,
            model=settings.model,
            log_prefix=CHUNK,
            client=client,
            sleep=self.hooks.sleep,
            rand=rand,
        )
        self.schema_supported = True

    def complete_json(
        self, messages: list[dict[str, str]], *, schema: dict[str, Any], name: str
    ) -> Any:
        """The JSON object the model answered (its time reported to the hooks)."""
        started = time.perf_counter()
        try:
            return self._complete_json(messages, schema=schema, name=name)
        finally:
            if self.hooks.observe is not None:
                self.hooks.observe("chat", time.perf_counter() - started)

    def _complete_json(
        self, messages: list[dict[str, str]], *, schema: dict[str, Any], name: str
    ) -> Any:
        body: dict[str, Any] = {"model": self.model_id, "messages": messages, "temperature": 0}
        if self.schema_supported:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": name, "strict": True, "schema": schema},
            }
            try:
                return self._content(self.http.post("/chat/completions", body))
            except ProviderHTTPError as e:
                about_format = "response_format" in str(e) or "schema" in str(e)
                if e.status not in (400, 422) or not about_format:
                    raise
                self.schema_supported = False  # this server wants json_object: ask again
        body["response_format"] = {"type": "json_object"}
        return self._content(self.http.post("/chat/completions", body))

    def _content(self, answer: Any) -> Any:
        where = self.http.where
        try:
            choice = answer["choices"][0]
            message = choice["message"]
        except (KeyError, IndexError, TypeError):
            raise BadAnswer(f"{where}: the answer has no choices[0].message") from None
        if not isinstance(choice, dict) or not isinstance(message, dict):
            raise BadAnswer(f"{where}: choices[0].message in the answer is not an object")
        if message.get("refusal"):
            refusal = self.http.shown(str(message["refusal"]))  # the key masked, then cut
            raise Refused(f"{where}: the model refused: {refusal}")
        if choice.get("finish_reason") == "length":
            raise BadAnswer(f"{where}: the answer was cut off by the length limit")
        content = message.get("content")
        if not isinstance(content, str) or not content.strip():
            raise BadAnswer(f"{where}: the answer is empty")
        try:
            return json.loads(content)
        except json.JSONDecodeError as e:
            raise BadAnswer(f"{where}: the answer is not JSON ({e.msg} at {e.pos})") from None
        except ValueError as e:  # a number past Python's digit limit, a lone surrogate, ...
            raise BadAnswer(f"{where}: the answer is not usable JSON ({str(e)[:100]})") from None
        except RecursionError:
            raise BadAnswer(f"{where}: the answer's JSON nests too deeply") from None

    def close(self) -> None:
        self.http.close()
