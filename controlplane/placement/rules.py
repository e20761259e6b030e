"""Which of its placement rules a deployment breaks now, in words: one pure function
(`violations`) that the API and the dashboard show (`rule_violations`), the alert rule
raises and the periodic replan repairs; and the loader that feeds it (`rule_violations`).

The rules:

- spread: its serving replicas span fewer regions than `spread_regions` asks
  ("spread_regions 3, serving in 1 region (aws:eu-central-1)");
- residency: a replica serves in a region outside the jurisdictions it allows;
- latency: a replica serves farther from its users (`user_regions`) than the network share
  of its TTFT SLO allows (the same budget the solver places within).

A deployment with no replica breaks none: scaled to zero is not squeezed into one region.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from controlplane.deployments.lifecycle import SERVING_STATES, STAYING_STATES
from controlplane.deployments.models import Deployment, Replica
from controlplane.placement.problem import NETWORK_SHARE_OF_TTFT
from regions.geo import great_circle_km, rtt_ms

SPREAD, RESIDENCY, LATENCY = "spread", "residency", "latency"


@dataclass(frozen=True)
class Placed:
    """Where one replica runs."""

    pk: int
    name: str  # r-7
    region: str  # cloud:code
    jurisdiction: str  # its code
    latitude: float
    longitude: float


@dataclass(frozen=True)
class Rules:
    """A deployment's placement rules."""

    spread_regions: int
    jurisdictions: frozenset[str]
    users: tuple[tuple[float, float], ...] = ()  # (latitude, longitude) of its user regions
    network_budget_ms: float = 0.0  # the round trip its users may wait, at most

    @classmethod
    def of(cls, deployment: Deployment) -> Rules:
        """From a deployment whose jurisdictions and user regions are loaded."""
        return cls(deployment.spread_regions,
                   frozenset(j.code for j in deployment.allowed_jurisdictions.all()),
                   tuple((r.latitude, r.longitude) for r in deployment.user_regions.all()),
                   deployment.slo_ttft_p95_ms * NETWORK_SHARE_OF_TTFT)


@dataclass(frozen=True)
class Violation:
    kind: str  # spread | residency | latency
    text: str
    replicas: tuple[int, ...]  # the replicas concerned (for spread: all of them)

    def __str__(self) -> str:
        return self.text


def violations(rules: Rules, replicas: Sequence[Placed]) -> list[Violation]:
    """Every rule `replicas` break, in words, spread first. Pure."""
    out: list[Violation] = []
    regions = sorted({r.region for r in replicas})
    if replicas and len(regions) < rules.spread_regions:
        out.append(Violation(
            SPREAD, f"spread_regions {rules.spread_regions}, serving in {len(regions)} "
            f"region{'s' if len(regions) != 1 else ''} ({', '.join(regions)})",
            tuple(r.pk for r in replicas)))
    for r in sorted(replicas, key=lambda r: r.pk):
        if r.jurisdiction not in rules.jurisdictions:
            out.append(Violation(
                RESIDENCY, f"{r.name} serves in {r.region} ({r.jurisdiction}), outside the "
                f"allowed jurisdictions ({', '.join(sorted(rules.jurisdictions)) or 'none'})",
                (r.pk,)))
        if rules.users:
            worst = max(rtt_ms(great_circle_km(lat, lon, r.latitude, r.longitude))
                        for lat, lon in rules.users)
            if worst > rules.network_budget_ms:
                out.append(Violation(
                    LATENCY, f"{r.name} serves in {r.region}, {worst:.0f} ms round trip from "
                    f"its farthest users, over the {rules.network_budget_ms:.0f} ms its TTFT "
                    f"SLO leaves the network", (r.pk,)))
    return out


def placed(replica: Replica) -> Placed:
    region = replica.region
    return Placed(replica.pk, replica.public_id, region.key, region.jurisdiction.code,
                  region.latitude, region.longitude)


def replicas_by_deployment(deployment_ids: Iterable[int], *, serving: bool = True
                           ) -> dict[int, list[Placed]]:
    """The deployments' replicas as the rules see them: serving ones (what users get now),
    or with `serving` false every live one that is not draining (what the fleet is
    becoming: the replan's view, launches included)."""
    rows = Replica.objects.filter(deployment_id__in=list(deployment_ids))
    rows = (rows.filter(state__in=SERVING_STATES) if serving
            else rows.filter(state__in=STAYING_STATES))
    out: dict[int, list[Placed]] = defaultdict(list)
    for r in rows.select_related("region__cloud", "region__jurisdiction").order_by("id"):
        out[r.deployment_id].append(placed(r))
    return out


def rule_violations(deployments: Sequence[Deployment]) -> dict[int, list[Violation]]:
    """What each deployment breaks now, by its serving replicas: {deployment id: violations}
    (an empty list for one that breaks none). Two queries beside the deployments' own
    prefetches (`allowed_jurisdictions`, `user_regions`)."""
    by = replicas_by_deployment(d.pk for d in deployments)
    return {d.pk: violations(Rules.of(d), by.get(d.pk, [])) for d in deployments}
