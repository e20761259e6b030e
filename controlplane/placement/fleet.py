"""A problem prepared for solving (options and running replicas per deployment), and the
deployments solved each on its own, without quota, many per HiGHS call."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from controlplane.placement import explain
from controlplane.placement.candidates import Candidate, CandidateIndex
from controlplane.placement.milp import Block, DeploymentPlan, Milp, Outcome, build, plans_from, run
from controlplane.placement.problem import ExistingReplica, PlacementProblem, Pool

# Deployments solved alone per HiGHS call: a few amortise its fixed cost per call; more
# and branching in one block slows the others.
BLOCKS_PER_CALL = 4
# Gap for the blocks solved alone: they are small, so solve them (nearly) exactly.
ALONE_GAP = 1e-6


@dataclass
class Fleet:
    """A problem prepared for solving: options and running replicas per deployment."""

    problem: PlacementProblem
    index: CandidateIndex
    blocks: dict[int, Block]
    forced_removals: dict[int, list[tuple[ExistingReplica, str]]]  # not an option any more

    @classmethod
    def prepare(cls, problem: PlacementProblem) -> Fleet:
        index = CandidateIndex(problem.offers, problem.profile)
        offers = {o.id: o for o in problem.offers}
        running: dict[int, dict[tuple[int, bool], int]] = defaultdict(dict)
        known_price: dict[tuple[int, int, bool], float] = {}
        for e in problem.existing:
            key = (e.offer_id, e.spot)
            running[e.deployment_id][key] = running[e.deployment_id].get(key, 0) + e.count
            if e.usd_h is not None:
                known_price[(e.deployment_id, *key)] = e.usd_h
        blocks: dict[int, Block] = {}
        forced: dict[int, list[tuple[ExistingReplica, str]]] = defaultdict(list)
        for d in problem.deployments:
            cands = index.options(d)
            mine = running.get(d.id, {})
            if mine:
                present = {(c.offer.id, c.spot) for c in cands}
                extra = []
                for (offer_id, spot), count in mine.items():
                    if (offer_id, spot) in present:
                        continue
                    # An option pruned as dominated is still allowed: bring it back so that
                    # keeping it is possible; one that breaks a rule must go.
                    o = offers.get(offer_id)
                    why = explain.why_not_an_option(d, o, spot, index)
                    if why is None:
                        assert o is not None
                        shape = index.shape(d, o)
                        assert shape is not None
                        price = o.spot_usd_h if spot else o.on_demand_usd_h
                        extra.append(Candidate(o, spot, shape, float(price) * shape.nodes))  # type: ignore[arg-type]
                    else:
                        e = ExistingReplica(d.id, offer_id, spot, count,
                                            known_price.get((d.id, offer_id, spot)))
                        forced[d.id].append((e, why))
                cands = cands + extra
            blocks[d.id] = Block(d, cands, {k: n for k, n in mine.items()})
        return cls(problem, index, blocks, forced)

    def forced_penalty(self, ids: Iterable[int]) -> float:
        return sum(self.problem.move_penalty_usd_h * e.count
                   for i in ids for e, _ in self.forced_removals.get(i, []))


def plan_usage(fleet: Fleet, i: int, plan: DeploymentPlan) -> dict[Pool, int]:
    cands = fleet.blocks[i].cands
    need: dict[Pool, int] = defaultdict(int)
    for j, n in plan.counts.items():
        need[cands[j].pool] += cands[j].gpus * n
    return need


def solve_alone(fleet: Fleet, deadline: float
                ) -> tuple[dict[int, DeploymentPlan], int, list[int], list[int]]:
    """Every deployment on its own and without quota, many per HiGHS call.

    Returns the plans, the variables used, the deployments without a plan even alone, and
    those the time limit cut off."""
    problem = fleet.problem
    # Identical deployments (same options and rules, nothing running) share one solve.
    unique: dict[tuple[object, ...], int] = {}
    twins: dict[int, int] = {}
    todo: list[Block] = []
    for d in problem.deployments:
        b = fleet.blocks[d.id]
        if not b.running:
            key = (id(fleet.index.options(d)), d.required_tokens_per_s, d.min_replicas,
                   d.max_replicas, d.spread_regions, d.spread_clouds, d.max_spot_fraction)
            if key in unique:
                twins[d.id] = unique[key]
                continue
            unique[key] = d.id
        todo.append(Block(d, fleet.index.undominated(d, b.cands, frozenset(), b.running),
                          b.running))
    plans, failed, timed_out, variables = solve_each(fleet, todo, deadline)
    for twin, first in twins.items():
        if first in plans:
            p = plans[first]
            plans[twin] = DeploymentPlan(dict(p.counts), p.objective, p.bound, p.status)
        elif first in failed:
            failed.append(twin)
    return plans, variables, failed, timed_out


def solve_each(fleet: Fleet, blocks: list[Block], deadline: float
               ) -> tuple[dict[int, DeploymentPlan], list[int], list[int], int]:
    """Each block as its own problem without quota, a few per HiGHS call: the plans (on
    the full option lists), the deployments without a plan, those the time limit cut off,
    and the variables used."""
    penalty = fleet.problem.move_penalty_usd_h
    plans: dict[int, DeploymentPlan] = {}
    failed: list[int] = []
    timed_out: list[int] = []
    variables = 0
    for start in range(0, len(blocks), BLOCKS_PER_CALL):
        chunk = blocks[start:start + BLOCKS_PER_CALL]
        m = build(chunk, {}, penalty)
        variables += m.columns
        out = run(m, deadline - time.perf_counter(), ALONE_GAP, small=True)
        if out.status == "infeasible" and len(chunk) > 1:
            for b in chunk:  # which of them? Each alone, to name them.
                one = build([b], {}, penalty)
                res = run(one, deadline - time.perf_counter(), ALONE_GAP, small=True)
                if res.status == "infeasible":
                    failed.append(b.d.id)
                elif res.x is None:
                    timed_out.append(b.d.id)
                else:
                    keep_plans(plans, fleet.blocks, one, res)
        elif out.status == "infeasible":
            failed.append(chunk[0].d.id)
        elif out.x is None:
            timed_out.extend(b.d.id for b in chunk)
        else:
            keep_plans(plans, fleet.blocks, m, out)
    return plans, failed, timed_out, variables


def keep_plans(plans: dict[int, DeploymentPlan], full_of: Mapping[int, Block], m: Milp,
               out: Outcome) -> None:
    """Record plans solved on reduced option lists against the deployments' full lists.

    The call's gap (objective − bound) covers all its blocks, so no block is further than
    that from its own optimum: its objective less the whole gap bounds it from below."""
    found = plans_from(m, out)
    slack = max(sum(p.objective for p in found) - out.bound, 0.0)
    for b, plan in zip(m.blocks, found, strict=True):
        full = full_of[b.d.id]
        position = {id(c): i for i, c in enumerate(full.cands)}
        counts = {position[id(b.cands[j])]: n for j, n in plan.counts.items()}
        plans[b.d.id] = DeploymentPlan(counts, plan.objective, plan.objective - slack, out.status)


def usage(fleet: Fleet, plans: Mapping[int, DeploymentPlan]) -> dict[Pool, int]:
    used: dict[Pool, int] = defaultdict(int)
    for i, p in plans.items():
        cands = fleet.blocks[i].cands
        for j, n in p.counts.items():
            used[cands[j].pool] += cands[j].gpus * n
    return used

