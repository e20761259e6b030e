"""What one tenant can make the fleet run: absolute bounds on a deployment's replicas, and each
tenant's max_replicas and max_gpus, checked at the door (400 naming the cap) and by everything
that adds replicas (the autoscaler, plans, operator scaling, request_replicas itself)."""

from __future__ import annotations

from typing import Any

import pytest
from django.utils import timezone

from controlplane.core.models import AuditLog, Role, Tenant
from controlplane.deployments import caps
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from regions.models import Offer

pytestmark = pytest.mark.django_db

PAYLOAD = {"served_model_name": "llama-3.1-8b", "model": "llama-3.1-8b-instruct",
           "allowed_jurisdictions": ["EU"], "min_replicas": 1, "max_replicas": 2}


@pytest.fixture
def fx(catalog, tenants, sent_tasks):  # type: ignore[no-untyped-def]
    return {**catalog, **tenants}


def capped(tenant: Tenant, replicas: int, gpus: int) -> Tenant:
    Tenant.objects.filter(pk=tenant.pk).update(max_replicas=replicas, max_gpus=gpus)
    tenant.refresh_from_db()
    return tenant


def deployment(fx: dict[str, Any], name: str, tenant: Tenant | None, **fields: Any) -> Deployment:
    """Straight into the database, past the door: what caps must still hold against."""
    values = {"served_model_name": name, "model": fx["llama8b"], "min_replicas": 1,
              "max_replicas": 8, **fields}
    row = Deployment.objects.create(name=name, tenant=tenant, **values)
    row.allowed_jurisdictions.set([fx["eu"]])
    return row


def running(d: Deployment, fx: dict[str, Any], n: int) -> list[Replica]:
    offer = Offer.objects.get(region=fx["fra"], gpu_type=fx["h100"])
    return [Replica.objects.create(deployment=d, region=fx["fra"], offer=offer, state=S.READY)
            for _ in range(n)]


def create(make_client, fx, tenant="acme", **fields):  # type: ignore[no-untyped-def]
    client = make_client(Role.OPERATOR, fx[tenant] if tenant else None)
    return client.post("/api/v1/deployments/", {**PAYLOAD, "name": fields.pop("name", "chat"),
                                                **fields}, format="json")


# -- at the door -------------------------------------------------------------------------------

@pytest.mark.parametrize("tenant", ["acme", None])
def test_500_replicas_are_refused_for_anyone(fx, make_client, tenant):  # type: ignore[no-untyped-def]
    response = create(make_client, fx, tenant, min_replicas=500, max_replicas=500)
    assert response.status_code == 400, response.content
    body = response.json()
    assert "most one deployment may ask for (100)" in body["max_replicas"][0]
    assert "most one deployment may ask for (100)" in body["min_replicas"][0]
    assert not Deployment.objects.exists()


def test_max_replicas_over_the_tenants_cap_is_a_400_naming_it(fx, make_client):  # type: ignore[no-untyped-def]
    capped(fx["acme"], replicas=3, gpus=100)
    response = create(make_client, fx, max_replicas=4)
    assert response.status_code == 400
    assert response.json()["max_replicas"] == [
        "max_replicas (4) exceeds tenant acme's max_replicas cap of 3 replicas."]
    assert create(make_client, fx, max_replicas=3).status_code == 201


def test_gpus_per_replica_count_against_max_gpus(fx, make_client):  # type: ignore[no-untyped-def]
    capped(fx["acme"], replicas=10, gpus=4)
    response = create(make_client, fx, tensor_parallel=2, max_replicas=3)
    assert response.status_code == 400
    assert response.json()["max_replicas"] == [
        "max_replicas (3) × 2 GPUs per replica (tensor × pipeline parallel) = 6 GPUs exceeds "
        "tenant acme's max_gpus cap of 4 GPUs."]


def test_minimums_of_all_the_tenants_deployments_count_together(fx, make_client):  # type: ignore[no-untyped-def]
    capped(fx["acme"], replicas=4, gpus=100)
    assert create(make_client, fx, name="first", min_replicas=3, max_replicas=4).status_code == 201
    response = create(make_client, fx, name="second", min_replicas=2, max_replicas=2)
    assert response.status_code == 400
    assert "with the 3 that tenant acme's other deployments keep running exceeds its " \
           "max_replicas cap of 4" in response.json()["min_replicas"][0]
    assert create(make_client, fx, name="second", min_replicas=1, max_replicas=2).status_code == 201


