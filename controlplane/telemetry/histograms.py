"""Quantiles from cumulative Prometheus buckets, the way PromQL's histogram_quantile works."""

from __future__ import annotations

import math
from collections.abc import Mapping

from controlplane.telemetry.windows import histogram_growth


def bucket_delta(newer: Mapping[str, float], older: Mapping[str, float]) -> dict[str, float]:
    """Observations that fell in each bucket between two scrapes (counter resets → newer;
    `windows.histogram_growth`)."""
    return histogram_growth([older, newer])


def histogram_quantile(q: float, buckets: Mapping[str, float]) -> float | None:
    """Linear interpolation inside the bucket holding the q-th observation; None if empty."""
    if not 0 <= q <= 1:
        raise ValueError(f"quantile must be within [0, 1], got {q}")
    bounds = sorted(((math.inf if le == "+Inf" else float(le)), count)
                    for le, count in buckets.items())
    if not bounds or bounds[-1][1] <= 0:
        return None
    total = bounds[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for upper, count in bounds:
        if count >= rank:
            if math.isinf(upper):
                return lower_bound  # as PromQL: the highest finite bound
            if count == lower_count:
                return upper
            return lower_bound + (upper - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = upper, count
    return lower_bound
