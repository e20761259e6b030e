"""Says, in words an operator can act on, why no plan exists. Pure.

`precheck` catches what makes one deployment impossible on its own (no allowed offer, too
few regions for its spread, not enough quota in its allowed pools); `explain_infeasible`
looks for quota that deployments fit alone but not together.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from controlplane.placement.solver import Candidate, DeploymentRequest, PlacementProblem


def _min_gpus(d: DeploymentRequest, cands: list[Candidate]) -> tuple[int, str]:
    """The fewest GPUs that meet the demand and minimum on the cheapest-in-GPUs option."""
    best = None
    for c in cands:
        replicas = max(d.min_replicas, math.ceil(d.tokens_per_s * d.headroom / c.shape.tokens_per_s)
                       if d.tokens_per_s > 0 else 0, 1 if d.min_replicas else 0)
        gpus = replicas * c.gpus
        if best is None or gpus < best[0]:
            best = (gpus, c.offer.gpu.name)
    return best or (0, "")


def precheck(problem: PlacementProblem, cands: list[Candidate]) -> list[str]:
    by_dep: dict[int, list[Candidate]] = defaultdict(list)
    for c in cands:
        by_dep[c.deployment.id].append(c)
    reasons = []
    for d in problem.deployments:
        mine = by_dep.get(d.id, [])
        where = ", ".join(sorted(d.allowed_jurisdictions)) or "no jurisdiction"
        if d.min_replicas > d.max_replicas:
            reasons.append(f"{d.name}: min_replicas {d.min_replicas} exceeds max_replicas "
                           f"{d.max_replicas}")
            continue
        if not mine:
            if d.min_replicas > 0 or d.tokens_per_s > 0:
                reasons.append(
                    f"{d.name}: no offer in {where} fits {d.model.name} at {d.context:,} tokens of "
                    f"context within {d.ttft_slo_ms / 2:.0f} ms round trip of its users")
            continue
        if d.min_replicas == 0 and d.tokens_per_s <= 0:
            continue  # may scale to zero: nothing to place, nothing to spread
        regions = {c.offer.region for c in mine}
        if len(regions) < d.spread_regions:
            reasons.append(f"{d.name}: needs {d.spread_regions} regions but only {len(regions)} "
                           f"in {where} have a fitting offer ({', '.join(sorted(regions))})")
        clouds = {c.offer.cloud for c in mine}
        if len(clouds) < d.spread_clouds:
            reasons.append(f"{d.name}: needs {d.spread_clouds} clouds but only {len(clouds)} "
                           f"qualify ({', '.join(sorted(clouds))})")
        if d.spread_regions > d.max_replicas:
            reasons.append(f"{d.name}: spread over {d.spread_regions} regions needs more than "
                           f"max_replicas {d.max_replicas}")
        best_rate = max(c.shape.tokens_per_s for c in mine)
        if d.tokens_per_s * d.headroom > best_rate * d.max_replicas:
            reasons.append(
                f"{d.name}: {d.tokens_per_s * d.headroom:,.0f} tok/s (with headroom) needs more than "
                f"max_replicas {d.max_replicas} × {best_rate:,.0f} tok/s of the fastest allowed offer")
        needed, gpu = _min_gpus(d, mine)
        pools = {(c.offer.region, c.offer.gpu.name) for c in mine}
        available = sum(problem.quota_gpus.get(p, 10**9) for p in pools)
        if needed > available:
            reasons.append(f"{where} has {available} GPUs left under quota across the offers "
                           f"{d.name} may use; it needs at least {needed} {gpu}")
    return reasons


def explain_infeasible(problem: PlacementProblem, cands: list[Candidate]) -> list[str]:
    """Deployments that fit alone but not together: name the shared quota that binds."""
    needs: dict[tuple[str, ...], list[tuple[str, int, str]]] = defaultdict(list)
    pools_of: dict[tuple[str, ...], set[tuple[str, str]]] = defaultdict(set)
    by_dep: dict[int, list[Candidate]] = defaultdict(list)
    for c in cands:
        by_dep[c.deployment.id].append(c)
    for d in problem.deployments:
        key = tuple(sorted(d.allowed_jurisdictions))
        needed, gpu = _min_gpus(d, by_dep.get(d.id, []))
        needs[key].append((d.name, needed, gpu))
        pools_of[key] |= {(c.offer.region, c.offer.gpu.name) for c in by_dep.get(d.id, [])}
    reasons = []
    for key, entries in needs.items():
        available = sum(problem.quota_gpus.get(p, 10**9) for p in pools_of[key])
        total = sum(n for _, n, _ in entries)
        if total > available:
            gpus = ", ".join(sorted({g for _, _, g in entries if g}))
            names = ", ".join(name for name, _, _ in entries)
            reasons.append(f"{'/'.join(key)} has {available} GPUs ({gpus}) left under quota; "
                           f"deployments {names} need at least {total} together")
    return reasons or ["no plan satisfies every deployment's spread, spot and quota rules "
                       "together; relax one deployment's spread or max_spot_fraction, or raise "
                       "quota"]
