"""Every periodic loop under beat takes its Postgres advisory lock: with the lock held by
another worker (a second connection here), the loop returns at once and changes nothing."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from celery import current_app
from django.db import connection

from controlplane.core.locks import lock_id
from controlplane.core.models import AuditLog
from controlplane.core.schedules import SCHEDULES

pytestmark = pytest.mark.django_db

# Scheduled task → the lock it takes and how its answer says it stood aside.
LOCKED: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "failover.watch": ("failover.watch", lambda r: "skipped" in r),
    "telemetry.collect": ("telemetry.collect", lambda r: r == {"skipped": 1}),
    "telemetry.autoscale": ("telemetry.autoscale", lambda r: r == {"skipped": 1}),
    "provisioning.reconcile_replicas": ("provisioning.reconcile", lambda r: "skipped" in r),
    "provisioning.reap_cloud_clusters": ("provisioning.reap_cloud", lambda r: "skipped" in r),
    "routing.check_drift": ("routing.publish", lambda r: r == {"behind": -1}),
    "alerts.evaluate": ("alerts.evaluate", lambda r: r == {"skipped": 1}),
    "costs.rollup": ("costs.rollup", lambda r: r == {"skipped": 1}),
    "placement.replan": ("placement.replan", lambda r: r.get("action") == "skipped"),
    "plans.resume_applying": ("plans.resume_applying", lambda r: r == {"skipped": 1}),
    "batches.sweep": ("batches.sweep", lambda r: r == {"skipped": 1}),
    "rollouts.check": ("rollouts.check", lambda r: r == {"skipped": 1}),
    "core.renew_certificates": ("core.renew_certificates", lambda r: r == {"skipped": 1}),
    "provisioning.deliver_certificates": ("provisioning.deliver_certificates",
                                          lambda r: "skipped" in r),
}
# Idempotent by nature: a tick is a timestamp; prices are an upsert of the same rows.
UNLOCKED = {"core.beat_tick", "regions.refresh_offers"}


def test_every_scheduled_loop_is_listed_here() -> None:
    assert {s.task for s in SCHEDULES} == set(LOCKED) | UNLOCKED


@pytest.fixture
def other_worker() -> Iterator[Callable[[str], None]]:
    params = connection.get_connection_params()
    conn = psycopg.connect(**{k: v for k, v in params.items()
                              if k in ("dbname", "user", "host", "port", "password")})

    def hold(name: str) -> None:
        conn.execute("SELECT pg_advisory_lock(%s)", [lock_id(name)])

    yield hold
    # Released before closing: a closed session's locks go only when its server process
    # exits, which may be after the next test has asked for them.
    conn.execute("SELECT pg_advisory_unlock_all()")
    conn.close()


@pytest.mark.parametrize("task", sorted(LOCKED))
def test_a_loop_stands_aside_while_another_worker_holds_its_lock(task, other_worker):  # type: ignore[no-untyped-def]
    lock, stood_aside = LOCKED[task]
    current_app.loader.import_default_modules()  # every app's tasks module, as a worker does
    function = current_app.tasks[task]
    other_worker(lock)
    before = AuditLog.objects.count()
    result = function()
    assert stood_aside(result), result
    assert AuditLog.objects.count() == before
