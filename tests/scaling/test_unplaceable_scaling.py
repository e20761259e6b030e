"""A deployment the autoscaler cannot place: its repeated scale-up is one open decision,
updated on each tick, and one audit event; the deployment shows why; once it can be placed
again, a new decision is written and the problem cleared."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.core.models import AuditLog
from controlplane.deployments.models import Deployment
from controlplane.scaling import autoscaler
from controlplane.scaling.models import ScalingDecision
from regions.models import Quota
from tests.scaling.test_autoscaler import make_deployment

pytestmark = pytest.mark.django_db


def test_an_unplaceable_scale_up_is_one_decision_and_one_event_however_many_ticks(  # type: ignore[no-untyped-def]
        catalog: dict[str, Any], sent_tasks, django_capture_on_commit_callbacks):
    Quota.objects.filter(gpu_type=catalog["h100"]).update(limit_gpus=0)
    d = make_deployment(catalog, min_replicas=2)

    for _ in range(5):
        with django_capture_on_commit_callbacks(execute=True):
            autoscaler.run()

    [decision] = ScalingDecision.objects.filter(deployment=d)
    assert decision.open and decision.repeats == 5 and decision.last_at is not None
    assert (decision.replicas_before, decision.replicas_wanted, decision.replicas_after) == (0, 2, 0)
    assert AuditLog.objects.filter(action="deployment.scale_up").count() == 1
    d.refresh_from_db()
    assert d.placement_status == "unplaceable" and "quota" in d.placement_problem
    assert not d.replicas.exists() and not sent_tasks

    Quota.objects.filter(gpu_type=catalog["h100"]).update(limit_gpus=16)
    with django_capture_on_commit_callbacks(execute=True):
        autoscaler.run()
    closed, placed = ScalingDecision.objects.filter(deployment=d).order_by("id")
    closed.refresh_from_db()
    assert not closed.open and not placed.open and placed.replicas_after == 2
    assert AuditLog.objects.filter(action="deployment.scale_up").count() == 2
    d.refresh_from_db()
    assert d.placement_status == "placeable" and d.placement_problem_since is None


def test_the_decisions_api_shows_the_open_decision(  # type: ignore[no-untyped-def]
        catalog: dict[str, Any], make_client, django_capture_on_commit_callbacks):
    from controlplane.core.models import Role

    Quota.objects.filter(gpu_type=catalog["h100"]).update(limit_gpus=0)
    make_deployment(catalog, min_replicas=1)
    for _ in range(3):
        with django_capture_on_commit_callbacks(execute=True):
            autoscaler.run()
    client = make_client(Role.VIEWER)
    [row] = client.get("/api/v1/scaling-decisions/?deployment=chat").json()["results"]
    assert row["open"] is True and row["repeats"] == 3 and row["replicas_wanted"] == 1
    body = client.get("/api/v1/deployments/chat/").json()
    assert body["placement_status"] == "unplaceable" and body["placement_problem"]
    assert Deployment.objects.get(name="chat").placement_problem == body["placement_problem"]
