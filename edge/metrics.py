"""The edge's Prometheus metrics: small counters, gauges and histograms, and their text form.

Written here rather than taken from prometheus_client because they sit on the hot path: an
observation is a dict lookup and a bisect, with labels passed as a tuple in declared order.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import TypeVar

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536)
# Finer where TTFT and inter-token gaps fall: a rollout compares two revisions' p95s within
# 20%, which the coarse buckets' linear interpolation (25 ms, then 50 ms) cannot resolve.
REVISION_LATENCY_BUCKETS = (0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.0125, 0.015, 0.0175,
                            0.02, 0.0225, 0.025, 0.0275, 0.03, 0.035, 0.04, 0.045, 0.05, 0.06,
                            0.07, 0.08, 0.09, 0.1, 0.12, 0.14, 0.16, 0.18, 0.2, 0.25, 0.3, 0.35,
                            0.4, 0.45, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0,
                            4.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0)

# Label values in declared order; numbers (an HTTP status) are rendered with str().
Labels = tuple[str | int, ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(names: Sequence[str], values: Labels, extra: str = "") -> str:
    parts = [f'{n}="{_escape(str(v))}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _number(value: float) -> str:
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


class Counter:
    kind = "counter"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.label_names = name, help_text, tuple(labels)
        self.values: dict[Labels, float] = {}

    def inc(self, labels: Labels = (), amount: float = 1.0) -> None:
        values = self.values
        values[labels] = values.get(labels, 0.0) + amount

    def get(self, labels: Labels = ()) -> float:
        return self.values.get(labels, 0.0)

    def samples(self) -> list[str]:
        return [f"{self.name}{_labels(self.label_names, k)} {_number(v)}"
                for k, v in sorted(self.values.items())]


class Gauge(Counter):
    kind = "gauge"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = (),
                 collect: Callable[[], dict[Labels, float]] | None = None) -> None:
        super().__init__(name, help_text, labels)
        self._collect = collect

    def set(self, labels: Labels, value: float) -> None:
        self.values[labels] = value

    def samples(self) -> list[str]:
        if self._collect is not None:
            self.values = self._collect()
        return super().samples()


class Histogram:
    kind = "histogram"

    def __init__(self, name: str, help_text: str, labels: Sequence[str] = (),
                 buckets: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.name, self.help, self.label_names = name, help_text, tuple(labels)
        self.bounds = tuple(buckets)
        # per label set: [count per bucket (+Inf last)..., sum, count]
        self.values: dict[Labels, list[float]] = {}

    def observe(self, labels: Labels, value: float) -> None:
        row = self.values.get(labels)
        if row is None:
            row = self.values[labels] = [0.0] * (len(self.bounds) + 3)
        row[bisect_left(self.bounds, value)] += 1
        row[-2] += value
        row[-1] += 1

    def count(self, labels: Labels = ()) -> float:
        row = self.values.get(labels)
        return row[-1] if row else 0.0

    def samples(self) -> list[str]:
        lines = []
        for key, row in sorted(self.values.items()):
            cumulative = 0.0
            for bound, n in zip((*self.bounds, float("inf")), row, strict=False):
                cumulative += n
                le = "+Inf" if bound == float("inf") else repr(float(bound))
                le_label = 'le="' + le + '"'
                lines.append(f"{self.name}_bucket{_labels(self.label_names, key, le_label)}"
                             f" {_number(cumulative)}")
            lines.append(f"{self.name}_sum{_labels(self.label_names, key)} {repr(row[-2])}")
            lines.append(f"{self.name}_count{_labels(self.label_names, key)} {_number(row[-1])}")
        return lines


Metric = Counter | Gauge | Histogram
M = TypeVar("M", Counter, Gauge, Histogram)


class Registry:
    def __init__(self) -> None:
        self.metrics: list[Metric] = []

    def add(self, metric: M) -> M:
        self.metrics.append(metric)
        return metric

    def render(self) -> bytes:
        lines = []
        for metric in self.metrics:
            lines.append(f"# HELP {metric.name} {metric.help}")
            lines.append(f"# TYPE {metric.name} {metric.kind}")
            lines.extend(metric.samples())
        return ("\n".join(lines) + "\n").encode()


class EdgeMetrics:
    """Every metric the edge exports, by name."""

    def __init__(self) -> None:
        r = self.registry = Registry()
        self.requests = r.add(Counter(
            "meridian_edge_requests_total", "Client requests by model, replica region, tenant "
            "and HTTP status.", ("model", "region", "tenant", "status")))
        self.ttft = r.add(Histogram(
            "meridian_edge_time_to_first_token_seconds", "From the request's arrival to the "
            "first response byte written to the client, of successful answers only (no error status).",
            ("model",)))
        self.itl = r.add(Histogram(
            "meridian_edge_inter_token_latency_seconds", "Between successive stream writes to "
            "the client.", ("model",)))
        # While a model's traffic is split between revisions (a rollout), the same three
        # again by revision: what a rollout's analysis compares.
        self.revision_requests = r.add(Counter(
            "meridian_edge_revision_requests_total", "Client requests of a model split "
            "between revisions, by the revision of the replica that answered, and HTTP status.",
            ("model", "revision", "status")))
        self.revision_ttft = r.add(Histogram(
            "meridian_edge_revision_time_to_first_token_seconds", "Time to first token of a "
            "split model's successful answers (no error status), by the answering replica's revision.",
            ("model", "revision"), REVISION_LATENCY_BUCKETS))
        self.revision_itl = r.add(Histogram(
            "meridian_edge_revision_inter_token_latency_seconds", "Inter-token latency of a "
            "split model's streams, by the answering replica's revision.",
            ("model", "revision"), REVISION_LATENCY_BUCKETS))
        self.tokens = r.add(Counter(
            "meridian_edge_tokens_total", "Tokens as reported by engines (estimated for "
            "streams without usage), by model, replica region and tenant.",
            ("model", "region", "tenant", "kind")))
        self.overhead = r.add(Histogram(
            "meridian_edge_added_latency_seconds", "Time the edge itself spent on a request: "
            "arrival to upstream send, plus upstream response head to client write."))
        self._add_edge_metrics(r)

    def _add_edge_metrics(self, r: Registry) -> None:
        """The edge's own state: its table, refusals, failures and waits."""
        self.table_version = r.add(Gauge(
            "meridian_edge_table_version", "Version of the routing table being served."))
        self.table_rejections = r.add(Counter(
            "meridian_edge_table_rejections_total", "Tables refused, by reason.", ("reason",)))
        self.admin_refusals = r.add(Counter(
            "meridian_edge_admin_refusals_total", "Admin API requests refused for their "
            "authentication, by reason (a fixed set of codes).", ("reason",)))
        self.upstream_tls_failures = r.add(Counter(
            "meridian_edge_upstream_tls_failures_total", "Upstream connections refused for "
            "mTLS, by reason (plain_http, expired, revoked, replica_revoked, handshake).",
            ("reason",)))
        self.ejections = r.add(Counter(
            "meridian_edge_ejections_total", "Passive ejections of replicas.", ("replica",)))
        self.retries = r.add(Counter(
            "meridian_edge_retries_total", "Requests retried on another replica before the "
            "first byte reached the client.", ("model",)))
        self.resumptions = r.add(Counter(
            "meridian_edge_stream_resumptions_total", "Streams whose replica failed after "
            "bytes reached the client, by what the edge did: resumed on another replica, or "
            "why not.", ("outcome",)))
        self.rate_limited = r.add(Counter(
            "meridian_edge_rate_limited_total", "Requests refused by a tenant's rate limit.",
            ("tenant", "limit")))
        self.queue_waits = r.add(Counter(
            "meridian_edge_queue_waits_total", "Requests that waited for capacity, by outcome.",
            ("tier", "outcome")))
        self.build = r.add(Gauge(
            "meridian_edge_build_info", "1, labelled with how the request path runs: "
            "compiled (mypyc) or source.", ("mode",)))
        self.client_disconnects = r.add(Counter(
            "meridian_edge_client_disconnects_total", "Requests the client abandoned."))
