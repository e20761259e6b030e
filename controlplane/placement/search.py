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
`repair.py`), then each round's joint plans mended the same way and combined with it. The
search ends as soon as that plan is within the gap asked for of the bound, and every joint
solve starts from it, so HiGHS begins with an incumbent. Infeasibility is explained in words
(`explain.py`); a result is a whole plan or none (`result.py`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence

from controlplane.placement import explain
from controlplane.placement.fleet import DeploymentPlan, Fleet, keep_plans, solve_alone, usage
from controlplane.placement.milp import Block, Outcome, build, plans_from, run
from controlplane.placement.problem import PlacementProblem, Pool
from controlplane.placement.repair import settle_by_regret
from controlplane.placement.result import PlacementResult, build_result, no_plan


def solve(problem: PlacementProblem) -> PlacementResult:
    """The cheapest plan for every deployment of `problem` under every rule, or none."""
    started = time.perf_counter()
    deadline = started + problem.time_limit_s
    fleet = Fleet.prepare(problem)
    quota = problem.quota
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

    # Constraint generation: quota rows only for pools that some plan overran, joint solves
    # only for the deployments whose plans did. Each round solves a relaxation of the fleet
    # problem (rows and couplings left out), so its bound holds for every plan. The plans of
    # a round that still overrun a pool are mended by regret into a plan that fits, which
    # ends the search as soon as it is within the gap of that bound, and each joint solve
    # starts from the best plan that fits so far.
    alone = {i: p.bound for i, p in plans.items()}
    best = settled[0] if settled is not None else None
    contested: set[Pool] = set()
    coupled: set[int] = set()
    joint: dict[tuple[frozenset[int], frozenset[Pool]], Outcome] = {}

    def fleet_bound() -> float:
        solved = {i for part in joint for i in part[0]}
        found = sum(b for i, b in alone.items() if i not in solved)
        found += sum(o.bound for o in joint.values()) + fleet.forced_penalty(plans)
        return max(found, alone_bound)

    def objective(these: Mapping[int, DeploymentPlan] | None) -> float:
        if these is None:
            return math.inf
        return sum(p.objective for p in these.values()) + fleet.forced_penalty(these)

    rounds = 0
    close = False
    while True:
        used = usage(fleet, plans)
        over = {pool for pool, n in used.items() if n > quota.get(pool, math.inf)}
        if joint:
            mended: Mapping[int, DeploymentPlan] | None = dict(plans)
            if over:
                again = settle_by_regret(fleet, plans, deadline, best)
                mended = again[0] if again is not None else None
                variables += again[1] if again is not None else 0
            if objective(mended) < objective(best):
                best = dict(mended)  # type: ignore[arg-type]
            bound = fleet_bound()
            close = objective(best) - bound <= problem.mip_rel_gap * bound + 1e-9
            if close:
                break
        if over:
            contested |= over
            coupled |= {i for i, p in plans.items()
                        if any(fleet.blocks[i].cands[j].pool in over for j in p.counts)}
        elif rounds > 0:
            break
        rounds = rounds + 1 if not over else 0  # one tightening round once the plans fit
        parts = _components(fleet, coupled, contested)
        coupled_floor = sum(floors[i] for i in coupled) or 1.0
        joint = {part: joint[part] for part in parts if part in joint}
        for part in _worst_first(parts, joint, over):
            share = max(budget, 0.0) * sum(floors[i] for i in part[0]) / coupled_floor
            if part in joint and joint[part].objective - joint[part].bound <= share + 1e-9:
                continue
            out = _solve_part(fleet, part, floors, share, deadline, best)
            variables += out.columns
            if out.status == "infeasible":
                return no_plan(problem, fleet, explain.infeasible(
                    problem, fleet.blocks, sorted(part[0]), diagnose), started)
            if out.x is None:
                if part in joint:  # the earlier plan for this part still stands
                    continue
                return no_plan(problem, fleet, [_timeout(problem, len(part[0]))], started)
            joint[part] = out
            keep_plans(plans, fleet.blocks, out.model, out)  # type: ignore[arg-type]

    assert best is not None  # the loop ends on a plan that fits
    return build_result(problem, fleet, best, "optimal" if close else "feasible", fleet_bound(),
                        variables, len(coupled), started)


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


def _worst_first(parts: list[tuple[frozenset[int], frozenset[Pool]]],
                 joint: Mapping[tuple[frozenset[int], frozenset[Pool]], Outcome],
                 over: set[Pool]) -> list[tuple[frozenset[int], frozenset[Pool]]]:
    """New parts first (they overrun quota), then the loosest solved ones."""
    return sorted(parts, key=lambda part: (part in joint, -(
        joint[part].objective - joint[part].bound) if part in joint else 0.0))


def _solve_part(fleet: Fleet, part: tuple[frozenset[int], frozenset[Pool]],
                floors: Mapping[int, float], abs_gap: float, deadline: float,
                start: Mapping[int, DeploymentPlan] | None = None) -> Outcome:
    """Deployments that contend for the quota of `part`'s pools, solved together; from
    `start`'s plans when given (they must fit every quota)."""
    problem = fleet.problem
    ids, pools = sorted(part[0]), part[1]
    blocks = []
    for i in ids:
        b = fleet.blocks[i]
        cands = fleet.index.undominated(b.d, b.cands, pools, b.running)
        given = None
        if start is not None and i in start:
            # The plan's options join the pruned ones: more options keep a relaxation.
            position = {id(c): j for j, c in enumerate(cands)}
            extra = [b.cands[j] for j in start[i].counts if id(b.cands[j]) not in position]
            cands = cands + extra
            position = {id(c): j for j, c in enumerate(cands)}
            given = {position[id(b.cands[j])]: n for j, n in start[i].counts.items()}
        blocks.append(Block(b.d, cands, b.running, floor=floors[i], start=given))
    m = build(blocks, {pool: problem.quota[pool] for pool in pools},
              problem.move_penalty_usd_h)
    out = run(m, deadline - time.perf_counter(), problem.mip_rel_gap, abs_gap=abs_gap)
    out.model = m
    out.columns = m.columns
    return out


def _timeout(problem: PlacementProblem, deployments: int) -> str:
    return (f"no plan found within the {problem.time_limit_s:g} s time limit "
            f"({deployments} deployments unsolved); retry with a longer limit")


def _components(fleet: Fleet, ids: set[int], contested: set[Pool]
                ) -> list[tuple[frozenset[int], frozenset[Pool]]]:
    """Split deployments into groups that share no contested pool: each group with the
    contested pools its options reach."""
    parent = {i: i for i in ids}

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[Pool, int] = {}
    for i in ids:
        for c in fleet.blocks[i].cands:
            if c.pool not in contested:
                continue
            if c.pool not in first:
                first[c.pool] = i
                continue
            a, b = find(first[c.pool]), find(i)
            if a != b:
                parent[b] = a
    members: dict[int, set[int]] = defaultdict(set)
    for i in ids:
        members[find(i)].add(i)
    pools: dict[int, set[Pool]] = defaultdict(set)
    for pool, i in first.items():
        pools[find(i)].add(pool)
    return [(frozenset(group), frozenset(pools[root])) for root, group in members.items()]


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