def test_changing_a_deployment_does_not_count_its_old_minimum_twice(fx, make_client):  # type: ignore[no-untyped-def]
    capped(fx["acme"], replicas=4, gpus=100)
    create(make_client, fx, name="first", min_replicas=3, max_replicas=4)
    client = make_client(Role.OPERATOR, fx["acme"])
    assert client.patch("/api/v1/deployments/first/", {"min_replicas": 4},
                        format="json").status_code == 200
    response = client.patch("/api/v1/deployments/first/", {"max_replicas": 5}, format="json")
    assert response.status_code == 400 and "max_replicas cap of 4" in response.json()["max_replicas"][0]


def test_another_tenants_deployments_do_not_count(fx, make_client):  # type: ignore[no-untyped-def]
    capped(fx["acme"], replicas=2, gpus=100)
    deployment(fx, "globex-big", fx["globex"], min_replicas=8)
    assert create(make_client, fx, min_replicas=2, max_replicas=2).status_code == 201


def test_shared_deployments_are_not_bound_by_tenant_caps(fx, make_client):  # type: ignore[no-untyped-def]
    capped(fx["acme"], replicas=1, gpus=1)
    assert create(make_client, fx, None, min_replicas=1, max_replicas=20).status_code == 201


# -- who sets the caps ----------------------------------------------------------------------------

def test_platform_admins_set_caps_through_the_api(fx, make_client):  # type: ignore[no-untyped-def]
    url = f"/api/v1/tenants/{fx['acme'].pk}/"
    response = make_client(Role.ADMIN).patch(url, {"max_gpus": 8, "max_replicas": 4}, format="json")
    assert response.status_code == 200, response.content
    assert (response.json()["max_gpus"], response.json()["max_replicas"]) == (8, 4)
    seen = make_client(Role.VIEWER, fx["acme"]).get(url).json()
    assert (seen["max_gpus"], seen["max_replicas"]) == (8, 4)


@pytest.mark.parametrize("role", [Role.ADMIN, Role.OPERATOR])
def test_tenant_users_cannot_raise_their_own_caps(fx, make_client, role):  # type: ignore[no-untyped-def]
    url = f"/api/v1/tenants/{fx['acme'].pk}/"
    response = make_client(role, fx["acme"]).patch(url, {"max_gpus": 8000}, format="json")
    assert response.status_code == 403
    fx["acme"].refresh_from_db()
    assert fx["acme"].max_gpus == 32


@pytest.mark.parametrize(("field", "value", "words"), [
    ("max_gpus", -1, "greater than or equal to 0"),
    ("max_gpus", 8001, "less than or equal to 8000"),
    ("max_replicas", 1001, "less than or equal to 1000"),
    ("max_replicas", "many", "valid integer"),
])
def test_bad_caps_are_a_400_naming_the_field(fx, make_client, field, value, words):  # type: ignore[no-untyped-def]
    response = make_client(Role.ADMIN).patch(f"/api/v1/tenants/{fx['acme'].pk}/", {field: value},
                                             format="json")
    assert response.status_code == 400
    assert words in response.json()[field][0]


# -- wherever replicas are added ----------------------------------------------------------------

def test_headroom_counts_live_replicas_and_their_gpus(fx):  # type: ignore[no-untyped-def]
    capped(fx["acme"], replicas=5, gpus=6)
    d = deployment(fx, "chat", fx["acme"], tensor_parallel=2)
    running(d, fx, 2)
    Replica.objects.create(deployment=d, region=fx["fra"], state=S.TERMINATED)
    assert caps.usage(fx["acme"].pk) == caps.Usage(replicas=2, gpus=4)
    room = caps.headroom(d)
    assert room.replicas == 1
    assert room.why == "tenant acme holds 4 of its max_gpus cap of 6 GPUs (2 per replica)"
    assert caps.headroom(deployment(fx, "shared", None)).replicas is None


