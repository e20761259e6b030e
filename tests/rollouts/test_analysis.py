"""A baked step is judged from what the edges counted by revision: a canary whose 5xx rate,
TTFT p95 or ITL p95 is over its limits (relative to the stable revision, or the absolute
SLO) is rolled back at once (weight 0, replicas drained, an alert, the figures in the audit
event and on the step); within them, the rollout moves to the next step; too little traffic
extends the step, then holds the rollout."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlplane.alerts import services as alerts
from controlplane.alerts.models import Alert
from controlplane.core.models import AuditLog
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.rollouts import analysis, analyst, lifecycle, placement
from controlplane.rollouts.models import Rollout, RolloutStep
from controlplane.routing.models import Edge
from controlplane.telemetry.edge_metrics import parse_edge_metrics
from controlplane.telemetry.models import EdgeSample
from edge.metrics import EdgeMetrics
from tests.api.test_endpoints_crud import make_deployment
from tests.rollouts.starting import start_rollout

pytestmark = pytest.mark.django_db


@pytest.fixture
def rollout(catalog, tenants):  # type: ignore[no-untyped-def]
    deployment = make_deployment({**catalog, **tenants}, "chat-eu", tenant=None)
    Replica.objects.create(deployment=deployment, region=catalog["fra"], state=S.READY,
                           url="http://10.0.0.1:8000")
    rollout = start_rollout(deployment, actor="op", steps=[10, 50, 100], bake_s=60)
    Replica.objects.filter(revision=rollout.to_revision).update(state=S.READY,
                                                                 url="http://10.0.0.2:8000")
    assert analyst.check() == {str(rollout.pk): "live"}
    return rollout


@pytest.fixture
def edges(catalog):  # type: ignore[no-untyped-def]
    return [Edge.objects.create(name=f"edge-{i}", region=catalog["fra"],
                                admin_url=f"http://127.0.0.1:{9000 + i}") for i in range(2)]


def histogram(fast: float, slow: float, slow_s: float = 1.0) -> dict[str, float]:
    """Cumulative buckets: `fast` observations under 0.1 s, `slow` more just under slow_s."""
    return {"0.1": fast, "0.5": fast, "1.0": fast + (slow if slow_s <= 1.0 else 0),
            "5.0": fast + slow, "+Inf": fast + slow}


def series(ok: float = 0, errors: float = 0, slow_ttft: float = 0,
           slow_itl: float = 0) -> dict[str, Any]:
    answered = ok + errors
    return {"requests": {"200": ok, "500": errors},
            "ttft": histogram(answered - slow_ttft, slow_ttft),
            "itl": histogram(5 * ok - slow_itl, slow_itl)}


def bake(rollout: Rollout, edges: list[Edge], stable: dict[str, Any], canary: dict[str, Any],
         seconds: float = 120) -> Any:
    """Samples from every edge over the current step's window (its traffic split between
    them); returns the moment the step's bake time is over."""
    step = RolloutStep.objects.get(rollout=rollout, step=rollout.current_step)
    start = timezone.now() - timedelta(seconds=seconds)
    RolloutStep.objects.filter(pk=step.pk).update(started_at=start, ready_at=start)
    ids = (str(rollout.from_revision_id), str(rollout.to_revision_id))

    def half(s: dict[str, Any]) -> dict[str, Any]:
        return {name: {k: v / len(edges) for k, v in values.items()} for name, values in s.items()}

    for edge in edges:
        EdgeSample.objects.create(edge=edge, at=start - timedelta(seconds=1),
                                  revisions={ids[0]: series(), ids[1]: series()})
        EdgeSample.objects.create(edge=edge, at=start + timedelta(seconds=seconds - 10),
                                  revisions={ids[0]: half(stable), ids[1]: half(canary)})
    return timezone.now()


