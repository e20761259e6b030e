"""Routing tasks: the debounced push after changes, and the periodic drift check."""

from __future__ import annotations

from celery import shared_task

from controlplane.core.locks import advisory_lock
from controlplane.core.redis_clients import redis_client
from controlplane.routing import services

# Set by routing.signals when it schedules a push, cleared here before compiling: many
# changes in a burst become one push.
PENDING_KEY = "meridian:routing:publish-pending"
DEBOUNCE_S = 0.25


@shared_task(name="routing.publish_tables")
def publish_tables(force: bool = False) -> dict[str, int | None]:
    redis_client().delete(PENDING_KEY)
    report = services.publish_exclusive(force=force)
    if report is None:
        # Another worker is publishing; make sure our change is not lost.
        publish_tables.apply_async(countdown=0.5)
        return {"version": None, "edges": 0}
    return {"version": report.version, "edges": len(report.results), "acked": report.acked}


@shared_task(name="routing.check_drift")
def check_drift() -> dict[str, int]:
    with advisory_lock(services.PUBLISH_LOCK) as acquired:
        if not acquired:
            return {"behind": -1}
        behind = services.edges_behind()
        if behind:
            tables = [t for t in (services.latest_table(e) for e in behind) if t is not None]
            services.push_tables(tables)
        # Content may have changed without a signal (e.g. an edge added by hand in SQL).
        services.publish(reason="periodic drift check")
    return {"behind": len(behind)}