def test_request_replicas_never_makes_more_than_the_caps_allow(fx):  # type: ignore[no-untyped-def]
    from controlplane.provisioning.tasks import request_replicas

    capped(fx["acme"], replicas=3, gpus=100)
    d = deployment(fx, "chat", fx["acme"])
    running(d, fx, 2)
    made = request_replicas(d, fx["fra"], 4, actor="tester", reason="test")
    assert len(made) == 1
    refused = AuditLog.objects.get(action="replica.refused_cap")
    assert refused.changes == {"asked": 4, "made": 1}
    assert "runs 2 of its max_replicas cap of 3 replicas" in refused.reason
    assert request_replicas(d, fx["fra"], 1, actor="tester", reason="test") == []


def test_operator_scaling_past_a_cap_is_refused_naming_it(fx, make_client):  # type: ignore[no-untyped-def]
    capped(fx["acme"], replicas=2, gpus=100)
    d = deployment(fx, "chat", fx["acme"])
    running(d, fx, 1)
    response = make_client(Role.OPERATOR, fx["acme"]).post(
        "/api/v1/deployments/chat/scale/", {"region": "aws:eu-central-1", "replicas": 3},
        format="json")
    assert response.status_code == 400, response.content
    assert "max_replicas cap of 2" in str(response.json())
    assert Replica.objects.filter(deployment=d).count() == 1


def test_the_autoscaler_stops_at_the_cap_and_says_so(fx):  # type: ignore[no-untyped-def]
    from controlplane.scaling import autoscaler
    from tests.scaling.test_autoscaler import store_rounds

    capped(fx["acme"], replicas=3, gpus=100)
    d = deployment(fx, "chat", fx["acme"], max_replicas=6, target_inflight_per_replica=4)
    d.user_regions.set([fx["fra"]])
    replicas = running(d, fx, 2)
    store_rounds(replicas, 6, running=40, waiting=30, kv_usage=0.9)
    [outcome] = autoscaler.run()
    assert outcome.recorded is not None, outcome.decision
    decision = outcome.recorded
    assert (decision.replicas_wanted or 0) > 3
    assert decision.replicas_after == 3
    assert "runs 2 of its max_replicas cap of 3 replicas, so at most 1 more" in decision.reason
    assert Replica.objects.filter(deployment=d).count() == 3


def test_the_planner_places_no_more_than_the_caps_leave(fx):  # type: ignore[no-untyped-def]
    from controlplane.placement.proposals import propose_plan

    capped(fx["acme"], replicas=2, gpus=100)
    first = deployment(fx, "chat-a", fx["acme"], min_replicas=3)
    second = deployment(fx, "chat-b", fx["acme"], min_replicas=3)
    running(first, fx, 1)
    plan = propose_plan([first, second], actor="tester", trigger="manual")
    changes = list(plan.changes.values("deployment__name", "action", "count"))
    net = {"chat-a": 1, "chat-b": 0}
    for c in changes:
        net[c["deployment__name"]] += c["count"] if c["action"] == "add" else -c["count"]
    # The one replica the cap leaves goes to one of them; together they run 2, not 6.
    assert sum(net.values()) == 2, changes
    assert plan.status == "proposed", plan.explanation
    for d in (first, second):
        d.refresh_from_db()
        assert "min_replicas (3) is more than tenant caps leave it" in d.placement_problem


def test_applying_a_plan_past_a_cap_makes_nothing_and_says_why(fx):  # type: ignore[no-untyped-def]
    from controlplane.placement.basis import record
    from controlplane.placement.models import Plan, PlanChange, PlanStatus
    from controlplane.plans.apply import PlanStateError, start_apply

    capped(fx["acme"], replicas=2, gpus=100)
    d = deployment(fx, "chat", fx["acme"])
    running(d, fx, 1)
    plan = Plan.objects.create(proposed_by="tester", status=PlanStatus.APPROVED,
                               reviewed_at=timezone.now())
    PlanChange.objects.create(plan=plan, deployment=d, action="add", region=fx["fra"],
                              offer=Offer.objects.get(region=fx["fra"], gpu_type=fx["h100"]),
                              count=3, reason="demand")
    record(plan)  # the fleet it was computed from: as it is now
    with pytest.raises(PlanStateError, match="only 1 fit its tenant's caps: tenant acme runs"):
        start_apply(plan.pk, "tester")
    plan.refresh_from_db()
    assert plan.status == PlanStatus.APPROVED
    assert Replica.objects.filter(deployment=d).count() == 1
