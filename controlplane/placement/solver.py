"""The placement solver: a mixed-integer program over the whole fleet, solved by HiGHS.

Variables: x[d, o, s] — replicas of deployment d on offer o, on demand (s=0) or spot (s=1);
y[d, r] — binary, deployment d uses region r (only where spread is asked for).
Objective: Σ price × nodes × x  +  penalty × (existing replicas removed).
Constraints per deployment: tokens/s ≥ demand × headroom; min ≤ Σx ≤ max; Σ_r y ≥ k with
y[d, r] ≤ Σ x in r; spot replicas ≤ fraction × Σx. Shared: GPUs per (region, GPU type)
within quota. Residency and latency are not constraints but filters: an offer outside a
deployment's jurisdictions, or too far from its users for its TTFT SLO, is never a
variable, so no plan can break them. Infeasible problems are explained in words
(`explain.py`), never returned half-solved.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from controlplane.placement.capacity import GpuSpec, ModelSpec, ReplicaShape, replica_shape
from controlplane.placement.geo import great_circle_km, rtt_ms

# The network round trip may take at most this share of a deployment's TTFT SLO; the rest
# is queueing and prefill.
NETWORK_SHARE_OF_TTFT = 0.5
DEFAULT_MOVE_PENALTY_USD_H = 0.5


@dataclass(frozen=True)
class OfferOption:
    id: int
    region: str  # cloud:code
    cloud: str
    jurisdiction: str
    gpu: GpuSpec
    gpus_per_node: int
    on_demand_usd_h: float
    spot_usd_h: float | None
    latitude: float
    longitude: float
    label: str = ""


@dataclass(frozen=True)
class DeploymentRequest:
    id: int
    name: str
    model: ModelSpec
    context: int
    tokens_per_s: float
    min_replicas: int
    max_replicas: int
    allowed_jurisdictions: frozenset[str]
    allowed_regions: frozenset[str] = frozenset()
    spread_regions: int = 1
    spread_clouds: int = 1
    max_spot_fraction: float = 0.0
    ttft_slo_ms: float = 1000.0
    user_locations: tuple[tuple[float, float], ...] = ()
    headroom: float = 1.2
    batch: int = 32


@dataclass(frozen=True)
class ExistingReplicas:
    deployment_id: int
    offer_id: int
    spot: bool
    count: int


@dataclass(frozen=True)
class PlacementProblem:
    deployments: tuple[DeploymentRequest, ...]
    offers: tuple[OfferOption, ...]
    quota_gpus: dict[tuple[str, str], int]  # (region, gpu) → GPUs Meridian may use in total
    existing: tuple[ExistingReplicas, ...] = ()
    move_penalty_usd_h: float = DEFAULT_MOVE_PENALTY_USD_H
    time_limit_s: float = 30.0
    mip_rel_gap: float = 0.005


@dataclass(frozen=True)
class Assignment:
    deployment_id: int
    offer_id: int
    spot: bool
    count: int
    usd_h: float  # for all `count` replicas
    gpus: int  # for all `count` replicas


@dataclass(frozen=True)
class Change:
    deployment_id: int
    offer_id: int
    spot: bool
    action: str  # add | remove
    count: int
    usd_h_delta: float
    reason: str


@dataclass
class PlacementResult:
    status: str  # optimal | feasible | infeasible
    assignments: list[Assignment] = field(default_factory=list)
    changes: list[Change] = field(default_factory=list)
    cost_before_usd_h: float = 0.0
    cost_after_usd_h: float = 0.0
    lp_bound_usd_h: float | None = None
    solve_s: float = 0.0
    explanation: list[str] = field(default_factory=list)
    variables: int = 0

    @property
    def deployment_ids(self) -> set[int]:
        return {a.deployment_id for a in self.assignments} | {c.deployment_id for c in self.changes}

    @property
    def gap_to_lp_bound(self) -> float | None:
        if self.lp_bound_usd_h is None or self.status == "infeasible":
            return None
        bound = max(self.lp_bound_usd_h, 1e-9)
        return max(self.cost_after_usd_h - self.lp_bound_usd_h, 0.0) / bound


@dataclass(frozen=True)
class Candidate:
    """One (deployment, offer, spot) choice that passed every filter."""

    deployment: DeploymentRequest
    offer: OfferOption
    spot: bool
    shape: ReplicaShape
    usd_h: float  # per replica (all its nodes)

    @property
    def nodes(self) -> int:
        return self.shape.pipeline_parallel

    @property
    def gpus(self) -> int:
        return self.nodes * self.offer.gpus_per_node


def offer_allowed(d: DeploymentRequest, o: OfferOption) -> bool:
    """Residency: the jurisdiction (and, if narrowed, the region) must be allowed."""
    if o.jurisdiction not in d.allowed_jurisdictions:
        return False
    return not d.allowed_regions or o.region in d.allowed_regions


def offer_close_enough(d: DeploymentRequest, o: OfferOption) -> bool:
    budget = d.ttft_slo_ms * NETWORK_SHARE_OF_TTFT
    return all(
        rtt_ms(great_circle_km(lat, lon, o.latitude, o.longitude)) <= budget
        for lat, lon in d.user_locations
    )


@lru_cache(maxsize=65536)
def _shape(model: ModelSpec, gpu: GpuSpec, gpus_per_node: int, context: int,
           batch: int) -> ReplicaShape | None:
    return replica_shape(model, gpu, gpus_per_node, context, batch)


def candidates_for(d: DeploymentRequest, offers: tuple[OfferOption, ...],
                   shapes: object = None) -> list[Candidate]:
    out = []
    for o in offers:
        if not offer_allowed(d, o) or not offer_close_enough(d, o):
            continue
        shape = _shape(d.model, o.gpu, o.gpus_per_node, d.context, d.batch)
        if shape is None or shape.tokens_per_s <= 0:
            continue
        out.append(Candidate(d, o, False, shape, o.on_demand_usd_h * shape.pipeline_parallel))
        if o.spot_usd_h is not None and d.max_spot_fraction > 0:
            out.append(Candidate(d, o, True, shape, o.spot_usd_h * shape.pipeline_parallel))
    return _prune(out)


def _prune(cands: list[Candidate]) -> list[Candidate]:
    """Within one quota pool (region × GPU type) and spot class, keep the cheapest per token
    and the cheapest per replica: the others can never be strictly better choices."""
    groups: dict[tuple[str, str, bool], list[Candidate]] = defaultdict(list)
    for c in cands:
        groups[(c.offer.region, c.offer.gpu.name, c.spot)].append(c)
    kept = []
    for group in groups.values():
        best_rate = min(group, key=lambda c: (c.usd_h / c.shape.tokens_per_s, c.usd_h))
        best_unit = min(group, key=lambda c: (c.usd_h, c.usd_h / c.shape.tokens_per_s))
        kept.append(best_rate)
        if best_unit is not best_rate:
            kept.append(best_unit)
    return kept


def solve(problem: PlacementProblem) -> PlacementResult:
    """Solve each deployment alone (they share only quota); where the independent plans
    together overrun a quota pool, re-solve the deployments on those pools jointly."""
    started = time.perf_counter()
    if len(problem.deployments) <= 1:
        return solve_joint(problem)
    parts = [solve_joint(_sub(problem, (d,)), lp_bound=False) for d in problem.deployments]
    if any(p.status == "infeasible" for p in parts):
        return solve_joint(problem)  # explanations need the whole picture
    offers = {o.id: o for o in problem.offers}
    touching: set[int] = set()
    for _ in range(8):
        used: dict[tuple[str, str], int] = defaultdict(int)
        users: dict[tuple[str, str], set[int]] = defaultdict(set)
        for part in parts:
            for a in part.assignments:
                pool = (offers[a.offer_id].region, offers[a.offer_id].gpu.name)
                used[pool] += a.gpus
                users[pool].add(a.deployment_id)
        over = [pool for pool, n in used.items() if n > problem.quota_gpus.get(pool, 10**12)]
        if not over:
            break
        # The deployments on overrun pools (and any re-solved before) are solved together,
        # against the quota the other deployments' plans leave over.
        touching |= {pid for pool in over for pid in users[pool]}
        left = dict(problem.quota_gpus)
        for part in parts:
            for a in part.assignments:
                if a.deployment_id not in touching:
                    pool = (offers[a.offer_id].region, offers[a.offer_id].gpu.name)
                    if pool in left:
                        left[pool] -= a.gpus
        sub = _sub(problem, tuple(d for d in problem.deployments if d.id in touching))
        joint = solve_joint(PlacementProblem(sub.deployments, sub.offers, left, sub.existing,
                                             sub.move_penalty_usd_h, sub.time_limit_s,
                                             sub.mip_rel_gap), lp_bound=False)
        if joint.status == "infeasible":
            return solve_joint(problem)
        parts = [p for p in parts if p.deployment_ids.isdisjoint(touching)] + [joint]
    else:
        return solve_joint(problem)
    return PlacementResult(
        status="optimal" if all(p.status == "optimal" for p in parts) else "feasible",
        assignments=[a for p in parts for a in p.assignments],
        changes=[c for p in parts for c in p.changes],
        cost_before_usd_h=_cost_before(problem),
        cost_after_usd_h=sum(p.cost_after_usd_h for p in parts),
        lp_bound_usd_h=lp_relaxation_bound(problem),
        solve_s=time.perf_counter() - started,
        variables=sum(p.variables for p in parts),
    )


def lp_relaxation_bound(problem: PlacementProblem) -> float | None:
    """The whole fleet's LP relaxation: no integer plan can cost less."""
    existing = {(e.deployment_id, e.offer_id, e.spot): e.count for e in problem.existing}
    cands = [c for d in problem.deployments for c in candidates_for(d, problem.offers)]
    if not cands:
        return 0.0
    model = _build(problem, cands, existing)
    lp = milp(model["c"], constraints=model["constraints"],
              integrality=np.zeros_like(model["integrality"]), bounds=model["bounds"],
              options={"time_limit": problem.time_limit_s})
    return None if lp.x is None else float(np.dot(model["price"], lp.x[: len(cands)]))


