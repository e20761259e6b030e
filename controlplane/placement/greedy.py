"""The baseline: place each deployment on its own, cheapest first, under the same rules.

This is how a per-task optimiser works (SkyPilot's picks the cheapest resources for one
task at a time): deployments are taken in order, each consumes quota as it goes, and no
decision is revisited. Used by the benchmark to show what planning the fleet at once saves.
"""

from __future__ import annotations

from controlplane.placement.solver import (
    Assignment,
    Candidate,
    PlacementProblem,
    PlacementResult,
    candidates_for,
)


def place_greedy(problem: PlacementProblem) -> PlacementResult:
    left = dict(problem.quota_gpus)
    shapes: dict = {}
    assignments: list[Assignment] = []
    unplaced: list[str] = []
    for d in problem.deployments:
        cands = sorted(candidates_for(d, problem.offers, shapes),
                       key=lambda c: (c.usd_h / c.shape.tokens_per_s, c.usd_h))
        chosen: dict[tuple[int, bool], int] = {}
        counts = {"total": 0, "spot": 0}

        def room(c: Candidate, d=d, counts=counts) -> bool:  # type: ignore[no-untyped-def]
            pool = (c.offer.region, c.offer.gpu.name)
            if left.get(pool, 10**9) < c.gpus:
                return False
            if c.spot and counts["spot"] + 1 > d.max_spot_fraction * (counts["total"] + 1):
                return False
            return counts["total"] < d.max_replicas

        def take(c: Candidate, chosen=chosen, counts=counts) -> None:  # type: ignore[no-untyped-def]
            pool = (c.offer.region, c.offer.gpu.name)
            if pool in left:
                left[pool] -= c.gpus
            chosen[(c.offer.id, c.spot)] = chosen.get((c.offer.id, c.spot), 0) + 1
            counts["total"] += 1
            counts["spot"] += int(c.spot)

        must_run = d.min_replicas > 0 or d.tokens_per_s > 0
        # Spread first: the cheapest option in each of the k cheapest regions.
        regions_used: set[str] = set()
        if must_run:
            for c in cands:
                if len(regions_used) >= d.spread_regions:
                    break
                if c.offer.region not in regions_used and room(c):
                    take(c)
                    regions_used.add(c.offer.region)
        rate = sum(n * next(c.shape.tokens_per_s for c in cands if (c.offer.id, c.spot) == key)
                   for key, n in chosen.items())
        need = d.tokens_per_s * d.headroom
        while counts["total"] < d.min_replicas or rate < need:
            pick = next((c for c in cands if room(c)), None)
            if pick is None:
                break
            take(pick)
            rate += pick.shape.tokens_per_s
        ok = (counts["total"] >= d.min_replicas and rate >= need
              and (not must_run or len(regions_used) >= min(d.spread_regions, counts["total"])))
        if not ok:
            unplaced.append(d.name)
        by_key = {(c.offer.id, c.spot): c for c in cands}
        for (offer_id, spot), n in chosen.items():
            c = by_key[(offer_id, spot)]
            assignments.append(Assignment(d.id, offer_id, spot, n, c.usd_h * n, c.gpus * n))
    status = "infeasible" if unplaced else "feasible"
    return PlacementResult(
        status=status, assignments=assignments,
        cost_after_usd_h=sum(a.usd_h for a in assignments),
        explanation=[f"greedy could not place: {', '.join(unplaced[:10])}"] if unplaced else [],
    )

