"""Reads an edge's /metrics text into one snapshot of its counters. Pure.

Counters are keyed by their labels joined with "|" (JSON objects need string keys):
requests by "model|region|tenant|status", tokens by "model|region|tenant|kind". A model
split between revisions (a rollout) is counted again by revision: `revisions` is
{revision id: {"requests": {status: n}, "ttft": {le: n}, "itl": {le: n}}}.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from controlplane.telemetry.windows import growth

REQUEST_LABELS = ("model", "region", "tenant", "status")
TOKEN_LABELS = ("model", "region", "tenant", "kind")
HISTOGRAMS = {
    "meridian_edge_time_to_first_token_seconds_bucket": "ttft",
    "meridian_edge_inter_token_latency_seconds_bucket": "itl",
}
REVISION_HISTOGRAMS = {
    "meridian_edge_revision_time_to_first_token_seconds_bucket": "ttft",
    "meridian_edge_revision_inter_token_latency_seconds_bucket": "itl",
}


@dataclass
class EdgeSnapshot:
    table_version: int | None = None
    requests: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)
    buckets: dict[str, dict[str, float]] = field(default_factory=dict)
    revisions: dict[str, dict[str, dict[str, float]]] = field(default_factory=dict)

    def add_revision(self, revision: str, series: str, key: str, value: float) -> None:
        counts = self.revisions.setdefault(revision, {}).setdefault(series, {})
        counts[key] = counts.get(key, 0.0) + value


def key(labels: Mapping[str, str], names: Iterable[str]) -> str:
    return "|".join(labels.get(n, "") for n in names)


def split_key(joined: str, names: tuple[str, ...]) -> dict[str, str]:
    parts = joined.split("|")
    return dict(zip(names, parts + [""] * (len(names) - len(parts)), strict=True))


def parse_edge_metrics(text: str) -> EdgeSnapshot:
    snap = EdgeSnapshot()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if name == "meridian_edge_requests_total":
                k = key(sample.labels, REQUEST_LABELS)
                snap.requests[k] = snap.requests.get(k, 0.0) + sample.value
            elif name == "meridian_edge_tokens_total":
                k = key(sample.labels, TOKEN_LABELS)
                snap.tokens[k] = snap.tokens.get(k, 0.0) + sample.value
            elif name == "meridian_edge_table_version":
                snap.table_version = int(sample.value)
            elif name == "meridian_edge_revision_requests_total":
                snap.add_revision(sample.labels.get("revision", ""), "requests",
                                  sample.labels.get("status", ""), sample.value)
            elif name in REVISION_HISTOGRAMS:
                snap.add_revision(sample.labels.get("revision", ""), REVISION_HISTOGRAMS[name],
                                  sample.labels.get("le", "+Inf"), sample.value)
            elif name in HISTOGRAMS:
                le = sample.labels.get("le", "+Inf")
                series = snap.buckets.setdefault(HISTOGRAMS[name], {})
                series[le] = series.get(le, 0.0) + sample.value
    return snap


def counter_delta(newer: Mapping[str, float], older: Mapping[str, float] | None
                  ) -> dict[str, float]:
    """Per key, what a set of counters grew by between two scrapes (`windows.growth`); a key
    that shrank restarted from zero, and with no older scrape all of it counts."""
    return growth([older or {}, newer])


def is_error_status(status: str) -> bool:
    """Server-side failures: 5xx answers (the edge's own 502/503/504 included)."""
    return len(status) == 3 and status.startswith("5") and status.isdigit()


def traffic_by_model(pairs: Iterable[tuple[Mapping[str, float], Mapping[str, float] | None]],
                     tenant: str | None = None) -> dict[str, tuple[float, float]]:
    """(requests, 5xx) per model from pairs of an edge's newer and older request counters
    (keyed "model|region|tenant|status"), only one tenant's requests when `tenant` is
    given; pairs with no older sample are skipped."""
    totals: dict[str, list[float]] = {}
    for newer, older in pairs:
        if older is None:
            continue
        for joined, grown in counter_delta(newer, older).items():
            labels = split_key(joined, REQUEST_LABELS)
            if tenant is not None and labels["tenant"] != tenant:
                continue
            row = totals.setdefault(labels["model"], [0.0, 0.0])
            row[0] += grown
            if is_error_status(labels["status"]):
                row[1] += grown
    return {model: (row[0], row[1]) for model, row in totals.items()}
