"""Constraint generation over the fleet's quota pools: joint solves of the deployments whose
plans overrun a pool, round by round, until a plan that fits is within the gap of the bound.

Quota rows only for pools that some plan overran, joint solves only for the deployments
whose plans did. Each round solves a relaxation of the fleet problem (rows and couplings left
out), so its bound holds for every plan. The plans of a round that still overrun a pool are
mended by regret into a plan that fits (`repair.py`), which ends the search as soon as it is
within the gap of that bound, and each joint solve starts from the best plan that fits so
far.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from controlplane.placement.fleet import DeploymentPlan, Fleet, keep_plans, usage
from controlplane.placement.milp import Block, Outcome, build, run
from controlplane.placement.problem import Pool
from controlplane.placement.repair import settle_by_regret

Part = tuple[frozenset[int], frozenset[Pool]]


@dataclass(frozen=True)
class Refusal:
    """A joint solve that gave no plan: its deployments, and whether it proved them
    infeasible together (else it ran out of time)."""

    ids: list[int]
    infeasible: bool


class ConstraintGeneration:
    """The search's state between rounds: the latest plans per deployment, the joint
    outcomes per part, and the best plan that fits so far."""

    def __init__(self, fleet: Fleet, plans: dict[int, DeploymentPlan],
                 floors: Mapping[int, float], alone_bound: float, budget: float,
                 deadline: float, best: dict[int, DeploymentPlan] | None,
                 variables: int) -> None:
        self.fleet = fleet
        self.plans = plans
        self.floors = floors
        self.alone = {i: p.bound for i, p in plans.items()}
        self.alone_bound = alone_bound
        self.budget = budget
        self.deadline = deadline
        self.best = best
        self.variables = variables
        self.contested: set[Pool] = set()
        self.coupled: set[int] = set()
        self.joint: dict[Part, Outcome] = {}

    def run(self) -> tuple[dict[int, DeploymentPlan], bool] | Refusal:
        """The best plan that fits and whether it is within the gap of the bound, or why
        there is none."""
        quota = self.fleet.problem.quota
        rounds = 0
        close = False
        while True:
            used = usage(self.fleet, self.plans)
            over = {pool for pool, n in used.items() if n > quota.get(pool, math.inf)}
            if self.joint:
                close = self._mend(over)
                if close:
                    break
            if over:
                self.contested |= over
                self.coupled |= {i for i, p in self.plans.items()
                                 if any(self.fleet.blocks[i].cands[j].pool in over
                                        for j in p.counts)}
            elif rounds > 0:
                break
            rounds = rounds + 1 if not over else 0  # one tightening round once the plans fit
            refused = self._solve_parts(over)
            if refused is not None:
                return refused
        assert self.best is not None  # the loop ends on a plan that fits
        return self.best, close

    def fleet_bound(self) -> float:
        solved = {i for part in self.joint for i in part[0]}
        found = sum(b for i, b in self.alone.items() if i not in solved)
        found += sum(o.bound for o in self.joint.values()) + self.fleet.forced_penalty(self.plans)
        return max(found, self.alone_bound)

    def _objective(self, these: Mapping[int, DeploymentPlan] | None) -> float:
        if these is None:
            return math.inf
        return sum(p.objective for p in these.values()) + self.fleet.forced_penalty(these)

    def _mend(self, over: set[Pool]) -> bool:
        """Keep this round's plans (mended by regret where they overrun) when better than the
        best so far; whether the best is now within the gap of the bound."""
        mended: Mapping[int, DeploymentPlan] | None = dict(self.plans)
        if over:
            again = settle_by_regret(self.fleet, self.plans, self.deadline, self.best)
            mended = again[0] if again is not None else None
            self.variables += again[1] if again is not None else 0
        if self._objective(mended) < self._objective(self.best):
            self.best = dict(mended)  # type: ignore[arg-type]
        bound = self.fleet_bound()
        gap = self.fleet.problem.mip_rel_gap
        return self._objective(self.best) - bound <= gap * bound + 1e-9

    def _solve_parts(self, over: set[Pool]) -> Refusal | None:
        """Solve jointly each part whose plan is new or looser than its share of the gap."""
        parts = _components(self.fleet, self.coupled, self.contested)
        coupled_floor = sum(self.floors[i] for i in self.coupled) or 1.0
        joint = self.joint = {part: self.joint[part] for part in parts if part in self.joint}
        for part in _worst_first(parts, joint, over):
            share = max(self.budget, 0.0) * sum(self.floors[i] for i in part[0]) / coupled_floor
            if part in joint and joint[part].objective - joint[part].bound <= share + 1e-9:
                continue
            out = _solve_part(self.fleet, part, self.floors, share, self.deadline, self.best)
            self.variables += out.columns
            if out.status == "infeasible":
                return Refusal(sorted(part[0]), infeasible=True)
            if out.x is None:
                if part in joint:  # the earlier plan for this part still stands
                    continue
                return Refusal(sorted(part[0]), infeasible=False)
            joint[part] = out
            keep_plans(self.plans, self.fleet.blocks, out.model, out)  # type: ignore[arg-type]
        return None


def _worst_first(parts: list[Part],
                 joint: Mapping[Part, Outcome],
                 over: set[Pool]) -> list[Part]:
    """New parts first (they overrun quota), then the loosest solved ones."""
    return sorted(parts, key=lambda part: (part in joint, -(
        joint[part].objective - joint[part].bound) if part in joint else 0.0))


def _solve_part(fleet: Fleet, part: Part,
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


def _components(fleet: Fleet, ids: set[int], contested: set[Pool]
                ) -> list[Part]:
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
