"""Applying a plan acts once however many times its step runs: a redelivered `advance_plan`
beside the chain, or the periodic resume, finds the plan applied and stops."""

from __future__ import annotations

import pytest

from controlplane.core.models import AuditLog, Role
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.placement.models import PlanStatus
from controlplane.plans import apply as plans
from controlplane.plans import tasks
from tests.api.test_endpoints_crud import make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def applying(catalog, tenants, make_client, sent_tasks):  # type: ignore[no-untyped-def]
    """An applying plan whose added replicas serve: the next advance drains the US one."""
    deployment = make_deployment({**catalog, **tenants}, "chat-eu")
    deployment.min_replicas, deployment.max_replicas = 2, 4
    deployment.save()
    old = Replica.objects.create(deployment=deployment, region=catalog["iad"], state=S.READY,
                                 offer=catalog["iad"].offers.first(), url="http://127.0.0.1:1")
    client = make_client(Role.OPERATOR)
    plan = client.post("/api/v1/plans/propose/", {}, format="json").json()
    client.post(f"/api/v1/plans/{plan['id']}/approve/", {}, format="json")
    client.post(f"/api/v1/plans/{plan['id']}/apply/", {}, format="json")
    Replica.objects.filter(deployment=deployment).exclude(pk=old.pk).update(state=S.READY)
    return plan["id"], old


class RacingStates(frozenset[str]):
    """SERVING_STATES that runs a second advance of the plan the first time it is asked, so
    the second finishes between the first's read of the plan and its drain: the interleaving
    of two workers running the step at once."""

    plan_id: int
    raced: bool

    def __new__(cls, plan_id: int) -> RacingStates:
        instance = super().__new__(cls, plans.SERVING_STATES)
        instance.plan_id, instance.raced = plan_id, False
        return instance

    def __contains__(self, state: object) -> bool:
        if not self.raced:
            self.raced = True
            assert plans.advance(self.plan_id) == PlanStatus.APPLIED
        return super().__contains__(state)


def test_two_advances_at_once_apply_the_plan_once(applying, monkeypatch):  # type: ignore[no-untyped-def]
    plan_id, old = applying
    monkeypatch.setattr(plans, "SERVING_STATES", RacingStates(plan_id))
    assert plans.advance(plan_id) == PlanStatus.APPLIED
    assert AuditLog.objects.filter(action="plan.applied", object_id=str(plan_id)).count() == 1
    assert AuditLog.objects.filter(action="replica.draining", object_id=str(old.pk)).count() == 1


def test_the_periodic_resume_finishes_a_plan_whose_chain_was_lost(applying):  # type: ignore[no-untyped-def]
    plan_id, old = applying
    # No advance_plan message runs (it was held by a worker that died): the resume applies it.
    assert tasks.resume_applying() == {str(plan_id): PlanStatus.APPLIED}
    old.refresh_from_db()
    assert old.state == S.DRAINING
    assert tasks.resume_applying() == {}
