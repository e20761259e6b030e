"""Plans that fit every quota, mended from plans that overrun some: settling by regret."""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Collection, Mapping

import numpy as np
from scipy.sparse import csc_matrix

from controlplane.placement.candidates import prune_dominated
from controlplane.placement.fleet import (
    ALONE_GAP,
    DeploymentPlan,
    Fleet,
    keep_plans,
    plan_usage,
    solve_each,
    usage,
)
from controlplane.placement.milp import Block, Milp, Rows, build, run
from controlplane.placement.problem import Pool


def settle_by_regret(fleet: Fleet, plans: Mapping[int, DeploymentPlan], deadline: float,
                     known: Mapping[int, DeploymentPlan] | None = None
                     ) -> tuple[dict[int, DeploymentPlan], int] | None:
    """Plans that fit every quota, from `plans` (alone or joint): where they overrun a
    pool, the deployments that would lose most by leaving it keep it, and the others are
    solved again, one at a time, against the quota left. With `known` (plans that fit),
    every deployment may also take its part of those. None when one cannot be placed so.

    Fast, and close to optimal when many deployments share a pool: what it gives up is
    bounded by the gap to the optima alone, which the caller checks."""
    problem = fleet.problem
    quota = problem.quota
    used = usage(fleet, plans)
    over = frozenset(pool for pool, n in used.items() if n > quota.get(pool, math.inf))
    if not over:
        return dict(plans), 0
    affected = [i for i, p in plans.items()
                if any(fleet.blocks[i].cands[j].pool in over for j in p.counts)]
    found = _plans_elsewhere(fleet, affected, over, deadline)
    if found is None:
        return None
    elsewhere, columns = found
    regret = {i: (elsewhere[i].objective - plans[i].objective) if i in elsewhere else math.inf
              for i in affected}
    left = _left_beside(quota, fleet, plans, set(affected))
    # Quota is counted in GPUs, so those that lose most per contested GPU go first.
    density = {i: regret[i] / max(sum(n for pool, n in plan_usage(fleet, i, plans[i]).items()
                                      if pool in over), 1) for i in affected}
    base = dict(left)
    fitted = dict(plans)
    spent = _fit_in_turn(fleet, fitted, sorted(affected, key=lambda i: (-density[i], i)), left,
                         deadline)
    if spent is None:
        return None
    columns += spent
    # The order above is a guess. Choose again, for every affected deployment at once,
    # between its plan alone, its plan off the overrun pools and its plan from the fitting:
    # a small 0-1 program whose answer is never worse than the fitting.
    options = {i: [plans[i], fitted[i]] + ([elsewhere[i]] if i in elsewhere else [])
               for i in affected}
    if known is not None:
        # A plan known to fit (an earlier answer): each deployment may go back to its part
        # of it, which combines the best of both.
        for i, p in known.items():
            if p.counts != plans[i].counts:
                options.setdefault(i, [plans[i]]).append(p)
        base = _left_beside(quota, fleet, plans, options.keys())
    chosen, extra = _choose_plans(fleet, options, base, deadline)
    columns += extra
    if chosen is not None:
        fitted.update(chosen)
    return fitted, columns


def _plans_elsewhere(fleet: Fleet, affected: list[int], over: frozenset[Pool],
                     deadline: float) -> tuple[dict[int, DeploymentPlan], int] | None:
    """Each affected deployment's plan kept off the overrun pools (absent where it has
    none), and the columns spent; None when the solves ran out of time.

    Options on the overrun pools cannot dominate others (pruned with them contested), then
    they are dropped."""
    away = []
    for i in affected:
        b = fleet.blocks[i]
        kept = fleet.index.undominated(b.d, b.cands, over, b.running)
        away.append(Block(b.d, [c for c in kept if c.pool not in over], b.running))
    elsewhere, _failed, timed_out, columns = solve_each(fleet, away, deadline)
    if timed_out:
        return None
    return elsewhere, columns


def _fit_in_turn(fleet: Fleet, fitted: dict[int, DeploymentPlan], order: list[int],
                 left: dict[Pool, int], deadline: float) -> int | None:
    """Each deployment in `order` keeps its plan where it still fits in `left`, else is
    solved again against what is left; `fitted` and `left` are updated in place. The
    columns spent, or None when one cannot be placed."""
    columns = 0
    for i in order:
        need = plan_usage(fleet, i, fitted[i])
        if any(left.get(pool, math.inf) < n for pool, n in need.items()):
            b = fleet.blocks[i]
            tight = {c.pool for c in b.cands
                     if left.get(c.pool, math.inf) < b.d.max_replicas * c.gpus}
            cands = prune_dominated(b.d, b.cands, tight, frozenset(b.running))
            one = build([Block(b.d, cands, b.running)], left, fleet.problem.move_penalty_usd_h)
            columns += one.columns
            out = run(one, deadline - time.perf_counter(), ALONE_GAP, small=True)
            if out.x is None:
                return None
            keep_plans(fitted, fleet.blocks, one, out)
            need = plan_usage(fleet, i, fitted[i])
        _deduct(left, need)
    return columns


def _choose_plans(fleet: Fleet, options: Mapping[int, list[DeploymentPlan]], left: Mapping[Pool, int],
                  deadline: float) -> tuple[dict[int, DeploymentPlan] | None, int]:
    """One plan per deployment from `options`, the cheapest combination within `left`."""
    rows = Rows()
    cost: list[float] = []
    which: list[tuple[int, DeploymentPlan]] = []
    pools: dict[Pool, list[tuple[int, float]]] = defaultdict(list)
    for i, plans in options.items():
        first = len(cost)
        for plan in plans:
            col = len(cost)
            cost.append(plan.objective)
            which.append((i, plan))
            for pool, n in plan_usage(fleet, i, plan).items():
                if pool in left:
                    pools[pool].append((col, float(n)))
        rows.add(((col, 1.0) for col in range(first, len(cost))), 1.0, 1.0)
    for pool, members in pools.items():
        if sum(n for _, n in members) > left[pool]:
            rows.add(members, -math.inf, float(left[pool]))
    n = len(cost)
    matrix = csc_matrix((rows.vals, (rows.rows, rows.cols)), shape=(len(rows.lower), n))
    m = Milp([], np.array(cost), np.zeros(n), np.ones(n), np.ones(n, dtype=bool), matrix,
             np.array(rows.lower), np.array(rows.upper), [])
    out = run(m, deadline - time.perf_counter(), ALONE_GAP)
    if out.x is None:
        return None, n
    return {i: plan for (i, plan), z in zip(which, out.x, strict=True) if z > 0.5}, n


def _deduct(left: dict[Pool, int], usage: Mapping[Pool, int]) -> None:
    """Take a plan's GPUs from those of the limited pools that are left."""
    for pool, n in usage.items():
        if pool in left:
            left[pool] -= n


def _left_beside(quota: Mapping[Pool, int], fleet: Fleet, plans: Mapping[int, DeploymentPlan],
                 moving: Collection[int]) -> dict[Pool, int]:
    """The quota left once the plans of every deployment not `moving` are placed."""
    left = dict(quota)
    for i, plan in plans.items():
        if i not in moving:
            _deduct(left, plan_usage(fleet, i, plan))
    return left

