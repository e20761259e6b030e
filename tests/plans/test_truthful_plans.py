"""Plans tell the truth: an infeasible plan states no cost after and no saving, and a plan
that changes nothing says so and cannot be approved or applied (409 naming why)."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from controlplane.core.models import AuditLog, Role
from controlplane.placement.models import Plan, PlanStatus
from controlplane.plans import apply as plans

pytestmark = pytest.mark.django_db


def test_an_empty_plan_cannot_be_approved_and_the_answer_says_why(make_client):  # type: ignore[no-untyped-def]
    plan = Plan.objects.create(cost_before_usd_h=Decimal("12.29"),
                               cost_after_usd_h=Decimal("12.29"), proposed_by="ops")
    client = make_client(Role.OPERATOR)
    body = client.get(f"/api/v1/plans/{plan.pk}/").json()
    assert body["nothing_to_do"] is True and body["saving_usd_h"] == 0.0
    response = client.post(f"/api/v1/plans/{plan.pk}/approve/", {}, format="json")
    assert response.status_code == 409
    assert "changes nothing" in response.json()["detail"]
    plan.refresh_from_db()
    assert plan.status == PlanStatus.PROPOSED and plan.reviewed_by == ""
    assert not AuditLog.objects.filter(action="plan.approve").exists()


def test_an_empty_plan_approved_before_cannot_be_applied() -> None:
    plan = Plan.objects.create(status=PlanStatus.APPROVED, proposed_by="ops")
    with pytest.raises(plans.PlanStateError, match="changes nothing"):
        plans.start_apply(plan.pk, "ops")
    plan.refresh_from_db()
    assert plan.status == PlanStatus.APPROVED


def test_an_infeasible_plan_has_no_after_and_no_saving(catalog: dict[str, Any], make_client):  # type: ignore[no-untyped-def]
    from controlplane.deployments.models import Deployment

    d = Deployment.objects.create(name="wide", served_model_name="wide",
                                  model=catalog["llama8b"], spread_regions=4, max_replicas=4)
    d.allowed_jurisdictions.set([catalog["eu"]])
    client = make_client(Role.OPERATOR)
    response = client.post("/api/v1/plans/propose/", {"deployments": ["wide"]}, format="json")
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["status"] == "infeasible"
    assert body["cost_after_usd_h"] is None and body["saving_usd_h"] is None
    assert body["nothing_to_do"] is False
    assert body["unplaced"] == [{"deployment": "wide", "reason": body["explanation"]}]
    approve = client.post(f"/api/v1/plans/{body['id']}/approve/", {}, format="json")
    assert approve.status_code == 409
