"""Canary replicas are placed like any replica: by the solver, within the deployment's
jurisdictions and the quota left, on the revision's preferred GPU type; a step whose canary
finds no room waits, and says why, until there is room."""

from __future__ import annotations

import pytest

from controlplane.core.models import AuditLog
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.rollouts import analyst, placement
from controlplane.rollouts.models import RolloutStep
from regions.models import Offer, Quota
from tests.api.test_endpoints_crud import make_deployment
from tests.rollouts.starting import start_rollout

pytestmark = pytest.mark.django_db


@pytest.fixture
def deployment(catalog, tenants) -> Deployment:  # type: ignore[no-untyped-def]
    """Two stable replicas on Frankfurt's H100s; EU only."""
    deployment = make_deployment({**catalog, **tenants}, "chat-canary", tenant=None)
    offer = Offer.objects.get(region=catalog["fra"], gpu_type=catalog["h100"])
    for i in range(2):
        Replica.objects.create(deployment=deployment, region=catalog["fra"], offer=offer,
                               state=S.READY, url=f"http://10.0.4.{i + 1}:8000")
    return deployment


def test_a_canary_goes_on_its_revisions_preferred_gpu_type(deployment, catalog):  # type: ignore[no-untyped-def]
    l4 = Offer.objects.get(region=catalog["fra"], gpu_type=catalog["l4"])
    Replica.objects.filter(deployment=deployment).update(offer=l4)  # the stable on L4s
    rollout = start_rollout(deployment, actor="op", steps=[50, 100], bake_s=60,
                             preferred_gpu_type=catalog["h100"])
    canaries = list(Replica.objects.filter(revision=rollout.to_revision))
    assert len(canaries) == 2
    for canary in canaries:
        assert canary.offer is not None and canary.offer.gpu_type == catalog["h100"]
        assert canary.region.jurisdiction == catalog["eu"]
    event = AuditLog.objects.get(action="rollout.started")
    assert sorted(event.changes["canary_replicas"]) == sorted(c.public_id for c in canaries)


def test_a_preferred_gpu_type_the_revision_does_not_fit_waits_saying_why(  # type: ignore[no-untyped-def]
        deployment, catalog):
    rollout = start_rollout(deployment, actor="op", steps=[50, 100], bake_s=60,
                             preferred_gpu_type=catalog["l4"])
    assert not Replica.objects.filter(revision=rollout.to_revision).exists()
    why = RolloutStep.objects.get(rollout=rollout).analysis["why"]
    assert "not placed: solver found no plan" in why and "does not fit 1× L4" in why


def test_without_the_gpu_type_preferred_canaries_run_on_the_type_running(deployment, catalog):  # type: ignore[no-untyped-def]
    rollout = start_rollout(deployment, actor="op", steps=[50, 100], bake_s=60)
    canaries = list(Replica.objects.filter(revision=rollout.to_revision))
    assert len(canaries) == 2
    assert {c.offer.gpu_type.name for c in canaries if c.offer} == {"H100"}
    # Residency: the cheaper H100s in the US are never used.
    assert {c.region.jurisdiction.code for c in canaries} == {"EU"}


def test_a_canary_without_quota_waits_and_says_why(deployment, catalog):  # type: ignore[no-untyped-def]
    # Frankfurt's H100 quota is what the stable replicas use; Eemshaven has none. Virginia
    # has room but is outside the deployment's jurisdictions.
    Quota.objects.filter(region=catalog["fra"], gpu_type=catalog["h100"]).update(limit_gpus=2)
    Quota.objects.filter(region=catalog["ams"], gpu_type=catalog["h100"]).update(limit_gpus=0)
    rollout = start_rollout(deployment, actor="op", steps=[10, 100], bake_s=60)
    assert not Replica.objects.filter(revision=rollout.to_revision).exists()
    step = RolloutStep.objects.get(rollout=rollout)
    assert step.ready_at is None and step.analysis["verdict"] == "waiting"
    why = step.analysis["why"]
    assert why.startswith("waiting for 1 canary replica to serve 10%: 0 serving, 0 launching")
    assert "not placed:" in why and "nothing placed" in why
    deployment.refresh_from_db()
    assert deployment.canary_weight == 0

    assert analyst.check() == {}  # still no room: still waiting, nothing asked for
    assert not Replica.objects.filter(revision=rollout.to_revision).exists()
    assert "not placed:" in RolloutStep.objects.get(pk=step.pk).analysis["why"]

    Quota.objects.filter(region=catalog["ams"], gpu_type=catalog["h100"]).update(limit_gpus=8)
    assert analyst.check() == {}
    canary = Replica.objects.get(revision=rollout.to_revision)
    assert canary.region == catalog["ams"] and canary.state == S.PENDING
    assert "not placed" not in RolloutStep.objects.get(pk=step.pk).analysis["why"]
    Replica.objects.filter(pk=canary.pk).update(state=S.READY, url="http://10.0.4.9:8000")
    assert analyst.check() == {str(rollout.pk): "live"}
    deployment.refresh_from_db()
    assert deployment.canary_weight == 10


