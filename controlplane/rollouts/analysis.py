"""A step's analysis: the canary revision against the stable one over the step's window,
from the engines' own TTFT histograms (telemetry's replica samples), summed over each
revision's replicas.

The verdict is `fail` when the canary's TTFT p95 is over `TTFT_RATIO` × the stable's,
`pass` when within, and `no_data` when either side served nothing measurable in the window
(then nothing is decided). The 5xx rate is not judged: neither the edges' request counters
nor the engines' are labelled by revision yet.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from controlplane.telemetry.histograms import bucket_delta, histogram_quantile
from controlplane.telemetry.models import ReplicaSample

TTFT_RATIO = 1.2


@dataclass(frozen=True)
class RevisionFigures:
    replicas: int  # replicas with samples in the window
    requests: float  # requests the engines finished in the window
    ttft_p95_s: float | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def figures(replica_ids: Iterable[int], since: datetime, until: datetime) -> RevisionFigures:
    """TTFT p95 and finished requests over [since, until] across these replicas: each
    replica's newest sample up to `until` against its newest at or before `since` (or, for a
    replica that started inside the window, its first sample in it)."""
    summed: dict[str, float] = {}
    requests = 0.0
    measured = 0
    for replica_id in replica_ids:
        rows = ReplicaSample.objects.filter(replica_id=replica_id, up=True, at__lte=until)
        newer = rows.order_by("-at").first()
        older = (rows.filter(at__lte=since).order_by("-at").first()
                 or rows.filter(at__gt=since).order_by("at").first())
        if newer is None or older is None or newer.pk == older.pk:
            continue
        measured += 1
        delta = bucket_delta(newer.buckets.get("ttft", {}), older.buckets.get("ttft", {}))
        for le, count in delta.items():
            summed[le] = summed.get(le, 0.0) + count
        done = newer.counters.get("requests_ok", 0.0) - older.counters.get("requests_ok", 0.0)
        requests += done if done >= 0 else newer.counters.get("requests_ok", 0.0)
    return RevisionFigures(replicas=measured, requests=requests,
                           ttft_p95_s=histogram_quantile(0.95, summed) if summed else None)


def judge(canary: RevisionFigures, stable: RevisionFigures,
          ratio: float = TTFT_RATIO) -> tuple[str, str]:
    """(verdict, why): pass, fail or no_data."""
    if canary.ttft_p95_s is None or stable.ttft_p95_s is None:
        side = "canary" if canary.ttft_p95_s is None else "stable revision"
        return "no_data", f"the {side} has no TTFT measured in the step's window"
    limit = ratio * stable.ttft_p95_s
    if canary.ttft_p95_s > limit:
        return "fail", (f"canary TTFT p95 {canary.ttft_p95_s:.3f} s is over {ratio}× the "
                        f"stable revision's {stable.ttft_p95_s:.3f} s")
    return "pass", (f"canary TTFT p95 {canary.ttft_p95_s:.3f} s is within {ratio}× the "
                    f"stable revision's {stable.ttft_p95_s:.3f} s")
