"""The autoscaler during a rollout: new replicas split between the revisions by the canary's
share (the rounding to the stable one), and a scale-down never takes a revision's last
serving replica."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.deployments.models import Deployment, Replica, Revision
from controlplane.deployments.models import ReplicaState as S
from controlplane.deployments.services import stable_revision
from controlplane.scaling import autoscaler
from controlplane.scaling import rules as policy
from controlplane.scaling.models import ScalingDecision
from controlplane.scaling.rules import DOWN, UP, Decision, Fleet, History
from regions.models import Offer
from tests.api.test_endpoints_crud import make_deployment


@pytest.mark.parametrize(("add", "weight", "split", "why"), [
    (1, 50, (1, 0), "one replica at 50%: the stable one gets the rounding"),
    (2, 50, (1, 1), "in proportion"),
    (4, 25, (3, 1), "in proportion"),
    (3, 10, (3, 0), "a small share rounds to the stable"),
    (2, 100, (0, 2), "at 100% the canary carries everything"),
    (3, 0, (3, 0), "a canary still waiting for its first step gets none"),
    (0, 50, (0, 0), "nothing to add"),
    (2, 150, (0, 2), "a share over 100 is taken as 100"),
])
def test_split_scale_up(add: int, weight: float, split: tuple[int, int], why: str) -> None:
    assert policy.split_scale_up(add, weight) == split, why


def test_canary_share_in_waves_is_the_mean_over_the_regions_reached() -> None:
    assert policy.canary_share(25, {}) == 25
    assert policy.canary_share(0, {"aws:eu-central-1": 100, "aws:us-east-1": 50}) == 75


@pytest.mark.parametrize(("revision", "serving", "left", "may"), [
    ("canary", True, {"canary": 1, "stable": 3}, False),
    ("canary", True, {"canary": 2, "stable": 3}, True),
    ("stable", True, {"canary": 2, "stable": 1}, False),
    ("canary", False, {"canary": 0}, True),  # not serving: a launch may always go
])
def test_keeps_each_revision(revision: str, serving: bool, left: dict[str, int],
                             may: bool) -> None:
    assert policy.keeps_each_revision(revision, serving, left) is may


@pytest.fixture
def split(db, catalog, tenants) -> dict[str, Any]:  # type: ignore[no-untyped-def]
    """A deployment at 50% between its stable revision (three replicas) and a canary (one),
    all serving on Frankfurt's H100s."""
    deployment = make_deployment({**catalog, **tenants}, "chat-split", tenant=None)
    Deployment.objects.filter(pk=deployment.pk).update(max_replicas=8)
    stable = stable_revision(deployment)
    canary = Revision.objects.create(deployment=deployment, number=2,
                                     model=catalog["llama8b"], engine_args={"engine": "vllm"})
    Deployment.objects.filter(pk=deployment.pk).update(canary_revision=canary,
                                                       canary_weight=50)
    offer = Offer.objects.get(region=catalog["fra"], gpu_type=catalog["h100"])
    replicas = [Replica.objects.create(deployment=deployment, region=catalog["fra"],
                                       offer=offer, state=S.READY,
                                       url=f"http://10.0.5.{i}:8000",
                                       revision=canary if i == 0 else None)
                for i in range(4)]
    deployment.refresh_from_db()
    return {"deployment": deployment, "stable": stable, "canary": canary,
            "replicas": replicas}


def act(deployment: Deployment, direction: str, before: int, after: int,
        load: dict[int, float] | None = None) -> ScalingDecision | None:
    snap = autoscaler.Snapshot(deployment, Fleet(serving=before), History(), [], load or {})
    return autoscaler.act(snap, Decision(direction, before, after, "test"))


def test_a_scale_up_during_a_rollout_adds_both_revisions_by_share(split):  # type: ignore[no-untyped-def]
    row = act(split["deployment"], UP, 4, 6)
    assert row is not None and row.replicas_after == 6
    added = Replica.objects.filter(pk__in=[int(p[2:]) for p in row.signals["requested"]])
    assert sorted(str(r.revision_id) for r in added) == sorted(
        [str(split["canary"].pk), "None"])
    assert row.signals["revisions"] == {"stable": 1, "canary 2": 1}
    # One more: the stable revision's (the rounding is its).
    row = act(split["deployment"], UP, 6, 7)
    assert row is not None
    newest = Replica.objects.get(pk=int(row.signals["requested"][0][2:]))
    assert newest.revision_id is None


def test_a_scale_down_during_a_rollout_keeps_the_only_canary_replica(split):  # type: ignore[no-untyped-def]
    canary_replica = split["replicas"][0]
    # The canary replica is the idlest: without the rollout it would go first.
    load = {r.pk: 10.0 for r in split["replicas"]} | {canary_replica.pk: 0.0}
    row = act(split["deployment"], DOWN, 4, 2, load)
    assert row is not None and row.replicas_after == 2
    assert Replica.objects.get(pk=canary_replica.pk).state == S.READY
    assert Replica.objects.filter(revision__isnull=True, state=S.READY).count() == 1
    # Down to one: the last stable and the only canary replica both stay.
    row = act(split["deployment"], DOWN, 2, 1, load)
    assert row is not None and row.replicas_after == 2 and row.signals["retired"] == []


def test_without_a_rollout_the_idlest_goes_whatever_its_revision(split):  # type: ignore[no-untyped-def]
    Deployment.objects.filter(pk=split["deployment"].pk).update(canary_revision=None,
                                                                canary_weight=0)
    split["deployment"].refresh_from_db()
    canary_replica = split["replicas"][0]
    load = {r.pk: 10.0 for r in split["replicas"]} | {canary_replica.pk: 0.0}
    row = act(split["deployment"], DOWN, 4, 3, load)
    assert row is not None and row.signals["retired"] == [canary_replica.public_id]


def test_a_canary_share_keeps_the_canary_spread_over_regions(catalog, tenants):  # type: ignore[no-untyped-def]
    """spread_regions 2: stable replicas in Frankfurt and Amsterdam, the canary's one in
    Virginia (the cheapest region). Its share of a scale-up goes, as a rollout places it, to
    a region the canary lacks (beside the stable replicas), not beside its first replica in
    the cheapest region, which would leave a canary at 100% in one region."""
    deployment = make_deployment({**catalog, **tenants}, "chat-spread-split", tenant=None)
    deployment.allowed_jurisdictions.set([catalog["eu"], catalog["us"]])
    deployment.user_regions.set([])
    stable_revision(deployment)
    canary = Revision.objects.create(deployment=deployment, number=2,
                                     model=catalog["llama8b"], engine_args={"engine": "vllm"})
    Deployment.objects.filter(pk=deployment.pk).update(
        canary_revision=canary, canary_weight=50, spread_regions=2, max_replicas=8)
    for i, (key, revision) in enumerate((("fra", None), ("ams", None), ("iad", canary))):
        offer = Offer.objects.get(region=catalog[key], gpu_type=catalog["h100"])
        Replica.objects.create(deployment=deployment, region=catalog[key], offer=offer,
                               state=S.READY, url=f"http://10.0.8.{i}:8000", revision=revision)
    deployment.refresh_from_db()
    row = act(deployment, UP, 3, 5)
    assert row is not None and row.signals["revisions"] == {"stable": 1, "canary 2": 1}
    regions = {r.region.key for r in Replica.objects.filter(revision=canary)
               .select_related("region__cloud")}
    assert regions == {catalog["iad"].key, catalog["ams"].key}, row.signals["placement"]
