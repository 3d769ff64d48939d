"""The Celery app: the only module of `worker/` that imports Celery.

    celery -A worker.app worker --pool=prefork --concurrency=2 -n kidx@%h \
           --statedb=data/worker-%h.state

Reliability: JSON only (a pickle from the broker would run code); a task is acknowledged after it
ran (`acks_late`) and put back when its process dies (`task_reject_on_worker_lost`); one task
prefetched per process; the Redis visibility timeout is above the hard time limit (or Redis would
hand a running task to a second worker), and is the same wherever Celery reads one. Events,
`task_track_started` and `result_extended` feed Flower, the Tasks page.
"""

from __future__ import annotations

import logging
import ssl
import sys
import time
from typing import Any
from urllib.parse import parse_qs, urlsplit

from celery import Celery, signals

from worker.errors import ConfigError
from worker.log import configure_logging
from worker.settings import Settings, load_settings

# The layers above reach the app, never the other way: the tasks and the beat schedule are
# named here (Celery's `include` imports the modules when a worker starts), not imported.
TASK_MODULES = [
    "tasks.metrics",
    "tasks.index",
    "tasks.group",
    "tasks.cancel",
    "tasks.memories",
    "scheduler.tasks",
]
RECONCILE = "kidx.reconcile"  # scheduler/tasks.py
RETRY_SWEEP = "kidx.retry_sweep"
EMBED_MEMORIES = "kidx.embed_memories"  # tasks/memories.py, sent by the reconcile sweep


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    """The periodic sweeps, by task name, every so many seconds from the settings; a sweep
    still queued when the next is due (or a minute, if that is later) expires: a backed-up
    queue keeps about one of each, not one a period."""
    s = settings.scheduler
    return {
        "kidx-reconcile": {
            "task": RECONCILE,
            "schedule": s.reconcile_every,
            "options": {"expires": max(s.reconcile_every, 60.0)},
        },
        "kidx-retry-sweep": {
            "task": RETRY_SWEEP,
            "schedule": s.retry_every,
            "options": {"expires": max(s.retry_every, 60.0)},
        },
    }


def verified_tls(url: str) -> dict[str, Any] | None:
    """For a rediss:// URL without ssl_cert_reqs: verify the server's certificate, as redis-py
    (kidx's own clients) does. Left alone, kombu (the broker) silently turned verification off,
    and Celery's Redis result backend refused the URL at the first result stored."""
    parts = urlsplit(url)
    if parts.scheme != "rediss" or "ssl_cert_reqs" in parse_qs(parts.query):
        return None
    return {"ssl_cert_reqs": ssl.CERT_REQUIRED}


def create_app(settings: Settings) -> Celery:
    """A Celery app configured from `settings` (tests and host applications make their own)."""
    t = settings.tasks
    transport = {"visibility_timeout": t.visibility_timeout}
    # A broker that is down or does not answer fails a send within the patience (kombu's
    # advice for a broker that can vanish without closing the connection).
    broker = {
        **transport,
        "socket_connect_timeout": t.broker_patience,
        "socket_timeout": t.broker_patience,
    }

    app = Celery("kidx", broker=settings.broker_url, backend=settings.backend_url)
    app.conf.update(
        include=TASK_MODULES,
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        event_serializer="json",
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_transport_options=broker,
        result_backend_transport_options=transport,
        worker_send_task_events=True,
        task_send_sent_event=True,
        task_track_started=True,
        result_extended=True,
        task_soft_time_limit=t.soft_time_limit,
        task_time_limit=t.time_limit,
        worker_hijack_root_logger=False,
        # False: Celery's True sends SIGTERM to a running task's process when the worker loses
        # Redis, which kidx takes for `kidx cancel --terminate` (the item ended `cancelled`,
        # sent again by nothing). The run goes on and writes; its ack is lost with the
        # connection, and the redelivered message finds the item indexed (a run that reuses).
        worker_cancel_long_running_tasks_on_connection_loss=False,
        broker_connection_retry_on_startup=True,
        result_expires=7 * 24 * 3600,
        worker_concurrency=t.concurrency,
        worker_max_tasks_per_child=t.max_tasks_per_child or None,
        worker_max_memory_per_child=t.max_memory_per_child * 1024 or None,  # Celery's KiB
        enable_utc=True,
        beat_schedule=beat_schedule(settings),
        beat_scheduler="scheduler.beat:LeaderScheduler",
        beat_max_loop_interval=5,
    )
    if tls := verified_tls(settings.broker_url):
        app.conf.broker_use_ssl = tls
    if tls := verified_tls(settings.backend_url):
        app.conf.redis_backend_use_ssl = tls
    app.kidx_settings = settings  # type: ignore[attr-defined]
    # When this worker read its settings: its pool processes (forked later, when one is
    # replaced too) have them from then (tasks.runtime, `connect(configured_at=)`).
    app.kidx_configured_at = time.time()  # type: ignore[attr-defined]
    return app


try:
    settings = load_settings()
except ConfigError as e:
    # Imported by `celery -A worker.app worker|beat`: Celery would wrap the error in a
    # 30-line traceback. One line and status 2, as every kidx command says it.
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
app = create_app(settings)


@signals.setup_logging.connect
def _logging(loglevel: Any = None, logfile: str | None = None, **_: Any) -> None:
    """Celery's own lines and ours, one JSON shape, once per process (not Celery's set-up)."""
    stream = open(logfile, "a", buffering=1, encoding="utf-8") if logfile else None  # noqa: SIM115
    if isinstance(loglevel, int):
        loglevel = logging.getLevelName(loglevel)
    # KIDX_LOG_LEVEL when it is set: Celery always passes a level (its --loglevel, every
    # start command's INFO, else WARNING), and the setting was never in force in a worker
    explicit = "log_level" in settings.model_fields_set
    level = settings.log_level if explicit or not isinstance(loglevel, str) else loglevel
    configure_logging(
        fmt=settings.log_format, level=level.lower(), secrets=settings.secrets(), stream=stream
    )
