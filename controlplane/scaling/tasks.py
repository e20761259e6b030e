"""The autoscaler's periodic task. Its name (`telemetry.autoscale`) and lock are those it had
when autoscaling lived in telemetry: beat schedules and running workers know it by them."""

from __future__ import annotations

from celery import shared_task

from controlplane.core.locks import advisory_lock
from controlplane.scaling import autoscaler


@shared_task(name="telemetry.autoscale")
def autoscale() -> dict[str, int]:
    """Every 2 s: each autoscaled deployment's replica count, decided and acted on."""
    with advisory_lock("telemetry.autoscale") as acquired:
        if not acquired:
            return {"skipped": 1}
        outcomes = autoscaler.run()
    return {"deployments": len(outcomes),
            "decisions": sum(1 for o in outcomes if o.recorded is not None)}