def _sub(problem: PlacementProblem, deployments: tuple[DeploymentRequest, ...]) -> PlacementProblem:
    ids = {d.id for d in deployments}
    return PlacementProblem(
        deployments, problem.offers, problem.quota_gpus,
        tuple(e for e in problem.existing if e.deployment_id in ids),
        problem.move_penalty_usd_h, problem.time_limit_s, problem.mip_rel_gap,
    )


def solve_joint(problem: PlacementProblem, lp_bound: bool = True) -> PlacementResult:
    started = time.perf_counter()
    shapes = None
    existing = {(e.deployment_id, e.offer_id, e.spot): e.count for e in problem.existing}
    cands: list[Candidate] = []
    for d in problem.deployments:
        found = candidates_for(d, problem.offers, shapes)
        # Offers that already run this deployment stay candidates so keeping them is possible.
        have = {(c.offer.id, c.spot) for c in found}
        for (dep, oid, spot), _count in existing.items():
            if dep == d.id and (oid, spot) not in have:
                offer = next((o for o in problem.offers if o.id == oid), None)
                if offer and offer_allowed(d, offer):
                    shape = replica_shape(d.model, offer.gpu, offer.gpus_per_node, d.context, d.batch)
                    price = offer.spot_usd_h if spot else offer.on_demand_usd_h
                    if shape and price is not None:
                        found.append(Candidate(d, offer, spot, shape, price * shape.pipeline_parallel))
        cands.extend(found)
    from controlplane.placement.explain import explain_infeasible, precheck

    problems = precheck(problem, cands)
    if problems:
        return PlacementResult("infeasible", explanation=problems, cost_before_usd_h=_cost_before(problem),
                               solve_s=time.perf_counter() - started)
    if not cands:  # nothing may or must run: the empty plan
        return PlacementResult("optimal", changes=_changes(problem, [], np.zeros(0), existing),
                               cost_before_usd_h=_cost_before(problem), lp_bound_usd_h=0.0,
                               solve_s=time.perf_counter() - started)
    model = _build(problem, cands, existing)
    result = milp(model["c"], constraints=model["constraints"], integrality=model["integrality"],
                  bounds=model["bounds"], options={"time_limit": problem.time_limit_s,
                                                   "mip_rel_gap": problem.mip_rel_gap})
    elapsed = time.perf_counter() - started
    if result.x is None:
        return PlacementResult("infeasible", explanation=explain_infeasible(problem, cands),
                               cost_before_usd_h=_cost_before(problem), solve_s=elapsed,
                               variables=len(model["c"]))
    x = np.rint(result.x[: len(cands)]).astype(int)
    assignments = [
        Assignment(c.deployment.id, c.offer.id, c.spot, int(n), c.usd_h * int(n), c.gpus * int(n))
        for c, n in zip(cands, x, strict=True) if n > 0
    ]
    return PlacementResult(
        status="optimal" if result.status == 0 else "feasible",
        assignments=assignments,
        changes=_changes(problem, cands, x, existing),
        cost_before_usd_h=_cost_before(problem),
        cost_after_usd_h=sum(a.usd_h for a in assignments),
        lp_bound_usd_h=lp_relaxation_bound(problem) if lp_bound else None,
        solve_s=elapsed,
        variables=len(model["c"]),
    )


