"""What every `kidx` command shares: the group, the settings, output, and errors at the edge.

Every command takes `--db PATH` (default KIDX_DB) and `--json` (machine-readable stdout; logs
go to stderr either way). Exceptions become one-line messages here, never tracebacks.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import math
import os
import re
import sys
import textwrap
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

import apsw
import click
from rich.cells import cell_len, chop_cells, set_cell_size
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table
from rich.text import Text

from worker.errors import Cancelled, ConfigError, InvalidInput, KidxError
from worker.log import Redact, configure_logging
from worker.regular import read_regular
from worker.settings import Settings, load_settings

# An id SQLite can hold (a larger one would overflow before any lookup): a usage error.
# An item id: any 64-bit integer (a host may write 0 or below; give those after `--`, as
# `kidx status -- -7`, or click reads them as options). A batch id is kidx's own, from 1.
ID = click.IntRange(-(2**63), 2**63 - 1)
BATCH = click.IntRange(1, 2**63 - 1)


class _Console(Console):
    """rich's Console, but a closed pipe is the command's edge to judge (`command`): rich's
    own handling ends the process with status 1 and no word (and points stdout at os.devnull,
    even for stderr's pipe), where a reader that has gone is SIGPIPE's quiet end. The console
    script's stdout says OutputClosed itself (`ops.cli._Stdout`); this covers stderr, and a
    stdout of another kind."""

    def on_broken_pipe(self) -> None:
        raise BrokenPipeError(errno.EPIPE, os.strerror(errno.EPIPE))


out = _Console(highlight=False, soft_wrap=True)
err = _Console(stderr=True, highlight=False, soft_wrap=True)

# Columns of free text, which wrap (fold) rather than push a table past the terminal's width;
# every other cell is shown whole.
FOLD = frozenset(
    {"error", "last_error", "summary", "snippet", "title", "content", "path", "task", "task_id"}
)
FOLD_MIN = 18  # a folded column's narrowest
NARROWEST = 20  # a terminal (or COLUMNS) narrower than this is taken as 80 columns wide

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


# The most of one cell a table shows (`--json` gives the whole): rich lays a cell out in time
# that grows faster than its length (a host's 10 MB error took `kidx status` 73 s, a 20 MB
# title kept `kidx search` busy past two minutes).
CELL_MAX = 2_000


def _cell(text: str) -> str:
    return text if len(text) <= CELL_MAX else text[: CELL_MAX - 1] + "…"


def printable(text: object) -> str:
    """`text` with every C0 and C1 control character (tab, newline and ESC included) as
    U+FFFD: what a title, a snippet or an error stored in the database holds is shown, never
    run by the terminal (ESC[2J would clear the screen, ESC]0; set its title)."""
    return _CONTROL.sub("\ufffd", str(text))


def finite(data: Any) -> Any:
    """`data` with every float that is not finite as None (null), as JavaScript's
    JSON.stringify does: SQLite stores infinity (a host's 9e999 in `duration_ms` or
    `chunk_index`), and json.dumps wrote it as `Infinity`, which is no JSON: a strict reader
    of `--json` refused the whole output."""
    if isinstance(data, float):
        return data if math.isfinite(data) else None
    if isinstance(data, dict):
        return {k: finite(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [finite(v) for v in data]
    return data


def fit_width() -> None:
    """COLUMNS=0 (or a terminal a few columns wide) would blank every table: 80 instead."""
    for console in (out, err):
        if console.width < NARROWEST:
            console.width = 80


class Seconds(click.ParamType):
    """A number of seconds, finite and above zero (click's FloatRange lets `nan` through)."""

    name = "seconds"

    def __init__(self, least: float = 0.0, most: float | None = None) -> None:
        self.least, self.most = least, most

    def convert(
        self, value: Any, param: click.Parameter | None, ctx: click.Context | None
    ) -> float:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds) or seconds <= 0:
            self.fail(f"{value!r} is not a positive, finite number of seconds", param, ctx)
        if seconds < self.least or (self.most is not None and seconds > self.most):
            upper = f" to {self.most:g}" if self.most is not None else " or more"
            self.fail(f"{value!r} is not from {self.least:g}{upper} seconds", param, ctx)
        return seconds


class OutputClosed(Exception):
    """stdout is a pipe whose reader has gone (`kidx status | head -1`): the command ends
    quietly (`ops.cli.main`), as git does, with no error line."""


class OutputFailed(OSError):
    """stdout refused a write (`> /dev/full`, a full disk, an I/O error): raised by the
    console script's stdout (`ops.cli.main`) in place of the bare OSError, which would read
    as the database's or a source file's ("No space left on device": was the note added?)."""


def output_failed(e: OutputFailed, done: str | None = None) -> NoReturn:
    """One line on stderr and status 1, as `echo hi > /dev/full` does; `done`: what the
    command had already done (`item 7 was added`), which its lost output would have said.
    What is still buffered for stdout goes to os.devnull: the interpreter's last flush would
    fail again, with a traceback."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        os.close(null)
    after = f" ({done})" if done else ""
    fail(f"write error on stdout: {e.strerror or e}{after}")


def stdout_closed() -> bool:
    """Whether stdout is a pipe with no reader left (poll reports POLLERR on its write end)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # not a file, closed, or no poll()
        return False


def not_utf8(name: str, value: str) -> InvalidInput | None:
    """The error for an argument that is not UTF-8 (its bytes came in as lone surrogates,
    Python's surrogateescape), or None: kidx stores text and paths as UTF-8."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        at = len(value[: e.start].encode("utf-8"))
        try:
            byte = value[e.start].encode("utf-8", "surrogateescape")[0]
            where = f" (byte 0x{byte:02x} at offset {at})"
        except UnicodeEncodeError:  # a surrogate that was not a byte of the argument
            where = f" (at offset {at})"
        return InvalidInput(f"{name} is not UTF-8{where}: kidx takes text and paths as UTF-8")
    return None


def check_utf8(params: dict[str, Any]) -> None:
    """Every argument and option of this command is UTF-8, or InvalidInput naming it (before
    anything is read or written)."""
    command_params = {p.name: p for p in click.get_current_context().command.params}
    for key, value in params.items():
        values = value if isinstance(value, tuple | list) else (value,)
        for v in values:
            if not isinstance(v, str | Path):
                continue
            param = command_params.get(key)
            if isinstance(param, click.Option):
                name = max(param.opts, key=len)
            else:
                name = param.human_readable_name if param is not None else key
            if problem := not_utf8(name, str(v)):
                raise problem


class Ctx:
    """What every command gets: the settings (built once) and the output mode."""

    def __init__(self, settings: Settings, as_json: bool) -> None:
        self.settings = settings
        self.json = as_json
        self.redact = Redact(settings.secrets())
        # What the command has done that its output reports (`item 7 was added`): said on
        # stderr should stdout refuse the output (`output_failed`).
        self.done: str | None = None

    def store(self, *, create: bool = False, claim: bool = False, adopt: bool = False) -> Any:
        """The database, which must exist: a mistyped --db or KIDX_DB is one line ("no database
        at PATH; run `kidx init`"), not a new empty database in new folders that a read-only
        command then reports as empty. `create=True`: init and add, which make it. `claim`:
        the command embeds here (`--inline`, memories): the index becomes its model's; any
        other command leaves an index of another model as it is (a shell with a stale .env
        switched the workers' index back; `connect`). `adopt`: init, which alone adds kidx's
        tables to a file that holds another program's."""
        from worker.store import open_store

        return open_store(self.settings, create=create, claim=claim, adopt=adopt)

    def embedder(self, db: Any) -> Any:
        from worker.providers import build_embedder

        return build_embedder(self.settings.embedding, dimensions=db.dimensions)

    def reader(self) -> Any:
        """Where files, URLs and code are read from, with the configured roots and limits."""
        from worker.sources import Reader

        return Reader(self.settings.files, self.settings.urls)

    def app(self) -> Any:
        """A Celery app for these settings (the broker of KIDX_BROKER_URL)."""
        from worker.app import create_app

        return create_app(self.settings)

    def redis(self) -> Any:
        """A client of the broker's Redis that gives up within the broker patience."""
        from tasks.redis_at import redis_at

        return redis_at(self.settings.broker_url, self.settings.tasks.broker_patience)

    def broker_redis(self) -> Any:
        """`redis()` if the broker answers, else None, said once on stderr: in-process runs
        take the items' locks there, and go on without them when there is no broker."""
        import redis

        from worker.sources.urls import safe_url

        client = self.redis()
        try:
            client.ping()
        except (redis.RedisError, OSError) as e:
            client.close()
            if not self.json:
                where = safe_url(self.settings.broker_url)
                err.print(
                    f"note: no broker at {escape(where)} ({escape(str(e))}): indexing "
                    "without the items' locks"
                )
            return None
        return client

    def say(self, text: object) -> str:
        """Free text that may hold stored data, as it may be shown: no control character,
        no secret, and no longer than a table's cell (`_cell`: a host's 100 MB error was one
        line of `kidx doctor`, 5 s and 700 MB to print; `--json` has it whole)."""
        return _cell(printable(self.redact.scrub(str(text))))

    def echo(self, text: object) -> None:
        """A line on stdout that may hold stored data (an abort reason, an error): `say`."""
        click.echo(self.say(text))

    def emit(self, data: Any, human: Callable[[], None]) -> None:
        """Print `data` as JSON, or call `human` to print it for people; no secret gets out
        either way (a provider's error text may quote the key)."""
        if self.json:
            # ASCII (still the same JSON): a stdout whose encoding is not UTF-8 takes it.
            data = finite(self.redact.scrub(data))
            click.echo(json.dumps(data, ensure_ascii=True, default=str))
        else:
            human()

    def table(
        self,
        headers: Sequence[str],
        rows: Iterable[Sequence[object]],
        *,
        drop: Sequence[str] = (),
    ) -> None:
        """A table on stdout that fits the terminal (80 columns when there is none): a status,
        a number or an id is never cut to `index…`; free text (FOLD) wraps; when the rest is
        still too wide, the `drop` columns go, least useful first (`--json` has them all).
        Cells are plain text (a title like "Plan [draft]" is not markup), with no control
        character (`printable`): what the database holds never drives the terminal."""
        names = list(headers)
        cells = [[Text(_cell(self.say("" if c is None else c))) for c in row] for row in rows]

        def natural(i: int) -> int:
            lines = (line for row in cells for line in row[i].plain.splitlines() or [""])
            return max(len(names[i]), *(len(x) for x in lines)) if cells else len(names[i])

        def width(i: int) -> int:
            return min(natural(i), FOLD_MIN) if names[i] in FOLD else natural(i)

        keep = list(range(len(names)))
        for name in drop:
            if sum(width(i) + 3 for i in keep) + 1 <= out.width:
                break
            if name in names and names.index(name) in keep:
                keep.remove(names.index(name))
        if len(cells) > PLAIN_ROWS:
            _plain_table([names[i] for i in keep], [[r[i] for i in keep] for r in cells])
            return
        # Too wide as it is: the table takes the terminal's width, and the free-text columns
        # share what the others leave in proportion to their text (rich's own squeeze would
        # give a title as much room as the snippet beside it).
        squeeze = sum(natural(i) + 3 for i in keep) + 1 > out.width
        table = Table(
            *(
                Column(
                    names[i],
                    overflow="fold",
                    min_width=min(natural(i), FOLD_MIN),
                    ratio=max(FOLD_MIN, min(natural(i), 60)) if squeeze else None,
                )
                if names[i] in FOLD
                else Column(names[i], no_wrap=True, min_width=natural(i))
                for i in keep
            ),
            expand=squeeze and any(names[i] in FOLD for i in keep),
        )
        for row in cells:
            table.add_row(*(row[i] for i in keep))
        out.print(table)


# Past this many rows a table is printed plain, a line a row: rich lays out every cell of a
# table at once, 0.4 ms a row (`kidx status` of 20,000 items took 8 s to print).
PLAIN_ROWS = 1000


def _plain_table(names: list[str], cells: list[list[Text]]) -> None:
    """`Ctx.table`'s rows as aligned lines under a header: every column but free text at its
    widest cell, free text (FOLD) sharing what is left of the terminal, wrapped onto lines
    of its own (cut with `…`, a failure's reason lost its end past 1,000 rows)."""
    texts = [[" ".join(c.plain.split()) for c in row] for row in cells]
    widest = [
        max(cell_len(names[i]), *(cell_len(row[i]) for row in texts)) for i in range(len(names))
    ]
    folds = [i for i, n in enumerate(names) if n in FOLD]
    room = out.width - sum(w for i, w in enumerate(widest) if i not in folds) - 2 * len(names)
    share = max(FOLD_MIN, room // len(folds)) if folds else 0
    widths = [min(w, share) if i in folds else w for i, w in enumerate(widest)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(set_cell_size(v, w) for v, w in zip(values, widths, strict=True)).rstrip()

    def wrapped(values: Sequence[str]) -> list[str]:
        pieces = [
            _wrap(v, w) if i in folds else [v]
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ]
        return [
            line([p[n] if n < len(p) else "" for p in pieces])
            for n in range(max(len(p) for p in pieces))
        ]

    lines = [line(names), "  ".join("─" * w for w in widths)]
    for row in texts:
        lines += wrapped(row)
    click.echo("\n".join(lines))


def _wrap(value: str, width: int) -> list[str]:
    """Free text in lines of at most `width` cells: at spaces (textwrap) when every character
    takes one cell, else at `width` cells (rich's chop_cells: wide CJK characters take two)."""
    if cell_len(value) <= width:
        return [value]
    if all(cell_len(c) == 1 for c in value):  # (a wide character and a mark: two, not one)
        return textwrap.wrap(value, width, break_on_hyphens=False) or [""]
    return chop_cells(value, width)


def configure_cli_logging(settings: Settings, verbose: bool) -> None:
    """Every record at KIDX_LOG_LEVEL in `$KIDX_DATA_DIR/log/kidx.log`; on stderr only
    warnings and errors, unless asked (`--verbose`, or KIDX_LOG_LEVEL set): a command's output
    is its own, not two hundred lines of a run's progress. A data directory that is not there
    is not made for the log: a command run in the wrong folder leaves nothing behind."""
    asked = verbose or "log_level" in settings.model_fields_set
    data = Path(settings.data_dir)
    configure_logging(
        fmt=settings.log_format,
        level=settings.log_level,
        secrets=settings.secrets(),
        stream_level=settings.log_level if asked else "warning",
        file=data / "log" / "kidx.log" if data.is_dir() else None,
    )


def sqlite_detail(e: apsw.Error) -> str:
    """apsw's text in parentheses, unless it is the empty "not an error" that SQLite reports
    for a connection whose own last call succeeded."""
    text = str(e).strip()
    return "" if text.lower() in ("", "not an error") else f" ({text})"


def sqlite_problem(e: apsw.Error, path: str | Path) -> str:
    """What SQLite's error means for the user, naming the file: apsw's own text ("attempt to
    write a readonly database") says neither which file nor what to do."""
    detail = sqlite_detail(e)
    if isinstance(e, apsw.ReadOnlyError):
        return f"{path} is read-only{detail}: kidx needs to write to it and to its folder"
    if isinstance(e, apsw.BusyError):
        return (
            f"{path} is locked: another process holds the write lock{detail}; try again "
            "(KIDX_BUSY_TIMEOUT_MS is how long kidx waits)"
        )
    if isinstance(e, apsw.NotADBError | apsw.CorruptError):
        return f"{path} is not a database, or is corrupt{detail}"
    if isinstance(e, apsw.FullError):
        return f"the disk holding {path} is full{detail}"
    if isinstance(e, apsw.CantOpenError):
        return f"cannot open {path}{detail}: check that it and its folder exist and are readable"
    return f"database {path}: {type(e).__name__}: {e}"


def _is_broker_error(e: Exception) -> bool:
    """redis-py's and kombu's errors, looked up only if they were imported (if not, `e` is
    not one of theirs), so that commands that never talk to the broker do not import them."""
    redis = sys.modules.get("redis")
    kombu = sys.modules.get("kombu.exceptions")
    return (redis is not None and isinstance(e, redis.RedisError)) or (
        kombu is not None and isinstance(e, kombu.OperationalError)
    )


def fail(message: str, code: int = 1, redact: Redact | None = None) -> NoReturn:
    if redact is not None:
        message = redact.scrub(message)
    message = printable(message)  # an error may quote a title, a path, a provider's text
    err.print(f"[red]error:[/red] {escape(message)}", markup=True, highlight=False)
    sys.exit(code)


def os_problem(e: OSError) -> str:
    """An OS error as a command's one line: its words and the file it is about."""
    return f"{e.strerror or e}: {e.filename}" if e.filename else str(e)


@contextlib.contextmanager
def one_line_errors(db: str | Path = "the database") -> Iterator[None]:
    """A script's errors (`make run`'s, `make demo`'s) as a kidx command says them: one line,
    status 2 for invalid settings, 1 for the rest (`db`: the file SQLite's errors are about).
    They printed tracebacks."""
    try:
        yield
    except ConfigError as e:
        fail(str(e), 2)
    except KidxError as e:
        fail(str(e), 1)
    except apsw.Error as e:
        fail(sqlite_problem(e, db), 1)
    except OSError as e:
        fail(os_problem(e), 1)


def command(group: click.Group, name: str | None = None) -> Callable[..., Any]:
    """A subcommand with --db and --json, whose errors become one line: exit status 2 for
    invalid settings (and click's usage errors), 1 for everything else. What SQLite or the
    broker says is told in the user's terms (which file, which broker, what to do); any other
    exception is a bug, told in one line too (`--verbose` shows its traceback)."""

    def wrap(fn: Callable[..., Any]) -> Any:
        @group.command(name or fn.__name__.replace("_", "-"))
        @click.option(
            "--db",
            "db_path",
            # (as given: a Path dropped the slash of `--db store/`, and made a file `store`,
            # which KIDX_DB=store/ refuses)
            type=click.Path(dir_okay=False, path_type=str),
            help="SQLite file (default: KIDX_DB or ./data/kidx.db).",
        )
        @click.option("--json", "as_json", is_flag=True, help="Print JSON on stdout.")
        @click.option(
            "--verbose",
            "-v",
            is_flag=True,
            help="Log lines on stderr too (else below warning only in $KIDX_DATA_DIR/log).",
        )
        @functools.wraps(fn)
        def run(db_path: str | None, as_json: bool, verbose: bool, **kwargs: Any) -> None:
            redact = None
            settings: Settings | None = None
            ctx: Ctx | None = None
            try:
                check_utf8({"db_path": db_path, **kwargs})
                fit_width()
                settings = load_settings(**({"db": db_path} if db_path is not None else {}))
                redact = Redact(settings.secrets())
                configure_cli_logging(settings, verbose)
                ctx = Ctx(settings, as_json)
                fn(ctx, **kwargs)
            except OutputFailed as e:
                output_failed(e, ctx.done if ctx is not None else None)
            except OutputClosed:
                raise  # the reader of stdout has gone: a quiet end (`ops.cli.main`)
            except ConfigError as e:
                fail(str(e), 2, redact)
            except (KidxError, Cancelled) as e:
                fail(str(e), 1, redact)
            except apsw.Error as e:
                fail(sqlite_problem(e, settings.db if settings else "the database"), 1, redact)
            except BrokenPipeError:
                if stdout_closed():
                    raise OutputClosed() from None
                fail("a pipe was closed (EPIPE) while kidx wrote to it", 1, redact)
            except OSError as e:
                fail(os_problem(e), 1, redact)
            except (click.ClickException, click.exceptions.Exit, click.Abort):
                raise  # click's own: usage errors (status 2), aborts
            except Exception as e:
                if settings is not None and _is_broker_error(e):
                    from worker.sources.urls import safe_url

                    where = safe_url(settings.broker_url)
                    fail(
                        f"the broker at {where} is unreachable ({type(e).__name__}: {e}): "
                        "start Redis, or check KIDX_BROKER_URL",
                        1,
                        redact,
                    )
                if verbose:
                    raise
                fail(
                    f"unexpected {type(e).__name__}: {e} (a bug in kidx; "
                    "run again with --verbose to see where)",
                    1,
                    redact,
                )

        return run

    return wrap


@click.group()
@click.version_option(package_name="kidx")
def cli() -> None:
    """kidx: notes, files, URLs and code into chunks with vectors in SQLite + sqlite-vec."""


def read_text(text: str | None, file: Path | None, max_bytes: int) -> str:
    """A note's text, given or read from `file` (decoded as a text file is, its line ends
    made `\n`), which may hold at most `max_bytes` (KIDX_FILES__MAX_BYTES, as `kidx add file`): a
    1.2 GB file was read whole (2.5 GB of memory, then SQLite's "string or blob too big")."""
    if (text is None) == (file is None):
        raise InvalidInput("give exactly one of --text and --file")
    if file is None:
        return text or ""
    try:
        data = read_regular(file, max_bytes + 1, follow=True)
    except OSError as e:
        raise InvalidInput(f"{file} cannot be read ({e.strerror or e})") from None
    if data is None:
        raise InvalidInput(f"not a readable file: {file}")
    if len(data) > max_bytes:
        raise InvalidInput(
            f"{file} is larger than KIDX_FILES__MAX_BYTES ({max_bytes} bytes); "
            "`kidx add file` takes a file up to that size too"
        )
    from worker.sources.decoding import decode_text

    # As `kidx add file` reads a text file: a byte-order mark read and dropped (UTF-8's stayed
    # at the note's start, UTF-16's failed as "not UTF-8"), NUL bytes refused as binary.
    return decode_text(data, file)
