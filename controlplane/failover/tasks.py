"""Failover tasks: the watch loop (every second, one worker at a time)."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from controlplane.core.locks import advisory_lock
from controlplane.failover import services


@shared_task(name="failover.watch")
def watch() -> dict[str, Any]:
    with advisory_lock("failover.watch") as acquired:
        if not acquired:
            return {"skipped": "another worker is watching"}
        return services.watch().as_dict()
