"""The `kidx` command: engine commands (`ops.cli.engine`) and queue commands (`ops.cli.queue`)."""

import io
import os
import signal
import sys
from typing import Any

from ops.cli import backup, doctor, engine, items, queue  # noqa: F401 - register commands
from ops.cli.base import OutputClosed, OutputFailed, cli, output_failed


def _standard_streams() -> None:
    """stdin, stdout and stderr as the commands expect them, whatever the process was given:

    * a closed one (`kidx ... 2>&-`: Python makes it None) is os.devnull, at its own file
      descriptor when that is free (as git does), so that no file opened later (the database)
      takes descriptor 2 and gets what is written there;
    * stdout and stderr replace what their encoding cannot hold (`PYTHONIOENCODING=latin-1`
      and a snippet's `…`) rather than fail the command;
    * a write that stdout refuses raises OutputFailed (`_Stdout`).
    """
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        if getattr(sys, name) is not None:
            continue
        try:
            os.fstat(fd)
        except OSError:  # closed: devnull there
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            stream = open(fd, mode, encoding="utf-8", closefd=False)  # noqa: SIM115
        else:  # the descriptor is something else's now: a stream of its own
            stream = open(os.devnull, mode, encoding="utf-8")  # noqa: SIM115
        setattr(sys, name, stream)
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="replace")
    sys.stdout = _own_stdout(sys.stdout)


class _Stdout(io.FileIO):
    """File descriptor 1, whose write errors say they are stdout's: OutputFailed, which the
    command's edge tells apart from a file's or the database's OSError; OutputClosed for a
    reader that has gone (EPIPE on stdout), which is no OSError: click's own handling of one
    (outside a command: `kidx --help | true`) would end the process with status 1, rich's
    with status 1 too, where it ends quietly by SIGPIPE (`main`)."""

    def write(self, data: Any) -> int | None:
        try:
            return super().write(data)
        except BrokenPipeError:
            raise OutputClosed() from None
        except OSError as e:
            raise OutputFailed(e.errno, e.strerror) from None


def _own_stdout(stream: Any) -> Any:
    """`stream` (Python's stdout) as a stream of the same encoding and buffering over
    `_Stdout`; unchanged when it is not file descriptor 1 (os.devnull in its place)."""
    try:
        if not isinstance(stream, io.TextIOWrapper) or stream.fileno() != 1:
            return stream
        stream.flush()
    except (OSError, ValueError):
        return stream
    return io.TextIOWrapper(
        io.BufferedWriter(_Stdout(1, "w", closefd=False)),
        encoding=stream.encoding,
        errors=stream.errors,
        line_buffering=stream.line_buffering,
    )


def _end_quietly() -> None:
    """The reader of stdout has gone (`kidx status | head -1`): end as git does, by SIGPIPE's
    default action (status 141 in a shell), with no message; nothing more is written."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())  # the interpreter's last flush goes nowhere
        os.close(null)
    except (OSError, ValueError, AttributeError):
        pass
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGPIPE)
    os._exit(141)


def main() -> None:
    _standard_streams()
    try:
        try:
            cli(prog_name="kidx")
        finally:
            sys.stdout.flush()  # what is still buffered: a closed pipe shows here too
    except (OutputClosed, BrokenPipeError):
        _end_quietly()
    except OutputFailed as e:  # outside a command: --help, --version
        output_failed(e)
