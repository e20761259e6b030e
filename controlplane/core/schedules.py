"""The periodic tasks Meridian runs under celery beat, kept in the database by one function.

`sync_schedules` is idempotent: it creates missing entries and fixes their interval, task
and queue, but keeps an operator's `enabled` choice made in the admin.
"""

from __future__ import annotations

from dataclasses import dataclass

from django.db import transaction
from django_celery_beat.models import IntervalSchedule, PeriodicTask


@dataclass(frozen=True)
class Schedule:
    name: str
    task: str
    every_s: int
    queue: str = "control"


SCHEDULES: tuple[Schedule, ...] = (
    Schedule("beat tick", "core.beat_tick", 10),
    Schedule("renew certificates", "core.renew_certificates", 600),
    Schedule("deliver certificates", "provisioning.deliver_certificates", 120,
             queue="provision"),
    Schedule("reconcile replicas", "provisioning.reconcile_replicas", 5, queue="provision"),
    Schedule("routing drift check", "routing.check_drift", 10),
    Schedule("telemetry collect", "telemetry.collect", 2),
    Schedule("telemetry autoscale", "telemetry.autoscale", 2),
    Schedule("cost rollup", "costs.rollup", 60),
    Schedule("failover watch", "failover.watch", 1),
    Schedule("alerts evaluate", "alerts.evaluate", 10),
    Schedule("placement replan", "placement.replan", 300),
    Schedule("resume applying plans", "plans.resume_applying", 5),
    Schedule("batches sweep", "batches.sweep", 30, queue="batch"),
    Schedule("rollouts check", "rollouts.check", 2),
    Schedule("refresh offer prices", "regions.refresh_offers", 3600, queue="provision"),
    Schedule("reap cloud clusters", "provisioning.reap_cloud_clusters", 600, queue="provision"),
)


@transaction.atomic
def sync_schedules(schedules: tuple[Schedule, ...] = SCHEDULES) -> list[str]:
    """Create or correct each schedule; returns the names that changed."""
    changed = []
    for schedule in schedules:
        interval, _ = IntervalSchedule.objects.get_or_create(
            every=schedule.every_s, period=IntervalSchedule.SECONDS
        )
        task, created = PeriodicTask.objects.get_or_create(
            name=schedule.name,
            defaults={"task": schedule.task, "interval": interval, "queue": schedule.queue},
        )
        if created:
            changed.append(schedule.name)
            continue
        if (task.task, task.interval_id, task.queue) != (schedule.task, interval.pk, schedule.queue):
            task.task, task.interval, task.queue = schedule.task, interval, schedule.queue
            task.save()
            changed.append(schedule.name)
    return changed
