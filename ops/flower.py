"""Start Flower, the Tasks page, against kidx's broker, with basic auth and persistent state.

    python -m ops.flower            needs KIDX_FLOWER__USER and KIDX_FLOWER__PASSWORD
    python -m ops.flower --demo     a local demo: loopback only, a generated password (printed)

Flower keeps its task history in memory unless told otherwise; here it is saved in
`<KIDX_DATA_DIR>/flower.db` so that it survives a restart. The credentials reach Flower in
FLOWER_BASIC_AUTH, not on its command line, where `ps` would show them; they guard every page,
`/metrics` included (Flower's own default leaves that one open), all but `/healthcheck`.
"""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from worker.settings import Settings, load_settings


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
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--demo",
        action="store_true",
        help="local demo: bind 127.0.0.1 and make up a password if none is set",
    )
    args = ap.parse_args(argv)
    settings = load_settings()
    f = settings.flower
    user = f.user
    password = f.password.get_secret_value() if f.password else ""
    address = f.address
    if args.demo:
        address = "127.0.0.1"  # a demo is never reachable from elsewhere
        if not (user and password):
            user = user or "kidx"
            password = password or secrets.token_urlsafe(12)
            print(f"Flower: http://127.0.0.1:{f.port}/ user {user} password {password}", flush=True)
    elif not (user and password):
        sys.exit(
            "error: Flower needs KIDX_FLOWER__USER and KIDX_FLOWER__PASSWORD "
            "(or --demo, for a local demo on 127.0.0.1)"
        )
    Path(settings.data_dir).mkdir(parents=True, exist_ok=True)
    cmd = flower_command(settings, address=address, port=f.port)
    os.environ["FLOWER_BASIC_AUTH"] = f"{user}:{password}"
    serve(cmd)


def serve(cmd: list[str]) -> None:
    """Run Flower in this process (`cmd` as `flower_command` gives it), every page behind
    the credentials: Flower leaves `/metrics` open for Prometheus, which can send them
    (`basic_auth` in its scrape config); only `/healthcheck` stays open."""
    from celery.bin.celery import main as celery
    from flower.views import monitor
    from tornado import web

    monitor.Metrics.get = web.authenticated(monitor.Metrics.get)  # type: ignore[method-assign]
    sys.argv = ["celery", *cmd[3:]]  # after `python -m celery`
    celery()


if __name__ == "__main__":
    main()
