"""Traffic and latency from the engine samples that the telemetry loop stores.

`telemetry.collect` keeps a sample of every serving replica's vLLM gauges, counters and
histogram buckets every few seconds. Rates and p95s come from the difference between two
samples of one replica, as PromQL's rate() and histogram_quantile() compute them; that
arithmetic is pure and lives in `interval`, `rates` and `series`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import DateTimeField, F, Func, Value
from django.utils import timezone

from controlplane.core.services import Principal
from controlplane.deployments.lifecycle import SERVING_STATES
from controlplane.telemetry import windows
from controlplane.telemetry.edge_metrics import traffic_by_model
from controlplane.telemetry.histograms import histogram_quantile
from controlplane.telemetry.models import ReplicaSample
from controlplane.telemetry.services import newest_edge_requests

FIELDS = ("replica_id", "at", "up", "running", "waiting", "kv_usage", "counters", "buckets")


@dataclass(frozen=True)
class Sample:
    replica_id: int
    at: datetime
    up: bool
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    counters: Mapping[str, float] = field(default_factory=dict)
    buckets: Mapping[str, Mapping[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Interval:
    """What one replica did between two of its samples."""

    seconds: float
    requests: float
    generation_tokens: float
    ttft: Mapping[str, float]
    itl: Mapping[str, float]


def interval(newer: Sample, older: Sample) -> Interval | None:
    """What the replica did between two samples; an engine restarted in between counts from
    zero (`windows`). None when either sample is down or no time passed."""
    if not (newer.up and older.up) or newer.at <= older.at:
        return None
    grown = windows.growth([older.counters, newer.counters], ("requests_ok", "generation_tokens"))
    return Interval(
        seconds=(newer.at - older.at).total_seconds(),
        requests=grown.get("requests_ok", 0.0),
        generation_tokens=grown.get("generation_tokens", 0.0),
        ttft=windows.histogram_growth([older.buckets.get("ttft", {}), newer.buckets.get("ttft", {})]),
        itl=windows.histogram_growth([older.buckets.get("itl", {}), newer.buckets.get("itl", {})]),
    )


def _merge(histograms: Iterable[Mapping[str, float]]) -> dict[str, float]:
    merged: dict[str, float] = defaultdict(float)
    for histogram in histograms:
        for le, count in histogram.items():
            merged[le] += count
    return dict(merged)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


@dataclass(frozen=True)
class Rates:
    requests_per_s: float
    tokens_per_s: float
    ttft_p95_ms: float | None
    itl_p95_ms: float | None


def rates(intervals: Iterable[Interval]) -> Rates | None:
    """Summed rates and pooled p95s over replicas' intervals; None when there are none."""
    intervals = list(intervals)
    if not intervals:
        return None
    return Rates(
        requests_per_s=sum(windows.per_second(i.requests, i.seconds) for i in intervals),
        tokens_per_s=sum(windows.per_second(i.generation_tokens, i.seconds) for i in intervals),
        ttft_p95_ms=_ms(histogram_quantile(0.95, _merge(i.ttft for i in intervals))),
        itl_p95_ms=_ms(histogram_quantile(0.95, _merge(i.itl for i in intervals))),
    )


def _samples(queryset: Any) -> list[Sample]:
    return [Sample(**row) for row in queryset.values(*FIELDS)]


@dataclass(frozen=True)
class FleetNow:
    """The viewer's serving replicas over the last window."""

    window_s: int
    reporting: int
    down: int
    rates: Rates | None
    running: float
    waiting: float
    kv_usage_max: float | None
    errors: EdgeErrors | None = None


@dataclass(frozen=True)
class EdgeErrors:
    """Requests the edges answered over a window, and how many were server errors (5xx)."""

    requests: float
    errors: float

    @property
    def rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


def edge_errors(newer: Mapping[int, Mapping[str, float]],
                older: Mapping[int, Mapping[str, float]], tenant: str | None) -> EdgeErrors | None:
    """Requests and 5xx between each edge's older and newer counters (keyed
    "model|region|tenant|status"), for one tenant's requests or, with None, all; None when
    no edge has an older sample to compare with. Pure."""
    if not any(edge_id in older for edge_id in newer):
        return None
    by_model = traffic_by_model(((counters, older.get(edge_id)) for edge_id, counters in
                                 newer.items()), tenant)
    return EdgeErrors(sum(r for r, _ in by_model.values()), sum(e for _, e in by_model.values()))


