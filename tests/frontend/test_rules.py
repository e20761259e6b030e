"""The dashboard's pure rules: region health, traffic arithmetic, table diffs, figures."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import plotly.graph_objects as go
import pytest

from frontend import charts
from frontend.fleet import EdgeStatus, RegionStatus, region_health, sum_states
from frontend.tablediff import diff_tables
from frontend.templatetags.meridian import ago, counts, ratio, usd
from frontend.traffic import Sample, interval, rates, series

T0 = datetime(2026, 11, 23, 12, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("states", "health", "why"),
    [
        ({}, "idle", "no replicas at all"),
        ({"terminated": 4}, "idle", "terminated replicas do not count"),
        ({"ready": 3}, "healthy", "all ready"),
        ({"ready": 2, "draining": 1, "starting": 1}, "healthy", "serving, nothing wrong"),
        ({"ready": 2, "failed": 1}, "degraded", "some failed"),
        ({"ready": 2, "degraded": 1}, "degraded", "some degraded"),
        ({"degraded": 2}, "degraded", "all degraded still serve"),
        ({"failed": 3}, "down", "all failed"),
        ({"failed": 3, "terminated": 2}, "down", "all that count have failed"),
        ({"pending": 1, "provisioning": 1}, "starting", "on the way up, none serving"),
        ({"starting": 1, "failed": 1}, "degraded", "a failure beside a start"),
        ({"draining": 1}, "idle", "its only replica drains: nothing serves"),
        ({"draining": 1, "starting": 1}, "starting", "draining out, another on its way up"),
    ],
)
def test_region_health_follows_replica_states(states, health, why):  # type: ignore[no-untyped-def]
    assert region_health(states) == health, why


def test_state_counts_are_listed_in_lifecycle_order():
    rows = [{"state": "failed", "n": 1}, {"state": "ready", "n": 2}, {"state": "pending", "n": 3},
            {"state": "ready", "n": 1}]
    assert list(sum_states(rows).items()) == [("pending", 3), ("ready", 3), ("failed", 1)]


def _sample(seconds: float, requests: float, tokens: float, ttft: dict[str, float],
            replica: int = 1, up: bool = True, **gauges: float) -> Sample:
    return Sample(replica_id=replica, at=T0 + timedelta(seconds=seconds), up=up,
                  counters={"requests_ok": requests, "generation_tokens": tokens},
                  buckets={"ttft": ttft, "itl": {}}, **gauges)


def test_rates_are_counter_deltas_over_time_and_pooled_p95():
    # Replica 1: 30 requests in 10 s; replica 2: 10 requests in 5 s. 3 + 2 = 5 requests/s.
    older = [_sample(0, 100, 1000, {"0.1": 0, "0.5": 0, "+Inf": 0}),
             _sample(0, 50, 0, {"0.1": 0, "0.5": 0, "+Inf": 0}, replica=2)]
    newer = [_sample(10, 130, 1600, {"0.1": 20, "0.5": 30, "+Inf": 30}),
             _sample(5, 60, 200, {"0.1": 0, "0.5": 10, "+Inf": 10}, replica=2)]
    found = [interval(n, o) for n, o in zip(newer, older, strict=True)]
    result = rates(i for i in found if i is not None)
    assert result is not None
    assert result.requests_per_s == pytest.approx(5.0)
    assert result.tokens_per_s == pytest.approx(60 + 40)
    # Pooled: 20 of 40 observations ≤ 0.1 s, all 40 ≤ 0.5 s; rank 38 lies 18/20 into (0.1, 0.5].
    assert result.ttft_p95_ms == pytest.approx((0.1 + 0.4 * 18 / 20) * 1000)
    assert result.itl_p95_ms is None


def test_restarted_engine_counts_from_zero_and_down_samples_give_no_rate():
    restarted = interval(_sample(10, 5, 50, {}), _sample(0, 900, 9000, {}))
    assert restarted is not None and restarted.requests == 5
    assert interval(_sample(10, 5, 50, {}, up=False), _sample(0, 1, 1, {})) is None
    assert rates([]) is None


def test_series_sums_gauges_per_step_and_rates_from_the_previous_step():
    step = timedelta(seconds=30)
    pairs = [
        (T0, _sample(25, 0, 0, {}, running=2, waiting=1, kv_usage=0.5)),
        (T0 + step, _sample(55, 60, 600, {}, running=4, waiting=0, kv_usage=0.7)),
        (T0 + step, _sample(50, 0, 0, {}, replica=2, running=1, waiting=3, kv_usage=0.1)),
    ]
    result = series(pairs, 30)
    assert result.times == [T0, T0 + step]
    assert result.running == [2, 5] and result.waiting == [1, 3]
    assert result.requests_per_s == [None, 2.0]  # 60 requests in 30 s; replica 2 is new
    assert result.tokens_per_s == [None, 20.0]
    assert result.kv_usage_mean_pct == [50.0, 40.0] and result.kv_usage_max_pct == [50.0, 70.0]


def _replica(rid: str, region: str, weight: float = 1.0) -> dict[str, object]:
    return {"id": rid, "url": f"http://{rid}", "region": region, "weight": weight,
            "state": "ready", "rtt_ms": 10.0}


def test_table_diff_names_replicas_tenants_and_policy_that_changed():
    older = {"version": 7, "signature": "a", "key_id": "k1",
             "models": {"llama": {"replicas": [_replica("r-1", "aws:eu-central-1"),
                                               _replica("r-2", "gcp:europe-west4")]}},
             "tenants": {"f" * 64: {"tenant": "acme", "rpm": 600}},
             "policy": {"scorers": {"latency": 1.0}, "eject_base_s": 1.0}}
    newer = {"version": 9, "signature": "b", "key_id": "k1",
             "models": {"llama": {"replicas": [_replica("r-2", "gcp:europe-west4", 0.0),
                                               _replica("r-3", "aws:us-east-1")]}},
             "tenants": {"f" * 64: {"tenant": "acme", "rpm": 900}},
             "policy": {"scorers": {"latency": 2.0}, "eject_base_s": 1.0}}
    diff = diff_tables(older, newer)
    assert [r["id"] for r in diff.replicas_added] == ["r-3"]
    assert [r["id"] for r in diff.replicas_removed] == ["r-1"]
    [changed] = diff.replicas_changed
    assert changed.label == "llama · r-2"
    assert [(f.name, f.before, f.after) for f in changed.fields] == [("weight", 1.0, 0.0)]
    [tenant] = diff.tenants_changed
    assert [(f.name, f.before, f.after) for f in tenant.fields] == [("rpm", 600, 900)]
    assert "f" * 64 not in tenant.label  # digests are shortened
    assert [(f.name, f.after) for f in diff.settings_changed] == [("policy.scorers.latency", 2.0)]
    assert not diff.unchanged
    assert any(line.startswith("+") and "r-3" in line for line in diff.lines)


def test_a_tenants_cache_salt_shows_as_a_digest_only():
    older = {"models": {}, "tenants": {"f" * 64: {"tenant": "acme", "cache_salt": "A" * 43}}}
    newer = {"models": {}, "tenants": {"f" * 64: {"tenant": "acme", "cache_salt": "B" * 43}}}
    diff = diff_tables(older, newer)
    [tenant] = diff.tenants_changed
    [change] = tenant.fields
    assert change.name == "cache_salt" and change.before != change.after
    assert str(change.before).startswith("sha256:")
    assert not any("A" * 43 in line or "B" * 43 in line for line in diff.lines)


def test_tables_that_differ_only_in_version_and_signature_are_unchanged():
    table = {"version": 1, "issued_at": "x", "signature": "s", "models": {}, "tenants": {}}
    diff = diff_tables(table, {**table, "version": 2, "issued_at": "y", "signature": "t"})
    assert diff.unchanged and diff.lines == []


def _region(key: str, counts: dict[str, int], lon: float = 8.7) -> RegionStatus:
    return RegionStatus(key=key, name=key, cloud="AWS", jurisdiction="EU", latitude=50.1,
                        longitude=lon, counts=counts, usd_h=Decimal("12.29"))


def test_world_map_is_a_valid_plotly_figure_with_health_traces_and_routes():
    regions = [_region("aws:eu-central-1", {"ready": 2}), _region("gcp:x", {"failed": 1}, 20),
               _region("aws:idle", {}, 30)]
    edges = [EdgeStatus(name="edge-eu", region="aws:eu-central-1", latitude=50.1, longitude=8.7,
                        enabled=True, latest_version=3, acked_version=3, last_error="",
                        routes=["aws:eu-central-1", "gcp:x", "unknown:region"])]
    figure = charts.world_map(regions, edges)
    go.Figure(figure)  # raises on anything plotly would not accept
    names = [trace["name"] for trace in figure["data"]]
    # Edges first, then regions, the worst last: plotly draws later traces on top, so no
    # diamond hides a region and a down region is above everything near it.
    assert names == ["routes (edge → region)", "edges (1)", "idle (1)", "healthy (1)",
                     "down (1)"]
    routes = figure["data"][0]
    assert routes["lon"] == [8.7, 8.7, None, 8.7, 20, None]  # unknown regions are not drawn
    healthy, down = figure["data"][3], figure["data"][4]
    assert healthy["marker"]["color"] == charts.HEALTH_COLOURS["healthy"]
    assert healthy["marker"]["size"] == [charts.marker_size(2)]
    # A down region is drawn bigger than an edge's diamond, however few replicas it holds.
    edge_size = figure["data"][1]["marker"]["size"]
    assert down["marker"]["size"][0] >= charts.marker_size(1) and down["marker"]["size"][0] > edge_size
    assert figure["layout"]["geo"]["resolution"] == 110


def test_marker_area_grows_with_replicas_within_bounds():
    sizes = [charts.marker_size(n) for n in (0, 1, 4, 16, 10_000)]
    assert sizes == sorted(sizes) and sizes[0] == 6 and sizes[-1] == 42


def test_time_series_figures_are_valid_plotly_and_span_the_window():
    step = timedelta(seconds=30)
    result = series([(T0, _sample(25, 0, 0, {}, running=1)),
                     (T0 + step, _sample(55, 30, 300, {"0.5": 30, "+Inf": 30}, running=2))], 30)
    result.since, result.until = T0 - timedelta(minutes=29), T0 + timedelta(minutes=1)
    for figure in (charts.latency_figure(result, 800, 60), charts.throughput_figure(result),
                   charts.load_figure(result), charts.kv_figure(result)):
        go.Figure(figure)
        assert figure["layout"]["xaxis"]["range"] == ["2026-11-23 11:31:00",
                                                      "2026-11-23 12:01:00"]
    slo = charts.latency_figure(result, 800, 60)["data"][2]
    assert slo["y"] == [800, 800] and slo["x"] == ["2026-11-23 11:31:00", "2026-11-23 12:01:00"]


def test_events_figure_stacks_kinds_per_hour():
    rows = [{"hour": T0, "kind": "replica", "n": 3}, {"hour": T0, "kind": "plan", "n": 1},
            {"hour": T0 + timedelta(hours=1), "kind": "replica", "n": 2}]
    figure = charts.events_figure(rows, since=T0, until=T0 + timedelta(hours=2))
    go.Figure(figure)
    by_name = {trace["name"]: trace for trace in figure["data"]}
    assert by_name["replica"]["y"] == [3, 2] and by_name["plan"]["y"] == [1]
    assert figure["layout"]["barmode"] == "stack"


def test_money_and_time_are_written_for_people():
    assert usd(Decimal("1234.5")) == "$1,234.50"
    assert usd(Decimal("-12.29")) == "−$12.29"
    assert usd(None) == "—"
    from django.utils import timezone

    assert ago(timezone.now() - timedelta(minutes=12, seconds=5)) == "12 min ago"
    assert ago(None) == "never"
    assert str(counts({"ready": 2})) == '<span class="badge state-ready">2 ready</span>'
    # Ratios to three decimals, as the API; one too small for them is not written as a
    # zero it is not.
    assert (ratio(0.4249), ratio(0.0004), ratio(0.0), ratio(None)) == (
        "0.425×", "<0.001×", "0.000×", "—")


@pytest.mark.parametrize(("states", "observed", "health"), [
    ({}, "down", "down"),  # failed replicas replaced elsewhere: the region is still down
    ({"ready": 2}, "degraded", "degraded"),
    ({"failed": 2}, "degraded", "down"),  # the worse of the two
    ({"ready": 2}, "", "healthy"),
])
def test_the_failover_loops_verdict_can_only_make_a_region_look_worse(states, observed, health):  # type: ignore[no-untyped-def]
    region = RegionStatus("aws:x", "X", "AWS", "EU", 0.0, 0.0, counts=states, observed=observed)
    assert region.health == health
