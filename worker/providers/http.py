"""An OpenAI-style JSON API over httpx, with the retry policy every provider shares.

Retries what may pass (408, 409, 429, 5xx, timeouts, connection errors, a compressed answer cut
short) with exponential backoff and full jitter, honouring `Retry-After` when it is within the
cap; a longer wait is not spent holding a worker: it raises `RetryLater` with `retry_after` set,
for the task queue to retry later. Never retries 400/401/403 or a 429 that says the quota is
exhausted. The API key and a password in the base URL never reach a message, even when the
server quotes them back (they are masked before any text is cut); the base URL is shown without
its user:password@ (`safe_url`).

Bodies are read raw and decompressed here (`read_body`), never by httpx: httpx inflates each
layer of `Content-Encoding: gzip, gzip` in full, so a few hundred bytes could become gigabytes
before any size check saw them. Here no more than the limit (+1 byte) is ever produced.
"""

from __future__ import annotations

import base64
import datetime
import email.utils
import ipaddress
import json
import math
import random
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit
from urllib.request import getproxies, proxy_bypass

import httpx

from worker import net
from worker.errors import (
    BadAnswer,
    InvalidInput,
    OutOfTime,
    PermanentProviderError,
    TimedOut,
    TransientProviderError,
)
from worker.log import get_logger
from worker.providers.base import backoff_delay
from worker.settings import HTTPProviderSettings
from worker.store.text import without_lone_surrogates

log = get_logger("kidx.providers")

# Worth trying again: these, and every 5xx but 501 and 505 (a gateway's 520-529, an origin's
# 507 "insufficient storage" or 529 "overloaded" are as passing as a 503).
RETRYABLE = frozenset({408, 409, 429}) | frozenset(range(500, 600)) - {501, 505}
PER_INPUT = frozenset({400, 413, 422})  # may concern one input only: worth trying alone
USER_AGENT = "kidx/0.1 (+https://github.com/kidx)"
ACCEPT_ENCODING = "gzip, deflate"  # what `read_body` decodes (httpx would also offer zstd)
MAX_ANSWER_BYTES = 64 * 1024 * 1024  # a provider's answer, decompressed; over it: BadAnswer
MAX_ERROR_BYTES = 1024 * 1024  # an error answer is read this far, for its message
DETAIL_CHARS = 200  # what is shown of a server's own text
JSON_HEADERS = {"Content-Type": "application/json"}


class BodyRefused(ValueError):
    """A body not read: over the size limit, in a content coding not accepted, or broken."""


class BodyTooLarge(BodyRefused):
    """A body over the size limit."""


class BodyIncomplete(Exception):
    """A compressed body that ended before its compressed stream did (a server or proxy that
    failed while compressing, the HTTP message itself complete): what came is only part of the
    body, and a retry may get it whole."""


class AnswerTooLarge(BadAnswer):
    """A 200 answer refused unread past its size limit (`limit`, in bytes)."""

    def __init__(self, message: str, *, limit: int) -> None:
        super().__init__(message)
        self.limit = limit


class _Inflater:
    """One gzip or deflate coding, decompressed a bounded amount at a time."""

    def __init__(self, coding: str) -> None:
        self.coding = coding
        self.started = False
        self._wbits = zlib.MAX_WBITS | 16 if coding == "gzip" else zlib.MAX_WBITS
        self._d = zlib.decompressobj(self._wbits)
        self._held = b""  # the first byte of what may be another gzip member's magic
        self._trailer = False  # past the stream's end: what follows is ignored

    def decode(self, data: bytes, cap: int) -> bytes:
        """At most `cap` bytes of what `data` decompresses to (exactly `cap`: there is more)."""
        out: list[bytes] = []
        size = 0
        data, self._held = self._held + data, b""
        while data and size < cap and not self._trailer:
            if self._d.eof:  # another gzip member may follow; anything else is ignored
                if self.coding == "gzip" and data == b"\x1f":
                    self._held = data  # a member's magic split between two reads
                    break
                if self.coding != "gzip" or not data.startswith(b"\x1f\x8b"):
                    self._trailer = True
                    break
                self._d = zlib.decompressobj(self._wbits)
            try:
                piece = self._d.decompress(data, cap - size)
            except zlib.error as e:
                if self.coding == "deflate" and not self.started:
                    # "deflate" is meant as zlib-wrapped, but some servers send it raw
                    self.started = True
                    self._wbits = -zlib.MAX_WBITS
                    self._d = zlib.decompressobj(self._wbits)
                    continue
                raise BodyRefused(f"the {self.coding} body could not be decoded ({e})") from None
            self.started = True
            out.append(piece)
            size += len(piece)
            data = self._d.unused_data if self._d.eof else self._d.unconsumed_tail
        return b"".join(out)

    def flush(self, cap: int) -> bytes:
        """The rest, once the raw body has ended; `BodyIncomplete` when the compressed stream
        had not: zlib gives what it could of a stream cut short, end marker and checksum
        missing, without a word."""
        try:
            rest = self._d.flush(cap) if not self._d.eof else b""
        except zlib.error as e:
            raise BodyRefused(f"the {self.coding} body could not be decoded ({e})") from None
        if self.started and not self._d.eof:
            raise BodyIncomplete(
                f"the compressed body ended early: its {self.coding} stream stops before its "
                "end, so what came is only part of it"
            )
        return rest


