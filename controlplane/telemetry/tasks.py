"""Telemetry tasks: the periodic scrape and the Prometheus target files."""

from __future__ import annotations

from celery import shared_task

from controlplane.core.locks import advisory_lock
from controlplane.costs import services as costs_services
from controlplane.telemetry import services


@shared_task(name="telemetry.collect")
def collect() -> dict[str, int]:
    with advisory_lock("telemetry.collect") as acquired:
        if not acquired:
            return {"skipped": 1}
        up = services.collect()
        edges = services.collect_edges()
        costs_services.record_usage(edges)
        services.write_prometheus_targets()
    return {"up": up, "edges": len(edges)}

