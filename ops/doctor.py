"""`kidx doctor`: check every part of the stack and say what to do about each problem.

Every check is a function of the settings and a timeout that returns one `Check`. They run in
parallel threads, each bounded by the timeout, so one that hangs or fails stops none of the
others. A check that cannot run because something it needs is broken (the database, Redis,
sqlite-vec) is a warning ("not checked"), so that one problem makes one FAIL line.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import redis

from scheduler.beat import HEARTBEAT_KEY, LEASE_TTL
from worker.errors import BadAnswer
from worker.log import Redact
from worker.settings import Settings
from worker.store import VEC_TABLES, Database, resolve_dimensions, vec_table_dimensions
from worker.store.schema import SCHEMA_VERSION, schema_version

DEFAULT_TIMEOUT = 5.0
REINDEX = "run a reconcile sweep (celery -A worker.app call kidx.reconcile) or `kidx index --all`"
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
        return {"check": self.check, "ok": self.ok, "level": self.level, "detail": self.detail,
                "fix": self.fix}  # fmt: skip

    def line(self) -> str:
        text = f"{self.detail}: {self.fix}" if self.fix else self.detail
        return f"{self.level.upper() if self.level != 'ok' else 'ok':<5} {self.check:<10} {text}"


class NotChecked(Exception):
    """Something this check needs is broken (and reported by its own check)."""


def safe_url(url: str) -> str:
    """The URL with its password masked."""
    parts = urlsplit(url)
    if not parts.password:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{netloc}"))


# -- the database ------------------------------------------------------------------------------


@contextmanager
def _store(settings: Settings, timeout: float) -> Iterator[Database]:
    """The database as it is: no migration, no vec-table rebuild (unlike `open_store`)."""
    if not Path(settings.db).is_file():
        raise NotChecked(f"no database at {settings.db}")
    db = Database(settings.db, busy_timeout_ms=int(timeout * 1000))
    try:
        if schema_version(db) < SCHEMA_VERSION:
            raise NotChecked("the database schema is not up to date")
        if settings.vec:
            db.load_vec(settings.vec_path)
        db.resolution = resolve_dimensions(db, settings.embedding)
        yield db
    finally:
        db.close()


def check_database(settings: Settings, timeout: float) -> Check:
    path = Path(settings.db)
    if not path.is_file():
        return Check("database", "fail", f"no database at {path}",
                     "check KIDX_DB, or create it with `kidx init`")  # fmt: skip
    db = Database(path, busy_timeout_ms=int(timeout * 1000))
    try:
        version = schema_version(db)
        if version < SCHEMA_VERSION:
            return Check("database", "fail", f"{path}: schema {version}, kidx needs "
                         f"{SCHEMA_VERSION}", "`kidx init` migrates it")  # fmt: skip
        items = db.scalar("SELECT count(*) FROM knowledge_items")
    finally:
        db.close()
    return Check("database", "ok", f"{path} (schema {version}, {items} items)")


def check_vec(settings: Settings, timeout: float) -> Check:
    if not settings.vec:
        return Check("sqlite-vec", "warn", "off (KIDX_VEC=off): search scans vectors in memory",
                     "unset KIDX_VEC to use sqlite-vec")  # fmt: skip
    db = Database(":memory:")
    try:
        if db.load_vec(settings.vec_path):
            where = f" from {settings.vec_path}" if settings.vec_path else ""
            return Check("sqlite-vec", "ok", f"{db.vec_version}{where}")
        fix = ("point KIDX_VEC_PATH at the sqlite-vec library, or unset it to use the package's"
               if settings.vec_path else "install sqlite-vec (pip install sqlite-vec)")  # fmt: skip
        return Check("sqlite-vec", "fail", f"cannot load sqlite-vec: {db.vec_error}", fix)
    finally:
        db.close()


def _vec_usable(db: Database) -> None:
    if not db.vec_loaded:
        raise NotChecked("sqlite-vec is not loaded")


def check_dimensions(settings: Settings, timeout: float) -> Check:
    with _store(settings, timeout) as db:
        _vec_usable(db)
        want, source = db.dimensions, db.resolution.source if db.resolution else "?"
        tables = vec_table_dimensions(db)
    missing = [name for name, d in tables.items() if d is None]
    wrong = {name: d for name, d in tables.items() if d is not None and d != want}
    if missing:
        return Check("dimensions", "fail", f"vec tables missing: {', '.join(missing)}",
                     "`kidx init` creates them")  # fmt: skip
    if wrong:
        have = ", ".join(f"{name} {d}" for name, d in wrong.items())
        return Check(
            "dimensions",
            "fail",
            f"vec tables have other dimensions ({have}) than the "
            f"resolved {want} (from the {source})",
            "`kidx init` rebuilds them; items of another dimension become pending",
        )
    return Check("dimensions", "ok", f"{want} (from the {source}), all {len(tables)} vec tables")


def check_rows(settings: Settings, timeout: float) -> Check:
    counts, problems = [], []
    with _store(settings, timeout) as db:
        _vec_usable(db)
        d = db.dimensions
        if any(v != d for v in vec_table_dimensions(db).values()):
            raise NotChecked("the vec tables are not at the resolved dimension")
        for t in VEC_TABLES:
            truth = f"SELECT {t.source_key} FROM {t.source} WHERE dimensions = ?"
            missing = db.scalar(f"SELECT count(*) FROM ({truth}) WHERE {t.source_key} NOT IN "
                                f"(SELECT {t.key} FROM {t.name})", (d,))  # fmt: skip
            orphans = db.scalar(f"SELECT count(*) FROM {t.name} WHERE {t.key} NOT IN ({truth})",
                                (d,))  # fmt: skip
            counts.append(f"{t.name} {db.scalar(f'SELECT count(*) FROM {t.name}')}")
            if missing:
                problems.append(f"{missing} vectors missing from {t.name}")
            if orphans:
                problems.append(f"{orphans} orphans in {t.name}")
    if problems:
        return Check("rows", "fail", "; ".join(problems), REINDEX)
    return Check("rows", "ok", "vec tables match their relational rows: " + ", ".join(counts))


def check_failed(settings: Settings, timeout: float) -> Check:
    with _store(settings, timeout) as db:
        rows = db.all("SELECT item_id, last_error FROM item_index_state WHERE status = 'failed' "
                      "ORDER BY updated_at DESC")  # fmt: skip
    if not rows:
        return Check("failed", "ok", "no failed items")
    last = f" (last: {rows[0][1]})" if rows[0][1] else ""
    return Check("failed", "fail", f"{len(rows)} items failed to index{last}",
                 "see `kidx jobs --failed`, then `kidx retry --failed`")  # fmt: skip


def check_stuck(settings: Settings, timeout: float) -> Check:
    limit = settings.tasks.time_limit
    age = "(julianday('now') - julianday({})) * 86400 > ?"
    with _store(settings, timeout) as db:
        runs = db.all("SELECT DISTINCT item_id FROM index_jobs WHERE state = 'started' AND "
                      + age.format("started_at"), (limit,))  # fmt: skip
        items = db.all("SELECT item_id FROM item_index_state WHERE status = 'indexing' AND "
                       + age.format("updated_at"), (limit,))  # fmt: skip
    if not runs and not items:
        return Check("stuck", "ok", f"nothing running longer than {limit} s")
    ids = sorted({r[0] for r in runs + items if r[0] is not None})
    shown = " ".join(map(str, ids[:10])) + (" ..." if len(ids) > 10 else "")
    return Check("stuck", "fail", f"stuck: {len(runs)} runs started and {len(items)} items "
                 f"indexing for more than {limit} s (items {shown})",
                 f"check the workers (`kidx jobs`), then `kidx retry {shown}`")  # fmt: skip


def check_sweeps(settings: Settings, timeout: float) -> Check:
    from worker.reconcile import last_sweeps

    with _store(settings, timeout) as db:
        sweeps = last_sweeps(db)
    shown = [f"{kind} at {s.get('at')} (sent {s.get('sent', 0)})"
             for kind, s in sorted(sweeps.items())]  # fmt: skip
    return Check("sweeps", "ok", "; ".join(shown) or "no sweep has run yet")


# -- Redis, workers, beat, Flower --------------------------------------------------------------


def _redis(settings: Settings, timeout: float) -> redis.Redis:
    return redis.Redis.from_url(settings.broker_url, socket_timeout=timeout,
                                socket_connect_timeout=timeout)  # fmt: skip


def _needs_redis(settings: Settings, timeout: float) -> redis.Redis:
    client = _redis(settings, timeout)
    try:
        client.ping()
    except redis.RedisError:
        client.close()
        raise NotChecked("Redis is unreachable") from None
    return client


def check_redis(settings: Settings, timeout: float) -> Check:
    url = safe_url(settings.broker_url)
    client = _redis(settings, timeout)
    try:
        version = client.info("server").get("redis_version", "?")
    except redis.RedisError as e:
        return Check("redis", "fail", f"Redis unreachable at {url} ({e})",
                     "start Redis, or fix KIDX_BROKER_URL")  # fmt: skip
    finally:
        client.close()
    return Check("redis", "ok", f"{url} (Redis {version})")


def check_workers(settings: Settings, timeout: float) -> Check:
    from worker.app import create_app

    _needs_redis(settings, timeout).close()
    app = create_app(settings)
    try:
        replies = app.control.ping(timeout=max(0.5, min(2.0, timeout / 2))) or []
    finally:
        app.close()
    names = sorted(name for reply in replies for name in reply)
    if not names:
        return Check("workers", "fail", "no worker answered a ping",
                     "start one (celery -A worker.app worker)")  # fmt: skip
    return Check("workers", "ok", f"{len(names)} online: {', '.join(names)}")


def check_beat(settings: Settings, timeout: float) -> Check:
    client = _needs_redis(settings, timeout)
    try:
        value = client.get(HEARTBEAT_KEY)
    finally:
        client.close()
    start = "start beat (celery -A worker.app beat)"
    if value is None:
        return Check("beat", "fail", f"no beat heartbeat in Redis ({HEARTBEAT_KEY})", start)
    at, _, identity = value.decode(errors="replace").partition(" ")
    try:
        age = time.time() - float(at)
    except ValueError:
        return Check("beat", "fail", f"unreadable beat heartbeat {value[:60]!r}", start)
    if age > LEASE_TTL:
        return Check(
            "beat",
            "fail",
            f"beat's last heartbeat is {age:.0f} s old ({identity})",
            "it is stuck or stopped: restart it (celery -A worker.app beat)",
        )
    return Check("beat", "ok", f"heartbeat {max(age, 0):.0f} s ago from {identity}")


def check_flower(settings: Settings, timeout: float) -> Check:
    f = settings.flower
    host = "127.0.0.1" if f.address in ("", "0.0.0.0", "::") else f.address
    url = f"http://{host}:{f.port}/healthcheck"
    password = f.password.get_secret_value() if f.password else ""
    try:
        r = httpx.get(url, timeout=timeout, auth=(f.user, password) if f.user else None)
        if r.status_code == 200:
            return Check("flower", "ok", url)
        problem = f"HTTP {r.status_code}"
    except httpx.HTTPError as e:
        problem = str(e) or type(e).__name__
    return Check("flower", "fail", f"Flower not reachable at {url} ({problem})",
                 "start it (python -m ops.flower), or fix KIDX_FLOWER__ADDRESS/PORT")  # fmt: skip


# -- the models ------------------------------------------------------------------------------


def check_embedding(settings: Settings, timeout: float) -> Check:
    from worker.providers import build_embedder

    e = settings.embedding
    if e.provider == "none":
        return Check("embedding", "warn", "KIDX_EMBEDDING__PROVIDER=none: nothing gets vectors",
                     "set KIDX_EMBEDDING__PROVIDER to openai or local")  # fmt: skip
    with _store(settings, timeout) as db:
        want = db.dimensions
    quick = e.model_copy(
        update={
            "max_retries": 0,
            "timeout": min(e.timeout, timeout),
            "connect_timeout": min(e.connect_timeout, timeout),
        }
    )
    fix = "set KIDX_EMBEDDING__DIMENSIONS or switch back the model"
    embedder = build_embedder(quick, dimensions=want)
    assert embedder is not None
    try:
        got = int(embedder.embed(["kidx doctor"]).shape[1])
    except BadAnswer as err:
        m = _WRONG_DIM.search(str(err))
        if not m:
            return Check("embedding", "fail", f"unusable answer: {err}", "check the provider")
        got = int(m.group(1))
    except Exception as err:
        return Check(
            "embedding",
            "fail",
            f"{e.provider} {e.model} did not answer: {err}",
            "check that it runs, KIDX_EMBEDDING__BASE_URL and the API key",
        )
    finally:
        embedder.close()
    if got != want:
        return Check("embedding", "fail", f"wrong dimension: the provider returns {got}, the "
                     f"index has {want}", fix)  # fmt: skip
    return Check("embedding", "ok", f"{e.provider} {e.model} answers with {got} dimensions")


def check_chunk(settings: Settings, timeout: float) -> Check:
    from worker.chunking.llm import INSTRUCTIONS, SCHEMA, SYSTEM
    from worker.providers import build_chat

    c = settings.chunk
    if not c.model:
        return Check("chunk", "ok", "no chunk model (KIDX_CHUNK__MODEL): structural chunking")
    quick = c.model_copy(
        update={
            "max_retries": 0,
            "timeout": min(c.timeout, timeout),
            "connect_timeout": min(c.connect_timeout, timeout),
        }
    )
    chat = build_chat(quick)
    assert chat is not None
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": INSTRUCTIONS.format(n=1) + "\n\n[[1]] kidx doctor"},
    ]
    try:
        answer = chat.complete_json(messages, schema=SCHEMA, name="chunks")
    except Exception as err:
        return Check("chunk", "fail", f"chunk model {c.model} did not answer: {err}",
                     "check it runs, KIDX_CHUNK__BASE_URL and the API key, or unset "
                     "KIDX_CHUNK__MODEL")  # fmt: skip
    finally:
        chat.close()
    if not isinstance(answer, dict) or "chunks" not in answer:
        return Check("chunk", "fail", f"chunk model {c.model} answered without chunks",
                     "use a model that follows JSON instructions")  # fmt: skip
    return Check("chunk", "ok", f"{c.model} answers")


# -- running them ----------------------------------------------------------------------------

CheckFn = Callable[[Settings, float], Check]
CHECKS: list[tuple[str, CheckFn]] = [
    ("database", check_database), ("sqlite-vec", check_vec), ("dimensions", check_dimensions),
    ("rows", check_rows), ("redis", check_redis), ("workers", check_workers),
    ("beat", check_beat), ("flower", check_flower), ("embedding", check_embedding),
    ("chunk", check_chunk), ("failed", check_failed), ("stuck", check_stuck),
    ("sweeps", check_sweeps),
]  # fmt: skip


def _one(name: str, fn: CheckFn, settings: Settings, timeout: float, out: dict[str, Check]) -> None:
    try:
        out[name] = fn(settings, timeout)
    except NotChecked as e:
        out[name] = Check(name, "warn", f"not checked: {e}")
    except Exception as e:
        out[name] = Check(name, "fail", f"{type(e).__name__}: {e}", "see the message")


def run_checks(settings: Settings, timeout: float = DEFAULT_TIMEOUT) -> list[Check]:
    """Every check, in parallel, each within `timeout` seconds; one line each, no secrets."""
    results: dict[str, Check] = {}
    threads = [
        threading.Thread(
            target=_one,
            args=(name, fn, settings, timeout, results),
            name=f"doctor-{name}",
            daemon=True,
        )
        for name, fn in CHECKS
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout + 1.0  # their own timeouts first, with their reasons
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    secrets = [*settings.secrets()]
    for url in (settings.broker_url, settings.backend_url):
        secrets += [urlsplit(url).password or ""]
    redact = Redact(secrets)
    checks = []
    for name, _ in CHECKS:
        c = results.get(name) or Check(name, "fail", f"no answer within {timeout:g} s",
                                       "see why, or try a longer --timeout")  # fmt: skip
        one_line = [" ".join(str(redact.scrub(v)).split()) for v in (c.detail, c.fix)]
        checks.append(Check(c.check, c.level, *one_line))
    return checks
