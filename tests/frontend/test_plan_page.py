"""A plan's page reads as people read money: an extra cost is a plus, bounds to the cent."""

from __future__ import annotations

from decimal import Decimal

import pytest

from controlplane.core.models import Role
from controlplane.deployments.models import Deployment
from controlplane.placement.models import Plan, PlanChange

pytestmark = pytest.mark.django_db


def test_a_plan_that_adds_replicas_shows_its_extra_cost_and_rounded_solver_facts(signed_in, catalog):  # type: ignore[no-untyped-def]
    plan = Plan.objects.create(
        cost_before_usd_h=Decimal("23.60"), cost_after_usd_h=Decimal("44.24"), proposed_by="ops",
        solver={"status": "optimal", "solve_s": 0.0024, "lp_bound_usd_h": 44.239000000000004,
                "gap_to_lp_bound": 0.00379})
    deployment = Deployment.objects.create(name="chat", served_model_name="chat",
                                           model=catalog["llama8b"])
    PlanChange.objects.create(plan=plan, deployment=deployment, action="add",
                              region=catalog["fra"], count=1, usd_h_delta=Decimal("20.64"),
                              reason="more demand")
    html = signed_in(Role.VIEWER).get(f"/plans/{plan.pk}/").content.decode()
    assert "Extra cost" in html and "+$20.64" in html and "−$20.64" not in html
    assert "$44.24" in html and "44.239000000000004" not in html
    assert "0.38%" in html and "0.002" in html
