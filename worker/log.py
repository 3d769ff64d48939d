"""structlog set-up, called once, only from process entry points (CLI, worker, beat).

Events of chunking start with `[Chunk]`, those of item embedding with `[KI Embed]`, the prefixes an
operator greps for. structlog goes through the standard library's logging, so Celery's own lines get
the same JSON shape. Secrets never reach a line: values of secret-looking keys are masked and every
configured secret value is replaced wherever it appears.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import logging.handlers
import os
import re
import stat
import sys
from collections.abc import Iterable, MutableMapping
from pathlib import Path
from typing import Any, TextIO

import structlog

CHUNK = "[Chunk]"
KI_EMBED = "[KI Embed]"
_SECRET_KEY = re.compile(r"api_?key|token|password|secret|authorization", re.I)
_MASK = "***"
_NULL: TextIO | None = None


def _devnull() -> TextIO:
    """One os.devnull stream for the process: where records go when stderr is closed."""
    global _NULL
    if _NULL is None:
        _NULL = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - the process's
    return _NULL


class Redact:
    """A processor that masks secret-looking keys and scrubs known secret values."""

    def __init__(self, secrets: Iterable[str]) -> None:
        self.secrets = sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True)

    def scrub(self, value: Any) -> Any:
        """`value` with secrets masked (strings, and inside dicts, lists and tuples)."""
        if isinstance(value, str):
            for s in self.secrets:
                if s in value:
                    value = value.replace(s, _MASK)
            return value
        if isinstance(value, dict):
            return {
                k: _MASK if _SECRET_KEY.search(str(k)) else self.scrub(v) for k, v in value.items()
            }
        if isinstance(value, list | tuple):
            return type(value)(self.scrub(v) for v in value)
        if isinstance(value, BaseException):
            return self.scrub(f"{type(value).__name__}: {value}")
        return value

    def __call__(self, _logger: Any, _name: str, event: MutableMapping[str, Any]) -> Any:
        for key in list(event):
            if key != "event" and _SECRET_KEY.search(key):
                event[key] = _MASK
            else:
                event[key] = self.scrub(event[key])
        return event


# C0 and C1 control characters but the tab (a line end too: it would forge a line): a host's
# bytes in a model name, a title or an error (index_meta, item rows) reached an operator's
# terminal as escape codes through the console's log lines (a window title set, the screen
# cleared). JSON escapes them.
_CONTROL = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def _visible(value: Any) -> Any:
    if isinstance(value, str):
        return _CONTROL.sub("\ufffd", value)
    return value


# In a traceback: its line ends and indentation kept.
_TRACE_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def visible(_logger: Any, _name: str, event: MutableMapping[str, Any]) -> Any:
    """Control characters in a console line's text and values shown as U+FFFD; in a
    traceback too, but for its line ends and tabs (its last line is the exception's text,
    which may quote a host's: an apsw error of a host's trigger, an ESC sequence in it)."""
    for key in list(event):
        if key != "exception":
            event[key] = _visible(event[key])
        elif isinstance(event[key], str):
            event[key] = _TRACE_CONTROL.sub("\ufffd", event[key])
    return event


class _RegularFileHandler(logging.handlers.RotatingFileHandler):
    """A rotating log file that is only ever a regular file, opened without blocking: a FIFO
    at $KIDX_DATA_DIR/log/kidx.log hung every command in open() (until a reader came). Opened
    so at start and at each rotation; anything else raises OSError (the file is left out)."""

    def _open(self) -> Any:
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(self.baseFilename, flags, 0o666)  # a FIFO with no reader: ENXIO
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EINVAL, "not a regular file", self.baseFilename)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return open(fd, self.mode, encoding=self.encoding, errors=self.errors)

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        """A write or a rotation that fails (a full disk, a folder made read-only): one line
        on stderr, and the file is left out from then on (logging's own handler printed a
        traceback of some 50 lines for every record). Any other error (a record that cannot
        be formatted) is logging's to report, as ever: the file stays."""
        error = sys.exc_info()[1]
        if not isinstance(error, OSError):
            super().handleError(record)
            return
        self.failed = True
        with contextlib.suppress(Exception):
            (sys.stderr or _devnull()).write(
                f"kidx: cannot write the log file {self.baseFilename} ({error}): "
                "it is left out from now on\n"
            )


def configure_logging(
    *,
    fmt: str = "auto",
    level: str = "info",
    secrets: Iterable[str] = (),
    stream: TextIO | None = None,
    stream_level: str | None = None,
    file: Path | None = None,
) -> None:
    """Configure structlog and the standard library's logging for this process: records at
    `level` and above, on `stream` from `stream_level` (default: `level`) and, with `file`, all
    of them as JSON lines in that file (rotated at 10 MB, three kept; a file that cannot be
    written, or that is no regular file, is left out, not an error). With stderr closed
    (`2>&-`: sys.stderr is None), the stream is os.devnull: the process runs on and logs to
    its file."""
    stream = stream or sys.stderr or _devnull()
    as_json = fmt == "json" or (fmt == "auto" and not stream.isatty())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.format_exc_info,
        Redact(secrets),
    ]
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if as_json
        else structlog.dev.ConsoleRenderer(colors=stream.isatty())
    )
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                *(() if as_json else (visible,)),
                renderer,
            ],
        )
    )
    handler.setLevel((stream_level or level).upper())
    handlers: list[logging.Handler] = [handler]
    if file is not None:
        try:
            file.parent.mkdir(parents=True, exist_ok=True)
            to_file = _RegularFileHandler(
                file, maxBytes=10_000_000, backupCount=3, encoding="utf-8"
            )
        except OSError:
            pass
        else:
            to_file.setFormatter(
                structlog.stdlib.ProcessorFormatter(
                    foreign_pre_chain=shared,
                    processors=[
                        structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                        structlog.processors.JSONRenderer(),
                    ],
                )
            )
            handlers.append(to_file)
    root = logging.getLogger()
    for old in root.handlers:
        if getattr(old, "kidx", False):  # ours, from an earlier call (a file left open else)
            old.close()
    for new in handlers:
        new.kidx = True  # type: ignore[attr-defined]
    root.handlers = handlers
    root.setLevel(level.upper())
    for noisy in ("httpx", "httpcore", "transformers", "urllib3", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def get_logger(name: str) -> Any:
    """A structlog logger; before `configure_logging` it prints through structlog's defaults."""
    return structlog.get_logger(name)
