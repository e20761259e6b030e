"""The baseline: each deployment placed on its own, cheapest first, under the same rules.

This is how a per-task optimiser works (SkyPilot's picks the cheapest resources for one
task at a time): deployments are taken in order, each takes quota as it goes, and no
decision is revisited. Per deployment it first buys the cheapest option in each region (and
cloud) its spread needs, then fills demand and the minimum, each time with the option that
costs least per token of the demand still open (a replica larger than what is open counts
only for what it covers).
The benchmark compares the solver's plans with these.
"""

from __future__ import annotations

import time
from collections import Counter

from controlplane.placement.candidates import Candidate, CandidateIndex
from controlplane.placement.problem import DeploymentRequest, PlacementProblem, Pool
from controlplane.placement.result import Assignment, PlacementResult


def place_greedy(problem: PlacementProblem) -> PlacementResult:
    """The baseline's plan for the fleet. When a deployment cannot be placed the status is
    infeasible and the assignments are those of the deployments it did place.

    Running replicas are ignored: the baseline plans from scratch."""
    started = time.perf_counter()
    index = CandidateIndex(problem.offers, problem.profile)
    left = dict(problem.quota)
    assignments: list[Assignment] = []
    unplaced: list[str] = []
    for d in problem.deployments:
        if not d.must_run:
            continue
        counts = place_one(d, index.options(d), left)
        if counts is None:
            unplaced.append(d.name)
            continue
        for c, n in sorted(counts.items(), key=lambda kv: (kv[0].offer.id, kv[0].spot)):
            assignments.append(Assignment(
                d.id, c.offer.id, c.spot, n, c.usd_h * n, c.gpus * n, c.offer.region,
                c.offer.gpu.name, c.shape.tensor_parallel, c.shape.pipeline_parallel,
                c.shape.nodes))
    cost = sum(a.usd_h for a in assignments)
    if unplaced:
        # No plan for the fleet; what it placed is kept so that the benchmark can compare
        # costs over the deployments the baseline did place.
        shown = ", ".join(unplaced[:10]) + (" …" if len(unplaced) > 10 else "")
        return PlacementResult(
            status="infeasible", assignments=tuple(assignments), cost_after_usd_h=cost,
            solve_s=time.perf_counter() - started,
            explanation=(f"placing deployments one at a time left {len(unplaced)} without a "
                         f"plan: {shown}",))
    return PlacementResult(status="feasible", assignments=tuple(assignments),
                           cost_after_usd_h=cost, objective_usd_h=cost,
                           solve_s=time.perf_counter() - started)


def place_one(d: DeploymentRequest, options: list[Candidate], left: dict[Pool, int]
              ) -> Counter[Candidate] | None:
    """Replicas per option for `d`, taking GPUs from `left` (None: the rules cannot be met;
    what was taken is given back)."""
    cands = sorted(options, key=lambda c: (c.usd_per_mtok, c.usd_h, c.offer.id))
    counts: Counter[Candidate] = Counter()

    def room(c: Candidate) -> bool:
        total = sum(counts.values())
        if total >= d.max_replicas or left.get(c.pool, c.gpus) < c.gpus:
            return False
        spot = sum(n for a, n in counts.items() if a.spot)
        return not c.spot or spot + 1 <= d.max_spot_fraction * (total + 1) + 1e-9

    def take(c: Candidate) -> None:
        counts[c] += 1
        if c.pool in left:
            left[c.pool] -= c.gpus

    need = d.required_tokens_per_s

    def price(c: Candidate, remaining: float) -> float:
        # Dollars per token of demand the replica would actually serve: a big replica for
        # a small remainder is no bargain.
        return c.usd_h / min(c.rate, remaining) if remaining > 0 else c.usd_h

    spread = max(d.spread_regions, d.spread_clouds, 1)
    for attr, k in (("region", d.spread_regions), ("cloud", d.spread_clouds)):
        while len({getattr(a.offer, attr) for a in counts}) < k:
            have = {getattr(a.offer, attr) for a in counts}
            fresh = [c for c in cands if getattr(c.offer, attr) not in have and room(c)]
            if not fresh:
                break
            take(min(fresh, key=lambda c: (price(c, need / spread), c.usd_h)))
    while True:
        rate = sum(c.rate * n for c, n in counts.items())
        if sum(counts.values()) >= d.min_replicas and rate >= need:
            break
        open_ = [c for c in cands if room(c)]
        if not open_:
            break
        take(min(open_, key=lambda c: (price(c, need - rate), c.usd_h)))
    rate = sum(c.rate * n for c, n in counts.items())
    if (sum(counts.values()) >= d.min_replicas and rate >= need
            and len({c.offer.region for c in counts}) >= d.spread_regions
            and len({c.offer.cloud for c in counts}) >= d.spread_clouds):
        return counts
    for c, n in counts.items():
        if c.pool in left:
            left[c.pool] += c.gpus * n
    return None
