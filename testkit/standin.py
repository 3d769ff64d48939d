"""A stand-in for an OpenAI-compatible embeddings API, served over real HTTP on 127.0.0.1.

Tests and benchmarks talk to it exactly as they would to the real service (sockets, headers,
status codes, timeouts), but the answers are deterministic and free, and switches inject the
faults a real provider produces: error statuses, Retry-After, slow answers, wrong vector counts
or dimensions, NaN, reordered items, poisoned inputs and non-JSON bodies; and, for fault
suites, ``chaos``: a seeded random share of requests meets a 500, a 429 or a timeout.

Run ``python -m testkit.standin --port 8089`` to serve it by hand.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import hashlib
import json
import math
import random
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Any, cast
from urllib.parse import urlsplit

import numpy as np
import numpy.typing as npt

from testkit.standin_chat import ChatScript

EMBEDDINGS_PATH = "/v1/embeddings"
CHAT_PATH = "/v1/chat/completions"  # answered by ``StandIn.chat`` (testkit/standin_chat.py)
HEALTH_PATH = "/health"
GARBAGE_BODY = b"<html>oops</html>"
STOP_JOIN_SECONDS = 2.0
CHAOS_KINDS = ("500", "429", "timeout")  # what a chaos fault may be, chosen at random


# -- vectors ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8192)
def _unit_vector(text: str, dimensions: int) -> npt.NDArray[np.float32]:
    # Cached as float32 arrays (1.5 kB at 384 dims) rather than lists of Python floats (12 kB),
    # so benchmarks that repeat texts stay cheap without the cache growing large.
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
    rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
    vector = rng.standard_normal(dimensions)
    vector = (vector / np.linalg.norm(vector)).astype(np.float32)
    vector.setflags(write=False)
    return vector


def vector_for(text: str, dimensions: int) -> list[float]:
    """The unit float32 vector the stand-in returns for ``text``.

    Derived from sha256 of the text (never Python's salted ``hash``), so it is the same in every
    process and tests can compute the expected answer themselves. Returns a fresh list.
    """
    return cast(list[float], _array_for(text, dimensions).tolist())


def _array_for(text: str, dimensions: int) -> npt.NDArray[np.float32]:
    """vector_for's vector as the cached read-only array (an answer encodes it as it is: a
    round trip through a list of floats cost a third of the stand-in's time a text)."""
    if isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1:
        raise ValueError(f"dimensions must be a positive integer, got {dimensions!r}")
    return _unit_vector(text, dimensions)


def _token_count(text: str) -> int:
    """A rough token count (4 UTF-8 bytes a token), only so that "usage" looks plausible."""
    return (len(text.encode("utf-8", "surrogatepass")) + 3) // 4


def _encode(vector: npt.NDArray[np.float32], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        # What the OpenAI SDKs ask for by default: little-endian float32 bytes, base64-encoded.
        return base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode("ascii")
    return cast(list[float], vector.tolist())


# -- replies ---------------------------------------------------------------------------------


@dataclass
class _Reply:
    status: int
    body: bytes
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)


def _json_reply(status: int, payload: object, headers: dict[str, str] | None = None) -> _Reply:
    # json.dumps writes a float NaN as the bare token NaN, which is what the nan fault wants.
    body = json.dumps(payload, separators=(",", ":")).encode("utf-8")
    return _Reply(status, body, headers=headers or {})


def _default_error_kind(status: int) -> tuple[str, str | None]:
    """OpenAI-like (type, code) for a status, used when no error_code is set."""
    if status == 429:
        return "requests", "rate_limit_exceeded"
    if status == 401:
        return "invalid_request_error", "invalid_api_key"
    if status >= 500:
        return "server_error", None
    return "invalid_request_error", None


def _error_reply(
    status: int,
    message: str,
    *,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> _Reply:
    kind, default_code = _default_error_kind(status)
    error = {"message": message, "type": code or kind, "param": None, "code": code or default_code}
    return _json_reply(status, {"error": error}, headers)


def _retry_after_value(value: float | str) -> str:
    if isinstance(value, str):
        return value
    number = float(value)
    return str(int(number)) if number.is_integer() else repr(number)


# -- the server ------------------------------------------------------------------------------


class StandIn:
    """An OpenAI-compatible embeddings server on 127.0.0.1 with switches for faults.

    Switches are plain attributes and may be flipped while serving; counters are appended to
    under a lock, so they are safe to read from the test thread between requests.

    Per request: count it and record body and headers; ``garbage``;
    ``fail_status`` (consuming ``fail_times``); reject an unparsable or invalid request (400);
    ``poison``; ``max_batch`` (more texts in one request: 413, as text-embeddings-inference
    answers past its maximum batch size); then answer, applying ``wrong_count``, ``nan`` and
    ``shuffle``, ``delay`` seconds after the request arrived (the stand-in's own work
    included, so that the latency is the same whatever the load), and ``delay_per_text``
    seconds more for each text answered. ``texts`` only grows on
    answers that carry embeddings.

    ``chaos`` (a probability, 0 = off) comes first, right after counting: a request it picks
    (drawn from ``random.Random(chaos_seed)``) meets one of ``CHAOS_KINDS`` at random: a 500; a
    429 with ``Retry-After: chaos_retry_after``; or a wait of ``chaos_delay`` seconds (set it
    past the client's timeout) before the normal answer, which the client no longer reads.
    ``chaos_faults`` counts them by kind.

    ``chat`` answers POST /v1/chat/completions, with its own switches and counters.

    ``raw_answer`` (status, headers, body), when set, answers every POST as it is, before
    anything else and uncounted: a broken, compressed or hostile body a switch cannot make.
    """

    # switches
    dimensions: int
    fail_status: int | None
    fail_times: int | None
    error_code: str | None
    retry_after: float | str | None
    delay: float
    delay_per_text: float
    wrong_count: int
    nan: bool
    shuffle: bool
    poison: str | None
    poison_status: int
    max_batch: int | None
    garbage: bool
    chaos: float
    chaos_seed: int
    chaos_delay: float
    chaos_retry_after: float | str
    raw_answer: tuple[int, dict[str, str], bytes] | None
    # counters
    requests: int
    texts: list[str]
    bodies: list[dict[str, Any]]
    headers: list[dict[str, str]]
    chaos_faults: dict[str, int]
    chat: ChatScript

    def __init__(self, dimensions: int = 384, *, host: str = "127.0.0.1", port: int = 0) -> None:
        vector_for("", dimensions)  # validate early, not on the first request
        self._initial_dimensions = dimensions
        self.host = host
        self._requested_port = port
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._address: tuple[str, int] | None = None
        self._connections: dict[socket.socket, threading.Thread] = {}
        self._chaos_rng: tuple[int, random.Random] | None = None  # (its seed, the generator)
        self.chat = ChatScript(self._stopping)  # delays wake on stop(), like embeddings
        self.reset()

    # -- lifecycle ---------------------------------------------------------------------------

    @property
    def port(self) -> int:
        """The bound port (the real one when constructed with port=0)."""
        if self._address is None:
            raise RuntimeError("StandIn has not been started")
        return self._address[1]

    @property
    def base_url(self) -> str:
        """The URL to give an OpenAI client as base_url, e.g. http://127.0.0.1:54321/v1."""
        if self._address is None:
            raise RuntimeError("StandIn has not been started")
        host, port = self._address
        return f"http://{host}:{port}/v1"

    def start(self) -> StandIn:
        """Bind and serve in a daemon thread; returns self so ``StandIn().start()`` chains."""
        if self._server is not None:
            raise RuntimeError("StandIn is already running")
        self._stopping.clear()
        server = _Server((self.host, self._requested_port), _Handler)
        server.standin = self
        host, port = server.server_address[:2]
        self._address = (str(host), int(port))
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.02},  # how fast stop() returns; the default is 0.5 s
            name=f"standin-{port}",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop serving, close the listening socket and every open connection; idempotent.

        Open keep-alive connections are cut too, so a pooled client cannot keep talking to a
        stopped server, and requests sleeping in ``delay`` are woken and abandoned.
        """
        server, thread = self._server, self._thread
        if server is None:
            return
        self._server = self._thread = None
        with self._lock:
            self._stopping.set()
            connections = dict(self._connections)
        server.shutdown()
        server.server_close()
        for connection in connections:
            _shutdown_socket(connection)
        deadline = time.monotonic() + STOP_JOIN_SECONDS
        for handler_thread in [*connections.values(), thread]:
            if handler_thread is not None and handler_thread is not threading.current_thread():
                handler_thread.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> StandIn:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def reset(self) -> None:
        """Clear the counters and put every switch back to its default (no faults)."""
        with self._lock:
            self.dimensions = self._initial_dimensions
            self.fail_status = None
            self.fail_times = None
            self.error_code = None
            self.retry_after = None
            self.delay = 0.0
            self.delay_per_text = 0.0
            self.wrong_count = 0
            self.nan = False
            self.shuffle = False
            self.poison = None
            self.poison_status = 400
            self.max_batch = None
            self.garbage = False
            self.chaos = 0.0
            self.chaos_seed = 0
            self.chaos_delay = 2.0
            self.chaos_retry_after = 1
            self._chaos_rng = None
            self.raw_answer = None
            self.chaos_faults = dict.fromkeys(CHAOS_KINDS, 0)
            self.requests = 0
            self.texts = []
            self.bodies = []
            self.headers = []
        self.chat.reset()

    # -- connection bookkeeping (called from handler threads) --------------------------------

    def _track(self, connection: socket.socket) -> bool:
        """Register a new connection; False if stop() has begun and it must be dropped."""
        with self._lock:
            if self._stopping.is_set():
                return False
            self._connections[connection] = threading.current_thread()
            return True

    def _untrack(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.pop(connection, None)

    # -- the embeddings endpoint -------------------------------------------------------------

    def _fault_headers(self) -> dict[str, str]:
        value = self.retry_after
        return {} if value is None else {"Retry-After": _retry_after_value(value)}

    def _should_fail(self) -> int | None:
        """The status to fail this request with, consuming one of fail_times; None to serve."""
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

    def _chaos_fault(self) -> str | None:
        """The chaos fault this request meets (one of CHAOS_KINDS), or None."""
        with self._lock:
            if self.chaos <= 0:
                return None
            if self._chaos_rng is None or self._chaos_rng[0] != self.chaos_seed:
                self._chaos_rng = (self.chaos_seed, random.Random(self.chaos_seed))
            rng = self._chaos_rng[1]
            if rng.random() >= self.chaos:
                return None
            kind = rng.choice(CHAOS_KINDS)
            self.chaos_faults[kind] += 1
            return kind

    def _embeddings(
        self, raw: bytes, headers: dict[str, str], arrived: float | None = None
    ) -> _Reply:
        """Answer one POST /v1/embeddings, applying the faults in their documented order;
        `delay` is counted from `arrived` (time.monotonic(), when the request came in)."""
        if arrived is None:
            arrived = time.monotonic()
        try:
            body: object = json.loads(raw)
            parsed = True
        except ValueError:
            body, parsed = None, False
        with self._lock:
            self.requests += 1
            self.headers.append(headers)
            if isinstance(body, dict):
                self.bodies.append(body)

        fault = self._chaos_fault()
        if fault == "500":
            return _error_reply(500, "Stand-in fault: chaos 500")
        if fault == "429":
            retry_after = {"Retry-After": _retry_after_value(self.chaos_retry_after)}
            return _error_reply(429, "Stand-in fault: chaos 429", headers=retry_after)
        if fault == "timeout":
            self._stopping.wait(self.chaos_delay)  # then answer; the client has given up
        reply, texts = self._answer(body, parsed)
        # The answer leaves `delay` seconds after the request arrived, its own work included:
        # a provider of that latency, whatever this machine's load (stop() wakes the wait).
        # `delay` as it is now: a test holds a request with a long one and lets it go by
        # setting 0, when what it waits for has happened (not after a guess of the time).
        # `delay_per_text` more for each text answered: a CPU server's large model.
        while (
            left := arrived + self.delay + self.delay_per_text * len(texts) - time.monotonic()
        ) > 0:
            if self._stopping.wait(min(left, 0.05)):
                break
        if texts:
            with self._lock:
                self.texts.extend(texts)
        return reply

    def _answer(self, body: object, parsed: bool) -> tuple[_Reply, list[str]]:
        """The reply, and the texts it carries embeddings of (none for a fault)."""
        reply = self._reply(body, parsed)
        return reply if isinstance(reply, tuple) else (reply, [])

    def _reply(self, body: object, parsed: bool) -> _Reply | tuple[_Reply, list[str]]:
        if self.garbage:
            return _Reply(200, GARBAGE_BODY, content_type="text/html")
        status = self._should_fail()
        if status is not None:
            message = f"Stand-in fault: fail_status {status}"
            return _error_reply(
                status, message, code=self.error_code, headers=self._fault_headers()
            )
        if not parsed:
            return _error_reply(400, "We could not parse the JSON body of your request.")
        request = _parse_request(body)
        if isinstance(request, _Reply):
            return request
        texts, model, requested_dimensions, encoding_format = request

        poison = self.poison
        if poison is not None and any(poison in text for text in texts):
            return _error_reply(
                self.poison_status,
                "Stand-in fault: an input contains the poison string",
                code=self.error_code,
                headers=self._fault_headers(),
            )

        if self.max_batch is not None and len(texts) > self.max_batch:
            return _error_reply(
                413,
                f"batch size {len(texts)} > maximum allowed batch size {self.max_batch}",
                code=self.error_code,
            )

        dimensions = self.dimensions
        if requested_dimensions is not None and dimensions == self._initial_dimensions:
            dimensions = requested_dimensions  # changed self.dimensions (wrong dimension) wins
        vectors = [_array_for(text, dimensions) for text in texts]
        extra = self.wrong_count
        if extra > 0:
            vectors += [_array_for(f"standin-extra-{k}", dimensions) for k in range(extra)]
        elif extra < 0:
            vectors = vectors[: max(0, len(vectors) + extra)]
        if self.nan and vectors:
            vectors[0] = vectors[0].copy()  # the cached one is read-only, and stays right
            vectors[0][0] = math.nan
        data = [
            {"object": "embedding", "index": i, "embedding": _encode(vector, encoding_format)}
            for i, vector in enumerate(vectors)
        ]
        if self.shuffle:
            data.reverse()
        tokens = sum(_token_count(text) for text in texts)
        payload = {
            "object": "list",
            "data": data,
            "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        return _json_reply(200, payload), texts


def _parse_request(body: object) -> tuple[list[str], str, int | None, str] | _Reply:
    """Validate an embeddings request like OpenAI does: (texts, model, dimensions, format)."""
    if not isinstance(body, dict):
        return _error_reply(400, "The request body must be a JSON object.")
    raw_input = body.get("input")
    texts = [raw_input] if isinstance(raw_input, str) else raw_input
    if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
        return _error_reply(400, "'input' must be a string or a non-empty list of strings.")
    model = body.get("model", "standin")
    if not isinstance(model, str):
        return _error_reply(400, "'model' must be a string.")
    dimensions = body.get("dimensions")
    if dimensions is not None and (
        isinstance(dimensions, bool) or not isinstance(dimensions, int) or dimensions < 1
    ):
        return _error_reply(400, "'dimensions' must be a positive integer.")
    encoding_format = body.get("encoding_format") or "float"
    if encoding_format not in ("float", "base64"):
        return _error_reply(400, "'encoding_format' must be 'float' or 'base64'.")
    return cast(list[str], texts), model, dimensions, encoding_format


def _shutdown_socket(connection: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already closed by the client or by the handler
        connection.shutdown(socket.SHUT_RDWR)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # StandIn.stop() joins handler threads itself, with a deadline
    request_queue_size = 128  # benchmarks open many connections at once; the default is 5
    standin: StandIn


class _Handler(BaseHTTPRequestHandler):
    """Routes requests to the StandIn; quiet, keep-alive, and indifferent to vanished clients."""

    protocol_version = "HTTP/1.1"  # keep-alive, like the real API and pooled clients
    # Headers and body go out in separate writes; with Nagle on, the client's delayed ACK
    # adds ~40 ms to every answer, which would swamp any benchmark.
    disable_nagle_algorithm = True

    @property
    def _standin(self) -> StandIn:
        return cast(_Server, self.server).standin

    def setup(self) -> None:
        super().setup()
        if not self._standin._track(self.connection):
            _shutdown_socket(self.connection)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self._standin._untrack(self.connection)

    def handle(self) -> None:
        # A client that gives up (timeout during `delay`) or a stop() cutting the connection
        # makes writes fail; that is expected here, not a server error worth a traceback.
        try:
            super().handle()
        except ConnectionError:
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        """Silence the per-request access log that BaseHTTPRequestHandler writes to stderr."""

    def _path(self) -> str:
        return urlsplit(self.path).path

    def _read_body(self) -> bytes | None:
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            return None
        if length < 0:
            return None
        return self.rfile.read(length) if length else b""

    def _send(self, reply: _Reply) -> None:
        self.send_response(reply.status)
        self.send_header("Content-Type", reply.content_type)
        self.send_header("Content-Length", str(len(reply.body)))
        for name, value in reply.headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(reply.body)

    def do_GET(self) -> None:
        if self._path() == HEALTH_PATH:
            self._send(_json_reply(200, {"ok": True}))
        else:
            self._send(_error_reply(404, f"Unknown path {self._path()}", code="not_found"))

    def do_POST(self) -> None:
        arrived = time.monotonic()  # the request line and headers are read; the body not yet
        raw = self._read_body()
        if raw is None:
            # Without a usable length the rest of the stream cannot be framed: close it.
            self.close_connection = True
            self._send(_error_reply(400, "A valid Content-Length header is required."))
            return
        path = self._path()
        if path not in (EMBEDDINGS_PATH, CHAT_PATH):
            self._send(_error_reply(404, f"Unknown path {path}", code="not_found"))
            return
        headers = {name.lower(): value for name, value in self.headers.items()}
        raw_answer = self._standin.raw_answer
        if raw_answer is not None:
            status, extra, body = raw_answer
            self._send(_Reply(status, body, headers=extra))
            return
        try:
            if path == CHAT_PATH:
                answer = self._standin.chat.answer(raw, headers)
                reply = _Reply(answer.status, answer.body, headers=answer.headers)
            else:
                reply = self._standin._embeddings(raw, headers, arrived)
        except Exception as exc:  # a bug or an impossible switch value: answer, don't crash
            reply = _error_reply(500, f"Stand-in error: {type(exc).__name__}: {exc}")
        self._send(reply)


# -- command line ----------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Serve until Ctrl-C or SIGTERM, for manual use and benchmarks run as a subprocess."""
    parser = argparse.ArgumentParser(
        prog="python -m testkit.standin",
        description="Serve a deterministic OpenAI-compatible embeddings API on 127.0.0.1.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8089, help="0 picks a free port")
    parser.add_argument("--dimensions", type=int, default=384)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds before each answer")
    parser.add_argument("--chaos", type=float, default=0.0, help="share of requests faulted")
    parser.add_argument("--chaos-seed", type=int, default=0)
    args = parser.parse_args(argv)

    standin = StandIn(args.dimensions, host=args.host, port=args.port)
    standin.delay = args.delay
    standin.chaos, standin.chaos_seed = args.chaos, args.chaos_seed
    # Ctrl-C and SIGTERM set an event rather than raise: a KeyboardInterrupt that arrived
    # before the wait began (a busy machine: right after the address is printed) escaped the
    # try below and the process ended with a traceback instead of stopping cleanly.
    stopping = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stopping.set())
    standin.start()
    try:
        print(standin.base_url, flush=True)
        stopping.wait()
    finally:
        standin.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
