"""A promoted rollout finishes cleanly: the new revision's replicas are brought up to the
deployment's count first (placed like any replica), then the old revision's are drained and
retired, each with an audit event; until then the next rollout waits."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from controlplane.core.models import AuditLog, Role
from controlplane.core.services import ensure_user
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.rollouts import analyst, lifecycle
from controlplane.rollouts.models import Rollout
from regions.models import Offer
from tests.api.test_endpoints_crud import make_deployment
from tests.rollouts.starting import start_rollout

pytestmark = pytest.mark.django_db


def serve(rows: Any) -> None:
    for replica in list(rows.all()):  # not the caller's queryset: it would cache
        Replica.objects.filter(pk=replica.pk).update(
            state=S.READY, url=f"http://10.0.2.{replica.pk % 250}:8000")


@pytest.fixture
def deployment(catalog, tenants) -> Deployment:  # type: ignore[no-untyped-def]
    """Two stable replicas on Frankfurt's H100s."""
    deployment = make_deployment({**catalog, **tenants}, "chat-promo", tenant=None)
    offer = Offer.objects.get(region=catalog["fra"], gpu_type=catalog["h100"])
    for i in range(2):
        Replica.objects.create(deployment=deployment, region=catalog["fra"], offer=offer,
                               state=S.READY, url=f"http://10.0.1.{i + 1}:8000")
    return deployment


def old_replicas(deployment: Deployment) -> list[Replica]:
    return list(Replica.objects.filter(deployment=deployment, revision__isnull=True))


def test_promoting_at_100_percent_retires_the_old_revision_at_once(deployment):  # type: ignore[no-untyped-def]
    old = old_replicas(deployment)
    rollout = start_rollout(deployment, actor="op", steps=[50, 100], bake_s=60)
    serve(Replica.objects.filter(revision=rollout.to_revision))
    assert analyst.check() == {str(rollout.pk): "live"}
    canaries = Replica.objects.filter(revision=rollout.to_revision)
    assert canaries.count() == 2  # 50% of the traffic: as many as the stable ones
    lifecycle.advance(rollout.pk, actor="op")
    deployment.refresh_from_db()
    assert deployment.canary_weight == 100 and canaries.count() == 2

    lifecycle.promote(rollout.pk, actor="op", reason="looks good")
    rollout.refresh_from_db()
    deployment.refresh_from_db()
    assert deployment.stable_revision_id == rollout.to_revision_id
    assert rollout.replicas_wanted == 2 and rollout.old_retired_at is not None
    # Nothing more was needed: the old ones are draining, marked as the old revision.
    assert {r.state for r in Replica.objects.filter(pk__in=[r.pk for r in old])} == {
        S.DRAINING}
    assert set(Replica.objects.filter(pk__in=[r.pk for r in old])
               .values_list("revision_id", flat=True)) == {rollout.from_revision_id}
    assert set(canaries.values_list("state", flat=True)) == {S.READY}
    assert Replica.objects.filter(deployment=deployment).count() == 4  # none asked for
    event = AuditLog.objects.get(action="rollout.promoted")
    assert sorted(event.changes["retired"]) == sorted(r.public_id for r in old)
    assert event.changes["requested"] == [] and event.changes["replicas_wanted"] == 2
    assert AuditLog.objects.filter(action="replica.draining").count() == 2
    assert analyst.check() == {}  # nothing left to do


def test_promoting_early_brings_the_new_revision_up_before_the_old_one_goes(  # type: ignore[no-untyped-def]
        deployment, catalog):
    old = old_replicas(deployment)
    rollout = start_rollout(deployment, actor="op", steps=[10, 50, 100], bake_s=60)
    canaries = Replica.objects.filter(revision=rollout.to_revision)
    serve(canaries)
    assert analyst.check() == {str(rollout.pk): "live"}
    assert canaries.count() == 1

    lifecycle.promote(rollout.pk, actor="op", reason="urgent fix")
    rollout.refresh_from_db()
    assert rollout.state == "promoted" and rollout.old_retired_at is None
    # One more replica of the new revision, placed by the solver within the deployment's
    # jurisdictions on the GPU type running; the old ones still serve meanwhile.
    assert canaries.count() == 2
    added = canaries.get(state=S.PENDING)
    assert added.region.jurisdiction == catalog["eu"]
    assert added.offer is not None and added.offer.gpu_type == catalog["h100"]
    assert {r.state for r in Replica.objects.filter(pk__in=[r.pk for r in old])} == {S.READY}
    event = AuditLog.objects.get(action="rollout.promoted")
    assert event.changes["requested"] == [added.public_id]
    assert "waiting for 2 replicas of revision 2" in event.changes["waiting"]
    # The next rollout waits until the old revision is retired.
    with pytest.raises(lifecycle.RolloutStateError, match="not retired yet"):
        start_rollout(deployment, actor="op", bake_s=60)

    assert analyst.check() == {str(rollout.pk): "retiring"}
    assert canaries.count() == 2  # not asked for twice
    # Its launch fails: asked for again at the next check.
    Replica.objects.filter(pk=added.pk).update(state=S.FAILED, last_error="boom")
    assert analyst.check() == {str(rollout.pk): "retiring"}
    assert canaries.exclude(state=S.FAILED).count() == 2
    assert AuditLog.objects.filter(action="rollout.replicas_requested").count() == 1
    assert {r.state for r in Replica.objects.filter(pk__in=[r.pk for r in old])} == {S.READY}

    serve(canaries.exclude(state=S.FAILED))
    assert analyst.check() == {str(rollout.pk): "retired_old"}
    assert {r.state for r in Replica.objects.filter(pk__in=[r.pk for r in old])} == {
        S.DRAINING}
    assert set(canaries.exclude(state=S.FAILED).values_list("state", flat=True)) == {S.READY}
    event = AuditLog.objects.get(action="rollout.old_retired")
    assert sorted(event.changes["retired"]) == sorted(r.public_id for r in old)
    rollout.refresh_from_db()
    assert rollout.old_retired_at is not None
    assert analyst.check() == {}
    assert start_rollout(deployment, actor="op", bake_s=60).state == "running"


