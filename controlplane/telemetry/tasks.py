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


@shared_task(name="telemetry.autoscale")
def autoscale() -> dict[str, int]:
    """Every 2 s: each autoscaled deployment's replica count, decided and acted on."""
    from controlplane.telemetry import autoscaler

    with advisory_lock("telemetry.autoscale") as acquired:
        if not acquired:
            return {"skipped": 1}
        outcomes = autoscaler.run()
    return {"deployments": len(outcomes),
            "decisions": sum(1 for o in outcomes if o.recorded is not None)}
