"""An OpenAI-style JSON API over httpx, with the retry policy every provider shares.

Retries what may pass (408, 409, 429, 5xx, timeouts, connection errors) with exponential backoff
and full jitter, honouring `Retry-After` when it is within the cap; a longer wait is not spent
holding a worker: it raises `RetryLater` with `retry_after` set, for the task queue to retry
later. Never retries 400/401/403 or a 429 that says the quota is exhausted. The API key never
reaches a message, even when the server quotes it back.
"""

from __future__ import annotations

import datetime
import email.utils
import json
import math
import random
import time
from collections.abc import Callable
from typing import Any
from urllib.request import getproxies

import httpx

from worker import net
from worker.errors import BadAnswer, PermanentProviderError, TransientProviderError
from worker.log import get_logger
from worker.providers.base import backoff_delay
from worker.settings import HTTPProviderSettings

log = get_logger("kidx.providers")

RETRYABLE = frozenset({408, 409, 429, 500, 502, 503, 504})
PER_INPUT = frozenset({400, 413, 422})  # may concern one input only: worth trying alone
USER_AGENT = "kidx/0.1 (+https://github.com/kidx)"


class ProviderHTTPError(PermanentProviderError):
    """A permanent HTTP refusal; `per_input` when it may concern one text of the batch."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message, per_input=status in PER_INPUT)
        self.status = status


class RetryLater(TransientProviderError):
    """Transient; `retry_after` (seconds) when the server said how long to wait."""

    def __init__(self, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def parse_retry_after(headers: httpx.Headers, now: float | None = None) -> float | None:
    """Seconds to wait from `retry-after-ms` or `Retry-After` (seconds or an HTTP date)."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            wait = float(ms) / 1000
        except ValueError:
            wait = math.nan
        if math.isfinite(wait):
            return max(0.0, wait)
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        wait = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError, IndexError):
            return None
        if when.tzinfo is None:  # the asctime form carries no zone; HTTP dates are GMT
            when = when.replace(tzinfo=datetime.UTC)
        return max(0.0, when.timestamp() - (time.time() if now is None else now))
    return max(0.0, wait) if math.isfinite(wait) else None


def _error_detail(response: httpx.Response) -> tuple[str, str]:
    """The server's error code and message, from an OpenAI-style body if there is one."""
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "", " ".join(response.text.split())[:200]
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        code = str(err.get("code") or err.get("type") or "")
        return code, " ".join(str(err.get("message") or "").split())[:200]
    if isinstance(err, str):
        return "", err[:200]
    return "", " ".join(response.text.split())[:200]


class JSONClient:
    """POST JSON, get JSON, with retries; `sleep` may be replaced (a cancellable wait)."""

    def __init__(
        self,
        settings: HTTPProviderSettings,
        *,
        model: str,
        log_prefix: str,
        client: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.settings = settings
        self.sleep = sleep
        self._rand = rand
        self._prefix = log_prefix
        headers = {"User-Agent": USER_AGENT}
        self._key = settings.api_key.get_secret_value() if settings.api_key else ""
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        if client is not None:
            client.headers.update(headers)  # a client passed in gets the key too
        self.client = client or httpx.Client(
            base_url=settings.base_url,
            headers=headers,
            timeout=httpx.Timeout(settings.timeout, connect=settings.connect_timeout),
            # Through a proxy from the environment (httpx's own transport, per-read
            # timeouts), else with the deadline in all.
            transport=None if getproxies() else net.DeadlineTransport(trust_env=True),
        )
        self.where = f"{model} at {settings.base_url}"

    def post(self, path: str, body: dict[str, Any]) -> Any:
        s = self.settings
        attempts = s.max_retries + 1
        cause = ""
        wait: float | None = None
        for attempt in range(attempts):
            wait = None
            try:
                with net.deadline(s.timeout):  # in all: a server trickling bytes included
                    response = self.client.post(path, json=body)
            except httpx.ConnectTimeout:
                cause = f"connect timed out after {s.connect_timeout:g}s"
            except httpx.TimeoutException:
                cause = f"timed out after {s.timeout:g}s"
            except httpx.TransportError as e:
                cause = f"connection failed ({type(e).__name__}: {e})"
            else:
                if response.status_code == 200:
                    try:
                        return response.json()
                    except (json.JSONDecodeError, UnicodeDecodeError):
                        raise BadAnswer(f"{self.where}: the answer is not JSON") from None
                code, message = _error_detail(response)
                cause = f"HTTP {response.status_code}" + (f" {code}" if code else "")
                cause += f": {message}" if message else ""
                if self._key:  # a server may echo the key back, in its message or its code
                    cause = cause.replace(self._key, "***")
                quota = response.status_code == 429 and "insufficient_quota" in (code + message)
                if response.status_code not in RETRYABLE or quota:
                    raise ProviderHTTPError(f"{self.where}: {cause}", status=response.status_code)
                wait = parse_retry_after(response.headers)
                if wait is not None and wait > s.retry_after_max:
                    raise RetryLater(
                        f"{self.where}: {cause} (asked to wait {wait:g}s)", retry_after=wait
                    )
            if attempt + 1 < attempts:
                if wait is None:
                    wait = backoff_delay(attempt, s.backoff, s.backoff_max, self._rand())
                log.warning(
                    f"{self._prefix} provider call failed, retrying",
                    provider=self.where,
                    reason=cause,
                    attempt=attempt + 1,
                    wait_s=round(wait, 3),
                )
                self.sleep(wait)
        raise RetryLater(f"{self.where}: {cause} (after {attempts} attempts)", retry_after=wait)

    def close(self) -> None:
        self.client.close()
