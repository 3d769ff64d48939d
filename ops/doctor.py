"""`kidx doctor`: check every part of the stack and say what to do about each problem.

A check is a function of the settings and a timeout: it returns what it found (all is well) or
raises `Fail` or `Warn` with what is wrong and what to do. The checks run in parallel threads,
each bounded by the timeout, so one that hangs or fails stops none of the others. A check that
needs something broken (the database, Redis, sqlite-vec) raises `NotChecked`, a warning: the
broken part's own check is the one FAIL line for that problem.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import apsw
import httpx
import redis

import worker.providers.chat
import worker.providers.openai  # noqa: F401 - imported here, never by two check threads at once
from ops.stack import url_host
from scheduler.beat import HEARTBEAT_KEY, LEASE_KEY, LEASE_TTL
from tasks.lock import conflict, not_a_lock
from tasks.redis_at import redis_at
from worker.chunking.llm import INSTRUCTIONS, SCHEMA, SYSTEM
from worker.errors import BadAnswer, StoreError
from worker.log import Redact
from worker.providers import build_chat, build_embedder
from worker.reconcile import changed_by_hand, last_sweeps
from worker.settings import Settings, deadline_problem
from worker.sources.urls import safe_url
from worker.store import VEC_TABLES, Database, resolve_dimensions, vec_table_dimensions
from worker.store.fts import CHECKED, FTS_TABLES, fts_counts, fts_intact
from worker.store.removal import leftovers
from worker.store.schema import SCHEMA_VERSION, host_objects, schema_problems, schema_version
from worker.store.text import integer_or_null, shown
from worker.store.vec import VEC0_MAX_DIMENSIONS, config_conflict

DEFAULT_TIMEOUT = 5.0
# A WAL past this is not being checkpointed (workers cut it back to 16 MB once emptied; a bulk
# run's transactions take a few MB each).
WAL_WARN_BYTES = 256 * 1024 * 1024
RECONCILE = "run a reconcile sweep (celery -A worker.app call kidx.reconcile) or `kidx index --all`"
_WRONG_DIM = re.compile(r"vectors have (\d+) dimensions, the index expects (\d+)")


@dataclass(frozen=True)
class Check:
    """One line of the report; `ok` unless the level is `fail` (a warning is not a failure)."""

    check: str
    level: str  # "ok" | "warn" | "fail"
    detail: str
    fix: str = ""

    @property
    def ok(self) -> bool:
        return self.level != "fail"

    def as_dict(self) -> dict[str, Any]:
        return {"check": self.check, "ok": self.ok, **asdict(self)}

    def line(self) -> str:
        text = f"{self.detail}: {self.fix}" if self.fix else self.detail
        return f"{self.level.upper() if self.level != 'ok' else 'ok':<5} {self.check:<10} {text}"


class Fail(Exception):
    """What is wrong, and what to do about it."""

    level = "fail"

    def __init__(self, detail: str, fix: str = "") -> None:
        super().__init__(detail)
        self.detail, self.fix = detail, fix


class Warn(Fail):
    level = "warn"


class NotChecked(Warn):
    """Something this check needs is broken, and reported by its own check."""

    def __init__(self, why: str) -> None:
        super().__init__(f"not checked: {why}")


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


# -- the database ----------------------------------------------------------------------------


@contextmanager
def _store(settings: Settings, timeout: float, *, vec: bool = False) -> Iterator[Database]:
    """The database as it is (no migration, no vec-table rebuild, unlike `open_store`), with
    the resolved dimension; `vec`: sqlite-vec is needed, and its tables at that dimension."""
    if not Path(settings.db).is_file():
        raise NotChecked(f"no database at {settings.db}")
    try:
        db = Database(settings.db, busy_timeout_ms=int(timeout * 1000), create=False, wal=False)
    except StoreError:  # (not a database at all: the database check says so, once)
        raise NotChecked("the database cannot be opened") from None
    try:
        try:
            current = schema_version(db) == SCHEMA_VERSION
        except StoreError:
            current = False
        if not current:  # older, newer or unreadable: the database check says which
            raise NotChecked("the database schema is not this kidx's")
        if settings.vec and vec:
            db.load_vec(settings.vec_path)
        db.resolution = resolve_dimensions(db, settings.embedding)
        if vec and not db.vec_loaded:
            raise NotChecked("sqlite-vec is not loaded")
        yield db
    finally:
        db.close()


def check_database(settings: Settings, timeout: float) -> str:
    path = Path(settings.db)
    if not path.is_file():
        raise Fail(f"no database at {path}", "check KIDX_DB, or create it with `kidx init`")
    wal_path = Path(f"{path}-wal")  # before this check's connection (its close empties it)
    wal = wal_path.stat().st_size if wal_path.is_file() else 0
    try:
        db = Database(path, busy_timeout_ms=int(timeout * 1000), create=False, wal=False)
    except StoreError as e:
        raise Fail(str(e), "point KIDX_DB at a kidx database, or restore a backup") from None
    try:
        try:
            version = schema_version(db)
        except StoreError as e:
            raise Fail(str(e), "point KIDX_DB at a kidx database, or restore a backup") from None
        if version > SCHEMA_VERSION:
            raise Fail(
                f"{path} has schema {version}, written by a newer kidx (this one knows "
                f"{SCHEMA_VERSION}); this kidx refuses to open it",
                "upgrade kidx here (and in the workers) to the version that wrote it",
            )
        if version < SCHEMA_VERSION:
            raise Fail(f"{path} has schema {version}, not {SCHEMA_VERSION}", "run `kidx init`")
        refused, again = schema_problems(db)  # (what a host changed: workers' connect says)
        if refused is not None:
            raise Fail(refused)
        items = db.scalar("SELECT count(*) FROM knowledge_items")
        said = f"{path} (schema {version}, {items} items, WAL {wal / 1e6:.1f} MB)"
        if again:
            raise Warn(
                f"{said}: dropped or altered outside kidx: {', '.join(again)}",
                "the next reconcile sweep (or kidx process) makes them again and refills them; "
                "until then runs that write there fail",
            )
        if theirs := host_objects(db):  # (information: a host may index kidx's tables)
            said += f"; not kidx's, on its tables: {', '.join(theirs)}"
        if wal > WAL_WARN_BYTES:
            raise Warn(
                f"{said}: the WAL is not being emptied into the database (reads slow down and "
                "the disk fills)",
                "look for a process that keeps a read transaction open on the database; a "
                "checkpoint can only copy what no reader still needs",
            )
        return said
    finally:
        db.close()


def check_vec(settings: Settings, timeout: float) -> str:
    if not settings.vec:
        raise Warn("off (KIDX_VEC=off): search scans vectors in memory", "unset KIDX_VEC")
    db = Database(":memory:")
    try:
        if db.load_vec(settings.vec_path):
            return f"{db.vec_version}" + (f" from {settings.vec_path}" if settings.vec_path else "")
        if settings.vec_path:
            fix = "point KIDX_VEC_PATH at the sqlite-vec library, or unset it (the package's)"
        else:
            fix = "install sqlite-vec (pip install sqlite-vec)"
        raise Fail(f"cannot load sqlite-vec: {db.vec_error}", fix)
    finally:
        db.close()


def check_dimensions(settings: Settings, timeout: float) -> str:
    with _store(settings, timeout, vec=True) as db:
        want, tables = db.dimensions, vec_table_dimensions(db)
        source = db.resolution.source if db.resolution else "?"
        conflict = config_conflict(db)
    if conflict is not None:  # first: the tables are the other model's, no `kidx init` mends it
        raise Warn(
            conflict,
            "a rolling restart not finished, or a stale .env: see 'Switching the embedding "
            "model' in ops/README.md",
        )
    if want > VEC0_MAX_DIMENSIONS:
        raise Warn(
            f"{want} dimensions (from the {source}): past sqlite-vec's {VEC0_MAX_DIMENSIONS}, "
            "so no vec tables; search is exact, in memory, slower as the index grows",
            f"a model or KIDX_EMBEDDING__DIMENSIONS of at most {VEC0_MAX_DIMENSIONS}",
        )
    if missing := [name for name, d in tables.items() if d is None]:
        raise Fail(f"vec tables missing: {', '.join(missing)}", "`kidx init` creates them")
    if wrong := [f"{name} {d}" for name, d in tables.items() if d != want]:
        raise Fail(
            f"vec tables at another dimension ({', '.join(wrong)}) than the resolved {want} "
            f"(from the {source})",
            "`kidx init` rebuilds them (items of another dimension become pending)",
        )
    return f"{want} (from the {source}) in all {len(tables)} vec tables"


def check_rows(settings: Settings, timeout: float) -> str:
    counts, problems = [], []
    with _store(settings, timeout, vec=True) as db:
        d = db.dimensions
        if any(v != d for v in vec_table_dimensions(db).values()):
            raise NotChecked("the vec tables are not at the resolved dimension")
        for t in VEC_TABLES:
            truth = f"SELECT {t.source_key} FROM {t.source} WHERE dimensions = ?"
            missing = db.scalar(
                f"SELECT count(*) FROM ({truth}) WHERE {t.source_key} NOT IN "
                f"(SELECT {t.key} FROM {t.name})",
                (d,),
            )
            orphans = db.scalar(
                f"SELECT count(*) FROM {t.name} WHERE {t.key} NOT IN ({truth})", (d,)
            )
            counts.append(f"{t.name} {db.scalar(f'SELECT count(*) FROM {t.name}')}")
            problems += [f"{_n(missing, 'vector')} missing from {t.name}"] if missing else []
            if orphans:
                problems.append(f"{_n(orphans, 'orphan')} in {t.name}")
    if problems:
        raise Fail("; ".join(problems), RECONCILE)
    return "vec tables match the relational rows: " + ", ".join(counts)


def check_leftovers(settings: Settings, timeout: float) -> str:
    """Rows that no live item reaches: what a deleted item left (worker.store.removal); and
    indexed items whose chunks or whole-item vector were deleted (or added) outside kidx: the
    sweep indexes them again."""
    with _store(settings, timeout) as db:
        found = leftovers(db)
        by_hand = changed_by_hand(db)
    problems = []
    if found:
        shown = ", ".join(f"{kind} {n}" for kind, n in found.items())
        problems.append(f"rows of deleted items left behind: {shown}")
    for name, what in (
        ("chunks_lost", "chunk rows"),
        ("whole_vector", "a whole-item vector"),
    ):
        if ids := by_hand[name]:
            shown = ", ".join(map(str, ids[:5])) + (", ..." if len(ids) > 5 else "")
            problems.append(
                f"{_n(len(ids), 'indexed item')} with {what} deleted or added by hand ({shown})"
            )
    if problems:
        raise Fail("; ".join(problems), RECONCILE)
    return "no rows of deleted items, no chunks lost"


def check_keywords(settings: Settings, timeout: float) -> str:
    """The keyword index against the chunks (worker.store.fts): one row per live chunk."""
    unchecked = None
    with _store(settings, timeout) as db:
        counts = fts_counts(db)
        missing_tables = [t.name for t in FTS_TABLES if not db.table_exists(t.name)]
        broken = []
        for t in FTS_TABLES:
            if t.name in missing_tables:
                continue
            try:
                if not fts_intact(db, t):
                    broken.append(t.name)
            # FTS5's check is an INSERT command: it needs the write lock, which a worker's
            # long write (or a read-only file) keeps from it. The check failed on that.
            except (apsw.BusyError, apsw.LockedError, apsw.ReadOnlyError) as e:
                unchecked = f"{type(e).__name__}: {e}"
                break
        if broken:  # the next sweep checks (and rebuilds), not the next hourly one
            with contextlib.suppress(apsw.Error):
                db.execute("DELETE FROM index_meta WHERE key = ?", (CHECKED,))
    problems = [f"{name} is missing" for name in missing_tables]
    problems += [f"{name}: its index does not match its text" for name in broken]
    for name, c in counts.items():
        if name in missing_tables:
            continue
        if c["missing"]:
            problems.append(f"{_n(c['missing'], 'chunk')} without a row in {name}")
        if c["stale"]:
            problems.append(f"{_n(c['stale'], 'stale row')} in {name}")
    if problems:
        raise Fail("; ".join(problems), RECONCILE)
    said = "one keyword row per chunk in " + ", ".join(counts)
    if unchecked is not None:
        raise Warn(
            f"{said}; FTS5's integrity check not run ({unchecked}): it needs the write lock",
            "the reconcile sweep runs it hourly; run kidx doctor again when no write is long",
        )
    return said


def check_failed(settings: Settings, timeout: float) -> str:
    with _store(settings, timeout) as db:
        # The error as bytes: a host's TEXT there that is not UTF-8 made this check report
        # apsw's UnicodeDecodeError in place of the failed items.
        rows = db.all(  # (the error's start: a host's 100 MB one was read whole)
            "SELECT item_id, substr(CAST(last_error AS BLOB), 1, 2000) FROM item_index_state "
            "WHERE status = 'failed' ORDER BY updated_at DESC"
        )
    if rows:
        last = f" (last: {shown(rows[0][1])})" if rows[0][1] else ""
        raise Fail(
            f"{_n(len(rows), 'item')} failed to index{last}",
            "see `kidx jobs --failed`, then `kidx retry --failed`",
        )
    return "no failed items"


def check_stuck(settings: Settings, timeout: float) -> str:
    limit = settings.tasks.time_limit
    # As the sweeps take an age (worker.reconcile): whole, so that a time in the future (a
    # clock set back, a host's year 9999) is no run under way, and a time SQLite cannot read
    # says nothing of one: both were never called stuck, and the sweeps end them as overruns.
    older = "coalesce(abs(julianday('now') - julianday({})) * 86400 > ?, 1)"
    with _store(settings, timeout) as db:
        runs = db.all(
            # (an item id that is no integer, a host's, as NULL: it may be TEXT apsw cannot read)
            f"SELECT DISTINCT {integer_or_null('item_id')} "
            "FROM index_jobs WHERE state = 'started' AND " + older.format("started_at"),
            (limit,),
        )
        items = db.all(
            "SELECT item_id FROM item_index_state WHERE status = 'indexing' AND "
            + older.format("updated_at"),
            (limit,),
        )
    if runs or items:
        ids = sorted({r[0] for r in runs + items if r[0] is not None})
        shown = " ".join(map(str, ids[:10])) + (" ..." if len(ids) > 10 else "")
        raise Fail(
            f"stuck: {_n(len(runs), 'run')} started and {_n(len(items), 'item')} indexing longer "
            f"than the time limit ({limit} s): items {shown}",
            f"check the workers (`kidx jobs`), then "
            f"`kidx retry {'-- ' if ids and ids[0] < 0 else ''}{shown}`",
        )
    return f"nothing running longer than {limit} s"


def check_sweeps(settings: Settings, timeout: float) -> str:
    with _store(settings, timeout) as db:
        sweeps = last_sweeps(db)
    shown = [f"{kind} at {s.get('at')} (sent {s.get('sent', 0)})" for kind, s in sweeps.items()]
    return "last " + "; ".join(sorted(shown)) if shown else "no sweep has run yet"


# -- Redis, workers, beat, Flower ------------------------------------------------------------


def _redis(settings: Settings, timeout: float, *, needed: bool = True) -> redis.Redis:
    client = redis_at(settings.broker_url, timeout)
    if needed:
        try:
            client.ping()
        except redis.RedisError:
            client.close()
            raise NotChecked("Redis is unreachable") from None
    return client


def check_redis(settings: Settings, timeout: float) -> str:
    url = safe_url(settings.broker_url)
    client = _redis(settings, timeout, needed=False)
    try:
        return f"{url} (Redis {client.info('server').get('redis_version', '?')})"
    except redis.RedisError as e:
        raise Fail(
            f"Redis unreachable at {url} ({e})", "start Redis, or fix KIDX_BROKER_URL"
        ) from None
    finally:
        client.close()


def check_workers(settings: Settings, timeout: float) -> str:
    from worker.app import create_app  # imports build the default app: not at `kidx`'s start

    _redis(settings, timeout).close()
    app = create_app(settings)
    try:
        replies = app.control.ping(timeout=max(0.5, min(2.0, timeout / 2))) or []
    finally:
        app.close()
    if not (names := sorted(name for reply in replies for name in reply)):
        raise Fail("no worker answered a ping", "start one (celery -A worker.app worker)")
    return f"{len(names)} online: {', '.join(names)}"


def check_beat(settings: Settings, timeout: float) -> str:
    client = _redis(settings, timeout)
    try:
        pipe = client.pipeline().type(HEARTBEAT_KEY).get(HEARTBEAT_KEY)
        kind, value, lease, lease_ttl = (
            pipe.type(LEASE_KEY).pttl(LEASE_KEY).execute(raise_on_error=False)
        )
        # A lease that is no beat's (another type, or a string that never expires): beat
        # follows it for good, sending nothing, while its heartbeat says all is well.
        if (what := not_a_lock(lease, lease_ttl)) is not None:
            raise Fail(
                str(conflict(client, LEASE_KEY, what)), "until then beat sends no sweep at all"
            )
    finally:
        client.close()
    start = "start beat (celery -A worker.app beat)"
    if kind == b"none":
        raise Fail(f"no beat heartbeat in Redis ({HEARTBEAT_KEY})", start)
    age = math.nan  # beat writes its time in seconds, then its host:pid
    if kind == b"string":
        at, _, identity = value.decode(errors="replace").partition(" ")
        with contextlib.suppress(ValueError):
            age = time.time() - float(at)
    if not math.isfinite(age):  # a host's list, hash or text at beat's key
        shown = repr(value[:40]) if kind == b"string" else f"a {kind.decode(errors='replace')}"
        raise Fail(
            f"{HEARTBEAT_KEY} holds {shown}, not beat's heartbeat: another program writes it",
            "find what writes it; a running beat writes the key over at its next tick",
        )
    if age < -LEASE_TTL:
        raise Fail(
            f"the beat heartbeat in {HEARTBEAT_KEY} is {-age:.3g} s in the future ({identity})",
            "this host's clock and beat's differ, or another program writes the key",
        )
    if age > LEASE_TTL:
        raise Fail(
            f"the last beat heartbeat is {age:.0f} s old ({identity})",
            "beat is stuck or stopped: restart it (celery -A worker.app beat)",
        )
    return f"heartbeat {max(age, 0):.0f} s ago from {identity}"


def check_flower(settings: Settings, timeout: float) -> str:
    f = settings.flower
    url = f"http://{url_host(f.address)}:{f.port}/healthcheck"
    try:
        status = httpx.get(url, timeout=timeout).status_code  # open: no credentials needed
        problem = f"HTTP {status}"
    except httpx.HTTPError as e:
        status, problem = 0, str(e) or type(e).__name__
    if status != 200:
        raise Fail(
            f"Flower not reachable at {url} ({problem})",
            "start it (python -m ops.flower), or fix KIDX_FLOWER__ADDRESS/PORT",
        )
    return url


# -- the models ------------------------------------------------------------------------------


def _quick(settings: Any, timeout: float) -> Any:
    """Provider settings that answer within `timeout`, without retries."""
    t = min(settings.timeout, timeout)
    limits = {"timeout": t, "connect_timeout": min(settings.connect_timeout, t), "max_retries": 0}
    return settings.model_copy(update=limits)


def check_embedding(settings: Settings, timeout: float) -> str:
    e = settings.embedding
    if e.provider == "none":
        raise Warn(
            "KIDX_EMBEDDING__PROVIDER=none: nothing gets vectors",
            "set KIDX_EMBEDDING__PROVIDER to openai or local",
        )
    with _store(settings, timeout) as db:
        want = db.dimensions
    embedder = build_embedder(_quick(e, timeout), dimensions=want)
    assert embedder is not None
    try:
        got = int(embedder.embed(["kidx doctor"]).shape[1])
    except BadAnswer as err:
        if not (m := _WRONG_DIM.search(str(err))):
            raise Fail(f"unusable answer: {err}", "check the provider and model") from None
        got = int(m.group(1))
    except Exception as err:
        fix = "check it, KIDX_EMBEDDING__BASE_URL and the API key"
        raise Fail(f"{e.provider} {e.model} did not answer: {err}", fix) from None
    finally:
        embedder.close()
    if got != want:
        raise Fail(
            f"wrong dimension: the provider returns {got}, the index has {want}",
            "set KIDX_EMBEDDING__DIMENSIONS or switch back the model",
        )
    return f"{e.provider} {e.model} answers with {got} dimensions"


def check_chunk(settings: Settings, timeout: float) -> str:
    if not (model := settings.chunk.model):
        return "no chunk model (KIDX_CHUNK__MODEL): structural chunking"
    chat = build_chat(_quick(settings.chunk, timeout))
    assert chat is not None
    user = INSTRUCTIONS.format(n=1) + "\n\n[[1]] kidx doctor"
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    try:
        answer = chat.complete_json(messages, schema=SCHEMA, name="chunks")
    except Exception as err:
        fix = "check it, KIDX_CHUNK__BASE_URL and the API key, or unset KIDX_CHUNK__MODEL"
        raise Fail(f"chunk model {model} did not answer: {err}", fix) from None
    finally:
        chat.close()
    if not isinstance(answer, dict) or not isinstance(answer.get("chunks"), list):
        raise Fail(
            f"chunk model {model} answered without chunks",
            "use a model that follows JSON instructions, or unset KIDX_CHUNK__MODEL",
        )
    if (problem := deadline_problem(settings)) is not None:
        limit = settings.tasks.soft_time_limit
        fix = f"set KIDX_CHUNK__DEADLINE under {limit / 2:g}"
        raise Warn(f"{model} answers, but {problem}", fix)
    return f"{model} answers"


# -- running them ----------------------------------------------------------------------------

CheckFn = Callable[[Settings, float], str]
CHECKS: dict[str, CheckFn] = {
    "database": check_database,
    "sqlite-vec": check_vec,
    "dimensions": check_dimensions,
    "rows": check_rows,
    "leftovers": check_leftovers,
    "keywords": check_keywords,
    "redis": check_redis,
    "workers": check_workers,
    "beat": check_beat,
    "flower": check_flower,
    "embedding": check_embedding,
    "chunk": check_chunk,
    "failed": check_failed,
    "stuck": check_stuck,
    "sweeps": check_sweeps,
}


def _run(name: str, fn: CheckFn, settings: Settings, timeout: float, out: dict[str, Check]) -> None:
    try:
        out[name] = Check(name, "ok", fn(settings, timeout))
    except Fail as e:
        out[name] = Check(name, e.level, e.detail, e.fix)
    except Exception as e:
        out[name] = Check(name, "fail", f"{type(e).__name__}: {e}", "see the message")


def _warm_up() -> None:
    """Import here what the checks import lazily: two threads importing one module at once may
    see it half-initialised (seen here: "partially initialized module 'numpy._typing'")."""
    import encodings.idna  # noqa: F401

    modules = ("celery.app.amqp", "celery.app.control", "kombu.transport.redis", "worker.app")
    for name in modules:
        with contextlib.suppress(ImportError):  # a missing one: its check says so
            importlib.import_module(name)
    httpx.Client().close()


def run_checks(settings: Settings, timeout: float = DEFAULT_TIMEOUT) -> list[Check]:
    """Every check, in parallel, each within `timeout` seconds; one line each, no secrets."""
    _warm_up()
    results: dict[str, Check] = {}
    threads = [
        threading.Thread(target=_run, args=(name, fn, settings, timeout, results), daemon=True)
        for name, fn in CHECKS.items()
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout + 1.0  # time for their own timeouts, with reasons
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    redact = Redact(settings.secrets())
    checks = []
    for name in CHECKS:
        c = results.get(name) or Check(
            name, "fail", f"no answer within {timeout:g} s", "try a longer --timeout"
        )
        detail, fix = (" ".join(str(redact.scrub(v)).split()) for v in (c.detail, c.fix))
        checks.append(Check(name, c.level, detail, fix))
    return checks