def read_body(response: httpx.Response, limit: int) -> bytes:
    """A streamed response's body, decoded, refused (`BodyRefused`) as soon as it would pass
    `limit` bytes, raw or decoded: no more than `limit` + 1 bytes are ever decompressed. One
    content coding at most, gzip or deflate (a coding applied twice only serves to hide a
    bomb). A compressed body cut short raises `BodyIncomplete`. A response already read in
    memory (a mock transport's) is only measured."""
    try:
        content = response.content
    except httpx.ResponseNotRead:
        pass
    else:
        if len(content) > limit:
            raise BodyTooLarge(f"over the size limit of {limit} bytes")
        return content
    codings = [
        c.strip().lower()
        for c in response.headers.get_list("content-encoding", split_commas=True)
        if c.strip() and c.strip().lower() != "identity"
    ]
    if len(codings) > 1:
        raise BodyRefused(
            f"the body is compressed more than once (Content-Encoding: {', '.join(codings)}); "
            "only one content coding is accepted"
        )
    coding = {"x-gzip": "gzip"}.get(codings[0], codings[0]) if codings else ""
    if coding not in ("", "gzip", "deflate"):
        raise BodyRefused(
            f"content coding {coding[:40]!r} is not supported (only gzip and deflate)"
        )
    inflater = _Inflater(coding) if coding else None
    parts: list[bytes] = []
    size = raw_size = 0

    def take(part: bytes) -> None:
        nonlocal size
        size += len(part)
        if size > limit:
            raise BodyTooLarge(f"over the size limit of {limit} bytes")
        parts.append(part)

    for raw in response.iter_raw():
        raw_size += len(raw)
        if raw_size > limit:
            raise BodyTooLarge(f"over the size limit of {limit} bytes")
        take(inflater.decode(raw, limit - size + 1) if inflater else raw)
    if inflater is not None:
        take(inflater.flush(limit - size + 1))
    return b"".join(parts)


def safe_url(url: str) -> str:
    """The URL with any credentials in it masked, and a lone surrogate in it U+FFFD (a
    message holding one could not be printed, logged or stored as UTF-8): what may be shown,
    stored and logged."""
    url = without_lone_surrogates(url)
    try:
        parts = urlsplit(url)
        if "@" not in parts.netloc:
            return url
        return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))
    except ValueError:
        return "(a URL that does not parse)" if "@" in url else url


def mask(text: str, secrets: Sequence[str]) -> str:
    """`text` with each of `secrets` replaced by ***, the longest first (one may hold another)."""
    for secret in sorted(filter(None, secrets), key=len, reverse=True):
        text = text.replace(secret, "***")
    return text


def shorten(text: str, secrets: Sequence[str] = (), limit: int = DETAIL_CHARS) -> str:
    """`text` on one line, `secrets` masked, then cut to `limit` characters (cut before the
    masking, a secret crossing the cut would keep its first part); a lone surrogate a server
    sent JSON-escaped is U+FFFD: the item's stored error is UTF-8 (it raised there)."""
    return without_lone_surrogates(mask(" ".join(text.split()), secrets)[:limit])


