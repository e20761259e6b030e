"""Each rule's pure logic on hand-made inputs: below, at and over its thresholds."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from controlplane.alerts import rules
from controlplane.alerts.models import Rule, Severity
from controlplane.alerts.thresholds import DEFAULTS, Thresholds, merged
from controlplane.telemetry.edge_metrics import is_error_status, traffic_by_model


def test_severity_uses_the_highest_threshold_reached() -> None:
    t = Thresholds(warning=0.8, critical=1.0)
    assert t.severity(0.79) is None
    assert t.severity(0.8) == Severity.WARNING
    assert t.severity(0.99) == Severity.WARNING
    assert t.severity(1.0) == Severity.CRITICAL
    assert Thresholds(warning=None, critical=1.0).severity(0.9) is None


def test_merged_overrides_only_what_is_given() -> None:
    t = merged(DEFAULTS[Rule.ERROR_RATE], warning=0.1, for_s=0)
    assert (t.warning, t.critical, t.for_s, t.window_s) == (0.1, 0.20, 0, 300)
    assert merged(DEFAULTS[Rule.BUDGET], enabled=False).enabled is False


def _latency(**p95: float) -> rules.DeploymentLatency:
    return rules.DeploymentLatency(name="chat", tenant_id=7, slo_ms=500, p95_ms=p95)


@pytest.mark.parametrize(("p95", "severity"), [
    ({"r1": 300.0, "r2": 499.0}, None),
    ({"r1": 300.0, "r2": 500.0}, Severity.WARNING),
    ({"r1": 300.0, "r2": 999.0}, Severity.WARNING),
    ({"r1": 1000.0, "r2": 300.0}, Severity.CRITICAL),
])
def test_latency_slo_judges_the_worst_replica(p95, severity) -> None:  # type: ignore[no-untyped-def]
    found = rules.latency_slo(Rule.TTFT_SLO, [_latency(**p95)], DEFAULTS[Rule.TTFT_SLO])
    assert [f.severity for f in found] == ([severity] if severity else [])


def test_latency_finding_names_replica_slo_and_tenant() -> None:
    [f] = rules.latency_slo(Rule.ITL_SLO, [_latency(a=120.0, b=800.0, c=510.0)],
                            DEFAULTS[Rule.ITL_SLO])
    assert (f.rule, f.subject, f.tenant_id, f.unit) == (Rule.ITL_SLO, "chat", 7, "ms")
    assert f.value == 800.0 and f.threshold == 500.0
    assert "ITL p95 800 ms on b" in f.message and "1.60×" in f.message
    assert "(2 of 3 replicas over the SLO)" in f.message


def test_latency_without_data_finds_nothing() -> None:
    empty = rules.DeploymentLatency(name="idle", tenant_id=None, slo_ms=500, p95_ms={})
    assert rules.latency_slo(Rule.TTFT_SLO, [empty], DEFAULTS[Rule.TTFT_SLO]) == []


def test_traffic_by_model_counts_5xx_and_handles_restarts() -> None:
    older = {"m|r|acme|200": 100, "m|r|acme|503": 10, "n|r||200": 50}
    newer = {"m|r|acme|200": 190, "m|r|acme|503": 20, "m|r|acme|429": 5, "n|r||200": 20,
             "n|r||502": 4}
    traffic = traffic_by_model([(newer, older), ({"x|r||500": 9}, None)])
    # m: 90 ok + 10 errors + 5 rate-limited; n restarted: 20 ok + 4 errors since then.
    assert traffic == {"m": (105.0, 10.0), "n": (24.0, 4.0)}
    assert is_error_status("504") and not is_error_status("429")
    assert not is_error_status("5xx") and not is_error_status("")


def test_error_rate_thresholds_and_minimum_volume() -> None:
    limits = DEFAULTS[Rule.ERROR_RATE]
    found = rules.error_rate([
        rules.ModelTraffic("few", requests=10, errors=10),        # too few requests to judge
        rules.ModelTraffic("fine", requests=1000, errors=49),     # 4.9%
        rules.ModelTraffic("warn", requests=1000, errors=50),     # 5%
        rules.ModelTraffic("bad", requests=100, errors=20, tenant_id=3),  # 20%
    ], limits)
    assert {(f.subject, f.severity) for f in found} == {
        ("warn", Severity.WARNING), ("bad", Severity.CRITICAL)}
    bad = next(f for f in found if f.subject == "bad")
    assert bad.value == 0.2 and bad.threshold == 0.2 and bad.tenant_id == 3
    assert "20.0% of requests for bad failed" in bad.message and "(20 of 100" in bad.message


def test_region_down_and_degraded() -> None:
    found = rules.region_down([
        rules.RegionState("aws:eu-central-1", "down", "no replica answers", failing=3),
        rules.RegionState("aws:us-east-1", "degraded", failing=1, serving=2),
        rules.RegionState("gcp:europe-west4", "healthy", serving=4),
    ])
    assert [(f.subject, f.severity) for f in found] == [
        ("aws:eu-central-1", Severity.CRITICAL), ("aws:us-east-1", Severity.WARNING)]
    assert found[0].message == ("Region aws:eu-central-1 is down: no replica answers "
                                "(0 serving, 3 failing).")


def test_quota_exhausted() -> None:
    found = rules.quota_exhausted([
        rules.QuotaUse("aws:eu-central-1", "H100", limit=16, in_use=14),  # 87.5%
        rules.QuotaUse("aws:us-east-1", "H100", limit=10, in_use=9),      # 90%
        rules.QuotaUse("gcp:europe-west4", "H100", limit=8, in_use=9),    # over
        rules.QuotaUse("gcp:europe-west4", "L4", limit=0, in_use=0),      # no quota at all
    ], DEFAULTS[Rule.QUOTA_EXHAUSTED])
    assert [(f.subject, f.severity) for f in found] == [
        ("aws:us-east-1/H100", Severity.WARNING), ("gcp:europe-west4/H100", Severity.CRITICAL)]
    assert found[1].message == ("H100 quota in gcp:europe-west4: 9 of 8 GPUs in use (112%), "
                                "0 left.")


def test_budget() -> None:
    limits = DEFAULTS[Rule.BUDGET]
    found = rules.budget([
        rules.TenantSpend("none", 1, budget_usd=None, spent_usd=1e6),
        rules.TenantSpend("under", 2, budget_usd=1000, spent_usd=799.99),
        rules.TenantSpend("near", 3, budget_usd=1000, spent_usd=800),
        rules.TenantSpend("over", 4, budget_usd=1000, spent_usd=1250.5),
        rules.TenantSpend("zero", 5, budget_usd=0, spent_usd=0.01),
        rules.TenantSpend("zero-idle", 6, budget_usd=0, spent_usd=0),
    ], limits)
    assert [(f.subject, f.severity, f.tenant_id) for f in found] == [
        ("near", Severity.WARNING, 3), ("over", Severity.CRITICAL, 4),
        ("zero", Severity.CRITICAL, 5)]
    assert found[0].threshold == 800 and found[1].threshold == 1000
    assert found[1].message == ("Tenant over has spent $1,250.50 this month, 125% of its "
                                "$1,000.00 budget.")
    assert "over its $0.00 budget" in found[2].message


def test_edge_table_stale_after_grace() -> None:
    now = datetime(2026, 11, 1, 12, 0, tzinfo=UTC)
    ago = lambda s: now - timedelta(seconds=s)  # noqa: E731
    found = rules.edge_table_stale([
        rules.EdgeLag("in-sync", acked_version=9, latest_version=9, behind_since=ago(999)),
        rules.EdgeLag("just-behind", acked_version=8, latest_version=9, behind_since=ago(29)),
        rules.EdgeLag("behind", acked_version=8, latest_version=10, behind_since=ago(30)),
        rules.EdgeLag("never", acked_version=None, latest_version=3, behind_since=ago(301)),
    ], now, DEFAULTS[Rule.EDGE_TABLE_STALE])
    assert [(f.subject, f.severity) for f in found] == [
        ("behind", Severity.WARNING), ("never", Severity.CRITICAL)]
    assert found[0].message == ("Edge behind has acked v8 but the newest table is v10; "
                                "behind for 30 s.")
    assert "acked no table" in found[1].message
