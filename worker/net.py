"""Network waits with a deadline that holds, and that a cancellation interrupts.

httpx's timeouts bound each wait for the *next* bytes: a server that sends one byte a second
never trips a 5-second read timeout, and a page fetch or a provider call could then hold a
worker for as long as the server likes (seen: 150 s with KIDX_URLS__TIMEOUT=5), deaf to
`kidx cancel`. Here a `deadline()` covers everything sent and received within it: connect,
TLS, headers and body, each wait cut to what is left of the whole, and, when a cancel check is
given, to a fraction of a second so that a cancellation is seen while waiting. httpx takes no
network backend of its own, so `DeadlineTransport` rebuilds its connection pool with one.

    with deadline(20, cancel):       # the budget of one fetch, redirects included
        response = client.get(url)   # a client made with transport=DeadlineTransport()

Outside a `deadline()` the transport behaves as httpx's own.
"""

from __future__ import annotations

import functools
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

import httpcore
import httpx

from worker.errors import Cancelled

CancelCheck = Callable[[], bool]
T = TypeVar("T")
POLL = 0.25  # seconds a wait lasts at most between two looks at the cancel check


class DeadlinePassed(TimeoutError):
    """The whole of a deadline's time is spent."""


class Deadline:
    """A time budget for a span of network waits, and an optional cancel check."""

    def __init__(self, seconds: float, cancel: CancelCheck | None = None) -> None:
        self.seconds = seconds
        self.cancel = cancel
        self.at = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left; Cancelled or DeadlinePassed when there is nothing to wait for."""
        if self.cancel is not None and self.cancel():
            raise Cancelled("cancelled while waiting on the network")
        left = self.at - time.monotonic()
        if left <= 0:
            raise DeadlinePassed(f"not done within the {self.seconds:g} s allowed in all")
        return left

    def slice(self, timeout: float | None) -> tuple[float, bool]:
        """How long the next wait may block, and whether that is the caller's own timeout
        (then its expiry is the caller's, not a moment to look at the cancel check again)."""
        budget = self.left()
        if self.cancel is not None:
            budget = min(budget, POLL)
        if timeout is not None and timeout <= budget:
            return timeout, True
        return budget, False


_current: ContextVar[Deadline | None] = ContextVar("kidx_deadline", default=None)


@contextmanager
def deadline(seconds: float, cancel: CancelCheck | None = None) -> Iterator[Deadline]:
    """Every network wait in this span (on this thread) ends within `seconds` in all, and
    as soon as `cancel()` is true (Cancelled)."""
    d = Deadline(seconds, cancel)
    token = _current.set(d)
    try:
        yield d
    finally:
        _current.reset(token)


def bounded(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` within the current deadline: for a blocking call that takes no timeout
    (the system resolver). On expiry the call is abandoned on its thread."""
    d = _current.get()
    if d is None:
        return fn(*args)
    box: dict[str, Any] = {}
    finished = threading.Event()

    def run() -> None:
        try:
            box["value"] = fn(*args)
        except BaseException as e:  # handed to the caller
            box["error"] = e
        finally:
            finished.set()

    threading.Thread(target=run, daemon=True, name="kidx-bounded").start()
    while not finished.wait(d.slice(None)[0]):
        pass
    if "error" in box:
        raise box["error"]
    return box["value"]


class _Stream(httpcore.NetworkStream):
    """httpcore's socket stream, its waits cut to the current deadline."""

    def __init__(self, inner: httpcore.NetworkStream) -> None:
        self._inner = inner

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        d = _current.get()
        if d is None:
            return self._inner.read(max_bytes, timeout)
        while True:  # a read that timed out consumed nothing: it may be tried again
            try:
                budget, own = d.slice(timeout)
            except DeadlinePassed as e:
                raise httpcore.ReadTimeout(str(e)) from None
            try:
                return self._inner.read(max_bytes, budget)
            except httpcore.ReadTimeout:
                if own:
                    raise

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        d = _current.get()
        if d is not None:  # not sliced: a send that times out may have sent a part
            try:
                left = d.left()
            except DeadlinePassed as e:
                raise httpcore.WriteTimeout(str(e)) from None
            timeout = left if timeout is None else min(timeout, left)
        self._inner.write(buffer, timeout)

    def close(self) -> None:
        self._inner.close()

    def start_tls(
        self, ssl_context: Any, server_hostname: str | None = None, timeout: float | None = None
    ) -> httpcore.NetworkStream:
        return _Stream(self._inner.start_tls(ssl_context, server_hostname, _cut(timeout)))

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


def _cut(timeout: float | None) -> float | None:
    """A wait that cannot be resumed (connect, TLS handshake): the least of its own timeout
    and what is left of the deadline."""
    d = _current.get()
    if d is None:
        return timeout
    try:
        left = d.left()
    except DeadlinePassed as e:
        raise httpcore.ConnectTimeout(str(e)) from None
    return left if timeout is None else min(timeout, left)


class _Backend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Any = None,
    ) -> httpcore.NetworkStream:
        return _Stream(
            self._inner.connect_tcp(host, port, _cut(timeout), local_address, socket_options)
        )

    def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Any = None
    ) -> httpcore.NetworkStream:
        return _Stream(self._inner.connect_unix_socket(path, _cut(timeout), socket_options))

    def sleep(self, seconds: float) -> None:
        self._inner.sleep(seconds)


@functools.cache
def _default_ssl_context(trust_env: bool) -> ssl.SSLContext:
    """One per process: loading the CA bundle costs ~50 ms, and every `kidx search` built two."""
    return httpx.create_ssl_context(verify=True, trust_env=trust_env)


class DeadlineTransport(httpx.HTTPTransport):
    """httpx's transport (HTTP/1.1) whose connections honour `deadline()`; through an HTTP
    proxy too (`proxy`: its URL), which httpx's own transport times read by read only (a
    proxy or a server trickling a byte every half second held a worker for days)."""

    def __init__(
        self,
        *,
        verify: Any = True,
        trust_env: bool = False,
        limits: httpx.Limits | None = None,
        proxy: str | None = None,
    ) -> None:
        limits = limits or httpx.Limits(max_connections=100, max_keepalive_connections=20)
        context = _default_ssl_context(trust_env) if verify is True else None
        if context is None:
            context = httpx.create_ssl_context(verify=verify, trust_env=trust_env)
        super().__init__(verify=context, trust_env=trust_env, limits=limits)
        pool = {
            "ssl_context": context,
            "max_connections": limits.max_connections,
            "max_keepalive_connections": limits.max_keepalive_connections,
            "keepalive_expiry": limits.keepalive_expiry,
            "network_backend": _Backend(),
        }
        if proxy is None:
            self._pool = httpcore.ConnectionPool(**pool)
            return
        via = httpx.Proxy(url=proxy)  # as httpx builds its own (HTTPTransport.__init__)
        self._pool = httpcore.HTTPProxy(
            proxy_url=httpcore.URL(
                scheme=via.url.raw_scheme,
                host=via.url.raw_host,
                port=via.url.port,
                target=via.url.raw_path,
            ),
            proxy_auth=via.raw_auth,
            proxy_headers=via.headers.raw,
            proxy_ssl_context=via.ssl_context,
            **pool,
        )