def fleet_now(principal: Principal, window_s: int = 60, now: datetime | None = None) -> FleetNow:
    """Two queries for the replicas (each serving replica's newest and oldest sample inside
    the window) and two for the edges' error counts."""
    now = now or timezone.now()
    recent = ReplicaSample.objects.filter(
        at__gte=now - timedelta(seconds=window_s), replica__state__in=SERVING_STATES,
    ).visible_to(principal)
    newest = _samples(windows.newest(recent, "replica_id"))
    oldest = {s.replica_id: s for s in _samples(windows.oldest(recent, "replica_id"))}
    up = [s for s in newest if s.up]
    found = (interval(s, oldest[s.replica_id]) for s in up if s.replica_id in oldest)
    return FleetNow(
        window_s=window_s, reporting=len(up), down=len(newest) - len(up),
        rates=rates(i for i in found if i is not None),
        running=sum(s.running for s in up), waiting=sum(s.waiting for s in up),
        kv_usage_max=max((s.kv_usage for s in up), default=None),
        # Two more queries: each edge's newest counters, and its newest from before the window
        # (at most an hour old, so that an edge restarted meanwhile is not compared).
        errors=edge_errors(
            newest_edge_requests(since=now - timedelta(seconds=window_s)),
            newest_edge_requests(before=now - timedelta(seconds=window_s),
                                 since=now - timedelta(hours=1)),
            principal.tenant_name()),
    )


@dataclass
class Series:
    """A deployment's traffic per time step, summed (or pooled) over its replicas."""

    step_s: int
    since: datetime | None = None
    until: datetime | None = None
    times: list[datetime] = field(default_factory=list)
    requests_per_s: list[float | None] = field(default_factory=list)
    tokens_per_s: list[float | None] = field(default_factory=list)
    ttft_p95_ms: list[float | None] = field(default_factory=list)
    itl_p95_ms: list[float | None] = field(default_factory=list)
    running: list[float] = field(default_factory=list)
    waiting: list[float] = field(default_factory=list)
    kv_usage_mean_pct: list[float] = field(default_factory=list)
    kv_usage_max_pct: list[float] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.times


def series(samples: Iterable[tuple[datetime, Sample]], step_s: int) -> Series:
    """Per-step figures from (step start, the replica's last sample in that step) pairs.

    Gauges are read from each step's samples; rates and p95s from each replica's change
    since its previous step.
    """
    by_replica: dict[int, list[tuple[datetime, Sample]]] = defaultdict(list)
    for step, sample in samples:
        by_replica[sample.replica_id].append((step, sample))
    gauges: dict[datetime, list[Sample]] = defaultdict(list)
    changes: dict[datetime, list[Interval]] = defaultdict(list)
    for rows in by_replica.values():
        rows.sort(key=lambda row: row[0])
        previous: Sample | None = None
        for step, sample in rows:
            if sample.up:
                gauges[step].append(sample)
            if previous is not None:
                change = interval(sample, previous)
                if change is not None:
                    changes[step].append(change)
            previous = sample
    out = Series(step_s=step_s)
    for step in sorted(gauges):
        up = gauges[step]
        step_rates = rates(changes.get(step, []))
        out.times.append(step)
        out.requests_per_s.append(round(step_rates.requests_per_s, 3) if step_rates else None)
        out.tokens_per_s.append(round(step_rates.tokens_per_s, 1) if step_rates else None)
        out.ttft_p95_ms.append(step_rates.ttft_p95_ms if step_rates else None)
        out.itl_p95_ms.append(step_rates.itl_p95_ms if step_rates else None)
        out.running.append(sum(s.running for s in up))
        out.waiting.append(sum(s.waiting for s in up))
        out.kv_usage_mean_pct.append(round(100 * sum(s.kv_usage for s in up) / len(up), 1))
        out.kv_usage_max_pct.append(round(100 * max(s.kv_usage for s in up), 1))
    return out


class _DateBin(Func):
    function = "date_bin"
    output_field = DateTimeField()


def deployment_series(
    deployment_id: int, minutes: int = 30, step_s: int = 30, now: datetime | None = None
) -> Series:
    """One query: each replica's last sample in every step of the last `minutes`."""
    now = now or timezone.now()
    since = now - timedelta(minutes=minutes)
    step = _DateBin(Value(timedelta(seconds=step_s)), F("at"), Value(since))
    rows = (
        ReplicaSample.objects.filter(replica__deployment_id=deployment_id, at__gte=since)
        .annotate(step=step).order_by("replica_id", "step", "-at")
        .distinct("replica_id", "step").values("step", *FIELDS)
    )
    pairs = [(row.pop("step"), Sample(**row)) for row in rows]
    out = series(pairs, step_s)
    out.since, out.until = since, now
    return out
