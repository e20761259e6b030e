"""A reviewer's reason for approving or applying a plan is kept in the audit log, as a
rejection's always was; fields a review or a proposal does not take are refused."""

from __future__ import annotations

import pytest

from controlplane.core.models import AuditLog, Role
from controlplane.placement.models import Plan, PlanStatus
from tests.api.test_endpoints_crud import make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def plan_id(catalog, tenants, make_client):  # type: ignore[no-untyped-def]
    deployment = make_deployment({**catalog, **tenants}, "chat-eu")
    deployment.min_replicas, deployment.max_replicas = 2, 4
    deployment.save()
    response = make_client(Role.OPERATOR).post("/api/v1/plans/propose/", {}, format="json")
    assert response.status_code == 201, response.content
    return response.json()["id"]


def test_approve_and_apply_keep_the_reason(plan_id, make_client):  # type: ignore[no-untyped-def]
    client = make_client(Role.OPERATOR)
    approved = client.post(f"/api/v1/plans/{plan_id}/approve/",
                           {"reason": "EU demand doubled"}, format="json")
    assert approved.status_code == 200, approved.content
    applied = client.post(f"/api/v1/plans/{plan_id}/apply/",
                          {"reason": "before the morning peak"}, format="json")
    assert applied.status_code == 200, applied.content
    said = dict(AuditLog.objects.filter(object_type="placement.plan", object_id=str(plan_id))
                .values_list("action", "reason"))
    assert said["plan.approve"].startswith("EU demand doubled (")
    assert said["plan.apply"].startswith("before the morning peak (")


def test_fields_a_review_does_not_take_are_refused(plan_id, make_client):  # type: ignore[no-untyped-def]
    client = make_client(Role.OPERATOR)
    response = client.post(f"/api/v1/plans/{plan_id}/approve/", {"note": "typo for reason"},
                           format="json")
    assert response.status_code == 400 and "note" in response.json()
    propose = client.post("/api/v1/plans/propose/", {"deployment": "chat-eu"}, format="json")
    assert propose.status_code == 400 and "deployment" in propose.json()
    assert Plan.objects.get(pk=plan_id).status == PlanStatus.PROPOSED


def test_a_tenant_user_cannot_review(plan_id, make_client, tenants):  # type: ignore[no-untyped-def]
    acme = make_client(Role.OPERATOR, tenants["acme"])
    response = acme.post(f"/api/v1/plans/{plan_id}/approve/", {"reason": "mine"}, format="json")
    assert response.status_code == 403
    assert Plan.objects.get(pk=plan_id).status == PlanStatus.PROPOSED