def test_a_slow_canary_is_rolled_back_with_the_figures_and_an_alert(rollout, edges):  # type: ignore[no-untyped-def]
    now = bake(rollout, edges, stable=series(ok=100), canary=series(ok=100, slow_ttft=50))
    assert analyst.check(now) == {str(rollout.pk): "rolled_back"}
    rollout.refresh_from_db()
    assert rollout.state == "rolled_back" and rollout.ended_by == analyst.ANALYST
    assert "canary TTFT p95" in rollout.reason and "over" in rollout.reason
    deployment = rollout.deployment
    deployment.refresh_from_db()
    assert deployment.canary_weight == 0 and deployment.canary_revision_id is None
    assert not Replica.objects.filter(revision=rollout.to_revision, state=S.READY).exists()
    step = RolloutStep.objects.get(rollout=rollout, step=0)
    assert step.decision == "rolled_back" and step.analysis["verdict"] == "fail"
    figures = step.analysis
    assert figures["canary"]["ttft_p95_s"] > 1.2 * figures["stable"]["ttft_p95_s"]
    assert figures["canary"]["requests"] == 100 and figures["canary"]["edges"] == 2
    assert figures["stable"]["requests"] == 100 and figures["stable"]["error_rate"] == 0
    failed = {c["name"] for c in figures["checks"] if not c["passed"]}
    assert failed == {"ttft_vs_stable"}
    event = AuditLog.objects.get(action="rollout.rolled_back")
    assert event.actor == analyst.ANALYST
    assert event.changes["analysis"]["verdict"] == "fail"
    # The alerts app opens a critical alert carrying the figures.
    alerts.evaluate(now)
    alert = Alert.objects.get(rule="rollout_rolled_back", state="open")
    assert alert.severity == "critical" and alert.subject == f"rollout {rollout.pk}"
    assert "TTFT p95" in alert.message and "10%" in alert.message


def test_a_canary_answering_5xx_is_rolled_back(rollout, edges):  # type: ignore[no-untyped-def]
    now = bake(rollout, edges, stable=series(ok=200, errors=1), canary=series(ok=90, errors=10))
    assert analyst.check(now) == {str(rollout.pk): "rolled_back"}
    step = RolloutStep.objects.get(rollout=rollout, step=0)
    assert step.analysis["canary"]["error_rate"] == pytest.approx(0.1)
    failed = {c["name"] for c in step.analysis["checks"] if not c["passed"]}
    assert failed == {"error_rate_vs_stable", "error_rate_slo"}


def test_a_canary_with_slow_tokens_is_rolled_back(rollout, edges):  # type: ignore[no-untyped-def]
    now = bake(rollout, edges, stable=series(ok=100), canary=series(ok=100, slow_itl=200))
    assert analyst.check(now) == {str(rollout.pk): "rolled_back"}
    step = RolloutStep.objects.get(rollout=rollout, step=0)
    assert {c["name"] for c in step.analysis["checks"] if not c["passed"]} == {"itl_vs_stable"}


def test_a_canary_over_the_slo_fails_even_when_the_stable_is_as_slow(rollout, edges):  # type: ignore[no-untyped-def]
    slow = series(ok=100, slow_ttft=100)  # every TTFT in (1, 5] s, the SLO is 1 s
    slow["ttft"] = histogram(0, 100, slow_s=5.0)
    now = bake(rollout, edges, stable=slow, canary=slow)
    assert analyst.check(now) == {str(rollout.pk): "rolled_back"}
    step = RolloutStep.objects.get(rollout=rollout, step=0)
    assert {c["name"] for c in step.analysis["checks"] if not c["passed"]} == {"ttft_slo"}


def test_a_canary_within_every_limit_moves_to_the_next_step(rollout, edges):  # type: ignore[no-untyped-def]
    now = bake(rollout, edges, stable=series(ok=100, slow_ttft=10),
               canary=series(ok=100, slow_ttft=10))
    assert analyst.check(now) == {str(rollout.pk): "advanced"}
    rollout.refresh_from_db()
    assert rollout.state == "running" and rollout.weight == 50
    first = RolloutStep.objects.get(rollout=rollout, step=0)
    assert first.decision == "advanced" and first.analysis["verdict"] == "pass"
    assert all(c["passed"] for c in first.analysis["checks"])
    assert len(first.analysis["checks"]) == 5
    # The new step has not baked yet: nothing happens.
    assert analyst.check(now) == {}


def test_at_100_percent_only_the_absolute_limits_are_judged(rollout, edges):  # type: ignore[no-untyped-def]
    Rollout.objects.filter(pk=rollout.pk).update(auto_promote=False)
    lifecycle.advance(rollout.pk, actor="op")
    lifecycle.advance(rollout.pk, actor="op")
    rollout.refresh_from_db()
    assert rollout.weight == 100
    now = bake(rollout, edges, stable=series(), canary=series(ok=100))
    # Without auto_promote the passed last step waits for an operator.
    assert analyst.check(now) == {str(rollout.pk): "awaiting_promote"}
    assert Rollout.objects.get(pk=rollout.pk).state == "running"
    step = RolloutStep.objects.get(rollout=rollout, step=2)
    assert {c["name"] for c in step.analysis["checks"]} == {"error_rate_slo", "ttft_slo"}


