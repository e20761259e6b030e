"""What the solver answers: assignments, changes against what runs today with their reasons,
costs before and after, the bound and the gap; and how a result is built from the plans."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from controlplane.placement import explain
from controlplane.placement.capacity import replica_nodes
from controlplane.placement.fleet import Fleet, usage
from controlplane.placement.milp import DeploymentPlan
from controlplane.placement.problem import (
    DeploymentRequest,
    ExistingReplica,
    OfferOption,
    PlacementProblem,
)


@dataclass(frozen=True)
class Assignment:
    deployment_id: int
    offer_id: int
    spot: bool
    count: int
    usd_h: float  # all `count` replicas
    gpus: int  # all `count` replicas
    region: str = ""
    gpu: str = ""
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    nodes: int = 1  # per replica


@dataclass(frozen=True)
class Change:
    deployment_id: int
    offer_id: int
    spot: bool
    action: str  # add | remove
    count: int
    usd_h_delta: float
    reason: str
    region: str = ""
    gpu: str = ""


@dataclass(frozen=True)
class PlacementResult:
    status: str  # optimal (within the gap asked for) | feasible (time limit) | infeasible
    assignments: tuple[Assignment, ...] = ()
    changes: tuple[Change, ...] = ()
    cost_before_usd_h: float = 0.0
    cost_after_usd_h: float = 0.0
    objective_usd_h: float = 0.0  # cost after + move penalties: what the bound bounds
    lp_bound_usd_h: float | None = None  # no plan can have a lower objective
    mip_gap: float | None = None  # (objective − bound) / objective
    solve_s: float = 0.0
    explanation: tuple[str, ...] = ()
    variables: int = 0
    coupled_deployments: int = 0  # solved jointly because they contend for quota
    # Deployments left out because no plan can place them: (deployment id, why). The plan
    # covers the others (`search.solve_placeable`).
    unplaced: tuple[tuple[int, str], ...] = ()

    @property
    def has_plan(self) -> bool:
        return self.status != "infeasible"

    @property
    def gap_to_lp_bound(self) -> float | None:
        """(objective − bound) / bound."""
        if self.lp_bound_usd_h is None or not self.has_plan:
            return None
        if self.lp_bound_usd_h <= 1e-9:
            return 0.0 if self.objective_usd_h <= 1e-9 else None
        return max(self.objective_usd_h - self.lp_bound_usd_h, 0.0) / self.lp_bound_usd_h

    @property
    def deployment_ids(self) -> set[int]:
        return ({a.deployment_id for a in self.assignments}
                | {c.deployment_id for c in self.changes})


def no_plan(problem: PlacementProblem, fleet: Fleet, reasons: Sequence[str],
            started: float) -> PlacementResult:
    return PlacementResult(
        status="infeasible", explanation=tuple(reasons),
        cost_before_usd_h=_cost_before(problem, fleet),
        solve_s=time.perf_counter() - started,
    )


def _cost_before(problem: PlacementProblem, fleet: Fleet) -> float:
    offers = {o.id: o for o in problem.offers}
    deps = {d.id: d for d in problem.deployments}
    total = 0.0
    for e in problem.existing:
        total += e.count * _running_price(e, offers.get(e.offer_id), deps.get(e.deployment_id),
                                          fleet)
    return total


def _running_price(e: ExistingReplica, o: OfferOption | None, d: DeploymentRequest | None,
                   fleet: Fleet) -> float:
    if e.usd_h is not None:
        return e.usd_h
    if o is None:
        return 0.0
    nodes = 1
    if d is not None:
        shape = fleet.index.shape(d, o)
        # Where the deployment's engine does not fit the offer's GPUs, nodes as provisioning
        # sizes it; where the nodes cannot hold its layout at all, no price, as costs bill it.
        sized = shape.nodes if shape else replica_nodes(
            d.tensor_parallel, d.pipeline_parallel, o.gpus_per_node)
        if sized is None:
            return 0.0
        nodes = sized
    price = o.spot_usd_h if e.spot and o.spot_usd_h is not None else o.on_demand_usd_h
    return price * nodes


def build_result(problem: PlacementProblem, fleet: Fleet, plans: Mapping[int, DeploymentPlan], status: str,
                 bound: float, variables: int, coupled: int, started: float) -> PlacementResult:
    assignments = []
    for d in problem.deployments:
        b = fleet.blocks[d.id]
        for j, n in sorted(plans[d.id].counts.items()):
            c = b.cands[j]
            assignments.append(Assignment(
                d.id, c.offer.id, c.spot, n, c.usd_h * n, c.gpus * n, c.offer.region,
                c.offer.gpu.name, c.shape.tensor_parallel, c.shape.pipeline_parallel,
                c.shape.nodes))
    changes = _changes(problem, fleet, plans)
    cost_after = sum(a.usd_h for a in assignments)
    removed = sum(c.count for c in changes if c.action == "remove")
    objective = cost_after + removed * problem.move_penalty_usd_h
    bound = min(bound, objective) if math.isfinite(bound) else bound
    gap = (objective - bound) / objective if objective > 1e-9 and math.isfinite(bound) else 0.0
    return PlacementResult(
        status=status, assignments=tuple(assignments), changes=tuple(changes),
        cost_before_usd_h=_cost_before(problem, fleet), cost_after_usd_h=cost_after,
        objective_usd_h=objective, lp_bound_usd_h=bound if math.isfinite(bound) else None,
        mip_gap=max(gap, 0.0), solve_s=time.perf_counter() - started, variables=variables,
        coupled_deployments=coupled,
    )


def _changes(problem: PlacementProblem, fleet: Fleet, plans: Mapping[int, DeploymentPlan]
             ) -> list[Change]:
    """Adds and removals per (deployment, offer, spot) against what runs today, each with
    its reason."""
    used = usage(fleet, plans)
    offers = {o.id: o for o in problem.offers}
    penalty = problem.move_penalty_usd_h
    running_gpus = _running_gpus(fleet)
    changes: list[Change] = []
    for d in problem.deployments:
        b = fleet.blocks[d.id]
        plan = {b.cands[j]: n for j, n in plans[d.id].counts.items()}
        after = {(c.offer.id, c.spot): (c, n) for c, n in plan.items()}
        forced = fleet.forced_removals.get(d.id, [])
        forced_keys = {(e.offer_id, e.spot) for e, _ in forced}
        price = {(c.offer.id, c.spot): c.usd_h for c in b.cands}
        cost_before = sum(n * price.get(k, 0.0) for k, n in b.running.items()
                          if k not in forced_keys)
        cost_before += sum(e.count * _running_price(e, offers.get(e.offer_id), d, fleet)
                           for e, _ in forced)
        cost_after = sum(c.usd_h * n for c, n in plan.items())
        before = sum(b.running.values())
        total_after = sum(plan.values())
        best = min(b.cands, key=lambda a: (a.usd_per_mtok, a.usd_h)) if b.cands else None
        for key, (c, n) in sorted(after.items(), key=lambda kv: kv[0]):
            had = b.running.get(key, 0)
            if n > had:
                changes.append(Change(
                    d.id, c.offer.id, c.spot, "add", n - had, c.usd_h * (n - had),
                    explain.add_reason(d, c, n - had, best or c, plan, used, problem.quota,
                                       fleet.index),
                    c.offer.region, c.offer.gpu.name))
        for key, had in sorted(b.running.items()):
            if key in forced_keys:
                continue
            n = after[key][1] if key in after else 0
            if had > n:
                o = offers[key[0]]
                changes.append(Change(
                    d.id, key[0], key[1], "remove", had - n, -price[key] * (had - n),
                    explain.remove_reason(
                        d, o.region, had - n, before, total_after, cost_before - cost_after,
                        penalty, pool_over_quota=running_gpus.get(o.pool, 0)
                        > problem.quota.get(o.pool, running_gpus.get(o.pool, 0))),
                    o.region, o.gpu.name))
        changes += _forced_changes(d, forced, offers, fleet)
    return changes


def _running_gpus(fleet: Fleet) -> dict[tuple[str, str], int]:
    """GPUs per pool that the fleet's deployments run today on their options."""
    running_gpus: dict[tuple[str, str], int] = {}
    for block in fleet.blocks.values():
        gpus_of = {(c.offer.id, c.spot): c for c in block.cands}
        for key, n in block.running.items():
            if key in gpus_of:
                pool = gpus_of[key].pool
                running_gpus[pool] = running_gpus.get(pool, 0) + gpus_of[key].gpus * n
    return running_gpus


def _forced_changes(d: DeploymentRequest, forced: list[tuple[ExistingReplica, str]],
                    offers: Mapping[int, OfferOption], fleet: Fleet) -> list[Change]:
    """The removals of replicas that may not stay where they run, each with its reason."""
    changes = []
    for e, why in forced:
        forced_offer = offers.get(e.offer_id)
        changes.append(Change(
            d.id, e.offer_id, e.spot, "remove", e.count,
            -e.count * _running_price(e, forced_offer, d, fleet),
            f"{e.count} × in "
            f"{forced_offer.region if forced_offer else f'offer {e.offer_id}'}: {why}",
            forced_offer.region if forced_offer else "",
            forced_offer.gpu.name if forced_offer else ""))
    return changes

