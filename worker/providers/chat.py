"""An OpenAI-compatible `/v1/chat/completions` that answers in JSON, for LLM chunking.

Structured output first (`response_format: json_schema`); a server that refuses the schema
(many local servers) is asked again with `json_object`, and one that refuses `temperature: 0`
(reasoning models take their default only) without it; each remembered. A refusal, an answer
cut off by the length limit, or content that is not JSON raise `BadAnswer`; HTTP failures follow
the shared retry policy (`worker.providers.http`).

A model that does not answer is remembered: each item would otherwise pay (retries + 1) x the
timeout before falling back to structure, three minutes an item with the defaults, hours for a
bulk run. After `KIDX_CHUNK__DOWN_AFTER` calls in a row (3) failed transiently (timeouts,
connection errors, 5xx, 429, after their retries) the model is taken for down for
`KIDX_CHUNK__COOL_DOWN` seconds (300): calls raise
`ChatDown` at once, naming the last failure; then one call tries it again. Any answer from the
server (a 400 or an unusable answer included) shows it is up. The state is this process's own.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable
from typing import Any

import httpx

from worker.embedding import Streak
from worker.errors import BadAnswer, OutOfTime, ProviderDown, TransientProviderError
from worker.log import CHUNK
from worker.providers.base import Hooks
from worker.providers.http import JSONClient, ProviderHTTPError
from worker.settings import ChunkSettings

ANSWER_BYTES_PER_WINDOW_CHAR = 128
MIN_ANSWER_BYTES = 1024 * 1024


def max_answer_bytes(window: int) -> int:
    """The largest chat answer read for windows of `window` characters (1 MB at the default
    6,000). A real answer is a few KB; this leaves room for one chunk, with a full summary, per
    short paragraph. The shared 64 MB cap let one answer cost hundreds of MB of memory; over
    this one the answer is `BadAnswer` (asked once more, then structure)."""
    return max(MIN_ANSWER_BYTES, ANSWER_BYTES_PER_WINDOW_CHAR * window)


_THINKING = re.compile(r"\s*<think>.*?</think>", re.DOTALL)
# One blank run before the newline, not one on each side of an optional `json`: those split a
# run of blanks in as many ways as it is long, and "```" and a million spaces took hours.
_FENCED = re.compile(r"\s*```[ \t]*(?:json[ \t]*)?\r?\n(.*)\n[ \t]*```\s*", re.DOTALL | re.I)


def _unwrapped(content: str) -> str:
    """The answer without the model's reasoning before it (<think>...</think>) and the code
    fence around it (```json ... ```), which a server that does not enforce the format lets
    many models write: without them every answer was "not JSON", and LLM chunking never ran.
    Nothing else is taken out: prose around the JSON stays not JSON."""
    if (m := _THINKING.match(content)) is not None:
        content = content[m.end() :]
    if (m := _FENCED.fullmatch(content)) is not None:
        content = m[1]
    return content


class Refused(BadAnswer):
    """The model declined to answer."""


class ChatDown(ProviderDown):
    """The chunk model failed transiently too often in a row: not asked until the cool-down
    ends (the caller falls back to structure at once)."""


class ChatModel:
    """One chat model; `complete_json` returns the parsed JSON object it answered."""

    def __init__(
        self,
        settings: ChunkSettings,
        *,
        hooks: Hooks | None = None,
        client: httpx.Client | None = None,
        rand: Callable[[], float] = random.random,
        clock: Callable[[], float] = time.monotonic,
        streak: Streak | None = None,
    ) -> None:
        self.model_id = settings.model
        self.hooks = hooks or Hooks()
        self.http = JSONClient(
            settings,
            model=settings.model,
            log_prefix=CHUNK,
            client=client,
            sleep=self.hooks.sleep,
            cancel=self.hooks.cancelled,
            rand=rand,
            max_answer_bytes=max_answer_bytes(settings.window),
        )
        self.schema_supported = True
        self.temperature_supported = True
        self.clock = clock
        self.down_after, self.cool_down = settings.down_after, settings.cool_down
        # Calls in a row that failed transiently, and the last cause: this process's, or one
        # its caller shares between processes (tasks/streak.py).
        self.streak = streak or Streak()
        self.down_until = 0.0  # a `clock` time; 0: not taken for down

    def complete_json(
        self,
        messages: list[dict[str, str]],
        *,
        schema: dict[str, Any],
        name: str,
        until: float | None = None,
    ) -> Any:
        """The JSON object the model answered (its time reported to the hooks); `ChatDown`
        without a request while the model is taken for down; `OutOfTime` at `until` (a
        `time.monotonic()` instant; the call in flight is cut), counted as a failed call when
        the model had the request and did not answer."""
        failed, last = self.streak.current()
        if failed < self.down_after:
            self.down_until = 0.0
        elif self.down_until == 0.0:  # taken for down elsewhere (a shared streak): here too,
            # for what is left of the cool-down after the last failed call (a probe the
            # reconcile sweep sends must not wait a whole cool-down of its own)
            since = self.streak.since_failure() or 0.0
            self.down_until = self.clock() + max(0.0, self.cool_down - since)
        if failed >= self.down_after and self.clock() < self.down_until:
            left = self.down_until - self.clock()
            raise ChatDown(
                f"{self.http.where}: taken for down for {left:.0f}s more after "
                f"{failed} failed calls in a row, last: {last}"
            )
        started = time.perf_counter()
        try:
            answer = self._complete_json(messages, schema=schema, name=name, until=until)
        except (TransientProviderError, OutOfTime) as e:
            # a call the deadline cut unanswered counts as failed: a model that never answers
            # within it is taken for down, not waited for at every item
            counts = not isinstance(e, OutOfTime) or e.unanswered
            if counts and self.streak.failed(str(e)) >= self.down_after:
                self.down_until = self.clock() + self.cool_down
            raise
        except (BadAnswer, ProviderHTTPError):
            self.streak.ok()  # it answered (a refusal too): up, whatever it was worth
            raise
        else:
            self.streak.ok()
            return answer
        finally:
            if self.hooks.observe is not None:
                self.hooks.observe("chat", time.perf_counter() - started)

    def _complete_json(
        self,
        messages: list[dict[str, str]],
        *,
        schema: dict[str, Any],
        name: str,
        until: float | None,
    ) -> Any:
        """Asked with `temperature: 0` and the schema while the server takes them; a 400 or 422
        that refuses one (its own message says which: not the model's name or URL) is asked
        again without it, which is remembered. Each is left out once at most."""
        while True:
            body: dict[str, Any] = {"model": self.model_id, "messages": messages}
            if self.temperature_supported:
                body["temperature"] = 0
            if self.schema_supported:
                body["response_format"] = {
                    "type": "json_schema",
                    "json_schema": {"name": name, "strict": True, "schema": schema},
                }
            else:
                body["response_format"] = {"type": "json_object"}
            try:
                return self._content(self.http.post("/chat/completions", body, until=until))
            except ProviderHTTPError as e:
                said = str(e).removeprefix(self.http.where)
                if e.status not in (400, 422):
                    raise
                if self.temperature_supported and "temperature" in said:
                    self.temperature_supported = False  # a reasoning model: its default only
                elif self.schema_supported and ("response_format" in said or "schema" in said):
                    self.schema_supported = False  # this server wants json_object
                else:
                    raise

    def _content(self, answer: Any) -> Any:
        where = self.http.where
        error = answer.get("error") if isinstance(answer, dict) else None
        if error and not answer.get("choices"):  # a gateway's upstream failure, sent as a 200
            said = (error.get("message") or error.get("code")) if isinstance(error, dict) else None
            raise BadAnswer(
                f"{where}: the answer is an error: {self.http.shown(str(said or error))}"
            )
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
            return json.loads(_unwrapped(content))
        except json.JSONDecodeError as e:
            raise BadAnswer(f"{where}: the answer is not JSON ({e.msg} at {e.pos})") from None
        except ValueError as e:  # a number past Python's digit limit, a lone surrogate, ...
            raise BadAnswer(f"{where}: the answer is not usable JSON ({str(e)[:100]})") from None
        except RecursionError:
            raise BadAnswer(f"{where}: the answer's JSON nests too deeply") from None

    def taken_for_down(self) -> bool:
        """Whether the last `down_after` calls (of any process sharing the streak) failed."""
        return self.streak.current()[0] >= self.down_after

    def close(self) -> None:
        self.http.close()
