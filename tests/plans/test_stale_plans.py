"""Plans are optimistic transactions: a plan records the fleet it was computed from, and
approve and apply refuse (409, naming what moved, offering to propose again) once it moved.

The first test is the walk that found it: plan 1, proposed by the replan for the spread
rule, was approved and applied after all three replicas it was computed from had been
replaced, and drained the deployment's last EU replica."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.core.models import AuditLog, Role
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.placement.models import Plan, PlanStatus
from controlplane.plans import apply as plans
from controlplane.plans.replan import replan
from regions.models import Offer
from tests.api.test_endpoints_crud import make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def demo(catalog, tenants):  # type: ignore[no-untyped-def]
    """demo-chat: EU or US, spread over 2 regions, 3 replicas all in Virginia (the spread
    rule is broken: the replan proposes a plan that moves one to the EU)."""
    d = make_deployment({**catalog, **tenants}, "demo-chat")
    d.allowed_jurisdictions.set([catalog["eu"], catalog["us"]])
    d.min_replicas, d.max_replicas, d.spread_regions = 3, 3, 2
    d.save()
    iad = Offer.objects.get(region=catalog["iad"], gpu_type=catalog["h100"])
    running = [Replica.objects.create(deployment=d, region=catalog["iad"], offer=iad,
                                      state=S.READY, url=f"http://127.0.0.1:{9200 + i}")
               for i in range(3)]
    return {**catalog, "d": d, "running": running}


def offer(fx: dict[str, Any], region: str) -> Offer:
    return Offer.objects.get(region=fx[region], gpu_type=fx["h100"])


def replace_all(fx: dict[str, Any]) -> list[Replica]:
    """Failover terminates the three replicas and places their replacements, one in
    Frankfurt and two in Virginia: the spread rule holds again without the plan."""
    Replica.objects.filter(pk__in=[r.pk for r in fx["running"]]).update(state=S.TERMINATED)
    return [Replica.objects.create(deployment=fx["d"], region=fx[region],
                                   offer=offer(fx, region), state=S.READY)
            for region in ("fra", "iad", "iad")]


def proposed_by_replan() -> Plan:
    outcome = replan()
    assert outcome.action == "proposed" and outcome.plan is not None, outcome.reason
    assert [b.kind for b in outcome.broken] == ["spread"]
    return outcome.plan


def nothing_changed(plan: Plan, status: str, replicas: list[Replica]) -> None:
    plan.refresh_from_db()
    assert plan.status == status
    live = set(Replica.objects.exclude(state=S.TERMINATED).values_list("pk", flat=True))
    assert live == {r.pk for r in replicas}


def test_the_stale_spread_plan_of_the_walk_is_refused_naming_what_moved(demo, make_client):  # type: ignore[no-untyped-def]
    plan = proposed_by_replan()
    now = replace_all(demo)
    client = make_client(Role.OPERATOR)

    response = client.post(f"/api/v1/plans/{plan.pk}/approve/", {}, format="json")
    assert response.status_code == 409, response.content
    plan.refresh_from_db()
    assert set(plan.basis["demo-chat"]["replicas"]) == {str(r.pk) for r in demo["running"]}
    assert plan.basis["demo-chat"]["rules"]["spread_regions"] == 2
    assert len(plan.basis_fingerprint) == 64
    body = response.json()
    first = demo["running"][0].pk
    assert f"r-{first} is terminated, was ready in aws:us-east-1" in body["changed"]
    assert f"r-{now[0].pk} is new (ready in aws:eu-central-1)" in body["changed"]
    assert f"r-{first} is terminated" in body["detail"]
    assert body["propose_url"] == "/api/v1/plans/propose/"
    assert body["propose"] == {"deployments": ["demo-chat"]}
    nothing_changed(plan, PlanStatus.PROPOSED, now)
    assert not AuditLog.objects.filter(action="plan.approve", object_id=str(plan.pk)).exists()

    # Proposing again, as offered, plans the fleet as it is, and supersedes plan 1.
    again = client.post(body["propose_url"], body["propose"], format="json")
    assert again.status_code == 201, again.content
    newer = again.json()
    assert set(newer["basis"]["demo-chat"]["replicas"]) == {str(r.pk) for r in now}
    old = Plan.objects.get(pk=plan.pk)
    assert old.status == PlanStatus.SUPERSEDED and old.superseded_by_id == newer["id"]


def test_a_plan_approved_before_the_fleet_moved_is_not_applied(demo, make_client):  # type: ignore[no-untyped-def]
    plan = proposed_by_replan()
    client = make_client(Role.OPERATOR)
    assert client.post(f"/api/v1/plans/{plan.pk}/approve/", {}, format="json").status_code == 200
    now = replace_all(demo)
    response = client.post(f"/api/v1/plans/{plan.pk}/apply/", {}, format="json")
    assert response.status_code == 409, response.content
    assert any("is terminated, was ready" in line for line in response.json()["changed"])
    nothing_changed(plan, PlanStatus.APPROVED, now)
    assert not AuditLog.objects.filter(action="plan.apply", object_id=str(plan.pk)).exists()
    # Frankfurt's one replica, the deployment's only EU one, still serves.
    assert Replica.objects.get(pk=now[0].pk).state == S.READY


def test_a_rule_changed_since_is_named_old_to_new(demo, make_client):  # type: ignore[no-untyped-def]
    plan = proposed_by_replan()
    Deployment.objects.filter(pk=demo["d"].pk).update(spread_regions=3)
    demo["d"].allowed_jurisdictions.set([demo["eu"]])
    with pytest.raises(plans.PlanStaleError) as refused:
        plans.approve(plan.pk, "alice")
    assert "demo-chat: spread_regions 2 → 3" in refused.value.changed
    assert "demo-chat: allowed_jurisdictions [EU, US] → [EU]" in refused.value.changed
    nothing_changed(plan, PlanStatus.PROPOSED, demo["running"])


def test_replicas_coming_up_do_not_make_a_plan_stale(demo, make_client):  # type: ignore[no-untyped-def]
    """The solver counts pending, starting, ready and degraded replicas alike: one moving
    between them leaves the plan as good as it was."""
    Replica.objects.filter(pk=demo["running"][0].pk).update(state=S.STARTING)
    plan = proposed_by_replan()
    Replica.objects.filter(pk=demo["running"][0].pk).update(state=S.READY)
    Replica.objects.filter(pk=demo["running"][1].pk).update(state=S.DEGRADED)
    client = make_client(Role.OPERATOR)
    assert client.post(f"/api/v1/plans/{plan.pk}/approve/", {}, format="json").status_code == 200
    applied = client.post(f"/api/v1/plans/{plan.pk}/apply/", {}, format="json")
    assert applied.status_code == 200 and applied.json()["status"] == "applying"


def test_a_replica_draining_since_makes_the_plan_stale(demo):  # type: ignore[no-untyped-def]
    plan = proposed_by_replan()
    Replica.objects.filter(pk=demo["running"][2].pk).update(state=S.DRAINING)
    with pytest.raises(plans.PlanStaleError, match=f"r-{demo['running'][2].pk} is "
                       "draining, was ready"):
        plans.approve(plan.pk, "alice")


def test_a_plan_stored_before_plans_recorded_their_fleet_is_refused(demo):  # type: ignore[no-untyped-def]
    plan = proposed_by_replan()
    Plan.objects.filter(pk=plan.pk).update(basis={}, basis_fingerprint="")
    with pytest.raises(plans.PlanStaleError, match="records no fleet state"):
        plans.approve(plan.pk, "alice")


def test_a_bad_review_body_is_refused_naming_the_field(demo, make_client):  # type: ignore[no-untyped-def]
    plan = proposed_by_replan()
    client = make_client(Role.OPERATOR)
    response = client.post(f"/api/v1/plans/{plan.pk}/approve/", {"reason": "x" * 501},
                           format="json")
    assert response.status_code == 400 and "reason" in response.json()
    assert Plan.objects.get(pk=plan.pk).status == PlanStatus.PROPOSED
