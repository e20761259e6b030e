"""Rollouts keep the deployment's rules: a revision that becomes the whole fleet spans the
regions its spread rule asks for, before and after promotion; and a revision whose replicas
fail during a step (failover replacing them at once) fails that step, saying which."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlplane.core.models import AuditLog
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.rollouts import analyst, lifecycle
from controlplane.rollouts.models import Rollout, RolloutStep
from regions.models import Offer
from tests.api.test_endpoints_crud import make_deployment
from tests.rollouts.starting import start_rollout

pytestmark = pytest.mark.django_db


def serve(rows: Any) -> None:
    for replica in list(rows.all()):
        Replica.objects.filter(pk=replica.pk).update(
            state=S.READY, ready_at=timezone.now(), url=f"http://10.0.7.{replica.pk % 250}:8000")


def regions_of(rows: Any) -> set[str]:
    return {r.region.key for r in rows.select_related("region__cloud")}


@pytest.fixture
def spread3(catalog, tenants) -> Deployment:  # type: ignore[no-untyped-def]
    """One stable replica in each of Frankfurt, Virginia and Eemshaven; spread_regions 3."""
    deployment = make_deployment({**catalog, **tenants}, "chat-spread", tenant=None)
    deployment.allowed_jurisdictions.set([catalog["eu"], catalog["us"]])
    deployment.user_regions.set([])
    Deployment.objects.filter(pk=deployment.pk).update(spread_regions=3, min_replicas=3,
                                                       max_replicas=6)
    deployment.refresh_from_db()
    for i, key in enumerate(("fra", "iad", "ams")):
        offer = Offer.objects.get(region=catalog[key], gpu_type=catalog["h100"])
        Replica.objects.create(deployment=deployment, region=catalog[key], offer=offer,
                               state=S.READY, ready_at=timezone.now(),
                               url=f"http://10.0.6.{i + 1}:8000")
    return deployment


def live(deployment: Deployment) -> Any:
    return Replica.objects.filter(deployment=deployment,
                                  state__in=[S.PENDING, S.READY]).exclude(state=S.DRAINING)


def test_a_rollout_promoting_into_a_spread_of_3_keeps_3_regions(spread3):  # type: ignore[no-untyped-def]
    rollout = start_rollout(spread3, actor="op", steps=[10, 100], bake_s=60)
    canaries = Replica.objects.filter(revision=rollout.to_revision)
    serve(canaries)
    assert analyst.check() == {str(rollout.pk): "live"}
    lifecycle.advance(rollout.pk, actor="op")
    # At 100% the canary's replicas are as many as the stable ones, one in each region.
    assert canaries.count() == 3
    assert regions_of(canaries) == {"aws:eu-central-1", "aws:us-east-1", "gcp:europe-west4"}
    serve(canaries)
    assert analyst.check() == {str(rollout.pk): "live"}

    lifecycle.promote(rollout.pk, actor="op", reason="good")
    rollout.refresh_from_db()
    assert rollout.old_retired_at is not None
    serving = Replica.objects.filter(deployment=spread3, state=S.READY)
    assert serving.count() == 3 and regions_of(serving) == {
        "aws:eu-central-1", "aws:us-east-1", "gcp:europe-west4"}


def test_promotion_of_a_revision_in_one_region_spreads_it_before_the_old_one_goes(  # type: ignore[no-untyped-def]
        spread3, catalog):
    """Canary replicas squeezed into Frankfurt (as an earlier release placed them): the
    promotion asks for replicas in the other regions, waits for them, and only then
    retires the old revision and the surplus in Frankfurt."""
    rollout = start_rollout(spread3, actor="op", steps=[10, 100], bake_s=60)
    canaries = Replica.objects.filter(revision=rollout.to_revision)
    fra = Offer.objects.get(region=catalog["fra"], gpu_type=catalog["h100"])
    Replica.objects.filter(pk__in=canaries.values("pk")).update(region=catalog["fra"],
                                                                 offer=fra)
    for i in range(2):
        Replica.objects.create(deployment=spread3, region=catalog["fra"], offer=fra,
                               revision=rollout.to_revision, state=S.READY,
                               ready_at=timezone.now(), url=f"http://10.0.8.{i}:8000")
    serve(canaries)
    old = list(Replica.objects.filter(deployment=spread3, revision__isnull=True))

    lifecycle.promote(rollout.pk, actor="op", reason="good")
    rollout.refresh_from_db()
    assert rollout.old_retired_at is None
    asked = canaries.filter(state=S.PENDING)
    assert regions_of(asked) == {"aws:us-east-1", "gcp:europe-west4"}
    event = AuditLog.objects.get(action="rollout.promoted")
    assert "in 3 regions" in event.changes["waiting"]
    assert {r.state for r in Replica.objects.filter(pk__in=[r.pk for r in old])} == {S.READY}

    serve(asked)
    assert analyst.check() == {str(rollout.pk): "retired_old"}
    serving = Replica.objects.filter(deployment=spread3, state=S.READY)
    assert serving.count() == 3 and regions_of(serving) == {
        "aws:eu-central-1", "aws:us-east-1", "gcp:europe-west4"}
    assert {r.state for r in Replica.objects.filter(pk__in=[r.pk for r in old])} == {
        S.DRAINING}


def test_a_canary_replica_failing_during_a_step_fails_the_rollout(spread3):  # type: ignore[no-untyped-def]
    rollout = start_rollout(spread3, actor="op", steps=[10, 50, 100], bake_s=60)
    canaries = Replica.objects.filter(revision=rollout.to_revision)
    serve(canaries)
    assert analyst.check() == {str(rollout.pk): "live"}
    lifecycle.advance(rollout.pk, actor="op")
    serve(canaries)
    assert analyst.check() == {str(rollout.pk): "live"}
    # Failover found one failed its health check and replaced it with a healthy one of the
    # same revision; the step's traffic figures would never show it.
    bad = canaries.order_by("id").first()
    assert bad is not None
    Replica.objects.filter(pk=bad.pk).update(
        state=S.TERMINATED, last_error="health check failed: 500",
        replacement_requested_at=timezone.now(), state_changed_at=timezone.now())
    Replica.objects.create(deployment=spread3, region=bad.region, offer=bad.offer,
                           revision=rollout.to_revision, state=S.READY,
                           ready_at=timezone.now(), url="http://10.0.9.9:8000")

    assert analyst.check() == {str(rollout.pk): "rolled_back"}
    rollout.refresh_from_db()
    assert rollout.state == "rolled_back"
    assert rollout.reason.startswith(
        f"canary replica {bad.public_id} failed and was replaced during step 2")
    assert "health check failed: 500" in rollout.reason
    assert RolloutStep.objects.get(rollout=rollout, step=1).decision == "rolled_back"
    spread3.refresh_from_db()
    assert spread3.canary_weight == 0 and spread3.canary_revision is None


def test_a_failure_before_the_step_or_a_failed_launch_does_not_fail_it(spread3):  # type: ignore[no-untyped-def]
    rollout = start_rollout(spread3, actor="op", steps=[10, 50, 100], bake_s=60)
    canaries = Replica.objects.filter(revision=rollout.to_revision)
    # A launch that fails (it never served) is asked for again, not a verdict.
    first = canaries.get()
    Replica.objects.filter(pk=first.pk).update(state=S.FAILED, last_error="no capacity")
    assert analyst.check() == {}
    assert Rollout.objects.get(pk=rollout.pk).state == "running"
    serve(canaries.exclude(state=S.FAILED))
    assert analyst.check() == {str(rollout.pk): "live"}
    # One replaced before this step started counts against that step, not this one.
    step = RolloutStep.objects.get(rollout=rollout, step=0)
    RolloutStep.objects.filter(pk=step.pk).update(started_at=timezone.now())
    Replica.objects.filter(pk=first.pk).update(
        ready_at=timezone.now() - timedelta(minutes=5),
        replacement_requested_at=timezone.now() - timedelta(minutes=1),
        state_changed_at=timezone.now() - timedelta(minutes=1))
    assert analyst.check() == {}
    assert Rollout.objects.get(pk=rollout.pk).state == "running"