def _build(problem: PlacementProblem, cands: list[Candidate],
           existing: dict[tuple[int, int, bool], int]) -> dict[str, object]:
    n = len(cands)
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lower: list[float] = []
    upper: list[float] = []
    row = 0

    def add_row(entries: list[tuple[int, float]], lo: float, hi: float) -> None:
        nonlocal row
        for col, val in entries:
            rows.append(row)
            cols.append(col)
            vals.append(val)
        lower.append(lo)
        upper.append(hi)
        row += 1

    by_dep: dict[int, list[int]] = defaultdict(list)
    for i, c in enumerate(cands):
        by_dep[c.deployment.id].append(i)
    extra_cols = 0
    region_vars: list[tuple[int, list[int]]] = []  # (deployment id, candidate indexes) per y
    removal_vars: list[tuple[int, list[int]]] = []  # (existing count, candidate indexes)
    for d in problem.deployments:
        idx = by_dep[d.id]
        if d.tokens_per_s > 0:
            add_row([(i, cands[i].shape.tokens_per_s) for i in idx], d.tokens_per_s * d.headroom, np.inf)
        # Σx ≥ ⌈demand / fastest replica⌉ holds for every integer plan; stating it tightens
        # the LP relaxation (and so the bound the solver proves against).
        floor_replicas = d.min_replicas
        if d.tokens_per_s > 0 and idx:
            fastest = max(cands[i].shape.tokens_per_s for i in idx)
            floor_replicas = max(floor_replicas, math.ceil(d.tokens_per_s * d.headroom / fastest - 1e-9))
        add_row([(i, 1.0) for i in idx], floor_replicas, d.max_replicas)
        if d.max_spot_fraction < 1:
            add_row([(i, (1 - d.max_spot_fraction) if cands[i].spot else -d.max_spot_fraction)
                     for i in idx], -np.inf, 0.0)
        # A deployment allowed to scale to zero (no minimum, no demand) needs no spread.
        must_run = d.min_replicas > 0 or d.tokens_per_s > 0
        if d.spread_regions > 1 and must_run:
            regions: dict[str, list[int]] = defaultdict(list)
            for i in idx:
                regions[cands[i].offer.region].append(i)
            first = n + extra_cols
            for members in regions.values():
                region_vars.append((d.id, members))
                extra_cols += 1
            # Σ y ≥ k, and each y ≤ Σ x in its region (added after all columns exist)
            add_row([(first + j, 1.0) for j in range(len(regions))], d.spread_regions, np.inf)
        if d.spread_clouds > 1 and must_run:
            clouds: dict[str, list[int]] = defaultdict(list)
            for i in idx:
                clouds[cands[i].offer.cloud].append(i)
            first = n + extra_cols
            for members in clouds.values():
                region_vars.append((d.id, members))
                extra_cols += 1
            add_row([(first + j, 1.0) for j in range(len(clouds))], d.spread_clouds, np.inf)
    y_start = n
    for j, (_dep, members) in enumerate(region_vars):
        add_row([(y_start + j, 1.0)] + [(i, -1.0) for i in members], -np.inf, 0.0)
    # Removals: r ≥ existing − x, r ≥ 0, penalised in the objective.
    r_start = n + extra_cols
    index = {(c.deployment.id, c.offer.id, c.spot): i for i, c in enumerate(cands)}
    for key, count in existing.items():
        if key in index:
            removal_vars.append((count, [index[key]]))
    for j, (count, members) in enumerate(removal_vars):
        add_row([(r_start + j, 1.0)] + [(i, 1.0) for i in members], count, np.inf)
    total = n + extra_cols + len(removal_vars)
    pools: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, c in enumerate(cands):
        pools[(c.offer.region, c.offer.gpu.name)].append(i)
    for pool, members in pools.items():
        limit = problem.quota_gpus.get(pool)
        if limit is not None:
            add_row([(i, float(cands[i].gpus)) for i in members], -np.inf, float(limit))
    price = np.array([c.usd_h for c in cands], dtype=float)
    c_vec = np.concatenate([price, np.zeros(extra_cols),
                            np.full(len(removal_vars), problem.move_penalty_usd_h)])
    matrix = coo_matrix((vals, (rows, cols)), shape=(row, total)).tocsr()
    integrality = np.concatenate([np.ones(n + extra_cols), np.zeros(len(removal_vars))])
    ub = np.concatenate([
        np.array([c.deployment.max_replicas for c in cands], dtype=float),
        np.ones(extra_cols), np.full(len(removal_vars), np.inf),
    ])
    return {
        "c": c_vec, "price": price, "integrality": integrality,
        "bounds": Bounds(np.zeros(total), ub),
        "constraints": [LinearConstraint(matrix, np.array(lower), np.array(upper))],
    }


