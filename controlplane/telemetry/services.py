"""Telemetry services: scrape and store samples, windowed stats, Prometheus file SD targets."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.utils import timezone

from controlplane.core.certificates import engine_client_context
from controlplane.deployments.lifecycle import SERVING_STATES
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.routing.models import Edge
from controlplane.telemetry import windows
from controlplane.telemetry.edge_metrics import counter_delta, parse_edge_metrics
from controlplane.telemetry.histograms import histogram_quantile
from controlplane.telemetry.models import EdgeSample, ReplicaSample
from controlplane.telemetry.sources import PrometheusSource, ReplicaStats, scrape_all

RETENTION = timedelta(hours=6)
SCRAPED_STATES = tuple(SERVING_STATES | {S.DRAINING, S.STARTING})


def scrape_targets() -> dict[int, str]:
    rows = Replica.objects.filter(state__in=SCRAPED_STATES).exclude(url="")
    return dict(rows.values_list("pk", "url"))


def collect(now: Any = None) -> int:
    """Scrape every replica once and store a sample each; returns how many were up."""
    now = now or timezone.now()
    targets = scrape_targets()
    results = scrape_all({str(pk): url for pk, url in targets.items()},
                         context=engine_client_context() if targets else None)
    samples = []
    for key, scrape in results.items():
        snap = scrape.snapshot
        samples.append(ReplicaSample(
            replica_id=int(key), at=now, up=snap is not None, error=scrape.error,
            running=snap.running if snap else 0.0, waiting=snap.waiting if snap else 0.0,
            kv_usage=snap.kv_usage if snap else 0.0,
            counters=snap.counters if snap else {}, buckets=snap.buckets if snap else {},
        ))
    ReplicaSample.objects.bulk_create(samples)
    ReplicaSample.objects.filter(at__lt=now - RETENTION).delete()
    return sum(1 for s in samples if s.up)


@dataclass(frozen=True)
class EdgeDelta:
    """What one edge counted between its previous scrape and this one."""

    edge_id: int
    since: Any  # datetime of the previous sample
    at: Any
    requests: dict[str, float]
    tokens: dict[str, float]


def collect_edges(now: Any = None) -> list[EdgeDelta]:
    """Scrape every enabled edge's /metrics once, store a sample each, and return what each
    counted since its previous sample (a counter that went down restarted from zero)."""
    now = now or timezone.now()
    edges = dict(Edge.objects.filter(enabled=True).values_list("pk", "admin_url"))
    results = scrape_all({str(pk): url for pk, url in edges.items()}, parse=parse_edge_metrics)
    previous = {s.edge_id: s for s in
                windows.newest(EdgeSample.objects.filter(edge_id__in=list(edges)), "edge_id")}
    samples, deltas = [], []
    for key, scrape in results.items():
        snap = scrape.snapshot
        sample = EdgeSample(
            edge_id=int(key), at=now, up=snap is not None, error=scrape.error,
            table_version=snap.table_version if snap else None,
            requests=snap.requests if snap else {}, tokens=snap.tokens if snap else {},
            buckets=snap.buckets if snap else {}, revisions=snap.revisions if snap else {})
        samples.append(sample)
        before = previous.get(sample.edge_id)
        if snap is not None and before is not None and before.up:
            deltas.append(EdgeDelta(sample.edge_id, before.at, now,
                                    counter_delta(snap.requests, before.requests),
                                    counter_delta(snap.tokens, before.tokens)))
    EdgeSample.objects.bulk_create(samples)
    EdgeSample.objects.filter(at__lt=now - RETENTION).delete()
    return deltas


def newest_edge_requests(before: Any = None, since: Any = None) -> dict[int, dict[str, float]]:
    """Each enabled edge's request counters from its newest answered scrape (at or before
    `before`, not older than `since`): edge id → {"model|region|tenant|status": count}."""
    rows = EdgeSample.objects.filter(up=True, edge__enabled=True)
    if before is not None:
        rows = rows.filter(at__lte=before)
    if since is not None:
        rows = rows.filter(at__gte=since)
    return dict(windows.newest(rows, "edge_id").values_list("edge_id", "requests"))


def stats_between(newer: ReplicaSample, older: ReplicaSample | None) -> ReplicaStats:
    """Rates and p95s over the interval between two samples of one replica (an engine
    restarted in between counts from zero; see `windows`). Pure."""
    if not newer.up:
        return ReplicaStats(up=False, error=newer.error)
    ttft = itl = None
    prompt_tps = generation_tps = 0.0
    if older is not None and older.up and newer.at > older.at:
        ttft, itl = (histogram_quantile(0.95, windows.histogram_growth(
            [older.buckets.get(name, {}), newer.buckets.get(name, {})])) for name in ("ttft", "itl"))
        readings = [(older.at, older.counters), (newer.at, newer.counters)]
        prompt_tps = windows.rate(readings, "prompt_tokens")
        generation_tps = windows.rate(readings, "generation_tokens")
    return ReplicaStats(
        up=True, running=newer.running, waiting=newer.waiting, kv_usage=newer.kv_usage,
        ttft_p95_s=ttft, itl_p95_s=itl, prompt_tps=prompt_tps, generation_tps=generation_tps,
    )


class DirectScrapeSource:
    """The embedded source: windows over the samples `collect` stores in Postgres."""

    def replica_stats(self, targets: Mapping[str, str], window_s: int) -> dict[str, ReplicaStats]:
        ids = [int(t) for t in targets]
        cutoff = timezone.now() - timedelta(seconds=window_s)
        at_cutoff, at_end = windows.ends(ReplicaSample.objects.filter(replica_id__in=ids),
                                         "replica_id", cutoff)
        latest = {s.replica_id: s for s in at_end}
        older = {s.replica_id: s for s in at_cutoff}
        stats: dict[str, ReplicaStats] = {}
        for rid in ids:
            newest = latest.get(rid)
            stats[str(rid)] = (stats_between(newest, older.get(rid)) if newest
                               else ReplicaStats(up=False, error="no sample yet"))
        return stats


def metrics_source() -> DirectScrapeSource | PrometheusSource:
    """Prometheus when PROMETHEUS_URL names one (the direct scrape stands in for any call it
    cannot answer), else the direct scrape."""
    url = os.environ.get("PROMETHEUS_URL")
    return PrometheusSource(url, fallback=DirectScrapeSource()) if url else DirectScrapeSource()


def write_prometheus_targets(directory: Path | None = None) -> Path:
    """File-based service discovery for Prometheus: one JSON file of replica targets."""
    directory = directory or settings.VAR_DIR / "prometheus" / "targets"
    directory.mkdir(parents=True, exist_ok=True)
    replicas = Replica.objects.filter(state__in=SCRAPED_STATES).exclude(url="").select_related(
        "deployment", "region__cloud")
    groups = [
        {"targets": [r.url.split("://", 1)[-1].rstrip("/")],
         "labels": {"replica": str(r.pk), "deployment": r.deployment.name,
                    "region": r.region.key}}
        for r in replicas
    ]
    # https replicas (mTLS) go to the job that scrapes with a client certificate; plain
    # ones (tests with MERIDIAN_ENGINE_TLS=0 only) to the plain job.
    urls = [r.url for r in replicas]
    plain = [g for g, url in zip(groups, urls, strict=True) if not url.startswith("https:")]
    groups = [g for g, url in zip(groups, urls, strict=True) if url.startswith("https:")]
    edges = [
        {"targets": [e.admin_url.split("://", 1)[-1].rstrip("/")],
         "labels": {"edge": e.name, "region": e.region.key}}
        for e in Edge.objects.filter(enabled=True).select_related("region__cloud")
    ]
    for name, content in (("replicas.json", groups), ("replicas-plain.json", plain),
                          ("edges.json", edges)):
        path = directory / name
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(content, indent=1))
        tmp.replace(path)  # Prometheus must never read a half-written file
    return directory
