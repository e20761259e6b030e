"""A canary in waves of edge regions: each wave's edges go through every step while earlier
waves' stay at 100% and later ones' at 0%; the tables say so edge by edge, each step is
judged at its wave's edges only, and bad waves are refused naming the field."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlplane.core.models import Role
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.rollouts import analyst, lifecycle
from controlplane.rollouts.models import Rollout, RolloutStep
from controlplane.routing import compiler
from controlplane.routing.models import Edge
from controlplane.routing.services import replica_views
from controlplane.telemetry.models import EdgeSample
from tests.api.test_endpoints_crud import make_deployment
from tests.rollouts.starting import start_rollout

pytestmark = pytest.mark.django_db

EU, US = "aws:eu-central-1", "aws:us-east-1"
MODEL = "llama-3.1-8b"


@pytest.fixture
def rollout(catalog, tenants):  # type: ignore[no-untyped-def]
    deployment = make_deployment({**catalog, **tenants}, "chat-waves", tenant=None)
    Replica.objects.create(deployment=deployment, region=catalog["fra"], state=S.READY,
                           url="http://10.0.0.1:8000")
    rollout = start_rollout(deployment, actor="op", steps=[10, 100], bake_s=60,
                             waves=[[EU], [US]])
    Replica.objects.filter(revision=rollout.to_revision).update(state=S.READY,
                                                                 url="http://10.0.0.2:8000")
    assert analyst.check() == {str(rollout.pk): "live"}
    return Rollout.objects.get(pk=rollout.pk)


def shares_at(catalog: dict[str, Any], region: str) -> dict[str, float]:
    where = catalog["fra"] if region == "fra" else catalog["iad"]
    edge = compiler.EdgeView(f"edge-{region}", where.key, where.latitude, where.longitude)
    policy = compiler.PolicyView(scorers={"load": 1.0}, retry_before_first_byte=1,
                                 eject_after_failures=2, eject_base_s=1.0)
    table = compiler.compile_table(edge, replica_views(), [], policy, version=1,
                                   issued_at="now", key_id="k")
    return dict(table["models"][MODEL]["revisions"])


def test_each_wave_goes_through_the_steps_while_earlier_ones_stay_at_100(rollout, catalog):  # type: ignore[no-untyped-def]
    stable, canary = str(rollout.from_revision_id), str(rollout.to_revision_id)
    assert shares_at(catalog, "fra") == {stable: 90.0, canary: 10.0}
    assert shares_at(catalog, "iad") == {stable: 100.0, canary: 0.0}
    lifecycle.advance(rollout.pk, actor="op")  # wave 1 at 100%
    assert shares_at(catalog, "fra") == {stable: 0.0, canary: 100.0}
    assert shares_at(catalog, "iad") == {stable: 100.0, canary: 0.0}
    lifecycle.advance(rollout.pk, actor="op")  # wave 2 from its first step
    rollout.refresh_from_db()
    assert (rollout.current_wave, rollout.current_step, rollout.weight) == (1, 0, 10)
    # Past the first wave the canary carries every wave-1 conversation: as many canary
    # replicas as stable ones (here one, already serving), so the step is live at once.
    assert shares_at(catalog, "fra") == {stable: 0.0, canary: 100.0}
    assert shares_at(catalog, "iad") == {stable: 90.0, canary: 10.0}
    lifecycle.advance(rollout.pk, actor="op")
    assert shares_at(catalog, "iad") == {stable: 0.0, canary: 100.0}
    with pytest.raises(lifecycle.RolloutStateError, match="last step"):
        lifecycle.advance(rollout.pk, actor="op")
    steps = list(RolloutStep.objects.filter(rollout=rollout).values_list("wave", "step",
                                                                          "weight"))
    assert steps == [(0, 0, 10), (0, 1, 100), (1, 0, 10), (1, 1, 100)]
    lifecycle.promote(rollout.pk, actor="op")
    rollout.deployment.refresh_from_db()
    assert rollout.deployment.canary_region_weights == {}
    assert "revisions" not in compiler.compile_table(
        compiler.EdgeView("e", EU, 50.1, 8.7), replica_views(), [],
        compiler.PolicyView(scorers={"load": 1.0}, retry_before_first_byte=1,
                            eject_after_failures=2, eject_base_s=1.0),
        version=1, issued_at="now", key_id="k")["models"][MODEL]


def test_a_rolled_back_wave_takes_the_canary_off_every_edge(rollout, catalog):  # type: ignore[no-untyped-def]
    lifecycle.advance(rollout.pk, actor="op")
    lifecycle.advance(rollout.pk, actor="op")
    lifecycle.roll_back(rollout.pk, actor="op")
    rollout.deployment.refresh_from_db()
    assert (rollout.deployment.canary_weight, rollout.deployment.canary_region_weights) == (
        0, {})
    assert rollout.deployment.canary_revision_id is None


def test_a_wave_is_judged_at_its_own_edges_only(rollout, catalog):  # type: ignore[no-untyped-def]
    eu = Edge.objects.create(name="edge-eu", region=catalog["fra"], admin_url="http://e:1")
    us = Edge.objects.create(name="edge-us", region=catalog["iad"], admin_url="http://e:2")
    stable, canary = str(rollout.from_revision_id), str(rollout.to_revision_id)
    step = RolloutStep.objects.get(rollout=rollout, wave=0, step=0)
    start = timezone.now() - timedelta(seconds=120)
    RolloutStep.objects.filter(pk=step.pk).update(started_at=start, ready_at=start)

    def counts(ok: float, errors: float) -> dict[str, Any]:
        return {"requests": {"200": ok, "500": errors}}

    # The US edge (not in the first wave) counts canary 5xx; they must not count here.
    for edge, canary_errors in ((eu, 0), (us, 50)):
        EdgeSample.objects.create(edge=edge, at=start - timedelta(seconds=1), revisions={})
        EdgeSample.objects.create(edge=edge, at=start + timedelta(seconds=100), revisions={
            stable: counts(100, 0), canary: counts(100, canary_errors)})
    assert analyst.check() == {str(rollout.pk): "advanced"}
    judged = RolloutStep.objects.get(pk=step.pk).analysis
    assert judged["edge_regions"] == [EU] and judged["canary"]["errors"] == 0
    assert judged["canary"]["edges"] == 1


@pytest.mark.parametrize(("waves", "field"), [
    ("eu", "waves"),
    ([[]], "waves"),
    ([EU], "waves"),
    ([["aws:nowhere"]], "waves[0][0]"),
    ([[EU], [US, EU]], "waves[1][1]"),
])
def test_bad_waves_are_400_naming_the_field(catalog, tenants, make_client, waves, field):  # type: ignore[no-untyped-def]
    deployment = make_deployment({**catalog, **tenants}, "chat-bad-waves", tenant=None)
    response = make_client(Role.OPERATOR).post("/api/v1/rollouts/", {
        "deployment": deployment.name, "bake_s": 60, "waves": waves}, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert not Rollout.objects.exists()


def test_waves_are_for_canaries_only(catalog, tenants, make_client):  # type: ignore[no-untyped-def]
    deployment = make_deployment({**catalog, **tenants}, "chat-bg-waves", tenant=None)
    response = make_client(Role.OPERATOR).post("/api/v1/rollouts/", {
        "deployment": deployment.name, "strategy": "blue_green", "waves": [[EU]]},
        format="json")
    assert response.status_code == 400 and "waves" in response.json()