def _cost_before(problem: PlacementProblem) -> float:
    offers = {o.id: o for o in problem.offers}
    deps = {d.id: d for d in problem.deployments}
    total = 0.0
    for e in problem.existing:
        o, d = offers.get(e.offer_id), deps.get(e.deployment_id)
        if o is None or d is None:
            continue
        shape = replica_shape(d.model, o.gpu, o.gpus_per_node, d.context, d.batch)
        nodes = shape.pipeline_parallel if shape else 1
        price = o.spot_usd_h if e.spot and o.spot_usd_h is not None else o.on_demand_usd_h
        total += price * nodes * e.count
    return total


def _changes(problem: PlacementProblem, cands: list[Candidate], x: np.ndarray,
             existing: dict[tuple[int, int, bool], int]) -> list[Change]:
    chosen = {(c.deployment.id, c.offer.id, c.spot): (c, int(n)) for c, n in zip(cands, x, strict=True)}
    offers = {o.id: o for o in problem.offers}
    changes = []
    for key, (c, n) in chosen.items():
        had = existing.get(key, 0)
        if n > had:
            kind = "spot" if c.spot else "on-demand"
            changes.append(Change(
                c.deployment.id, c.offer.id, c.spot, "add", n - had, c.usd_h * (n - had),
                f"{c.offer.gpu.name}×{c.gpus} {kind} in {c.offer.region} at ${c.usd_h:.2f}/h "
                f"serves ~{c.shape.tokens_per_s:,.0f} tok/s (${c.usd_h / c.shape.tokens_per_s * 1e6 / 3600:.2f}"
                f"/M tokens); allowed in {c.offer.jurisdiction}",
            ))
    for key, had in existing.items():
        c, n = chosen.get(key, (None, 0))
        if had > n:
            o = offers.get(key[1])
            per = (c.usd_h if c else (o.on_demand_usd_h if o else 0.0))
            where = o.region if o else f"offer {key[1]}"
            changes.append(Change(key[0], key[1], key[2], "remove", had - n, -per * (had - n),
                                  f"{where} is no longer needed or a cheaper allowed offer "
                                  f"serves the demand"))
    return changes
