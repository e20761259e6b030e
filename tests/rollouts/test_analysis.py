"""A baked step is judged from the engines' TTFT histograms: a canary over 1.2× the stable
TTFT p95 is rolled back at once (weight 0, replicas drained, the figures in the audit event
and on the step); within it, the rollout moves to the next step; no data decides nothing."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlplane.core.models import AuditLog
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.rollouts import analysis, services
from controlplane.rollouts.models import Rollout, RolloutStep
from controlplane.telemetry.models import ReplicaSample
from tests.api.test_endpoints_crud import make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def rollout(catalog, tenants):  # type: ignore[no-untyped-def]
    deployment = make_deployment({**catalog, **tenants}, "chat-eu", tenant=None)
    Replica.objects.create(deployment=deployment, region=catalog["fra"], state=S.READY,
                           url="http://10.0.0.1:8000")
    rollout = services.start(deployment, actor="op", steps=[10, 50, 100], bake_s=60)
    Replica.objects.filter(revision=rollout.to_revision).update(state=S.READY,
                                                                 url="http://10.0.0.2:8000")
    return rollout


def histogram(fast: float, slow: float) -> dict[str, float]:
    """Cumulative buckets: `fast` requests under 0.1 s, `slow` more between 0.5 s and 1 s."""
    return {"0.1": fast, "0.5": fast, "1.0": fast + slow, "+Inf": fast + slow}


def sample(replica: Replica, at: Any, fast: float, slow: float) -> None:
    ReplicaSample.objects.create(replica=replica, at=at, counters={"requests_ok": fast + slow},
                                 buckets={"ttft": histogram(fast, slow)})


def bake(rollout: Rollout, stable_slow: float, canary_slow: float) -> Any:
    """Samples over the current step's window; returns the moment its bake time is over."""
    step = RolloutStep.objects.get(rollout=rollout, step=rollout.current_step)
    start = timezone.now() - timedelta(seconds=120)
    RolloutStep.objects.filter(pk=step.pk).update(started_at=start)
    for replica in Replica.objects.filter(deployment=rollout.deployment):
        slow = canary_slow if replica.revision_id == rollout.to_revision_id else stable_slow
        sample(replica, start - timedelta(seconds=1), 0, 0)
        sample(replica, start + timedelta(seconds=100), 100 - slow, slow)
    return timezone.now()


def test_a_slow_canary_is_rolled_back_with_the_figures(rollout):  # type: ignore[no-untyped-def]
    now = bake(rollout, stable_slow=0, canary_slow=50)
    assert services.check(now) == {str(rollout.pk): "rolled_back"}
    rollout.refresh_from_db()
    assert rollout.state == "rolled_back" and "over 1.2×" in rollout.reason
    deployment = rollout.deployment
    deployment.refresh_from_db()
    assert deployment.canary_weight == 0 and deployment.canary_revision_id is None
    assert not Replica.objects.filter(revision=rollout.to_revision, state=S.READY).exists()
    step = RolloutStep.objects.get(rollout=rollout, step=0)
    assert step.decision == "rolled_back" and step.analysis["verdict"] == "fail"
    assert step.analysis["canary"]["ttft_p95_s"] > 1.2 * step.analysis["stable"]["ttft_p95_s"]
    assert step.analysis["canary"]["requests"] == 100
    event = AuditLog.objects.get(action="rollout.rolled_back")
    assert event.actor == services.ANALYST
    assert event.changes["analysis"]["verdict"] == "fail"


def test_a_canary_within_the_threshold_moves_to_the_next_step(rollout):  # type: ignore[no-untyped-def]
    now = bake(rollout, stable_slow=10, canary_slow=10)
    assert services.check(now) == {str(rollout.pk): "advanced"}
    rollout.refresh_from_db()
    assert rollout.state == "running" and rollout.weight == 50
    first = RolloutStep.objects.get(rollout=rollout, step=0)
    assert first.decision == "advanced" and first.analysis["verdict"] == "pass"
    # The new step has not baked yet: nothing happens.
    assert services.check(now) == {}


def test_a_step_without_figures_decides_nothing(rollout):  # type: ignore[no-untyped-def]
    step = RolloutStep.objects.get(rollout=rollout, step=0)
    RolloutStep.objects.filter(pk=step.pk).update(
        started_at=timezone.now() - timedelta(seconds=120))
    assert services.check() == {str(rollout.pk): "no_data"}
    rollout.refresh_from_db()
    assert rollout.state == "running" and rollout.weight == 10
    assert RolloutStep.objects.get(pk=step.pk).analysis["verdict"] == "no_data"


def test_paused_rollouts_are_not_judged(rollout):  # type: ignore[no-untyped-def]
    now = bake(rollout, stable_slow=0, canary_slow=50)
    services.pause(rollout.pk, actor="op")
    assert services.check(now) == {}


@pytest.mark.parametrize(("canary", "stable", "verdict"), [
    (1.0, 1.0, "pass"), (1.2, 1.0, "pass"), (1.21, 1.0, "fail"), (None, 1.0, "no_data"),
    (1.0, None, "no_data"),
])
def test_judge(canary: float | None, stable: float | None, verdict: str) -> None:
    got, _ = analysis.judge(analysis.RevisionFigures(1, 10, canary),
                            analysis.RevisionFigures(1, 10, stable))
    assert got == verdict
