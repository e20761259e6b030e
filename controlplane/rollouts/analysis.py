"""A step's analysis: the canary revision against the stable one over the step's window,
from what the edges counted by revision (`EdgeSample.revisions`: requests by status, TTFT
and ITL buckets, as clients saw them), summed over the edges.

`judge` is pure: `no_data` while either side has served fewer than `min_requests` in the
window; otherwise `fail` when any check fails — relative to the stable revision (TTFT p95 and
ITL p95 at most a ratio of the stable's, the 5xx rate at most the stable's plus some points)
or absolute (the SLO: a TTFT p95 and a 5xx rate the canary may not exceed) — else `pass`.
A latency check is skipped when either side has no observation of it (no streams: no ITL).
At a 100% step the stable revision serves nothing new: only the absolute checks apply.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from django.db.models import Q

from controlplane.telemetry.edge_metrics import counter_delta, is_error_status
from controlplane.telemetry.histograms import bucket_delta, histogram_quantile
from controlplane.telemetry.models import EdgeSample
from regions.models import Region

# Every threshold a rollout is judged by, with its default and its bounds. The absolute
# TTFT limit defaults to the deployment's SLO (`defaults_for`).
DEFAULT_THRESHOLDS: dict[str, float] = {
    "ttft_ratio": 1.2,  # canary TTFT p95 ≤ this × the stable's
    "itl_ratio": 1.2,  # canary ITL p95 ≤ this × the stable's
    "error_points": 1.0,  # canary 5xx rate ≤ the stable's + this many percentage points
    "max_ttft_p95_s": 1.0,  # canary TTFT p95 ≤ this (the SLO)
    "max_error_rate": 0.05,  # canary 5xx share ≤ this
    "min_requests": 20,  # per side in the window, else the step is extended
    "max_extensions": 3,  # extensions before a step without enough traffic is held
}
BOUNDS: dict[str, tuple[float, float, bool]] = {  # (low, high, whole number)
    "ttft_ratio": (1.0, 100.0, False),
    "itl_ratio": (1.0, 100.0, False),
    "error_points": (0.0, 100.0, False),
    "max_ttft_p95_s": (0.001, 3600.0, False),
    "max_error_rate": (0.0, 1.0, False),
    "min_requests": (1, 1_000_000, True),
    "max_extensions": (0, 100, True),
}


class ThresholdError(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_thresholds(given: object, defaults: Mapping[str, float]) -> dict[str, float]:
    """The defaults with the given overrides, each checked against its bounds."""
    if given is None:
        given = {}
    if not isinstance(given, dict):
        raise ThresholdError("thresholds", "thresholds must be an object of named limits, "
                                           f"not {given!r}")
    merged = dict(defaults)
    for name, value in given.items():
        field = f"thresholds.{name}"
        if name not in BOUNDS:
            raise ThresholdError(field, f"unknown threshold {name!r}; known: "
                                        f"{', '.join(sorted(BOUNDS))}")
        low, high, whole = BOUNDS[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (
                whole and not isinstance(value, int)):
            kind = "a whole number" if whole else "a number"
            raise ThresholdError(field, f"{name} must be {kind}, not {value!r}")
        if not low <= value <= high:
            raise ThresholdError(field, f"{name} must be within [{low:g}, {high:g}], "
                                        f"not {value!r}")
        merged[name] = value
    return merged


def defaults_for(slo_ttft_p95_ms: int) -> dict[str, float]:
    return {**DEFAULT_THRESHOLDS, "max_ttft_p95_s": slo_ttft_p95_ms / 1000.0}


@dataclass(frozen=True)
class RevisionFigures:
    edges: int  # edges that counted this revision in the window
    requests: float  # requests answered (any status) in the window
    errors: float  # of which 5xx
    ttft_p95_s: float | None
    itl_p95_s: float | None

    @property
    def error_rate(self) -> float | None:
        return self.errors / self.requests if self.requests else None

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "error_rate": self.error_rate}


EMPTY = RevisionFigures(edges=0, requests=0.0, errors=0.0, ttft_p95_s=None, itl_p95_s=None)


def fold(pairs: Iterable[tuple[Mapping[str, Any], Mapping[str, Any]]]) -> RevisionFigures:
    """One revision's figures from (newer, older) pairs of an edge's revision series."""
    edges, requests, errors = 0, 0.0, 0.0
    ttft: dict[str, float] = {}
    itl: dict[str, float] = {}
    for newer, older in pairs:
        grown = counter_delta(newer.get("requests", {}), older.get("requests", {}))
        if not grown:
            continue
        edges += 1
        requests += sum(grown.values())
        errors += sum(n for status, n in grown.items() if is_error_status(status))
        for name, summed in (("ttft", ttft), ("itl", itl)):
            delta = bucket_delta(newer.get(name, {}), older.get(name, {}))
            for le, count in delta.items():
                summed[le] = summed.get(le, 0.0) + count
    return RevisionFigures(edges=edges, requests=requests, errors=errors,
                           ttft_p95_s=histogram_quantile(0.95, ttft) if ttft else None,
                           itl_p95_s=histogram_quantile(0.95, itl) if itl else None)


def figures(revisions: Iterable[int], since: datetime, until: datetime,
            edge_regions: Iterable[str] | None = None) -> dict[int, RevisionFigures]:
    """Each revision's figures over [since, until] across the edges (those in
    `edge_regions`, `cloud:code` keys, when given): per edge its newest sample up to `until`
    against its newest at or before `since` (an edge first scraped inside the window: its
    first sample in it)."""
    wanted = [str(r) for r in revisions]
    rows = EdgeSample.objects.filter(up=True, at__lte=until).order_by("edge_id")
    if edge_regions is not None:
        where = Q(pk__in=[])
        for key in edge_regions:
            where |= Q(**Region.key_filter(key, prefix="edge__region__"))
        rows = rows.filter(where)
    newer = dict(rows.order_by("edge_id", "-at").distinct("edge_id")
                 .values_list("edge_id", "revisions"))
    older = dict(rows.filter(at__lte=since).order_by("edge_id", "-at").distinct("edge_id")
                 .values_list("edge_id", "revisions"))
    missing = [edge for edge in newer if edge not in older]
    if missing:
        older.update(rows.filter(edge_id__in=missing, at__gt=since)
                     .order_by("edge_id", "at").distinct("edge_id")
                     .values_list("edge_id", "revisions"))
    out = {}
    for revision in wanted:
        out[int(revision)] = fold(
            (newer[edge].get(revision, {}), older.get(edge, {}).get(revision, {}))
            for edge in newer)
    return out


@dataclass(frozen=True)
class Check:
    name: str
    value: float
    limit: float
    passed: bool
    says: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def checks(canary: RevisionFigures, stable: RevisionFigures | None,
           limits: Mapping[str, float]) -> list[Check]:
    """Every check that both sides have figures for (no stable side: the absolute ones)."""
    out: list[Check] = []
    stable = stable or EMPTY
    canary_rate, stable_rate = canary.error_rate, stable.error_rate
    if canary_rate is not None and stable_rate is not None:
        limit = stable_rate + limits["error_points"] / 100.0
        out.append(Check("error_rate_vs_stable", canary_rate, limit, canary_rate <= limit,
                         f"canary 5xx rate {canary_rate:.1%} against the stable revision's "
                         f"{stable_rate:.1%} + {limits['error_points']:g} points"))
    if canary_rate is not None:
        limit = limits["max_error_rate"]
        out.append(Check("error_rate_slo", canary_rate, limit, canary_rate <= limit,
                         f"canary 5xx rate {canary_rate:.1%} against the {limit:.1%} limit"))
    for name, c, s, ratio in (("ttft", canary.ttft_p95_s, stable.ttft_p95_s, "ttft_ratio"),
                              ("itl", canary.itl_p95_s, stable.itl_p95_s, "itl_ratio")):
        if c is None or s is None:
            continue
        limit = limits[ratio] * s
        out.append(Check(f"{name}_vs_stable", c, limit, c <= limit,
                         f"canary {name.upper()} p95 {c:.3f} s against {limits[ratio]:g}× "
                         f"the stable revision's {s:.3f} s"))
    if canary.ttft_p95_s is not None:
        limit = limits["max_ttft_p95_s"]
        out.append(Check("ttft_slo", canary.ttft_p95_s, limit, canary.ttft_p95_s <= limit,
                         f"canary TTFT p95 {canary.ttft_p95_s:.3f} s against the "
                         f"{limit:g} s SLO"))
    return out


def judge(canary: RevisionFigures, stable: RevisionFigures | None,
          limits: Mapping[str, float]) -> tuple[str, str, list[Check]]:
    """(verdict, why, the checks): pass, fail or no_data. `stable` None: nothing to compare
    with (the canary has all the traffic)."""
    needed = limits["min_requests"]
    sides = [("canary", canary)] + ([("stable revision", stable)] if stable else [])
    for side, got in sides:
        if got.requests < needed:
            return "no_data", (f"the {side} served {got.requests:.0f} requests in the "
                               f"window, under the minimum of {needed:g}"), []
    done = checks(canary, stable, limits)
    failed = [c for c in done if not c.passed]
    if failed:
        return "fail", "; ".join(f"{c.says}: over" for c in failed), done
    return "pass", "; ".join(f"{c.says}: within" for c in done), done
