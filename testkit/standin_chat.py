"""The chat-completions half of the stand-in: ``POST /v1/chat/completions`` for LLM chunking.

kidx's LLM chunker sends numbered units (``[[1]] text``) in the last user message and expects
JSON chunk boundaries back. A real model is slow, costs money and answers differently each time,
so tests get this instead: a deterministic automatic model that groups units by size, a scripted
queue for exact answers (including broken ones), and switches for the faults a provider produces.

This module knows nothing of HTTP serving; ``testkit.standin.StandIn`` owns one ``ChatScript`` as
``standin.chat`` and hands it each request body.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_TARGET = 900
DEFAULT_MAX_CHARS = 1500
SUMMARY_CHARS = 80
SCHEMA_REJECTED = "response_format json_schema is not supported by this server"


@dataclass
class ChatReply:
    """A fully controlled scripted answer.

    ``status`` >= 400 answers an OpenAI-style error whose message is ``content`` (or a default);
    otherwise a completion carrying ``content``, ``refusal`` and ``finish_reason``. ``delay`` is
    slept (waking on stop) before answering.
    """

    content: str | None = None
    status: int = 200
    delay: float = 0.0
    refusal: str | None = None
    finish_reason: str = "stop"


ScriptItem = str | dict[str, Any] | list[Any] | ChatReply | Callable[[list[str]], object]


@dataclass
class ChatAnswer:
    """What the HTTP layer sends: status, a JSON body and extra headers."""

    status: int
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)


# -- parsing ---------------------------------------------------------------------------------


def _text_of(content: object) -> str:
    """A message's text: a plain string, or the text parts of a content-part list."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


_MARKER = re.compile(r"^\[\[(\d+)\]\](?: |$)", re.MULTILINE)


def parse_units(text: str) -> list[str]:
    """The unit texts of a user message, in order; unit ``k`` is the text after ``[[k]] ``.

    Only a marker carrying the next expected id starts a unit, so a line in a unit's text that
    happens to look like ``[[9]] ...`` stays text. One trailing newline is dropped per unit.
    """
    starts: list[tuple[int, int]] = []  # (marker start, text start)
    for match in _MARKER.finditer(text):
        if int(match.group(1)) == len(starts) + 1:
            starts.append((match.start(), match.end()))
    units = []
    for k, (_, begin) in enumerate(starts):
        end = starts[k + 1][0] if k + 1 < len(starts) else len(text)
        unit = text[begin:end]
        units.append(unit[:-1] if unit.endswith("\n") else unit)
    return units


def units_of(messages: list[Any]) -> list[str]:
    """The units of the last user message (none if there is no user message)."""
    for message in reversed(messages):
        if isinstance(message, dict) and message.get("role") == "user":
            return parse_units(_text_of(message.get("content")))
    return []


def automatic_chunks(
    units: list[str], target: int = DEFAULT_TARGET, max_chars: int = DEFAULT_MAX_CHARS
) -> dict[str, Any]:
    """Greedy size-based chunk boundaries covering units 1..n, as a plausible model would give.

    A chunk closes once it holds ``target`` characters, or before a unit that would take it past
    ``max_chars``; a single unit longer than ``max_chars`` is a chunk on its own.
    """
    ranges: list[tuple[int, int]] = []
    start, size = 1, 0
    for number, unit in enumerate(units, 1):
        if number > start and (size >= target or size + len(unit) > max_chars):
            ranges.append((start, number - 1))
            start, size = number, 0
        size += len(unit)
    if units:
        ranges.append((start, len(units)))
    return {
        "chunks": [
            {"start": s, "end": e, "summary": " ".join(units[s - 1].split())[:SUMMARY_CHARS]}
            for s, e in ranges
        ]
    }


# -- replies ---------------------------------------------------------------------------------


def _token_count(text: str) -> int:
    """A rough token count (4 UTF-8 bytes a token), only so that "usage" looks plausible."""
    return (len(text.encode("utf-8", "surrogatepass")) + 3) // 4


def _json_answer(status: int, payload: object, headers: dict[str, str] | None = None) -> ChatAnswer:
    body = json.dumps(payload, separators=(",", ":")).encode("utf-8")
    return ChatAnswer(status, body, headers or {})


def error_answer(
    status: int, message: str, *, code: str | None = None, headers: dict[str, str] | None = None
) -> ChatAnswer:
    """An OpenAI-style error body, with the same (type, code) defaults as the embeddings side."""
    if status == 429:
        kind, default_code = "requests", "rate_limit_exceeded"
    elif status == 401:
        kind, default_code = "invalid_request_error", "invalid_api_key"
    elif status >= 500:
        kind, default_code = "server_error", None
    else:
        kind, default_code = "invalid_request_error", None
    error = {"message": message, "type": code or kind, "param": None, "code": code or default_code}
    return _json_answer(status, {"error": error}, headers)


def _retry_after_value(value: float | str) -> str:
    if isinstance(value, str):
        return value
    number = float(value)
    return str(int(number)) if number.is_integer() else repr(number)


_NO_ITEM = object()


