"""Plans through the API: propose, read the reasons, approve, apply make-before-break."""

from __future__ import annotations

import pytest

from controlplane.core.models import Role
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.placement.models import Plan, PlanStatus
from controlplane.plans import apply as plans
from tests.api.test_endpoints_crud import make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def deployment(catalog, tenants):  # type: ignore[no-untyped-def]
    d = make_deployment({**catalog, **tenants}, "chat-eu")
    d.min_replicas, d.max_replicas = 2, 4
    d.save()
    return d


def test_operator_proposes_and_reads_reasons(deployment, make_client):  # type: ignore[no-untyped-def]
    client = make_client(Role.OPERATOR)
    response = client.post("/api/v1/plans/propose/", {"deployments": ["chat-eu"]}, format="json")
    assert response.status_code == 201, response.content
    plan = response.json()
    assert plan["status"] == "proposed"
    adds = [c for c in plan["changes"] if c["action"] == "add"]
    assert sum(c["count"] for c in adds) == 2
    assert all(c["region"].split(":")[0] in ("aws", "gcp") for c in adds)
    assert all("EU" in c["reason"] for c in adds)
    assert float(plan["cost_after_usd_h"]) > 0


def test_viewer_cannot_approve_or_propose(deployment, make_client):  # type: ignore[no-untyped-def]
    plan = make_client(Role.OPERATOR).post("/api/v1/plans/propose/", {}, format="json").json()
    viewer = make_client(Role.VIEWER)
    assert viewer.post("/api/v1/plans/propose/", {}, format="json").status_code == 403
    assert viewer.post(f"/api/v1/plans/{plan['id']}/approve/", {}, format="json").status_code == 403
    assert Plan.objects.get(pk=plan["id"]).status == PlanStatus.PROPOSED


def test_apply_needs_approval_first(deployment, make_client):  # type: ignore[no-untyped-def]
    client = make_client(Role.OPERATOR)
    plan = client.post("/api/v1/plans/propose/", {}, format="json").json()
    assert client.post(f"/api/v1/plans/{plan['id']}/apply/", {}, format="json").status_code == 409
    assert client.post(f"/api/v1/plans/{plan['id']}/approve/", {}, format="json").status_code == 200
    applied = client.post(f"/api/v1/plans/{plan['id']}/apply/", {}, format="json")
    assert applied.status_code == 200 and applied.json()["status"] == "applying"
    added = Replica.objects.filter(deployment=deployment)
    assert added.count() == 2 and {r.state for r in added} == {S.PENDING}


def test_removals_wait_until_added_replicas_are_ready(deployment, catalog, make_client):  # type: ignore[no-untyped-def]
    old = Replica.objects.create(deployment=deployment, region=catalog["iad"], state=S.READY,
                                 offer=catalog["iad"].offers.first(), url="http://127.0.0.1:1")
    client = make_client(Role.OPERATOR)
    plan = client.post("/api/v1/plans/propose/", {}, format="json").json()
    # The US replica breaks the deployment's EU residency: the plan moves it.
    assert {(c["action"], c["count"]) for c in plan["changes"]} == {("add", 2), ("remove", 1)}
    client.post(f"/api/v1/plans/{plan['id']}/approve/", {}, format="json")
    client.post(f"/api/v1/plans/{plan['id']}/apply/", {}, format="json")
    assert plans.advance(plan["id"]) == PlanStatus.APPLYING  # new replicas still pending
    old.refresh_from_db()
    assert old.state == S.READY, "no removal before the new replicas are ready"
    Replica.objects.filter(deployment=deployment).exclude(pk=old.pk).update(state=S.READY)
    assert plans.advance(plan["id"]) == PlanStatus.APPLIED
    old.refresh_from_db()
    assert old.state == S.DRAINING


def test_infeasible_plan_is_stored_with_its_reason(deployment, catalog, make_client):  # type: ignore[no-untyped-def]
    from datetime import UTC, datetime

    from regions.models import Quota

    Quota.objects.create(region=catalog["iad"], gpu_type=catalog["l4"], limit_gpus=4,
                         observed_at=datetime(2026, 11, 1, tzinfo=UTC))
    deployment.allowed_jurisdictions.set([catalog["us"]])
    # Quota is what binds here, not the tenant's caps (16 replicas by default).
    type(deployment.tenant).objects.filter(pk=deployment.tenant_id).update(max_replicas=100,
                                                                           max_gpus=1000)
    deployment.min_replicas = 40
    deployment.max_replicas = 40
    deployment.save()
    plan = make_client(Role.OPERATOR).post("/api/v1/plans/propose/", {}, format="json").json()
    assert plan["status"] == "infeasible"
    assert "quota" in plan["explanation"] and plan["changes"] == []