def test_a_canary_whose_last_step_passes_is_promoted_by_the_analysis(rollout, edges):  # type: ignore[no-untyped-def]
    assert rollout.auto_promote  # the default
    lifecycle.advance(rollout.pk, actor="op")
    lifecycle.advance(rollout.pk, actor="op")
    rollout.refresh_from_db()
    now = bake(rollout, edges, stable=series(), canary=series(ok=100))
    assert analyst.check(now) == {str(rollout.pk): "promoted"}
    rollout.refresh_from_db()
    assert rollout.state == "promoted" and rollout.ended_by == analyst.ANALYST
    assert rollout.reason.startswith("last step passed: ")
    step = RolloutStep.objects.get(rollout=rollout, step=2)
    assert step.decision == "promoted" and step.analysis["verdict"] == "pass"
    assert AuditLog.objects.filter(action="rollout.promoted", actor=analyst.ANALYST).exists()
    # A failing last step is rolled back, not promoted: see the tests above (any step fails).


def test_too_little_traffic_extends_the_step_then_holds_the_rollout(rollout, edges):  # type: ignore[no-untyped-def]
    Rollout.objects.filter(pk=rollout.pk).update(
        thresholds={**rollout.thresholds, "max_extensions": 2})
    now = bake(rollout, edges, stable=series(ok=100), canary=series(ok=5), seconds=100)
    # The step's bake time is 60 s, and it started 100 s ago: judged, and extended once.
    assert analyst.check(now) == {str(rollout.pk): "extended"}
    assert analyst.check(now) == {}  # the extension has not run out
    step = RolloutStep.objects.get(rollout=rollout, step=0)
    assert step.extensions == 1 and step.analysis["verdict"] == "no_data"
    assert "canary served 5 requests" in step.analysis["why"]
    later = now + timedelta(seconds=60)
    assert analyst.check(later) == {str(rollout.pk): "extended"}
    assert analyst.check(later + timedelta(seconds=60)) == {str(rollout.pk): "held"}
    rollout.refresh_from_db()
    step.refresh_from_db()
    assert rollout.state == "paused" and rollout.weight == 10
    assert step.decision == "no_data" and step.ended_at is None
    held = AuditLog.objects.get(action="rollout.held")
    assert "after 2 extensions" in held.reason and held.actor == analyst.ANALYST
    # An operator resumes: the step gets its extensions again.
    lifecycle.resume(rollout.pk, actor="op")
    step.refresh_from_db()
    assert (step.decision, step.extensions) == ("", 0)


def test_a_step_goes_live_only_once_its_canary_replicas_serve(catalog, tenants):  # type: ignore[no-untyped-def]
    """Make-before-break: three stable replicas; 10% needs one canary replica, 50% three.
    Until they serve, the tables keep the previous weight and the step does not bake."""
    deployment = make_deployment({**catalog, **tenants}, "chat-three", tenant=None)
    for i in range(3):
        Replica.objects.create(deployment=deployment, region=catalog["fra"], state=S.READY,
                               url=f"http://10.0.0.{i + 1}:8000")
    rollout = start_rollout(deployment, actor="op", steps=[10, 50, 100], bake_s=60)
    canaries = Replica.objects.filter(revision=rollout.to_revision)
    assert canaries.count() == 1
    deployment.refresh_from_db()
    assert (deployment.canary_revision_id, deployment.canary_weight) == (
        rollout.to_revision_id, 0)
    assert analyst.check() == {}  # its replica is still launching
    canaries.update(state=S.READY)
    assert analyst.check() == {str(rollout.pk): "live"}
    deployment.refresh_from_db()
    assert deployment.canary_weight == 10
    step = RolloutStep.objects.get(rollout=rollout, step=0)
    assert step.ready_at is not None and step.ready_at >= step.started_at

    lifecycle.advance(rollout.pk, actor="op")
    assert canaries.count() == 3  # two more asked for, beside the stable ones
    deployment.refresh_from_db()
    assert deployment.canary_weight == 10  # the previous weight until they serve
    event = AuditLog.objects.get(action="rollout.advanced")
    assert event.changes["live"] is False and len(event.changes["canary_replicas"]) == 2
    # One launch fails: check asks for a replacement instead of waiting for ever, and the
    # step says what it waits for.
    pending = list(canaries.filter(state=S.PENDING))
    Replica.objects.filter(pk=pending[0].pk).update(state=S.FAILED,
                                                    last_error="quota: no A100 left in fra")
    assert analyst.check() == {}
    assert canaries.exclude(state=S.FAILED).count() == 3
    waiting = RolloutStep.objects.get(rollout=rollout, step=1).analysis
    assert waiting == {"verdict": "waiting", "why": (
        "waiting for 3 canary replicas to serve 50%: 1 serving, 2 launching; the last "
        "launch failed: quota: no A100 left in fra")}
    canaries.exclude(state=S.FAILED).update(state=S.READY)
    assert analyst.check() == {str(rollout.pk): "live"}
    deployment.refresh_from_db()
    assert deployment.canary_weight == 50
    assert RolloutStep.objects.get(rollout=rollout, step=1).analysis == {}


