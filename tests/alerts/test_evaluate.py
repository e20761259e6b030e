"""Evaluation against real Postgres: inputs loaded from the fleet's rows, alerts opened,
updated and resolved, never duplicated, history kept."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.core.exceptions import ValidationError
from django.db import IntegrityError, connections, transaction
from django.utils import timezone

from controlplane.alerts import gatherers, services, tasks
from controlplane.alerts.models import Alert, AlertCondition, AlertState, Rule, RuleSetting
from controlplane.alerts.rules import Finding
from controlplane.core.locks import lock_id
from controlplane.core.models import AuditLog
from controlplane.failover.models import RegionHealth
from controlplane.routing.models import RoutingTable
from controlplane.telemetry.models import EdgeSample, ReplicaSample

pytestmark = pytest.mark.django_db


def _health(region: Any, state: str, now: Any, reason: str = "") -> RegionHealth:
    row, _ = RegionHealth.objects.update_or_create(
        region=region, defaults={"state": state, "reason": reason, "failing": 2, "serving": 0,
                                 "changed_at": now, "checked_at": now})
    return row


def _evaluate(now: Any) -> services.Report:
    report = services.evaluate(now=now)
    assert report.errors == {}
    return report


def test_region_alert_opens_updates_resolves_and_keeps_history(catalog):  # type: ignore[no-untyped-def]
    t0 = timezone.now()
    _health(catalog["fra"], "down", t0, "every replica failed")
    report = _evaluate(t0)
    [alert] = Alert.objects.all()
    assert report.opened == [alert.pk]
    assert (alert.rule, alert.subject, alert.severity, alert.state) == (
        Rule.REGION_DOWN, "aws:eu-central-1", "critical", AlertState.OPEN)
    assert alert.opened_at == t0 and alert.resolved_at is None and alert.tenant_id is None
    assert "every replica failed" in alert.message

    # Evaluating again changes nothing but the evaluation time: no duplicate, no new event.
    report = _evaluate(t0 + timedelta(seconds=10))
    assert (report.opened, report.resolved, report.updated) == ([], [], 1)
    assert Alert.objects.count() == 1
    assert Alert.objects.get().last_evaluated_at == t0 + timedelta(seconds=10)

    _health(catalog["fra"], "degraded", t0)
    _evaluate(t0 + timedelta(seconds=20))
    alert = Alert.objects.get()
    assert alert.severity == "warning" and alert.state == AlertState.OPEN

    _health(catalog["fra"], "healthy", t0)
    report = _evaluate(t0 + timedelta(seconds=30))
    alert = Alert.objects.get()
    assert report.resolved == [alert.pk]
    assert alert.state == AlertState.RESOLVED and alert.resolved_at == t0 + timedelta(seconds=30)
    assert _evaluate(t0 + timedelta(seconds=40)).resolved == []

    _health(catalog["fra"], "down", t0)
    _evaluate(t0 + timedelta(seconds=50))
    assert list(Alert.objects.order_by("pk").values_list("state", flat=True)) == [
        AlertState.RESOLVED, AlertState.OPEN]
    actions = list(AuditLog.objects.filter(object_type="alerts.alert").order_by("pk")
                   .values_list("action", flat=True))
    assert actions == ["alert.opened", "alert.resolved", "alert.opened"]


def test_database_refuses_a_second_open_alert_for_a_subject(catalog):  # type: ignore[no-untyped-def]
    now = timezone.now()
    fields = dict(rule=Rule.BUDGET, subject="acme", severity="warning", message="m",
                  firing_since=now, opened_at=now, last_evaluated_at=now)
    Alert.objects.create(**fields)
    Alert.objects.create(**fields, state=AlertState.RESOLVED, resolved_at=now)
    Alert.objects.create(**fields, state=AlertState.RESOLVED, resolved_at=now)
    with pytest.raises(IntegrityError), transaction.atomic():
        Alert.objects.create(**fields)
    with pytest.raises(IntegrityError), transaction.atomic():
        Alert.objects.create(**{**fields, "subject": "globex"}, state=AlertState.RESOLVED)


def _edge_traffic(edge: Any, at: Any, ok: float, errors: float, model: str = "llama") -> None:
    EdgeSample.objects.create(edge=edge, at=at, requests={
        f"{model}|aws:eu-central-1|acme|200": ok, f"{model}|aws:eu-central-1|acme|503": errors,
        f"{model}|aws:eu-central-1|acme|429": 7})


def test_error_rate_opens_only_after_holding_for_its_duration(  # type: ignore[no-untyped-def]
    deployment, make_edge,
):
    edge = make_edge("edge-eu")
    t0 = timezone.now()
    _edge_traffic(edge, t0 - timedelta(seconds=400), ok=1000, errors=10)
    _edge_traffic(edge, t0, ok=1070, errors=40)  # 70 ok, 30 failed, 0 new 429s: 30%
    EdgeSample.objects.create(edge=edge, at=t0 + timedelta(seconds=1), up=False, error="down")

    assert _evaluate(t0).pending == 1
    assert not Alert.objects.exists()
    assert _evaluate(t0 + timedelta(seconds=59)).pending == 1
    report = _evaluate(t0 + timedelta(seconds=61))
    [alert] = Alert.objects.all()
    assert report.opened == [alert.pk] and not AlertCondition.objects.exists()
    assert (alert.rule, alert.subject, alert.severity) == (Rule.ERROR_RATE, "llama", "critical")
    assert alert.value == pytest.approx(0.3) and alert.firing_since == t0
    assert alert.tenant_id == deployment.tenant_id  # llama is only served by acme's deployment
    assert "30.0% of requests for llama failed" in alert.message

    # The window slides past the failures: nothing new in it, so the alert resolves at once.
    report = _evaluate(t0 + timedelta(seconds=301))
    assert report.resolved == [alert.pk]


def test_a_condition_that_stops_before_its_duration_never_opens(make_edge):  # type: ignore[no-untyped-def]
    edge = make_edge("edge-eu")
    t0 = timezone.now()
    _edge_traffic(edge, t0 - timedelta(seconds=400), ok=0, errors=0)
    _edge_traffic(edge, t0, ok=50, errors=50)
    _evaluate(t0)
    assert AlertCondition.objects.get().since == t0
    _evaluate(t0 + timedelta(seconds=301))  # no traffic in the window any more
    assert not AlertCondition.objects.exists() and not Alert.objects.exists()


def _latency_samples(replica: Any, ttft_s_bucket: str) -> None:
    """Two samples 70 s apart: 100 requests in the window, all with TTFT in one bucket."""
    now = timezone.now()
    bounds = ("0.25", "0.5", "1.0", "2.0", "4.0", "+Inf")
    older = dict.fromkeys(bounds, 0.0)
    newer = {le: (100.0 if float(le) >= float(ttft_s_bucket) else 0.0) for le in bounds}
    itl = {"0.01": 100.0, "0.025": 100.0, "+Inf": 100.0}
    ReplicaSample.objects.create(replica=replica, at=now - timedelta(seconds=70),
                                 buckets={"ttft": older, "itl": dict.fromkeys(itl, 0.0)})
    ReplicaSample.objects.create(replica=replica, at=now - timedelta(seconds=1),
                                 buckets={"ttft": newer, "itl": itl})


def test_ttft_slo_from_stored_engine_samples(  # type: ignore[no-untyped-def]
    catalog, deployment, make_replica,
):
    RuleSetting.objects.create(rule=Rule.TTFT_SLO, for_s=0)  # open at once for this test
    fast = make_replica(deployment, catalog["fra"])
    slow = make_replica(deployment, catalog["ams"])
    _latency_samples(fast, "0.5")
    _latency_samples(slow, "2.0")  # p95 ≈ 1.95 s against a 1 s SLO
    report = _evaluate(timezone.now())
    [alert] = Alert.objects.all()
    assert report.opened == [alert.pk]
    assert (alert.rule, alert.subject, alert.severity, alert.unit) == (
        Rule.TTFT_SLO, "chat", "warning", "ms")
    assert alert.value == pytest.approx(1950, abs=1) and alert.threshold == 1000
    assert alert.tenant_id == deployment.tenant_id
    assert f"r-{slow.pk} (gcp:europe-west4)" in alert.message
    assert "(1 of 2 replicas over the SLO)" in alert.message
    # ITL is 10 ms p95-ish against 50 ms: no ITL alert; its default `for` would hold it anyway.
    assert not AlertCondition.objects.filter(rule=Rule.ITL_SLO).exists()


def test_quota_rule_reads_quota_rows(catalog):  # type: ignore[no-untyped-def]
    from regions.models import Quota

    Quota.objects.filter(region=catalog["fra"]).update(in_use_gpus=16)
    Quota.objects.filter(region=catalog["iad"]).update(in_use_gpus=8)
    _evaluate(timezone.now())
    [alert] = Alert.objects.all()
    assert (alert.subject, alert.severity, alert.value) == ("aws:eu-central-1/H100", "critical", 1)


def test_budget_rule_reads_month_to_date_spend(tenants):  # type: ignore[no-untyped-def]
    from controlplane.costs.models import CostRollup

    now = timezone.now()
    hour = now.replace(minute=0, second=0, microsecond=0)
    acme, globex = tenants["acme"], tenants["globex"]
    acme.monthly_budget_usd = Decimal("100.00")
    acme.save()
    globex.monthly_budget_usd = Decimal("1000.00")
    globex.save()
    for tenant, usd in ((acme, "85.5"), (globex, "10")):
        CostRollup.objects.create(hour=hour, model="llama", region="aws:eu-central-1",
                                  tenant=tenant.name, usd=Decimal(usd), computed_at=now)
    _evaluate(now)
    [alert] = Alert.objects.all()
    assert (alert.rule, alert.subject, alert.severity) == (Rule.BUDGET, "acme", "warning")
    assert alert.tenant_id == acme.pk and alert.value == 85.5 and alert.threshold == 80


def test_edge_behind_alerts_after_the_grace_period(make_edge):  # type: ignore[no-untyped-def]
    from controlplane.routing.services import edges_behind

    t0 = timezone.now()
    behind, in_sync, never = make_edge("edge-a", acked=5), make_edge("edge-b", acked=7), \
        make_edge("edge-c")
    for edge, versions in ((behind, (5, 6, 7)), (in_sync, (6, 7)), (never, (7,))):
        for v in versions:
            RoutingTable.objects.create(edge=edge, version=v, payload={}, payload_hash=str(v))
    RoutingTable.objects.filter(version=6).update(created_at=t0 - timedelta(seconds=100))
    RoutingTable.objects.filter(version=7).update(created_at=t0 - timedelta(seconds=10))

    lags = {lag.edge: lag for lag in gatherers.edge_lags()}
    assert set(lags) == {e.name for e in edges_behind()} == {"edge-a", "edge-c"}
    assert lags["edge-a"].behind_since == t0 - timedelta(seconds=100)  # since v6, not v7
    assert lags["edge-a"].latest_version == 7 and lags["edge-c"].acked_version is None

    _evaluate(t0)
    assert list(Alert.objects.values_list("subject", "severity")) == [("edge-a", "warning")]
    _evaluate(t0 + timedelta(seconds=20))
    assert sorted(Alert.objects.values_list("subject", flat=True)) == ["edge-a", "edge-c"]
    behind.last_acked_version = 7
    behind.save()
    _evaluate(t0 + timedelta(seconds=30))
    assert list(Alert.objects.filter(state="open").values_list("subject", flat=True)) == [
        "edge-c"]


def test_a_rule_that_cannot_be_evaluated_keeps_its_alerts(catalog):  # type: ignore[no-untyped-def]
    t0 = timezone.now()
    _health(catalog["fra"], "down", t0)
    _evaluate(t0)

    def broken(now: Any, limits: Any) -> list[Finding]:
        raise ConnectionError("metrics store unreachable")

    report = services.evaluate(now=t0 + timedelta(seconds=10), gatherers=[
        ((Rule.REGION_DOWN,), broken)])
    assert report.errors == {Rule.REGION_DOWN: "ConnectionError: metrics store unreachable"}
    alert = Alert.objects.get()
    assert alert.state == AlertState.OPEN and alert.last_evaluated_at == t0


def test_disabling_a_rule_resolves_its_alerts(catalog):  # type: ignore[no-untyped-def]
    t0 = timezone.now()
    _health(catalog["fra"], "down", t0)
    _evaluate(t0)
    RuleSetting.objects.create(rule=Rule.REGION_DOWN, enabled=False)
    assert len(_evaluate(t0 + timedelta(seconds=10)).resolved) == 1
    assert not Alert.objects.filter(state="open").exists()


def test_rule_settings_override_defaults_and_are_validated(db):  # type: ignore[no-untyped-def]
    RuleSetting.objects.create(rule=Rule.BUDGET, warning=0.5)
    limits = services.thresholds()
    assert (limits[Rule.BUDGET].warning, limits[Rule.BUDGET].critical) == (0.5, 1.0)
    assert limits[Rule.ERROR_RATE].warning == 0.05
    with pytest.raises(ValidationError) as caught:
        RuleSetting(rule=Rule.QUOTA_EXHAUSTED, warning=1.5).full_clean()
    assert "critical" in caught.value.message_dict
    with pytest.raises(ValidationError) as caught:
        RuleSetting(rule=Rule.BUDGET, warning=-1).full_clean()
    assert "warning" in caught.value.message_dict


def test_evaluate_task_skips_while_another_worker_holds_the_lock(catalog):  # type: ignore[no-untyped-def]
    _health(catalog["fra"], "down", timezone.now())
    other = connections.create_connection("default")
    try:
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_lock(%s)", [lock_id("alerts.evaluate")])
        assert tasks.evaluate.apply().get() == {"skipped": 1}
        assert not Alert.objects.exists()
        # Released explicitly: a closed session's locks go when its server process exits,
        # which may be after the next call.
        with other.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_unlock(%s)", [lock_id("alerts.evaluate")])
    finally:
        other.close()
    summary = tasks.evaluate.apply().get()
    assert summary["opened"] == 1 and summary["errors"] == {}
