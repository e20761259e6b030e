"""The status endpoint, beat schedules and the management commands people run by hand."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command

from controlplane.core.models import ApiToken, Membership, Role, Tenant
from controlplane.core.schedules import SCHEDULES, sync_schedules
from controlplane.core.services import beat, sha256_hex
from controlplane.core.status import BEAT_HEARTBEAT

pytestmark = pytest.mark.django_db


def test_status_reports_database_redis_workers_and_beat(make_client):  # type: ignore[no-untyped-def]
    beat(BEAT_HEARTBEAT)
    body = make_client(Role.VIEWER).get("/api/v1/status/").json()
    assert body["database"]["ok"] is True
    assert body["redis"]["ok"] is True
    assert body["last_beat_tick"] is not None
    assert "ok" in body["celery"] and "ok" in body["beat"]
    assert isinstance(body["workers"], list) and isinstance(body["heartbeats"], list)


def test_status_reports_unreachable_redis(settings, make_client):  # type: ignore[no-untyped-def]
    settings.REDIS_URL = "redis://127.0.0.1:1/0"
    response = make_client(Role.VIEWER).get("/api/v1/status/")
    assert response.status_code == 503
    assert response.json()["redis"]["ok"] is False
    assert response.json()["celery"]["detail"] == "broker unreachable"


def test_status_needs_a_token(db, make_client):  # type: ignore[no-untyped-def]
    assert make_client(None).get("/api/v1/status/").status_code == 401


def test_sync_schedules_is_idempotent():  # type: ignore[no-untyped-def]
    from django_celery_beat.models import PeriodicTask

    assert sync_schedules() == [s.name for s in SCHEDULES]
    assert sync_schedules() == []
    PeriodicTask.objects.filter(name=SCHEDULES[0].name).update(task="wrong.task")
    assert sync_schedules() == [SCHEDULES[0].name]


def test_every_scheduled_task_exists_and_queues_where_its_worker_listens():  # type: ignore[no-untyped-def]
    from controlplane.celery import app

    app.loader.import_default_modules()
    missing = [s.task for s in SCHEDULES if s.task not in app.tasks]
    assert missing == []
    assert {s.queue for s in SCHEDULES} <= {"control", "provision", "batch"}
    assert {q.name for q in app.conf.task_queues} == {"control", "provision", "batch"}
    # The fast loops must not wait behind provider jobs.
    fast = {s.task for s in SCHEDULES if s.every_s <= 2}
    assert fast and all(s.queue == "control" for s in SCHEDULES if s.task in fast)


def test_batch_tasks_go_to_the_batch_queue_and_control_loops_stay_on_control():  # type: ignore[no-untyped-def]
    from controlplane.celery import app

    app.loader.import_default_modules()
    router = app.amqp.router
    for name in ("batches.run_batch", "batches.sweep"):
        assert router.route({}, name)["queue"].name == "batch", name
    # A batch run holds its worker for up to BATCH_TASK_BUDGET_S: never beside the 1 s watch.
    for name in ("failover.watch", "telemetry.autoscale", "telemetry.collect"):
        assert router.route({}, name)["queue"].name == "control", name
    assert router.route({}, "provisioning.provision_replica")["queue"].name == "provision"
    sweep = next(s for s in SCHEDULES if s.task == "batches.sweep")
    assert sweep.queue == "batch"


def test_create_api_token_prints_token_last(tenants):  # type: ignore[no-untyped-def]
    out = StringIO()
    call_command("create_api_token", "alice", "--role", "operator", "--tenant", "acme", stdout=out)
    token = out.getvalue().strip().splitlines()[-1]
    assert token.startswith("mrd_")
    row = ApiToken.objects.get(token_hash=sha256_hex(token))
    assert row.user.username == "alice"
    membership = Membership.objects.get(user=row.user)
    assert (membership.role, membership.tenant) == ("operator", Tenant.objects.get(name="acme"))


def test_create_api_token_rejects_unknown_tenant_and_role(db):  # type: ignore[no-untyped-def]
    with pytest.raises(CommandError, match="--tenant: no tenant named 'nobody'"):
        call_command("create_api_token", "bob", "--role", "viewer", "--tenant", "nobody")
    with pytest.raises(CommandError):
        call_command("create_api_token", "bob", "--role", "superhero")
    assert not ApiToken.objects.exists()