class ChatScript:
    """Answers chat completions: switches, then a scripted queue, then the automatic model.

    Per request, after counting (``requests``, ``bodies``, ``headers``, ``units``): sleep
    ``delay``; ``fail_status`` (consuming ``fail_times``, with ``retry_after`` and
    ``error_code``); reject a malformed request (400); ``reject_json_schema``; ``refusal``; pop
    ``script[0]``; otherwise ``automatic_chunks`` with ``target`` and ``max_chars``.
    """

    # switches
    delay: float
    fail_status: int | None
    fail_times: int | None
    error_code: str | None
    retry_after: float | str | None
    reject_json_schema: bool
    refusal: str | None
    target: int
    max_chars: int
    script: list[ScriptItem]
    # counters
    requests: int
    bodies: list[dict[str, Any]]
    headers: list[dict[str, str]]
    units: list[str]

    def __init__(self, stopping: threading.Event | None = None) -> None:
        # The StandIn's stop event, so a delayed answer is abandoned promptly by stop().
        self._stopping = stopping if stopping is not None else threading.Event()
        self._lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        """Clear the counters and the script and put every switch back to its default."""
        with self._lock:
            self.delay = 0.0
            self.fail_status = None
            self.fail_times = None
            self.error_code = None
            self.retry_after = None
            self.reject_json_schema = False
            self.refusal = None
            self.target = DEFAULT_TARGET
            self.max_chars = DEFAULT_MAX_CHARS
            self.script = []
            self.requests = 0
            self.bodies = []
            self.headers = []
            self.units = []

    # -- per request -------------------------------------------------------------------------

    def _should_fail(self) -> int | None:
        with self._lock:
            status = self.fail_status
            if status is None:
                return None
            if self.fail_times is None:
                return status
            if self.fail_times > 0:
                self.fail_times -= 1
                return status
            return None

    def _next_item(self) -> object:
        with self._lock:
            return self.script.pop(0) if self.script else _NO_ITEM

    def answer(self, raw: bytes, headers: dict[str, str] | None = None) -> ChatAnswer:
        """Answer one POST /v1/chat/completions body, applying the switches in order."""
        try:
            body: object = json.loads(raw)
        except ValueError:
            body = None
        messages = body.get("messages") if isinstance(body, dict) else None
        valid = isinstance(messages, list) and bool(messages)
        units = units_of(messages) if isinstance(messages, list) else []
        with self._lock:
            self.requests += 1
            number = self.requests
            self.headers.append(dict(headers or {}))
            if isinstance(body, dict):
                self.bodies.append(body)
            self.units = units

        if self.delay > 0:
            self._stopping.wait(self.delay)
        status = self._should_fail()
        if status is not None:
            value = self.retry_after
            extra = {} if value is None else {"Retry-After": _retry_after_value(value)}
            message = f"Stand-in fault: fail_status {status}"
            return error_answer(status, message, code=self.error_code, headers=extra)
        if not isinstance(body, dict):
            return error_answer(400, "We could not parse the JSON body of your request.")
        if not valid:
            return error_answer(400, "'messages' must be a non-empty array of messages.")
        model = body.get("model", "standin")
        if not isinstance(model, str):
            return error_answer(400, "'model' must be a string.")
        response_format = body.get("response_format")
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if self.reject_json_schema and kind == "json_schema":
            return error_answer(400, f"Invalid parameter: {SCHEMA_REJECTED}.")

        prompt = sum(
            _token_count(_text_of(m.get("content"))) for m in messages if isinstance(m, dict)
        )
        refusal = self.refusal
        if refusal is not None:
            return self._completion(number, model, prompt, ChatReply(refusal=refusal))
        item = self._next_item()
        if item is _NO_ITEM:
            item = automatic_chunks(units, self.target, self.max_chars)
        return self._scripted(item, units, number, model, prompt)

    def _scripted(
        self, item: object, units: list[str], number: int, model: str, prompt: int
    ) -> ChatAnswer:
        if callable(item):
            item = item(list(units))
            if item is None:  # a callable that only looks (or asserts) gets the automatic answer
                item = automatic_chunks(units, self.target, self.max_chars)
        if isinstance(item, str):
            reply = ChatReply(content=item)
        elif isinstance(item, dict | list):
            reply = ChatReply(content=json.dumps(item))
        elif isinstance(item, ChatReply):
            reply = item
        else:
            raise TypeError(f"unsupported chat script item: {type(item).__name__}")
        if reply.delay > 0:
            self._stopping.wait(reply.delay)
        if reply.status >= 400:
            message = reply.content or f"Stand-in scripted error: status {reply.status}"
            return error_answer(reply.status, message, code=self.error_code)
        return self._completion(number, model, prompt, reply)

    def _completion(self, number: int, model: str, prompt: int, reply: ChatReply) -> ChatAnswer:
        completion = _token_count(reply.content or reply.refusal or "")
        payload = {
            "id": f"chatcmpl-standin-{number}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": reply.content,
                        "refusal": reply.refusal,
                    },
                    "finish_reason": reply.finish_reason,
                }
            ],
            "usage": {
                "prompt_tokens": prompt,
                "completion_tokens": completion,
                "total_tokens": prompt + completion,
            },
        }
        return _json_answer(reply.status, payload)
