"""Start Flower, the Tasks page, against kidx's broker, with basic auth and persistent state.

    python -m ops.flower            needs KIDX_FLOWER__USER and KIDX_FLOWER__PASSWORD
    python -m ops.flower --demo     a local demo: loopback only, a generated password (printed)

Flower keeps its task history in memory unless told otherwise; here it is saved in
`<KIDX_DATA_DIR>/flower.db` so that it survives a restart. The credentials reach Flower in
FLOWER_BASIC_AUTH, not on its command line, where `ps` would show them; they guard every page,
`/metrics` included (Flower's own default leaves that one open), all but `/healthcheck`.

The task list shows what the seed's Tasks page shows, without a click: what each task is about
(`args`: the item id; `kwargs`: the kind and title the producer sends in `kwargsrepr`, kept
through retries), its state, its duration (a failed task's too: Flower has none for it, so it is
the time from its start to its failure event, else the failure's one line, "... (after 1.2 s)")
and the failure's reason.
"""

from __future__ import annotations

import argparse
import copy
import os
import re
import secrets
import socket
import sys
from pathlib import Path
from typing import Any

from ops.stack import data_dirs, fail
from worker.errors import ConfigError
from worker.settings import Settings, load_settings

# Flower's default list is name, uuid, state, received, runtime, worker: not what a task is
# about, nor why it failed.
TASKS_COLUMNS = "name,args,kwargs,state,runtime,exception,result,received,worker,uuid"
_AFTER = re.compile(r"\(after (\d+(?:\.\d+)?) s\)")


def format_task(task: Any) -> Any:
    """Flower's `format_task` hook, for the task list: a failed task's runtime (Celery's
    task-failed event carries none), from its start and failure events, else from its one-line
    failure ("... (after 1.2 s)")."""
    if task.state != "FAILURE" or task.runtime is not None:
        return task
    runtime = None
    if task.started and task.failed and task.failed >= task.started:
        runtime = task.failed - task.started
    elif found := _AFTER.findall(str(task.exception or "")):
        # kidx's suffix is the last: an earlier one is an item's of a group, or quoted text
        runtime = float(found[-1])
    if runtime is not None:
        task = copy.copy(task)
        task.runtime = runtime
    return task


def flower_command(settings: Settings, *, address: str, port: int) -> list[str]:
    data = Path(settings.data_dir)
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "worker.app",
        "flower",
        f"--address={address}",
        f"--port={port}",
        "--persistent=True",
        f"--db={data / 'flower.db'}",
        "--state_save_interval=5000",
        "--purge_offline_workers=3600",
        f"--tasks_columns={TASKS_COLUMNS}",
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--demo",
        action="store_true",
        help="local demo: bind 127.0.0.1 and make up a password if none is set",
    )
    args = ap.parse_args(argv)
    try:
        settings = load_settings()
    except ConfigError as e:  # one line and status 2, as every kidx command says it
        fail(f"error: {e}", 2)
    f = settings.flower
    user = f.user
    password = f.password.get_secret_value() if f.password else ""
    address = f.address
    if not args.demo and not (user and password):
        fail(
            "error: Flower needs KIDX_FLOWER__USER and KIDX_FLOWER__PASSWORD "
            "(or --demo, for a local demo on 127.0.0.1)",
            2,
        )
    data_dirs(settings.data_dir, Path(settings.data_dir).resolve())  # else one line, status 2
    if args.demo:
        address = "127.0.0.1"  # a demo is never reachable from elsewhere
        if not (user and password):
            user = user or "kidx"
            password = password or secrets.token_urlsafe(12)
            print(f"Flower: http://127.0.0.1:{f.port}/ user {user} password {password}", flush=True)
    if (why := cannot_listen(address, f.port)) is not None:
        fail(
            f"error: Flower cannot listen on {address or '*'}:{f.port} ({why}): set "
            "KIDX_FLOWER__ADDRESS and KIDX_FLOWER__PORT to an address of this machine and a "
            "free port",
            2,
        )
    cmd = flower_command(settings, address=address, port=f.port)
    os.environ["FLOWER_BASIC_AUTH"] = f"{user}:{password}"
    serve(cmd)


def cannot_listen(address: str, port: int) -> str | None:
    """Why a server could not listen there (a port taken, an address not this machine's, a
    name that does not resolve), or None: looked at before Flower starts, whose own error is
    a traceback of forty lines. (Flower binds a moment later: a port taken meanwhile is its
    error again.)"""
    try:
        found = socket.getaddrinfo(
            address or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        family, kind, proto, _, where = found[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as tornado binds
            probe.bind(where)
    except (OSError, UnicodeError) as e:  # (gaierror is an OSError)
        return getattr(e, "strerror", None) or str(e)
    return None


def serve(cmd: list[str]) -> None:
    """Run Flower in this process (`cmd` as `flower_command` gives it), every page behind
    the credentials: Flower leaves `/metrics` open for Prometheus, which can send them
    (`basic_auth` in its scrape config); only `/healthcheck` stays open."""
    from celery.bin.celery import main as celery
    from flower.options import options
    from flower.views import monitor
    from tornado import web

    monitor.Metrics.get = web.authenticated(monitor.Metrics.get)  # type: ignore[method-assign]
    options.format_task = format_task  # a callable: no command-line form
    sys.argv = ["celery", *cmd[3:]]  # after `python -m celery`
    celery()


if __name__ == "__main__":
    main()
