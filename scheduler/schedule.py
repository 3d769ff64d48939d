"""The beat schedule, from the settings (no Celery here: `worker/app.py` reads it)."""

from __future__ import annotations

from typing import Any

from worker.settings import Settings

RECONCILE = "kidx.reconcile"
RETRY_SWEEP = "kidx.retry_sweep"


def beat_schedule(settings: Settings) -> dict[str, dict[str, Any]]:
    s = settings.scheduler
    return {
        "kidx-reconcile": {"task": RECONCILE, "schedule": s.reconcile_every},
        "kidx-retry-sweep": {"task": RETRY_SWEEP, "schedule": s.retry_every},
    }