def test_a_replica_launched_after_promotion_counts_as_the_new_revision(deployment):  # type: ignore[no-untyped-def]
    """Unmarked replicas are the stable revision's: those running at promotion are marked
    as the old one, so one the autoscaler adds afterwards counts for the new one."""
    rollout = start_rollout(deployment, actor="op", steps=[10, 100], bake_s=60)
    serve(Replica.objects.filter(revision=rollout.to_revision))
    analyst.check()
    lifecycle.promote(rollout.pk, actor="op")
    pending = Replica.objects.get(revision=rollout.to_revision, state=S.PENDING)
    Replica.objects.filter(pk=pending.pk).update(state=S.FAILED)  # no replacement of ours
    later = Replica.objects.create(deployment=deployment, region=pending.region,
                                   offer=pending.offer, state=S.READY, url="http://10.0.3.1:8000")
    assert analyst.check() == {str(rollout.pk): "retired_old"}
    assert Replica.objects.get(pk=later.pk).state == S.READY
    assert not Replica.objects.filter(revision=rollout.from_revision, state=S.READY).exists()


def test_rolling_back_retires_the_canary_and_keeps_the_old_revision(deployment):  # type: ignore[no-untyped-def]
    old = old_replicas(deployment)
    rollout = start_rollout(deployment, actor="op", steps=[50, 100], bake_s=60)
    canaries = Replica.objects.filter(revision=rollout.to_revision)
    serve(canaries)
    analyst.check()
    lifecycle.roll_back(rollout.pk, actor="op", reason="bad")
    assert set(canaries.values_list("state", flat=True)) == {S.DRAINING}
    assert {r.state for r in Replica.objects.filter(pk__in=[r.pk for r in old])} == {S.READY}
    assert Rollout.objects.get(pk=rollout.pk).old_retired_at is not None
    assert analyst.check() == {}


def test_the_rollout_page_says_whether_the_old_revision_is_retired(deployment):  # type: ignore[no-untyped-def]
    rollout = start_rollout(deployment, actor="op", steps=[10, 100], bake_s=60)
    serve(Replica.objects.filter(revision=rollout.to_revision))
    analyst.check()
    lifecycle.promote(rollout.pk, actor="op")
    client = Client()
    client.force_login(ensure_user("viewer-promo", Role.VIEWER, None))
    html = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert "keep serving until 2 of revision 2" in html
    serve(Replica.objects.filter(revision=rollout.to_revision))
    analyst.check()
    html = client.get(f"/rollouts/{rollout.pk}/").content.decode()
    assert "were retired" in html and "once 2 of revision 2" in html


def test_the_new_revision_takes_the_old_ones_regions_region_for_region(  # type: ignore[no-untyped-def]
        deployment, catalog):
    """Two stable replicas in Frankfurt, one in Eemshaven: promoted early, with its one
    canary in Frankfurt, the two replicas it lacks go where the old ones ran (one each in
    Frankfurt and Eemshaven), not wherever is cheapest, so users keep their distance."""
    ams = Offer.objects.get(region=catalog["ams"], gpu_type=catalog["h100"])
    Replica.objects.create(deployment=deployment, region=catalog["ams"], offer=ams,
                           state=S.READY, url="http://10.0.1.9:8000")
    rollout = start_rollout(deployment, actor="op", steps=[25, 100], bake_s=60)
    (canary,) = Replica.objects.filter(revision=rollout.to_revision)
    serve(Replica.objects.filter(pk=canary.pk))
    lifecycle.promote(rollout.pk, actor="op")
    new = Replica.objects.filter(deployment=deployment).exclude(
        revision=rollout.from_revision).exclude(pk=canary.pk)
    assert sorted(r.region.key for r in [canary, *new]) == sorted(
        [catalog["fra"].key, catalog["fra"].key, catalog["ams"].key])