@pytest.fixture
def blue_green(catalog, tenants):  # type: ignore[no-untyped-def]
    """A blue/green rollout over two stable (blue) replicas, its two green ones serving."""
    deployment = make_deployment({**catalog, **tenants}, "chat-bg", tenant=None)
    for i in range(2):
        Replica.objects.create(deployment=deployment, region=catalog["fra"], state=S.READY,
                               url=f"http://10.0.1.{i + 1}:8000")
    rollout = start_rollout(deployment, actor="op", strategy="blue_green", bake_s=60,
                             rollback_window_s=300)
    assert (rollout.steps, rollout.rollback_window_s) == ([100], 300)
    green = Replica.objects.filter(revision=rollout.to_revision)
    assert green.count() == 2  # the whole new set, make-before-break
    deployment.refresh_from_db()
    assert deployment.canary_weight == 0  # blue serves everything until green does
    green.update(state=S.READY)
    assert analyst.check() == {str(rollout.pk): "live"}
    deployment.refresh_from_db()
    assert deployment.canary_weight == 100  # all traffic switched at once
    return rollout


def test_blue_green_keeps_the_old_set_for_its_window_then_promotes_and_retires_it(  # type: ignore[no-untyped-def]
        blue_green, edges):
    rollout = blue_green
    blue = list(Replica.objects.filter(deployment=rollout.deployment, revision__isnull=True))
    now = bake(rollout, edges, stable=series(), canary=series(ok=100), seconds=120)
    assert analyst.check(now) == {str(rollout.pk): "in_window"}  # judged, blue kept
    assert all(r.state == S.READY for r in Replica.objects.filter(pk__in=[b.pk for b in blue]))
    later = now + timedelta(seconds=200)  # the 300 s window has passed since the switch
    assert analyst.check(later) == {str(rollout.pk): "promoted"}
    rollout.refresh_from_db()
    assert rollout.state == "promoted" and rollout.ended_by == analyst.ANALYST
    assert "rollback window of 300 s passed" in rollout.reason
    assert {r.state for r in Replica.objects.filter(pk__in=[b.pk for b in blue])} == {
        S.DRAINING}
    assert set(Replica.objects.filter(revision=rollout.to_revision)
               .values_list("state", flat=True)) == {S.READY}
    event = AuditLog.objects.get(action="rollout.promoted")
    assert sorted(event.changes["retired"]) == sorted(b.public_id for b in blue)


def test_blue_green_failing_in_its_window_switches_back_to_the_old_set(blue_green, edges):  # type: ignore[no-untyped-def]
    rollout = blue_green
    now = bake(rollout, edges, stable=series(), canary=series(ok=90, errors=10))
    assert analyst.check(now) == {str(rollout.pk): "rolled_back"}
    deployment = rollout.deployment
    deployment.refresh_from_db()
    assert deployment.canary_weight == 0 and deployment.canary_revision_id is None
    assert set(Replica.objects.filter(deployment=deployment, revision__isnull=True)
               .values_list("state", flat=True)) == {S.READY}
    assert not Replica.objects.filter(revision=rollout.to_revision, state=S.READY).exists()
    step = RolloutStep.objects.get(rollout=rollout)
    assert {c["name"] for c in step.analysis["checks"] if not c["passed"]} == {
        "error_rate_slo"}


@pytest.mark.parametrize(("weight", "stable", "target"), [
    (5, 3, 1), (10, 3, 1), (25, 3, 1), (50, 3, 3), (75, 3, 9), (100, 3, 3), (50, 0, 1),
    (100, 0, 1), (20, 8, 2), (33, 2, 1),
])
def test_canary_target(weight: int, stable: int, target: int) -> None:
    assert placement.canary_target(weight, stable) == target


