"""The placement solver: replicas for the whole fleet as one mixed-integer program (HiGHS),
solved by decomposition.

The model is `milp.py`'s; its inputs and filters are `problem.py`'s, its options
`candidates.py`'s. Deployments meet only in quota pools, so the fleet is solved by
constraint generation: every deployment is first solved alone (pools capped at their quota,
many deployments per HiGHS call as independent blocks, `fleet.py`); wherever the plans
together overrun a pool, the deployments on it are solved jointly, still against the full
quota, and the set grows until the plans fit. Each step solves a relaxation of the fleet
problem, so its bound is a lower bound on every plan. Alongside, a plan that fits is kept:
first the plans alone settled by regret (who loses most by leaving an overrun pool keeps it,
`repair.py`), then each round's joint plans mended the same way and combined with it
(`generation.py`). The
search ends as soon as that plan is within the gap asked for of the bound, and every joint
solve starts from it, so HiGHS begins with an incumbent. Infeasibility is explained in words
(`explain.py`); a result is a whole plan or none (`result.py`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence

from controlplane.placement import explain
from controlplane.placement.fleet import Fleet, solve_alone
from controlplane.placement.generation import ConstraintGeneration, Refusal
from controlplane.placement.milp import build, plans_from, run
from controlplane.placement.problem import PlacementProblem
from controlplane.placement.repair import settle_by_regret
from controlplane.placement.result import PlacementResult, build_result, no_plan


def solve(problem: PlacementProblem) -> PlacementResult:
    """The cheapest plan for every deployment of `problem` under every rule, or none."""
    started = time.perf_counter()
    deadline = started + problem.time_limit_s
    fleet = Fleet.prepare(problem)
    diagnose = _diagnose_runner(fleet, deadline)
    static = explain.precheck(problem, fleet.blocks, fleet.index)
    if static:
        return no_plan(problem, fleet, static, started)

    plans, variables, failed, timed_out = solve_alone(fleet, deadline)
    if failed:
        return no_plan(problem, fleet, explain.infeasible(problem, fleet.blocks, failed,
                                                          diagnose), started)
    if timed_out:
        return no_plan(problem, fleet, [_timeout(problem, len(timed_out))], started)

    floors = {i: max(p.bound, 0.0) for i, p in plans.items()}
    # Dropping quota altogether is a relaxation of the fleet problem, so the optima alone
    # bound every plan from below.
    alone_bound = sum(p.bound for p in plans.values()) + fleet.forced_penalty(plans)
    # The gap asked for is the fleet's. Deployments solved alone are (nearly) exact, so most
    # of it is left for settling quota.
    budget = problem.mip_rel_gap * sum(floors.values())
    budget -= sum(p.objective - p.bound for p in plans.values())
    settled = settle_by_regret(fleet, plans, deadline)
    if settled is not None:
        fitted, extra = settled
        variables += extra
        spent = sum(p.objective for p in fitted.values()) - sum(floors.values())
        if spent <= max(budget, 0.0) + 1e-9:
            return build_result(problem, fleet, fitted, "optimal", alone_bound, variables,
                                len([i for i in fitted if fitted[i] is not plans[i]]), started)

    search = ConstraintGeneration(fleet, plans, floors, alone_bound, budget, deadline,
                                  settled[0] if settled is not None else None, variables)
    found = search.run()
    if isinstance(found, Refusal):
        reasons = (explain.infeasible(problem, fleet.blocks, found.ids, diagnose)
                   if found.infeasible else [_timeout(problem, len(found.ids))])
        return no_plan(problem, fleet, reasons, started)
    best, close = found
    return build_result(problem, fleet, best, "optimal" if close else "feasible",
                        search.fleet_bound(), search.variables, len(search.coupled), started)


def solve_placeable(problem: PlacementProblem) -> PlacementResult:
    """`solve`, except that a deployment no plan can place does not block the others.

    Deployments impossible on their own (the static checks; then, only when the fleet has
    no plan, each one solved alone within quota) are left out with their reasons in
    `unplaced`, their running replicas left alone and the GPUs they hold kept from the
    others; the rest is solved as usual. What remains infeasible (deployments that each fit
    alone but not together) is explained as `solve` explains it."""
    fleet = Fleet.prepare(problem)
    unplaced = {i: "; ".join(text for _, text in found) for i, found in
                explain.precheck_each(problem, fleet.blocks, fleet.index).items()}
    result = _solve_without(problem, fleet, unplaced)
    if not result.has_plan and len(problem.deployments) - len(unplaced) > 1:
        for d in problem.deployments:
            if d.id in unplaced:
                continue
            alone = solve(_without(problem, fleet, {
                other.id for other in problem.deployments if other.id != d.id}))
            if not alone.has_plan:
                unplaced[d.id] = "; ".join(alone.explanation)
        result = _solve_without(problem, fleet, unplaced)
    return dataclasses.replace(result, unplaced=tuple(sorted(unplaced.items())))


def _solve_without(problem: PlacementProblem, fleet: Fleet, unplaced: Mapping[int, str]
                   ) -> PlacementResult:
    if not unplaced:
        return solve(problem)
    if len(unplaced) == len(problem.deployments):
        return no_plan(problem, fleet, list(unplaced.values()), time.perf_counter())
    result = solve(_without(problem, fleet, set(unplaced)))
    if result.has_plan:
        return result
    return dataclasses.replace(result, explanation=(*unplaced.values(), *result.explanation))


def _without(problem: PlacementProblem, fleet: Fleet, ids: set[int]) -> PlacementProblem:
    """`problem` less the deployments `ids`: their running replicas stay where they are and
    keep the quota they hold."""
    offers = {o.id: o for o in problem.offers}
    requests = {d.id: d for d in problem.deployments}
    quota = dict(problem.quota)
    for e in problem.existing:
        o = offers.get(e.offer_id)
        if e.deployment_id not in ids or o is None or o.pool not in quota:
            continue
        shape = fleet.index.shape(requests[e.deployment_id], o)
        nodes = shape.nodes if shape is not None else 1
        quota[o.pool] = max(quota[o.pool] - e.count * nodes * o.gpus_per_node, 0)
    return dataclasses.replace(
        problem, deployments=tuple(d for d in problem.deployments if d.id not in ids),
        existing=tuple(e for e in problem.existing if e.deployment_id not in ids),
        quota_gpus=quota)


def _timeout(problem: PlacementProblem, deployments: int) -> str:
    return (f"no plan found within the {problem.time_limit_s:g} s time limit "
            f"({deployments} deployments unsolved); retry with a longer limit")


def _diagnose_runner(fleet: Fleet, deadline: float) -> explain.Feasibility:
    """What explanations use to test relaxed problems: the plan per deployment and the GPUs
    short per pool, or None when even the relaxed problem has no plan."""
    def diagnose(ids: Sequence[int], relax: frozenset[str]) -> explain.Diagnosis | None:
        blocks = [fleet.blocks[i] for i in ids]
        m = build(blocks, fleet.problem.quota, fleet.problem.move_penalty_usd_h, relax)
        out = run(m, max(deadline - time.perf_counter(), 2.0), 1e-4)
        if out.x is None:
            return None
        plans = {b.d.id: {b.cands[j]: n for j, n in p.counts.items()}
                 for b, p in zip(blocks, plans_from(m, out), strict=True)}
        short = {pool: int(math.ceil(out.x[col] - 1e-6)) for col, pool in m.shortfall_cols
                 if out.x[col] > 1e-6}
        return explain.Diagnosis(plans, short)
    return diagnose

