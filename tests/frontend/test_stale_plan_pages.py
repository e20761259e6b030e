"""The Plans pages say when a plan can no longer act: superseded (naming the newer plan) or
stale (naming what moved since), with no Approve or Apply, and an operator's answer to a
stale plan's step says what moved and that nothing was done."""

from __future__ import annotations

import pytest

from controlplane.core.models import Role
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.placement.models import Plan, PlanStatus
from controlplane.placement.proposals import propose_plan

pytestmark = pytest.mark.django_db


def test_a_superseded_plan_names_the_plan_that_replaced_it(signed_in, fleet):  # type: ignore[no-untyped-def]
    newer = propose_plan(None, actor="ops", trigger="manual")
    assert Plan.objects.get(pk=fleet.plan.pk).status == PlanStatus.SUPERSEDED
    client = signed_in(Role.OPERATOR)
    html = client.get(f"/plans/{fleet.plan.pk}/").content.decode()
    assert "plan-superseded" in html and f'href="/plans/{newer.pk}/"' in html
    assert "cannot be approved or applied" in html
    assert f"/plans/{fleet.plan.pk}/approve/" not in html
    listing = client.get("/plans/").content.decode()
    assert f'by <a href="/plans/{newer.pk}/">plan {newer.pk}</a>' in listing


def test_a_stale_plan_says_what_moved_and_offers_to_propose_again(signed_in, fleet):  # type: ignore[no-untyped-def]
    gone = Replica.objects.filter(deployment=fleet.deployments[0], state=S.READY).first()
    assert gone is not None
    Replica.objects.filter(pk=gone.pk).update(state=S.TERMINATED)
    client = signed_in(Role.OPERATOR)
    html = client.get(f"/plans/{fleet.plan.pk}/").content.decode()
    assert "Stale: the fleet moved" in html and f"r-{gone.pk} is terminated, was ready" in html
    assert "Propose again" in html and f"/plans/{fleet.plan.pk}/approve/" not in html
    assert "plan-stale" in client.get("/plans/").content.decode()
    answer = client.post(f"/plans/{fleet.plan.pk}/approve/", follow=True).content.decode()
    assert "Nothing done" in answer and f"r-{gone.pk} is terminated" in answer
    assert Plan.objects.get(pk=fleet.plan.pk).status == PlanStatus.PROPOSED


def test_a_fresh_plan_shows_what_it_was_computed_from(signed_in, fleet):  # type: ignore[no-untyped-def]
    html = signed_in(Role.VIEWER).get(f"/plans/{fleet.plan.pk}/").content.decode()
    assert "Computed from" in html and "Stale: the fleet moved" not in html
    assert "badge plan-stale" not in html and f"/plans/{fleet.plan.pk}/approve/" not in html