def _credentials(settings: HTTPProviderSettings) -> list[str]:
    """What a server could quote back that gives access: the API key, and the base URL's
    password as written, decoded, and as the basic-auth token httpx sends for it."""
    found = [settings.api_key.get_secret_value()] if settings.api_key else []
    try:
        parts = urlsplit(settings.base_url)
        user, password = parts.username or "", parts.password or ""
    except ValueError:
        return found
    if password:
        pair = f"{unquote(user)}:{unquote(password)}".encode()
        found += [password, unquote(password), base64.b64encode(pair).decode("ascii")]
    found = [s for s in found if s]
    # quoted inside a server's JSON text, a key is escaped (`"` as `\"`, maybe `/` as `\/`)
    quoted = [json.dumps(s)[1:-1] for s in found]
    return list(dict.fromkeys(found + quoted + [q.replace("/", "\\/") for q in quoted]))


def proxied(url: str) -> bool:
    """Whether requests for `url` go through a proxy from the environment: one is set for its
    scheme (HTTP(S)_PROXY, ALL_PROXY) and NO_PROXY does not exempt its host. NO_PROXY alone
    names no proxy (`getproxies()` lists it, under "no"). A network in NO_PROXY (`10.0.0.0/8`,
    as curl and requests read it) exempts the addresses in it: neither urllib nor httpx reads
    one, and a provider on the private network went through the proxy."""
    parts = urlsplit(url)
    proxies = getproxies()
    if not (proxies.get(parts.scheme) or proxies.get("all")):
        return False
    host = parts.hostname or ""
    try:
        port = parts.port
    except ValueError:
        port = None
    if proxy_bypass(host) or (port is not None and proxy_bypass(f"{host}:{port}")):
        return False
    return not _in_networks(host, proxies.get("no", ""))


def proxy_for(url: str) -> str | None:
    """The environment's proxy for `url` (`proxied`), or None."""
    if not proxied(url):
        return None
    proxies = getproxies()
    proxy = proxies.get(urlsplit(url).scheme) or proxies.get("all")
    # `proxy.corp:3128`, as curl and httpx take it: http (else the read-by-read transport)
    return f"http://{proxy}" if proxy and "://" not in proxy else proxy


def _transport(url: str) -> httpx.BaseTransport | None:
    """A transport that honours `net.deadline()` for requests to `url`; None (httpx's own,
    which finds the proxy) for a proxy of another scheme than http(s)."""
    proxy = proxy_for(url)
    if proxy is not None and urlsplit(proxy).scheme not in ("http", "https"):
        return None
    return net.DeadlineTransport(trust_env=True, proxy=proxy)


def _in_networks(host: str, no_proxy: str) -> bool:
    """Whether `host` is an IP address in one of NO_PROXY's networks (`a.b.c.d/n`, `::/n`)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    for entry in no_proxy.split(","):
        if "/" not in (entry := entry.strip()):
            continue
        try:
            if address in ipaddress.ip_network(entry, strict=False):
                return True
        except ValueError:  # not a network (a path, a typo): NO_PROXY's other entries stand
            continue
    return False


def _lone_surrogate(value: Any) -> tuple[str, int] | None:
    """The first text in a request body that is not UTF-8 (a lone surrogate), and where."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return value, e.start
    elif isinstance(value, dict | list):
        for part in value.values() if isinstance(value, dict) else value:
            if (found := _lone_surrogate(part)) is not None:
                return found
    return None


