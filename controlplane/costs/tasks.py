"""Costs tasks: the periodic hourly rollup (the current hour, and closed hours' final pass)."""

from __future__ import annotations

from celery import shared_task

from controlplane.core.locks import advisory_lock
from controlplane.costs import services


@shared_task(name="costs.rollup")
def rollup() -> dict[str, int]:
    with advisory_lock("costs.rollup") as acquired:
        if not acquired:
            return {"skipped": 1}
        hours = services.rollup_due()
    return {"hours": len(hours)}