@pytest.mark.parametrize("busy", ["fra", "ams"])
def test_a_canary_goes_beside_the_stable_replicas_that_serve_the_most(  # type: ignore[no-untyped-def]
        deployment, catalog, busy):
    """The analysis compares the revisions through the same edges: a canary far from the
    stable replicas those edges use would be judged on the network distance too."""
    from datetime import timedelta

    from django.utils import timezone

    from controlplane.telemetry.models import ReplicaSample

    ams = Offer.objects.get(region=catalog["ams"], gpu_type=catalog["h100"])
    Replica.objects.create(deployment=deployment, region=catalog["ams"], offer=ams,
                           state=S.READY, url="http://10.0.4.9:8000")
    now = timezone.now()
    for replica in Replica.objects.filter(deployment=deployment):
        served = 500.0 if replica.region == catalog[busy] else 5.0
        for at, done in ((now - timedelta(minutes=2), 100.0), (now, 100.0 + served)):
            ReplicaSample.objects.create(replica=replica, at=at,
                                         counters={"requests_ok": done})
    rollout = start_rollout(deployment, actor="op", steps=[25, 100], bake_s=60)
    (canary,) = Replica.objects.filter(revision=rollout.to_revision)
    assert canary.region == catalog[busy]
    by_region = placement.served_by_region(
        Replica.objects.filter(deployment=deployment, revision__isnull=True))
    assert max(by_region, key=by_region.__getitem__) == catalog[busy].key


def test_an_engine_restart_inside_the_window_still_counts_what_it_served(  # type: ignore[no-untyped-def]
        deployment, catalog):
    """Amsterdam's one stable replica served the most, but its engine restarted inside the
    window (its counter fell from 1300 to 50): comparing the window's ends read it as 0 and
    put the canary in Frankfurt. Counted across the restart, it served 650 to Frankfurt's
    200, and the canary goes to Amsterdam."""
    from datetime import timedelta

    from django.utils import timezone

    from controlplane.telemetry.models import ReplicaSample

    ams = Offer.objects.get(region=catalog["ams"], gpu_type=catalog["h100"])
    Replica.objects.create(deployment=deployment, region=catalog["ams"], offer=ams,
                           state=S.READY, url="http://10.0.4.9:8000")
    now = timezone.now()
    ams_counts = ((4, 1000.0), (2, 1300.0), (1, 50.0), (0, 350.0))
    fra_counts = ((4, 100.0), (0, 200.0))
    for replica in Replica.objects.filter(deployment=deployment).select_related("region"):
        counts = ams_counts if replica.region == catalog["ams"] else fra_counts
        for minutes, done in counts:
            ReplicaSample.objects.create(replica=replica, at=now - timedelta(minutes=minutes),
                                         counters={"requests_ok": done})
    by_region = placement.served_by_region(
        Replica.objects.filter(deployment=deployment).select_related("region__cloud"), now)
    assert by_region == {catalog["ams"].key: 650.0, catalog["fra"].key: 200.0}
    rollout = start_rollout(deployment, actor="op", steps=[25, 100], bake_s=60)
    (canary,) = Replica.objects.filter(revision=rollout.to_revision)
    assert canary.region == catalog["ams"]