def encode_body(body: Any) -> bytes:
    """The JSON a request sends, as httpx would write it, but refused with `InvalidInput` when
    a text holds a lone surrogate (a host's str decoded with "surrogateescape", JSON's
    "\\udce9"), which UTF-8 cannot carry: httpx raised a bare UnicodeEncodeError."""
    text = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:
        found = _lone_surrogate(body)
        where = f" at character {found[1]}" if found else ""
        code = f" U+{ord(found[0][found[1]]):04X}" if found else ""
        raise InvalidInput(
            f"the text is not UTF-8: it holds a lone surrogate{code}{where} (text decoded "
            "with errors='surrogateescape'?); nothing was sent"
        ) from None


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
    """Seconds to wait from `retry-after-ms` or `Retry-After` (seconds or an HTTP date); a
    wait that is not above 0 (negative, a date past) is none: the backoff decides, as in
    OpenAI's own client, not five requests sent back to back."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            wait = float(ms) / 1000
        except ValueError:
            wait = math.nan
        if math.isfinite(wait) and wait > 0:
            return wait
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        wait = float(value)
    except ValueError:
        # A date a server made up (the year 99999999999999999999, a zone of +99999) is no
        # usable wait: OverflowError, like ValueError, means "back off as usual".
        try:
            when = email.utils.parsedate_to_datetime(value)
            if when.tzinfo is None:  # the asctime form carries no zone; HTTP dates are GMT
                when = when.replace(tzinfo=datetime.UTC)
            at = when.timestamp()
        except (TypeError, ValueError, IndexError, OverflowError):
            return None
        wait = at - (time.time() if now is None else now)
    return wait if math.isfinite(wait) and wait > 0 else None


def _error_detail(data: bytes, secrets: Sequence[str] = ()) -> tuple[str, str]:
    """The server's error code and message, from an OpenAI-style body if there is one, with
    `secrets` masked (before either is shortened)."""
    text = data.decode("utf-8", "replace")
    try:
        body = json.loads(data)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, too deep, too long a number
        return "", shorten(text, secrets)
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        code = shorten(str(err.get("code") or err.get("type") or ""), secrets)
        return code, shorten(str(err.get("message") or ""), secrets)
    if isinstance(err, str):
        return "", shorten(err, secrets)
    return "", shorten(text, secrets)


class JSONClient:
    """POST JSON, get JSON, with retries; `sleep` may be replaced (a cancellable wait), and
    `cancel` ends a call in flight (Cancelled) when it turns true (it is looked at every
    quarter second of a wait; a client through a proxy waits on httpx's own timeouts)."""

    def __init__(
        self,
        settings: HTTPProviderSettings,
        *,
        model: str,
        log_prefix: str,
        client: httpx.Client | None = None,
        sleep: Callable[[float], None] = time.sleep,
        cancel: Callable[[], bool] | None = None,
        rand: Callable[[], float] = random.random,
        max_answer_bytes: int = MAX_ANSWER_BYTES,
    ) -> None:
        self.settings = settings
        self.cancel = cancel
        self.max_answer_bytes = max_answer_bytes
        self.sleep = sleep
        self._rand = rand
        self._prefix = log_prefix
        headers = {"User-Agent": USER_AGENT, "Accept-Encoding": ACCEPT_ENCODING}
        self._key = settings.api_key.get_secret_value() if settings.api_key else ""
        if self._key:
            headers["Authorization"] = f"Bearer {self._key}"
        if client is not None:
            client.headers.update(headers)  # a client passed in gets the key too
        self.client = client or httpx.Client(
            base_url=settings.base_url,
            headers=headers,
            timeout=httpx.Timeout(settings.timeout, connect=settings.connect_timeout),
            # With the deadline in all, through the environment's HTTP proxy too (a SOCKS
            # one: httpx's own transport, its timeouts read by read).
            transport=_transport(settings.base_url),
        )
        # shown in errors (stored, shown by Flower) and logs: never the URL's user:password@
        self.where = f"{model} at {safe_url(settings.base_url)}"
        self._secrets = _credentials(settings)

    def post(
        self,
        path: str,
        body: dict[str, Any],
        *,
        max_answer_bytes: int | None = None,
        until: float | None = None,
        retry_timeouts: bool = True,
    ) -> Any:
        """The JSON answer to `body`; `max_answer_bytes`: a tighter bound on the answer than
        the client's (what this request can need), never a looser one; `until`: the
        `time.monotonic()` instant past which no attempt goes on and none is made (OutOfTime).
        `retry_timeouts=False`: an answer that does not come within the timeout is TimedOut
        at once (a batch of texts the caller sends again in halves, rather than whole again)."""
        s = self.settings
        limit = self.max_answer_bytes
        if max_answer_bytes is not None:
            limit = min(limit, max_answer_bytes)
        content = encode_body(body)  # once, not at every attempt
        attempts = s.max_retries + 1
        cause = ""
        garbled = False  # the last attempt's answer was a 200 that is not JSON
        slow = False  # the last attempt had no answer within the timeout
        wait: float | None = None
        asked = 0.0  # the waits servers asked for (Retry-After) in this call, in all
        for attempt in range(attempts):
            wait = None
            budget = s.timeout
            if until is not None:
                budget = min(budget, until - time.monotonic())
                if budget <= 0:
                    said = f" after {cause}" if cause else ""
                    raise OutOfTime(
                        f"{self.where}: no time left to ask{said}", unanswered=bool(cause)
                    )
            garbled = slow = False
            try:
                with (
                    # in all (a server trickling bytes included), and cut by a cancellation
                    net.deadline(budget, self.cancel),
                    self.client.stream(
                        "POST", path, content=content, headers=JSON_HEADERS
                    ) as response,
                ):
                    ok = response.status_code == 200
                    try:
                        data = read_body(response, limit if ok else MAX_ERROR_BYTES)
                    except BodyRefused as e:
                        if ok:
                            raise (
                                AnswerTooLarge(
                                    f"{self.where}: the answer was refused: {e}", limit=limit
                                )
                                if isinstance(e, BodyTooLarge)
                                else BadAnswer(f"{self.where}: the answer was refused: {e}")
                            ) from None
                        data = b""  # an error answer too big to show: its status says enough
                    except BodyIncomplete:
                        if ok:
                            raise  # retried as a connection failure is: it may come whole
                        data = b""  # an error answer cut short: its status says enough
            except BodyIncomplete as e:
                cause = f"the answer was cut short ({e})"
            except httpx.TimeoutException as e:
                if until is not None and budget < s.timeout and time.monotonic() >= until - 0.01:
                    raise OutOfTime(
                        f"{self.where}: no answer before its caller's deadline", unanswered=True
                    ) from None
                if isinstance(e, httpx.ConnectTimeout):
                    cause = f"connect timed out after {s.connect_timeout:g}s"
                else:
                    cause = f"timed out after {s.timeout:g}s"
                    # sending or answering this request took too long (not the pool's wait)
                    slow = isinstance(e, httpx.ReadTimeout | httpx.WriteTimeout)
                    if slow and not retry_timeouts:
                        raise TimedOut(f"{self.where}: {cause}") from None
            except httpx.TransportError as e:  # its text may quote a header or the URL
                cause = mask(f"connection failed ({type(e).__name__}: {e})", self._secrets)
            else:
                try:
                    if ok:
                        return json.loads(data)
                except (ValueError, UnicodeDecodeError):  # JSONDecodeError is a ValueError
                    # a gateway's or a proxy's page in place of the answer: asked again, as a
                    # 5xx is (once, it failed every item of a bulk run); every time, refused
                    garbled = True
                    cause = f"the answer is not JSON ({_error_detail(data, self._secrets)[1]})"
                except RecursionError:
                    raise BadAnswer(f"{self.where}: the answer nests too deeply") from None
                else:
                    # a server may echo the key back, in its message or its code: masked first
                    code, message = _error_detail(data, self._secrets)
                    cause = f"HTTP {response.status_code}" + (f" {code}" if code else "")
                    cause += f": {message}" if message else ""
                    status = response.status_code
                    quota = status == 429 and "insufficient_quota" in (code + message)
                    if status not in RETRYABLE or quota:
                        raise ProviderHTTPError(f"{self.where}: {cause}", status=status)
                    wait = parse_retry_after(response.headers)
                    # In all, not each: a 429 storm asking 60 s a time kept a worker waiting
                    # 720 s over three calls, past the task's soft time limit; longer is the
                    # queue's.
                    if wait is not None and asked + wait > s.retry_after_max:
                        raise RetryLater(
                            f"{self.where}: {cause} (asked to wait {wait:g}s)", retry_after=wait
                        )
                    asked += wait or 0.0
            if attempt + 1 < attempts:
                if wait is None:
                    wait = backoff_delay(attempt, s.backoff, s.backoff_max, self._rand())
                if until is not None and time.monotonic() + wait >= until:
                    raise OutOfTime(
                        f"{self.where}: no time left to retry after {cause}", unanswered=True
                    )
                log.warning(
                    f"{self._prefix} provider call failed, retrying",
                    provider=self.where,
                    reason=cause,
                    attempt=attempt + 1,
                    wait_s=round(wait, 3),
                )
                self.sleep(wait)
        if garbled:  # the same every time: what the server at this URL answers
            raise BadAnswer(f"{self.where}: {cause} (after {attempts} attempts)")
        if slow:
            raise TimedOut(f"{self.where}: {cause} (after {attempts} attempts)")
        raise RetryLater(f"{self.where}: {cause} (after {attempts} attempts)", retry_after=wait)

    def shown(self, text: str) -> str:
        """A server's text as it may be shown: the credentials masked, then cut (`shorten`)."""
        return shorten(text, self._secrets)

    def close(self) -> None:
        self.client.close()