def test_paused_rollouts_are_not_judged(rollout, edges):  # type: ignore[no-untyped-def]
    now = bake(rollout, edges, stable=series(ok=100), canary=series(ok=100, slow_ttft=50))
    lifecycle.pause(rollout.pk, actor="op")
    assert analyst.check(now) == {}


def test_an_edge_first_scraped_inside_the_window_counts_from_its_first_sample(  # type: ignore[no-untyped-def]
        rollout, edges):
    start = timezone.now() - timedelta(seconds=100)
    canary = str(rollout.to_revision_id)
    EdgeSample.objects.create(edge=edges[0], at=start + timedelta(seconds=5),
                              revisions={canary: series(ok=10)})
    EdgeSample.objects.create(edge=edges[0], at=start + timedelta(seconds=50),
                              revisions={canary: series(ok=40)})
    EdgeSample.objects.create(edge=edges[0], at=start + timedelta(seconds=200),
                              revisions={canary: series(ok=1000)})  # after the window
    got = analysis.figures([rollout.to_revision_id, rollout.from_revision_id], start,
                           start + timedelta(seconds=60))
    assert got[rollout.to_revision_id].requests == 30
    assert got[rollout.from_revision_id] == analysis.EMPTY


def test_the_edges_revision_series_parse_by_revision() -> None:
    metrics = EdgeMetrics()
    for status in ("200", "200", "503"):
        metrics.revision_requests.inc(("chat", "7", status))
    metrics.revision_ttft.observe(("chat", "7"), 0.2)
    metrics.revision_itl.observe(("chat", "8"), 0.01)
    metrics.requests.inc(("chat", "local:x", "acme", "200"))
    snap = parse_edge_metrics(metrics.registry.render().decode())
    assert snap.revisions["7"]["requests"] == {"200": 2.0, "503": 1.0}
    assert snap.revisions["7"]["ttft"]["0.25"] == 1.0
    assert snap.revisions["8"]["itl"]["+Inf"] == 1.0
    assert snap.requests == {"chat|local:x|acme|200": 1.0}


LIMITS = analysis.DEFAULT_THRESHOLDS


def figures(requests: float, errors: float = 0, ttft: float | None = 0.5,
            itl: float | None = 0.05) -> analysis.RevisionFigures:
    return analysis.RevisionFigures(1, requests, errors, ttft, itl)


@pytest.mark.parametrize(("canary", "stable", "verdict", "failed"), [
    (figures(100), figures(100), "pass", set()),
    (figures(100, ttft=0.6), figures(100), "pass", set()),  # exactly 1.2×
    (figures(100, ttft=0.61), figures(100), "fail", {"ttft_vs_stable"}),
    (figures(100, itl=0.07), figures(100), "fail", {"itl_vs_stable"}),
    (figures(100, itl=None), figures(100), "pass", set()),  # no streams: ITL not judged
    (figures(100, errors=2), figures(100, errors=1), "pass", set()),  # 2% ≤ 1% + 1 point
    (figures(100, errors=3), figures(100, errors=1), "fail", {"error_rate_vs_stable"}),
    (figures(100, errors=6), figures(100, errors=6), "fail", {"error_rate_slo"}),
    (figures(19), figures(100), "no_data", set()),
    (figures(100), figures(19), "no_data", set()),
    (figures(100, ttft=1.5), None, "fail", {"ttft_slo"}),  # 100%: absolute only
    (figures(100, ttft=0.9), None, "pass", set()),
])
def test_judge(canary: analysis.RevisionFigures, stable: analysis.RevisionFigures | None,
               verdict: str, failed: set[str]) -> None:
    got, why, done = analysis.judge(canary, stable, LIMITS)
    assert got == verdict, why
    assert {c.name for c in done if not c.passed} == failed


@pytest.mark.parametrize(("given", "field"), [
    ("x", "thresholds"), ({"ttft_ratio": 0.5}, "thresholds.ttft_ratio"),
    ({"min_requests": 0}, "thresholds.min_requests"), ({"bogus": 1}, "thresholds.bogus"),
])
def test_bad_thresholds_name_the_field(given: Any, field: str) -> None:
    with pytest.raises(analysis.ThresholdError) as caught:
        analysis.check_thresholds(given, LIMITS)
    assert caught.value.field == field
