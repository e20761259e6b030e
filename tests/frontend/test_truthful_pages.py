"""Pages that tell the truth: an infeasible plan shows no cost after and no saving, an empty
plan says there is nothing to do and offers no approval, and a deployment that cannot be
placed says so and why."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from controlplane.core.models import Role
from controlplane.deployments.models import Deployment
from controlplane.placement.models import Plan, PlanStatus

pytestmark = pytest.mark.django_db


def test_an_infeasible_plan_shows_no_after_and_no_saving(signed_in):  # type: ignore[no-untyped-def]
    plan = Plan.objects.create(status=PlanStatus.INFEASIBLE, cost_before_usd_h=Decimal("22.43"),
                               cost_after_usd_h=None, proposed_by="ops",
                               explanation="chat-eu: needs 2 regions but only 1",
                               inputs={"unplaced": [{"deployment": "chat-eu",
                                                     "reason": "needs 2 regions but only 1"}]})
    html = signed_in(Role.OPERATOR).get(f"/plans/{plan.pk}/").content.decode()
    assert "$22.43" in html and "No plan" in html
    assert "Cost after" not in html and "Saving" not in html and "$0.00" not in html
    assert "Nothing to do" not in html and ">Approve<" not in html
    assert "needs 2 regions but only 1" in html
    listing = signed_in(Role.OPERATOR).get("/plans/").content.decode()
    assert "no plan" in listing and "$0.00/h" not in listing


def test_an_empty_plan_says_nothing_to_do_and_offers_no_approval(signed_in):  # type: ignore[no-untyped-def]
    plan = Plan.objects.create(cost_before_usd_h=Decimal("12.29"),
                               cost_after_usd_h=Decimal("12.29"), proposed_by="ops")
    html = signed_in(Role.OPERATOR).get(f"/plans/{plan.pk}/").content.decode()
    assert "Nothing to do" in html and ">Approve<" not in html
    assert "Saving" not in html
    listing = signed_in(Role.OPERATOR).get("/plans/").content.decode()
    assert "nothing to do" in listing


def test_an_unplaceable_deployment_page_says_why(signed_in, catalog: dict[str, Any]):  # type: ignore[no-untyped-def]
    d = Deployment.objects.create(name="chat-eu", served_model_name="chat",
                                  model=catalog["llama8b"],
                                  placement_problem="EU has 0 H100 left under quota")
    d.allowed_jurisdictions.set([catalog["eu"]])
    html = signed_in(Role.VIEWER).get("/deployments/chat-eu/").content.decode()
    assert "Cannot be placed" in html and "EU has 0 H100 left under quota" in html
    assert "unplaceable" in signed_in(Role.VIEWER).get("/deployments/").content.decode()
