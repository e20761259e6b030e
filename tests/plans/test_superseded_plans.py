"""A newer plan over the same deployments supersedes the older open ones (proposed, or
approved and not applying): approving or applying one answers 409 naming the newer plan.
Plans are for platform staff alone: a tenant's users cannot approve or apply them."""

from __future__ import annotations

import pytest

from controlplane.core.models import AuditLog, Role
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.placement.models import Plan, PlanStatus
from controlplane.placement.proposals import propose_plan
from controlplane.plans import apply as plans
from tests.api.test_endpoints_crud import make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def two(catalog, tenants):  # type: ignore[no-untyped-def]
    """chat-a and chat-b, each asking for 2 replicas and running none."""
    fx = {**catalog, **tenants}
    out = []
    for name in ("chat-a", "chat-b"):
        d = make_deployment(fx, name)
        d.min_replicas, d.max_replicas = 2, 4
        d.save()
        out.append(d)
    return out


def propose(client, *names: str) -> dict:  # type: ignore[no-untyped-def,type-arg]
    response = client.post("/api/v1/plans/propose/", {"deployments": list(names)},
                           format="json")
    assert response.status_code == 201, response.content
    return response.json()  # type: ignore[no-any-return]


def test_approving_a_superseded_plan_answers_409_naming_the_newer_one(two, make_client):  # type: ignore[no-untyped-def]
    client = make_client(Role.OPERATOR)
    first = propose(client, "chat-a")
    second = propose(client, "chat-a", "chat-b")
    response = client.post(f"/api/v1/plans/{first['id']}/approve/", {}, format="json")
    assert response.status_code == 409, response.content
    body = response.json()
    assert body["superseded_by"] == second["id"]
    assert f"superseded by plan {second['id']}" in body["detail"]
    old = Plan.objects.get(pk=first["id"])
    assert old.status == PlanStatus.SUPERSEDED and old.reviewed_by == ""
    assert client.get(f"/api/v1/plans/{first['id']}/").json()["superseded_by"] == second["id"]
    audit = AuditLog.objects.get(action="plan.superseded", object_id=str(first["id"]))
    assert audit.reason == f"superseded by plan {second['id']}"
    assert not Replica.objects.exists()


def test_applying_an_approved_plan_superseded_since_answers_409(two, make_client):  # type: ignore[no-untyped-def]
    client = make_client(Role.OPERATOR)
    first = propose(client, "chat-a")
    assert client.post(f"/api/v1/plans/{first['id']}/approve/", {},
                       format="json").status_code == 200
    second = propose(client, "chat-a")
    response = client.post(f"/api/v1/plans/{first['id']}/apply/", {}, format="json")
    assert response.status_code == 409, response.content
    assert response.json()["superseded_by"] == second["id"]
    assert Plan.objects.get(pk=first["id"]).status == PlanStatus.SUPERSEDED
    assert not Replica.objects.exists()
    assert client.post(f"/api/v1/plans/{first['id']}/reject/", {},
                       format="json").status_code == 409


def test_plans_over_other_deployments_and_applying_ones_are_not_superseded(two, make_client):  # type: ignore[no-untyped-def]
    client = make_client(Role.OPERATOR)
    only_b = propose(client, "chat-b")
    applying = propose(client, "chat-a")
    client.post(f"/api/v1/plans/{applying['id']}/approve/", {}, format="json")
    assert client.post(f"/api/v1/plans/{applying['id']}/apply/", {},
                       format="json").status_code == 200
    newer = propose(client, "chat-a")
    assert Plan.objects.get(pk=only_b["id"]).status == PlanStatus.PROPOSED
    assert Plan.objects.get(pk=applying["id"]).status == PlanStatus.APPLYING
    assert Plan.objects.get(pk=newer["id"]).supersedes.count() == 0


def test_an_infeasible_plan_supersedes_nothing(two, catalog):  # type: ignore[no-untyped-def]
    a = two[0]
    standing = propose_plan([a], actor="ops", trigger="manual")
    a.spread_regions = 4  # two EU regions exist: no plan fits
    a.save()
    infeasible = propose_plan([a], actor="ops", trigger="manual")
    assert infeasible.status == PlanStatus.INFEASIBLE
    assert Plan.objects.get(pk=standing.pk).status == PlanStatus.PROPOSED


def test_a_tenant_user_cannot_approve_apply_or_propose(two, tenants, make_client):  # type: ignore[no-untyped-def]
    plan = propose(make_client(Role.OPERATOR), "chat-a")
    tenant_admin = make_client(Role.ADMIN, tenants["acme"])
    for step in ("approve", "apply", "reject"):
        response = tenant_admin.post(f"/api/v1/plans/{plan['id']}/{step}/", {}, format="json")
        assert response.status_code == 403, (step, response.content)
    assert tenant_admin.post("/api/v1/plans/propose/", {}, format="json").status_code == 403
    assert Plan.objects.get(pk=plan["id"]).status == PlanStatus.PROPOSED
    assert Plan.objects.count() == 1


def test_the_replan_marks_what_it_replaces_superseded(two, catalog):  # type: ignore[no-untyped-def]
    from controlplane.plans.replan import replan
    from regions.models import Offer

    # chat-a runs in Virginia, outside the EU it allows: a broken rule, so the replan proposes.
    Replica.objects.create(deployment=two[0], region=catalog["iad"], state=S.READY,
                           offer=Offer.objects.filter(region=catalog["iad"]).first())
    manual = propose_plan(None, actor="ops", trigger="manual")
    outcome = replan()
    assert outcome.plan is not None and outcome.action == "proposed", outcome.reason
    assert outcome.superseded == [manual.pk]
    assert Plan.objects.get(pk=manual.pk).superseded_by_id == outcome.plan.pk
    with pytest.raises(plans.PlanSupersededError, match=f"superseded by plan {outcome.plan.pk}"):
        plans.approve(manual.pk, "alice")
    assert not Replica.objects.filter(state=S.PENDING).exists()
