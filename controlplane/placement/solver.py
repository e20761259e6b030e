"""The placement solver: replicas for the whole fleet as one mixed-integer program (HiGHS).

Variables, per deployment d: x[d, o, s] — integer replicas on offer o, on demand (s=0) or
spot (s=1); y[d, r] and z[d, c] — binary, d uses region r / cloud c (only where spread is
asked for); u[d, o, s] — replicas that run today and the plan removes.
Objective: Σ $/h × x + move penalty × Σ u.
Constraints: Σ tokens/s × x ≥ demand × headroom; min ≤ Σ x ≤ max; Σ spot x ≤ fraction × Σ x;
Σ_r y ≥ k with y[r] ≤ Σ x in r (clouds alike); u ≥ running − x; and, shared by the fleet,
Σ GPUs × x ≤ quota per (region, GPU type). Residency and latency are filters, not rows: an
offer outside a deployment's jurisdictions or regions, or too far from its users for its TTFT
SLO, never becomes a variable, so no plan can break them.

Deployments meet only in quota pools, so the fleet is solved by constraint generation:
every deployment is first solved alone (pools capped at their quota, many deployments per
HiGHS call as independent blocks); wherever the plans together overrun a pool, the
deployments on it are solved jointly, still against the full quota, and the set grows until
the plans fit. Each step solves a relaxation of the fleet problem, so its bound is a lower
bound on every plan. Alongside, a plan that fits is kept: first the plans alone settled by
regret (who loses most by leaving an overrun pool keeps it), then each round's joint plans
mended the same way and combined with it. The search ends as soon as that plan is within
the gap asked for of the bound, and every joint solve starts from it, so HiGHS begins with
an incumbent. Infeasibility is explained in words (`explain.py`); a result is a whole plan
or none.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field

import highspy
import numpy as np
from scipy.sparse import csc_matrix

from controlplane.placement import explain
from controlplane.placement.capacity import (
    DEFAULT_BATCH,
    DEFAULT_PROFILE,
    GpuSpec,
    ModelSpec,
    ReplicaShape,
    ThroughputProfile,
    replica_shape,
)
from controlplane.placement.geo import great_circle_km, rtt_ms

# The network round trip may take at most this share of a deployment's TTFT SLO; the rest
# is queueing and prefill.
NETWORK_SHARE_OF_TTFT = 0.5
DEFAULT_MOVE_PENALTY_USD_H = 0.5
# Deployments solved alone per HiGHS call: a few amortise its fixed cost per call; more
# and branching in one block slows the others.
BLOCKS_PER_CALL = 4
# Gap for the blocks solved alone: they are small, so solve them (nearly) exactly.
ALONE_GAP = 1e-6
ELASTIC_USD_PER_GPU = 1e5

Pool = tuple[str, str]  # (region, GPU type)


# -- inputs -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class OfferOption:
    id: int
    region: str  # cloud:code
    cloud: str
    jurisdiction: str
    gpu: GpuSpec
    gpus_per_node: int
    on_demand_usd_h: float  # per node
    spot_usd_h: float | None  # per node; None: no spot market
    latitude: float
    longitude: float
    label: str = ""

    @property
    def pool(self) -> Pool:
        return (self.region, self.gpu.name)


@dataclass(frozen=True)
class DeploymentRequest:
    id: int
    name: str
    model: ModelSpec
    context: int  # tokens per sequence (max_model_len)
    tokens_per_s: float  # demand; 0: only min_replicas
    min_replicas: int
    max_replicas: int
    allowed_jurisdictions: frozenset[str]
    allowed_regions: frozenset[str] = frozenset()  # narrows further when not empty
    spread_regions: int = 1
    spread_clouds: int = 1
    max_spot_fraction: float = 0.0
    ttft_slo_ms: float = 1000.0
    user_locations: tuple[tuple[float, float], ...] = ()  # (lat, lon) of its users
    headroom: float = 1.2
    batch: int = DEFAULT_BATCH  # sequences per engine the replica must hold at `context`
    # The engine every replica is launched with (the deployment's settings): offers are
    # sized, priced and counted against quota for exactly this layout.
    tensor_parallel: int = 1
    pipeline_parallel: int = 1

    @property
    def required_tokens_per_s(self) -> float:
        return max(self.tokens_per_s, 0.0) * self.headroom

    @property
    def must_run(self) -> bool:
        """False for a deployment allowed to scale to zero: nothing to place or spread."""
        return self.min_replicas > 0 or self.tokens_per_s > 0


@dataclass(frozen=True)
class QuotaLimit:
    region: str
    gpu: str
    limit_gpus: int  # GPUs these deployments may use in total in the pool


@dataclass(frozen=True)
class ExistingReplica:
    deployment_id: int
    offer_id: int
    spot: bool
    count: int
    usd_h: float | None = None  # per replica, for offers no longer listed


ExistingReplicas = ExistingReplica  # the earlier name


@dataclass(frozen=True)
class PlacementProblem:
    deployments: tuple[DeploymentRequest, ...]
    offers: tuple[OfferOption, ...]
    # (region, GPU type) → GPUs left under quota; a pool not named is unlimited. Takes a
    # mapping or QuotaLimit rows.
    quota_gpus: Mapping[Pool, int] | Iterable[QuotaLimit] = field(default_factory=dict)
    existing: tuple[ExistingReplica, ...] = ()
    move_penalty_usd_h: float = DEFAULT_MOVE_PENALTY_USD_H  # per running replica removed
    time_limit_s: float = 30.0
    mip_rel_gap: float = 0.005
    profile: ThroughputProfile = DEFAULT_PROFILE

    def __post_init__(self) -> None:
        quota = self.quota_gpus
        if not isinstance(quota, Mapping):
            quota = {(q.region, q.gpu): int(q.limit_gpus) for q in quota}
        object.__setattr__(self, "quota_gpus", dict(quota))
        object.__setattr__(self, "deployments", tuple(self.deployments))
        object.__setattr__(self, "offers", tuple(self.offers))
        object.__setattr__(self, "existing", tuple(self.existing))

    @property
    def quota(self) -> dict[Pool, int]:
        return self.quota_gpus  # type: ignore[return-value]


# -- outputs ----------------------------------------------------------------------------------

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


# -- candidates -------------------------------------------------------------------------------

@dataclass(frozen=True, eq=False)
class Candidate:
    """One (offer, spot) way to run a replica of a deployment, past every filter."""

    offer: OfferOption
    spot: bool
    shape: ReplicaShape
    usd_h: float  # per replica: all its nodes
    # Read in the solver's inner loops, so stored rather than derived each time.
    gpus: int = field(init=False)
    rate: float = field(init=False)  # tokens/s per replica
    pool: Pool = field(init=False)
    usd_per_mtok: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpus", self.shape.gpus)
        object.__setattr__(self, "rate", self.shape.tokens_per_s)
        object.__setattr__(self, "pool", self.offer.pool)
        object.__setattr__(self, "usd_per_mtok", self.usd_h / (self.rate * 3600) * 1e6)


def offer_allowed(d: DeploymentRequest, o: OfferOption) -> bool:
    """Residency: the jurisdiction (and, if narrowed, the region) must be allowed."""
    if o.jurisdiction not in d.allowed_jurisdictions:
        return False
    return not d.allowed_regions or o.region in d.allowed_regions


def network_budget_ms(d: DeploymentRequest) -> float:
    return d.ttft_slo_ms * NETWORK_SHARE_OF_TTFT


def worst_rtt_ms(d: DeploymentRequest, o: OfferOption) -> float:
    """Round trip from the farthest of the deployment's users (0 when it names none)."""
    return max((rtt_ms(great_circle_km(lat, lon, o.latitude, o.longitude))
                for lat, lon in d.user_locations), default=0.0)


def offer_close_enough(d: DeploymentRequest, o: OfferOption) -> bool:
    return worst_rtt_ms(d, o) <= network_budget_ms(d)


class CandidateIndex:
    """Candidates per deployment, computed once per kind of deployment: fleets repeat the
    same model, context, residency and users many times over."""

    def __init__(self, offers: Sequence[OfferOption],
                 profile: ThroughputProfile = DEFAULT_PROFILE) -> None:
        self.offers = tuple(offers)
        self.profile = profile
        self._shapes: dict[tuple[object, ...], ReplicaShape | None] = {}
        self._rtt: dict[tuple[tuple[tuple[float, float], ...], str], float] = {}
        self._lists: dict[tuple[object, ...], list[Candidate]] = {}
        self._jurisdictions: _JurisdictionIndex | None = None
        self._dominance: dict[tuple[object, ...], list[Candidate]] = {}

    def shape(self, d: DeploymentRequest, o: OfferOption) -> ReplicaShape | None:
        key = (d.model, o.gpu.name, o.gpu.memory_gib, o.gpus_per_node, d.context, d.batch,
               d.tensor_parallel, d.pipeline_parallel)
        if key not in self._shapes:
            self._shapes[key] = replica_shape(
                d.model, o.gpu, o.gpus_per_node, d.context, d.batch, self.profile,
                tensor_parallel=d.tensor_parallel, pipeline_parallel=d.pipeline_parallel)
        return self._shapes[key]

    def rtt(self, d: DeploymentRequest, o: OfferOption) -> float:
        key = (d.user_locations, o.region)
        if key not in self._rtt:
            self._rtt[key] = worst_rtt_ms(d, o)
        return self._rtt[key]

    def options(self, d: DeploymentRequest, prune: bool = True) -> list[Candidate]:
        """Every allowed, close-enough, fitting (offer, spot) of `d`; with `prune`, only
        those that no other option of the same quota pool beats on price, speed and GPUs."""
        key = (d.model, d.context, d.batch, d.tensor_parallel, d.pipeline_parallel,
               d.allowed_jurisdictions, d.allowed_regions, d.max_spot_fraction > 0, prune,
               d.user_locations, network_budget_ms(d))
        found = self._lists.get(key)
        if found is None:
            # The latency filter drops whole regions, so it commutes with pruning inside
            # pools: the pruned list is shared by deployments with different users.
            near = key[:-2]
            allowed = self._lists.get(near)
            if allowed is None:
                allowed = self._allowed(d, prune)
                self._lists[near] = allowed
            budget = network_budget_ms(d)
            found = [c for c in allowed if self.rtt(d, c.offer) <= budget]
            self._lists[key] = found
        return found

    def _allowed(self, d: DeploymentRequest, prune: bool) -> list[Candidate]:
        found = []
        for o in self._by_jurisdiction().get(frozenset(d.allowed_jurisdictions), ()):
            if d.allowed_regions and o.region not in d.allowed_regions:
                continue
            shape = self.shape(d, o)
            if shape is None or shape.tokens_per_s <= 0:
                continue
            found.append(Candidate(o, False, shape, o.on_demand_usd_h * shape.nodes))
            if o.spot_usd_h is not None and d.max_spot_fraction > 0:
                found.append(Candidate(o, True, shape, o.spot_usd_h * shape.nodes))
        return prune_within_pools(found) if prune else found

    def undominated(self, d: DeploymentRequest, cands: list[Candidate], contested: Set[Pool],
                    running: Mapping[tuple[int, bool], int]) -> list[Candidate]:
        """`prune_dominated`, remembered for deployments that share an option list."""
        if running:
            return prune_dominated(d, cands, contested, frozenset(running))
        pools = frozenset(c.pool for c in cands) & frozenset(contested)
        key = (id(cands), d.spread_regions, d.spread_clouds, pools)
        if key not in self._dominance:
            self._dominance[key] = prune_dominated(d, cands, contested)
        return self._dominance[key]

    def _by_jurisdiction(self) -> _JurisdictionIndex:
        if self._jurisdictions is None:
            self._jurisdictions = _JurisdictionIndex(self.offers)
        return self._jurisdictions


class _JurisdictionIndex:
    """Offers of any set of jurisdictions, without scanning the whole catalog each time."""

    def __init__(self, offers: Sequence[OfferOption]) -> None:
        self._by_one: dict[str, list[OfferOption]] = defaultdict(list)
        for o in offers:
            self._by_one[o.jurisdiction].append(o)
        self._by_set: dict[frozenset[str], list[OfferOption]] = {}

    def get(self, jurisdictions: frozenset[str], default: Sequence[OfferOption] = ()
            ) -> Sequence[OfferOption]:
        if jurisdictions not in self._by_set:
            self._by_set[jurisdictions] = [o for j in sorted(jurisdictions)
                                           for o in self._by_one.get(j, ())]
        return self._by_set[jurisdictions] or default


def candidates_for(d: DeploymentRequest, offers: Sequence[OfferOption],
                   profile: ThroughputProfile = DEFAULT_PROFILE,
                   prune: bool = True) -> list[Candidate]:
    return CandidateIndex(offers, profile).options(d, prune)


def prune_within_pools(cands: list[Candidate], keep: frozenset[tuple[int, bool]] = frozenset()
                       ) -> list[Candidate]:
    """Drop an option when another of the same quota pool and spot class costs no more,
    serves no fewer tokens/s and takes no more GPUs: swapping it in keeps every constraint
    (region, cloud, pool, spot share, count) and costs no more, so no optimum is lost.
    Options in `keep` (replicas run there today) stay: leaving them costs a move."""
    groups: dict[tuple[str, str, bool], list[Candidate]] = defaultdict(list)
    for c in cands:
        groups[(c.offer.region, c.offer.gpu.name, c.spot)].append(c)
    kept: list[Candidate] = []
    for group in groups.values():
        group.sort(key=lambda c: (c.usd_h, -c.rate, c.gpus, c.offer.id))
        mine: list[Candidate] = []
        for c in group:
            if (c.offer.id, c.spot) in keep or not any(
                    a.usd_h <= c.usd_h and a.rate >= c.rate and a.gpus <= c.gpus for a in mine):
                mine.append(c)
        kept.extend(mine)
    return kept


def prune_dominated(d: DeploymentRequest, cands: list[Candidate], contested: Set[Pool],
                    keep: frozenset[tuple[int, bool]] = frozenset()) -> list[Candidate]:
    """Options that can matter while only the `contested` pools' quotas are constraints.

    Option A dominates B when it is in the same spot class, costs no more, serves no fewer
    tokens/s and sits in an uncontested pool (it can take any number of replicas). In any
    plan, B's replicas can move to A without breaking a rule, except that the plan may
    lose a region (or cloud) it needs for spread. So B is kept only if no option dominates
    it (the frontier), or, when `d` spreads over k regions, if fewer than k other regions
    hold an option that dominates it: a plan needs at most one replica in each of k
    regions as witnesses of its spread, and a witness on B can move to one of k dominating
    regions not already a witness. Options in `keep` (running today) stay: leaving them
    costs a move.
    """
    if d.spread_regions > 1 and d.spread_clouds > 1:
        attr, k = "region", math.inf  # two kinds of witness: keep each region's frontier
    elif d.spread_regions > 1:
        attr, k = "region", d.spread_regions
    elif d.spread_clouds > 1:
        attr, k = "cloud", d.spread_clouds
    else:
        attr, k = "", 1
    kept: list[Candidate] = []
    for spot in (False, True):
        group = sorted((c for c in cands if c.spot == spot),
                       key=lambda c: (c.usd_h, -c.rate, c.offer.id))
        best_rate = -1.0  # fastest uncontested option seen so far (none cheaper)
        best_in: dict[str, float] = {}  # the same per region (or cloud)
        top: list[tuple[float, str]] = []  # the k + 1 places with the fastest, fastest first
        for c in group:
            place = getattr(c.offer, attr) if attr else ""
            needed = c.rate > best_rate or (c.offer.id, c.spot) in keep
            if not needed and attr:
                others = [rate for rate, where in top if where != place]
                needed = (len(others) < k or others[int(k) - 1] < c.rate) \
                    and best_in.get(place, -1.0) < c.rate
            if needed:
                kept.append(c)
            if c.pool not in contested:
                best_rate = max(best_rate, c.rate)
                if c.rate > best_in.get(place, -1.0):
                    best_in[place] = c.rate
                    if attr and k != math.inf:
                        top = sorted([(r, w) for r, w in top if w != place] + [(c.rate, place)],
                                     reverse=True)[:int(k) + 1]
                    elif attr:
                        top = []  # every region keeps its own frontier: nothing to count
    return kept


# -- the model --------------------------------------------------------------------------------

@dataclass
class _Block:
    """One deployment's part of a model: its options and what runs today."""

    d: DeploymentRequest
    cands: list[Candidate]
    running: dict[tuple[int, bool], int]  # (offer id, spot) → replicas running on an option
    floor: float = 0.0  # a lower bound on the block's objective, known from solving it alone
    first_col: int = 0
    start: dict[int, int] | None = None  # candidate index → replicas: a plan to start from


@dataclass
class _Milp:
    blocks: list[_Block]
    cost: np.ndarray
    lower: np.ndarray
    upper: np.ndarray
    integer: np.ndarray
    matrix: csc_matrix
    row_lower: np.ndarray
    row_upper: np.ndarray
    removal_cols: list[tuple[int, int]]  # (column, block index)
    shortfall_cols: list[tuple[int, Pool]] = field(default_factory=list)
    start: np.ndarray | None = None  # a feasible point, when every block brings its plan

    @property
    def columns(self) -> int:
        return len(self.cost)


class _Rows:
    def __init__(self) -> None:
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []

    def add(self, entries: Iterable[tuple[int, float]], lo: float, hi: float) -> None:
        r = len(self.lower)
        for col, val in entries:
            self.rows.append(r)
            self.cols.append(col)
            self.vals.append(val)
        self.lower.append(lo)
        self.upper.append(hi)


def _build(blocks: list[_Block], quota: Mapping[Pool, int], move_penalty: float,
           relax: frozenset[str] = frozenset()) -> _Milp:
    """The MILP over `blocks`, bound together by the quota of the pools in `quota` (others
    are left free). `relax` names constraint groups to leave out, for explanations."""
    rows = _Rows()
    cost: list[float] = []
    lower: list[float] = []
    upper: list[float] = []
    integer: list[bool] = []
    removal_cols: list[tuple[int, int]] = []
    shortfall_cols: list[tuple[int, Pool]] = []
    start: list[float] = []
    starting = bool(blocks) and all(b.start is not None for b in blocks)

    def column(c: float, lo: float, hi: float, is_int: bool, value: float = 0.0) -> int:
        cost.append(c)
        lower.append(lo)
        upper.append(hi)
        integer.append(is_int)
        start.append(value)
        return len(cost) - 1

    pools: dict[Pool, list[tuple[int, int]]] = defaultdict(list)
    for b_index, b in enumerate(blocks):
        d = b.d
        b.first_col = len(cost)
        top = d.max_replicas if "max_replicas" not in relax else 10**6
        given = b.start or {}
        cols = [column(c.usd_h, 0.0, float(top), True, float(given.get(j, 0)))
                for j, c in enumerate(b.cands)]
        for col, c in zip(cols, b.cands, strict=True):
            pools[c.pool].append((col, c.gpus))
        need = d.required_tokens_per_s if "demand" not in relax else 0.0
        low = d.min_replicas if "min_replicas" not in relax else 0
        if need > 0 and cols:
            rows.add(((col, c.rate) for col, c in zip(cols, b.cands, strict=True)), need,
                     math.inf)
            # Σx ≥ ⌈need / fastest⌉ holds for every integer plan and tightens the relaxation.
            low = max(low, math.ceil(need / max(c.rate for c in b.cands) - 1e-9))
        if cols:
            rows.add(((col, 1.0) for col in cols), float(low), float(top))
        elif low > 0:
            rows.add((), float(low), math.inf)  # nothing may run, yet something must
        f = d.max_spot_fraction
        if f < 1 and "spot" not in relax and any(c.spot for c in b.cands):
            rows.add(((col, (1 - f) if c.spot else -f)
                      for col, c in zip(cols, b.cands, strict=True)), -math.inf, 0.0)
        if d.must_run:
            for attr, k, name in (("region", d.spread_regions, "spread_regions"),
                                  ("cloud", d.spread_clouds, "spread_clouds")):
                if k <= 1 or name in relax:
                    continue
                members: dict[str, list[int]] = defaultdict(list)
                for col, c in zip(cols, b.cands, strict=True):
                    members[getattr(c.offer, attr)].append(col)
                used = [column(0.0, 0.0, 1.0, True,
                               float(any(start[col] > 0 for col in group)))
                        for group in members.values()]
                rows.add(((u, 1.0) for u in used), float(k), math.inf)
                for u, group in zip(used, members.values(), strict=True):
                    rows.add([(u, 1.0)] + [(col, -1.0) for col in group], -math.inf, 0.0)

        index = {(c.offer.id, c.spot): col for col, c in zip(cols, b.cands, strict=True)}
        removals = []
        for key, count in b.running.items():
            if key in index:
                u = column(move_penalty, 0.0, math.inf, False,
                           max(count - start[index[key]], 0.0))
                removal_cols.append((u, b_index))
                removals.append(u)
                rows.add(((u, 1.0), (index[key], 1.0)), float(count), math.inf)
        if b.floor > 0:
            # No joint plan gives a deployment less than its optimum alone; stating so lifts
            # the LP bound of a joint model to the sum of those optima, which plain
            # relaxations miss by the rounding of whole replicas.
            rows.add([(col, c.usd_h) for col, c in zip(cols, b.cands, strict=True)]
                     + [(u, move_penalty) for u in removals], b.floor, math.inf)
    if "quota" not in relax:
        for pool, pool_cols in pools.items():
            limit = quota.get(pool)
            if limit is None:
                continue
            if sum(upper[col] * g for col, g in pool_cols) <= limit:
                continue  # cannot bind
            if "quota_elastic" in relax:
                # Every GPU over quota costs far more than any plan, so the solver uses
                # quota first and reports the least it must exceed it by.
                short = column(ELASTIC_USD_PER_GPU, 0.0, math.inf, False)
                shortfall_cols.append((short, pool))
                rows.add([(short, -1.0)] + [(col, float(g)) for col, g in pool_cols],
                         -math.inf, float(limit))
            elif len(pool_cols) == 1:
                col, g = pool_cols[0]
                upper[col] = min(upper[col], limit // g)
            else:
                rows.add(((col, float(g)) for col, g in pool_cols), -math.inf, float(limit))
    n = len(cost)
    matrix = csc_matrix((rows.vals, (rows.rows, rows.cols)), shape=(len(rows.lower), n))
    return _Milp(blocks, np.array(cost, dtype=float), np.array(lower, dtype=float),
                 np.array(upper, dtype=float), np.array(integer, dtype=bool), matrix,
                 np.array(rows.lower, dtype=float), np.array(rows.upper, dtype=float),
                 removal_cols, shortfall_cols,
                 np.array(start, dtype=float) if starting else None)


@dataclass
class _Outcome:
    status: str  # optimal | feasible | infeasible | unsolved
    x: np.ndarray | None
    objective: float
    bound: float
    model: _Milp | None = None
    columns: int = 0


# For the small models of deployments alone: HiGHS's root heuristics, restarts and symmetry
# detection cost more than the branching they save (measured: 2 ms a model instead of 15).
SMALL_MODEL_OPTIONS: dict[str, bool | str] = {
    "presolve": "off", "mip_allow_restart": False, "mip_detect_symmetry": False,
    "mip_heuristic_run_feasibility_jump": False, "mip_heuristic_run_rins": False,
    "mip_heuristic_run_rens": False, "mip_heuristic_run_root_reduced_cost": False,
}


def _run(m: _Milp, time_limit: float, gap: float, lp_only: bool = False,
         small: bool = False, abs_gap: float = 0.0) -> _Outcome:
    if m.columns == 0:
        feasible = bool(np.all(m.row_lower <= 0) and np.all(m.row_upper >= 0))
        return _Outcome("optimal" if feasible else "infeasible", np.zeros(0), 0.0, 0.0)
    h = highspy.Highs()
    h.setOptionValue("output_flag", False)
    h.setOptionValue("threads", 1)
    h.setOptionValue("time_limit", max(time_limit, 0.05))
    h.setOptionValue("mip_rel_gap", gap)
    h.setOptionValue("mip_abs_gap", max(abs_gap, 1e-6))
    for name, value in (SMALL_MODEL_OPTIONS.items() if small else ()):
        h.setOptionValue(name, value)
    lp = highspy.HighsLp()
    lp.num_col_ = m.columns
    lp.num_row_ = len(m.row_lower)
    lp.col_cost_ = m.cost
    lp.col_lower_ = m.lower
    lp.col_upper_ = m.upper
    lp.row_lower_ = m.row_lower
    lp.row_upper_ = m.row_upper
    lp.a_matrix_.format_ = highspy.MatrixFormat.kColwise
    lp.a_matrix_.start_ = m.matrix.indptr
    lp.a_matrix_.index_ = m.matrix.indices
    lp.a_matrix_.value_ = m.matrix.data
    lp.a_matrix_.num_col_ = m.columns
    lp.a_matrix_.num_row_ = len(m.row_lower)
    if not lp_only:
        kinds = (highspy.HighsVarType.kContinuous, highspy.HighsVarType.kInteger)
        lp.integrality_ = [kinds[int(i)] for i in m.integer]
    h.passModel(lp)
    if m.start is not None and not lp_only:
        # A plan known to be feasible: HiGHS starts from it as its incumbent and stops as
        # soon as the bound comes within the gap asked for.
        start = highspy.HighsSolution()
        start.col_value = m.start
        start.value_valid = True
        h.setSolution(start)
    h.run()
    status = h.getModelStatus()
    info = h.getInfo()
    if status == highspy.HighsModelStatus.kInfeasible:
        return _Outcome("infeasible", None, math.inf, math.inf)
    has_solution = info.primal_solution_status == 2  # kSolutionStatusFeasible
    if not has_solution:
        return _Outcome("unsolved", None, math.inf, -math.inf)
    x = np.array(h.getSolution().col_value)
    objective = float(info.objective_function_value)
    if lp_only:
        return _Outcome("optimal", x, objective, objective)
    bound = float(info.mip_dual_bound)
    done = status == highspy.HighsModelStatus.kOptimal
    return _Outcome("optimal" if done else "feasible", x, objective,
                    bound if math.isfinite(bound) else -math.inf)


@dataclass
class _Plan:
    """Replicas per option for one deployment, from a solved model."""

    counts: dict[int, int]  # candidate index → replicas
    objective: float
    bound: float
    status: str


def _plans_from(m: _Milp, out: _Outcome) -> list[_Plan]:
    assert out.x is not None
    x = out.x
    plans = []
    for b in m.blocks:
        counts = {}
        for i in range(len(b.cands)):
            n = int(round(x[b.first_col + i]))
            if n > 0:
                counts[i] = n
        plans.append(_Plan(counts, 0.0, 0.0, out.status))
    # Objective and bound belong to the whole call; split the objective by block so that
    # plans from different calls add up.
    for b, plan in zip(m.blocks, plans, strict=True):
        plan.objective = sum(b.cands[i].usd_h * n for i, n in plan.counts.items())
    for col, b_index in m.removal_cols:
        plans[b_index].objective += m.cost[col] * max(x[col], 0.0)
    return plans


# -- solving ----------------------------------------------------------------------------------

@dataclass
class _Fleet:
    """A problem prepared for solving: options and running replicas per deployment."""

    problem: PlacementProblem
    index: CandidateIndex
    blocks: dict[int, _Block]
    forced_removals: dict[int, list[tuple[ExistingReplica, str]]]  # not an option any more

    @classmethod
    def prepare(cls, problem: PlacementProblem) -> _Fleet:
        index = CandidateIndex(problem.offers, problem.profile)
        offers = {o.id: o for o in problem.offers}
        running: dict[int, dict[tuple[int, bool], int]] = defaultdict(dict)
        known_price: dict[tuple[int, int, bool], float] = {}
        for e in problem.existing:
            key = (e.offer_id, e.spot)
            running[e.deployment_id][key] = running[e.deployment_id].get(key, 0) + e.count
            if e.usd_h is not None:
                known_price[(e.deployment_id, *key)] = e.usd_h
        blocks: dict[int, _Block] = {}
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
            blocks[d.id] = _Block(d, cands, {k: n for k, n in mine.items()})
        return cls(problem, index, blocks, forced)

    def forced_penalty(self, ids: Iterable[int]) -> float:
        return sum(self.problem.move_penalty_usd_h * e.count
                   for i in ids for e, _ in self.forced_removals.get(i, []))


def solve(problem: PlacementProblem) -> PlacementResult:
    """The cheapest plan for every deployment of `problem` under every rule, or none."""
    started = time.perf_counter()
    deadline = started + problem.time_limit_s
    fleet = _Fleet.prepare(problem)
    quota = problem.quota
    diagnose = _diagnose_runner(fleet, deadline)
    static = explain.precheck(problem, fleet.blocks, fleet.index)
    if static:
        return _no_plan(problem, fleet, static, started)

    plans, variables, failed, timed_out = _solve_alone(fleet, deadline)
    if failed:
        return _no_plan(problem, fleet, explain.infeasible(problem, fleet.blocks, failed,
                                                           diagnose), started)
    if timed_out:
        return _no_plan(problem, fleet, [_timeout(problem, len(timed_out))], started)

    floors = {i: max(p.bound, 0.0) for i, p in plans.items()}
    # Dropping quota altogether is a relaxation of the fleet problem, so the optima alone
    # bound every plan from below.
    alone_bound = sum(p.bound for p in plans.values()) + fleet.forced_penalty(plans)
    # The gap asked for is the fleet's. Deployments solved alone are (nearly) exact, so most
    # of it is left for settling quota.
    budget = problem.mip_rel_gap * sum(floors.values())
    budget -= sum(p.objective - p.bound for p in plans.values())
    settled = _settle_by_regret(fleet, plans, deadline)
    if settled is not None:
        fitted, extra = settled
        variables += extra
        spent = sum(p.objective for p in fitted.values()) - sum(floors.values())
        if spent <= max(budget, 0.0) + 1e-9:
            return _result(problem, fleet, fitted, "optimal", alone_bound, variables,
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
    joint: dict[tuple[frozenset[int], frozenset[Pool]], _Outcome] = {}

    def fleet_bound() -> float:
        solved = {i for part in joint for i in part[0]}
        found = sum(b for i, b in alone.items() if i not in solved)
        found += sum(o.bound for o in joint.values()) + fleet.forced_penalty(plans)
        return max(found, alone_bound)

    def objective(these: Mapping[int, _Plan] | None) -> float:
        if these is None:
            return math.inf
        return sum(p.objective for p in these.values()) + fleet.forced_penalty(these)

    rounds = 0
    close = False
    while True:
        used = _usage(fleet, plans)
        over = {pool for pool, n in used.items() if n > quota.get(pool, math.inf)}
        if joint:
            mended: Mapping[int, _Plan] | None = dict(plans)
            if over:
                again = _settle_by_regret(fleet, plans, deadline, best)
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
                return _no_plan(problem, fleet, explain.infeasible(
                    problem, fleet.blocks, sorted(part[0]), diagnose), started)
            if out.x is None:
                if part in joint:  # the earlier plan for this part still stands
                    continue
                return _no_plan(problem, fleet, [_timeout(problem, len(part[0]))], started)
            joint[part] = out
            _keep_plans(plans, fleet.blocks, out.model, out)  # type: ignore[arg-type]

    assert best is not None  # the loop ends on a plan that fits
    return _result(problem, fleet, best, "optimal" if close else "feasible", fleet_bound(),
                   variables, len(coupled), started)


def _gap(joint: Mapping[tuple[frozenset[int], frozenset[Pool]], _Outcome]) -> float:
    """Objective less bound over the joint solves: what they spent of the gap budget."""
    return sum(o.objective - o.bound for o in joint.values())


def _worst_first(parts: list[tuple[frozenset[int], frozenset[Pool]]],
                 joint: Mapping[tuple[frozenset[int], frozenset[Pool]], _Outcome],
                 over: set[Pool]) -> list[tuple[frozenset[int], frozenset[Pool]]]:
    """New parts first (they overrun quota), then the loosest solved ones."""
    return sorted(parts, key=lambda part: (part in joint, -(
        joint[part].objective - joint[part].bound) if part in joint else 0.0))


def _solve_part(fleet: _Fleet, part: tuple[frozenset[int], frozenset[Pool]],
                floors: Mapping[int, float], abs_gap: float, deadline: float,
                start: Mapping[int, _Plan] | None = None) -> _Outcome:
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
        blocks.append(_Block(b.d, cands, b.running, floor=floors[i], start=given))
    m = _build(blocks, {pool: problem.quota[pool] for pool in pools},
               problem.move_penalty_usd_h)
    out = _run(m, deadline - time.perf_counter(), problem.mip_rel_gap, abs_gap=abs_gap)
    out.model = m
    out.columns = m.columns
    return out


def _settle_by_regret(fleet: _Fleet, plans: Mapping[int, _Plan], deadline: float,
                      known: Mapping[int, _Plan] | None = None
                      ) -> tuple[dict[int, _Plan], int] | None:
    """Plans that fit every quota, from `plans` (alone or joint): where they overrun a
    pool, the deployments that would lose most by leaving it keep it, and the others are
    solved again, one at a time, against the quota left. With `known` (plans that fit),
    every deployment may also take its part of those. None when one cannot be placed so.

    Fast, and close to optimal when many deployments share a pool: what it gives up is
    bounded by the gap to the optima alone, which the caller checks."""
    problem = fleet.problem
    quota = problem.quota
    used = _usage(fleet, plans)
    over = frozenset(pool for pool, n in used.items() if n > quota.get(pool, math.inf))
    if not over:
        return dict(plans), 0
    affected = [i for i, p in plans.items()
                if any(fleet.blocks[i].cands[j].pool in over for j in p.counts)]
    # Regret: what each would pay more, kept off the overrun pools. Options there cannot
    # dominate others (prune with them contested), then they are dropped.
    away = []
    for i in affected:
        b = fleet.blocks[i]
        kept = fleet.index.undominated(b.d, b.cands, over, b.running)
        away.append(_Block(b.d, [c for c in kept if c.pool not in over], b.running))
    elsewhere, failed, timed_out, columns = _solve_each(fleet, away, deadline)
    if timed_out:
        return None
    regret = {i: (elsewhere[i].objective - plans[i].objective) if i in elsewhere else math.inf
              for i in affected}
    left = _left_beside(quota, fleet, plans, set(affected))
    # Quota is counted in GPUs, so those that lose most per contested GPU go first.
    density = {i: regret[i] / max(sum(n for pool, n in _plan_usage(fleet, i, plans[i]).items()
                                      if pool in over), 1) for i in affected}
    base = dict(left)
    fitted = dict(plans)
    for i in sorted(affected, key=lambda i: (-density[i], i)):
        need = _plan_usage(fleet, i, plans[i])
        if any(left.get(pool, math.inf) < n for pool, n in need.items()):
            b = fleet.blocks[i]
            tight = {c.pool for c in b.cands
                     if left.get(c.pool, math.inf) < b.d.max_replicas * c.gpus}
            cands = prune_dominated(b.d, b.cands, tight, frozenset(b.running))
            one = _build([_Block(b.d, cands, b.running)], left, problem.move_penalty_usd_h)
            columns += one.columns
            out = _run(one, deadline - time.perf_counter(), ALONE_GAP, small=True)
            if out.x is None:
                return None
            _keep_plans(fitted, fleet.blocks, one, out)
            need = _plan_usage(fleet, i, fitted[i])
        _deduct(left, need)
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


def _choose_plans(fleet: _Fleet, options: Mapping[int, list[_Plan]], left: Mapping[Pool, int],
                  deadline: float) -> tuple[dict[int, _Plan] | None, int]:
    """One plan per deployment from `options`, the cheapest combination within `left`."""
    rows = _Rows()
    cost: list[float] = []
    which: list[tuple[int, _Plan]] = []
    pools: dict[Pool, list[tuple[int, float]]] = defaultdict(list)
    for i, plans in options.items():
        first = len(cost)
        for plan in plans:
            col = len(cost)
            cost.append(plan.objective)
            which.append((i, plan))
            for pool, n in _plan_usage(fleet, i, plan).items():
                if pool in left:
                    pools[pool].append((col, float(n)))
        rows.add(((col, 1.0) for col in range(first, len(cost))), 1.0, 1.0)
    for pool, members in pools.items():
        if sum(n for _, n in members) > left[pool]:
            rows.add(members, -math.inf, float(left[pool]))
    n = len(cost)
    matrix = csc_matrix((rows.vals, (rows.rows, rows.cols)), shape=(len(rows.lower), n))
    m = _Milp([], np.array(cost), np.zeros(n), np.ones(n), np.ones(n, dtype=bool), matrix,
              np.array(rows.lower), np.array(rows.upper), [])
    out = _run(m, deadline - time.perf_counter(), ALONE_GAP)
    if out.x is None:
        return None, n
    return {i: plan for (i, plan), z in zip(which, out.x, strict=True) if z > 0.5}, n


def _deduct(left: dict[Pool, int], usage: Mapping[Pool, int]) -> None:
    """Take a plan's GPUs from those of the limited pools that are left."""
    for pool, n in usage.items():
        if pool in left:
            left[pool] -= n


def _left_beside(quota: Mapping[Pool, int], fleet: _Fleet, plans: Mapping[int, _Plan],
                 moving: Collection[int]) -> dict[Pool, int]:
    """The quota left once the plans of every deployment not `moving` are placed."""
    left = dict(quota)
    for i, plan in plans.items():
        if i not in moving:
            _deduct(left, _plan_usage(fleet, i, plan))
    return left


def _plan_usage(fleet: _Fleet, i: int, plan: _Plan) -> dict[Pool, int]:
    cands = fleet.blocks[i].cands
    need: dict[Pool, int] = defaultdict(int)
    for j, n in plan.counts.items():
        need[cands[j].pool] += cands[j].gpus * n
    return need


def _timeout(problem: PlacementProblem, deployments: int) -> str:
    return (f"no plan found within the {problem.time_limit_s:g} s time limit "
            f"({deployments} deployments unsolved); retry with a longer limit")


def _solve_alone(fleet: _Fleet, deadline: float
                 ) -> tuple[dict[int, _Plan], int, list[int], list[int]]:
    """Every deployment on its own and without quota, many per HiGHS call.

    Returns the plans, the variables used, the deployments without a plan even alone, and
    those the time limit cut off."""
    problem = fleet.problem
    # Identical deployments (same options and rules, nothing running) share one solve.
    unique: dict[tuple[object, ...], int] = {}
    twins: dict[int, int] = {}
    todo: list[_Block] = []
    for d in problem.deployments:
        b = fleet.blocks[d.id]
        if not b.running:
            key = (id(fleet.index.options(d)), d.required_tokens_per_s, d.min_replicas,
                   d.max_replicas, d.spread_regions, d.spread_clouds, d.max_spot_fraction)
            if key in unique:
                twins[d.id] = unique[key]
                continue
            unique[key] = d.id
        todo.append(_Block(d, fleet.index.undominated(d, b.cands, frozenset(), b.running),
                           b.running))
    plans, failed, timed_out, variables = _solve_each(fleet, todo, deadline)
    for twin, first in twins.items():
        if first in plans:
            p = plans[first]
            plans[twin] = _Plan(dict(p.counts), p.objective, p.bound, p.status)
        elif first in failed:
            failed.append(twin)
    return plans, variables, failed, timed_out


def _solve_each(fleet: _Fleet, blocks: list[_Block], deadline: float
                ) -> tuple[dict[int, _Plan], list[int], list[int], int]:
    """Each block as its own problem without quota, a few per HiGHS call: the plans (on
    the full option lists), the deployments without a plan, those the time limit cut off,
    and the variables used."""
    penalty = fleet.problem.move_penalty_usd_h
    plans: dict[int, _Plan] = {}
    failed: list[int] = []
    timed_out: list[int] = []
    variables = 0
    for start in range(0, len(blocks), BLOCKS_PER_CALL):
        chunk = blocks[start:start + BLOCKS_PER_CALL]
        m = _build(chunk, {}, penalty)
        variables += m.columns
        out = _run(m, deadline - time.perf_counter(), ALONE_GAP, small=True)
        if out.status == "infeasible" and len(chunk) > 1:
            for b in chunk:  # which of them? Each alone, to name them.
                one = _build([b], {}, penalty)
                res = _run(one, deadline - time.perf_counter(), ALONE_GAP, small=True)
                if res.status == "infeasible":
                    failed.append(b.d.id)
                elif res.x is None:
                    timed_out.append(b.d.id)
                else:
                    _keep_plans(plans, fleet.blocks, one, res)
        elif out.status == "infeasible":
            failed.append(chunk[0].d.id)
        elif out.x is None:
            timed_out.extend(b.d.id for b in chunk)
        else:
            _keep_plans(plans, fleet.blocks, m, out)
    return plans, failed, timed_out, variables


def _keep_plans(plans: dict[int, _Plan], full_of: Mapping[int, _Block], m: _Milp,
                out: _Outcome) -> None:
    """Record plans solved on reduced option lists against the deployments' full lists.

    The call's gap (objective − bound) covers all its blocks, so no block is further than
    that from its own optimum: its objective less the whole gap bounds it from below."""
    found = _plans_from(m, out)
    slack = max(sum(p.objective for p in found) - out.bound, 0.0)
    for b, plan in zip(m.blocks, found, strict=True):
        full = full_of[b.d.id]
        position = {id(c): i for i, c in enumerate(full.cands)}
        counts = {position[id(b.cands[j])]: n for j, n in plan.counts.items()}
        plans[b.d.id] = _Plan(counts, plan.objective, plan.objective - slack, out.status)


def _usage(fleet: _Fleet, plans: Mapping[int, _Plan]) -> dict[Pool, int]:
    used: dict[Pool, int] = defaultdict(int)
    for i, p in plans.items():
        cands = fleet.blocks[i].cands
        for j, n in p.counts.items():
            used[cands[j].pool] += cands[j].gpus * n
    return used


def _components(fleet: _Fleet, ids: set[int], contested: set[Pool]
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


def _diagnose_runner(fleet: _Fleet, deadline: float) -> explain.Feasibility:
    """What explanations use to test relaxed problems: the plan per deployment and the GPUs
    short per pool, or None when even the relaxed problem has no plan."""
    def run(ids: Sequence[int], relax: frozenset[str]) -> explain.Diagnosis | None:
        blocks = [fleet.blocks[i] for i in ids]
        m = _build(blocks, fleet.problem.quota, fleet.problem.move_penalty_usd_h, relax)
        out = _run(m, max(deadline - time.perf_counter(), 2.0), 1e-4)
        if out.x is None:
            return None
        plans = {b.d.id: {b.cands[j]: n for j, n in p.counts.items()}
                 for b, p in zip(blocks, _plans_from(m, out), strict=True)}
        short = {pool: int(math.ceil(out.x[col] - 1e-6)) for col, pool in m.shortfall_cols
                 if out.x[col] > 1e-6}
        return explain.Diagnosis(plans, short)
    return run


def _no_plan(problem: PlacementProblem, fleet: _Fleet, reasons: Sequence[str],
             started: float) -> PlacementResult:
    return PlacementResult(
        status="infeasible", explanation=tuple(reasons),
        cost_before_usd_h=_cost_before(problem, fleet),
        solve_s=time.perf_counter() - started,
    )


# -- the result -------------------------------------------------------------------------------

def _cost_before(problem: PlacementProblem, fleet: _Fleet) -> float:
    offers = {o.id: o for o in problem.offers}
    deps = {d.id: d for d in problem.deployments}
    total = 0.0
    for e in problem.existing:
        total += e.count * _running_price(e, offers.get(e.offer_id), deps.get(e.deployment_id),
                                          fleet)
    return total


def _running_price(e: ExistingReplica, o: OfferOption | None, d: DeploymentRequest | None,
                   fleet: _Fleet) -> float:
    if e.usd_h is not None:
        return e.usd_h
    if o is None:
        return 0.0
    nodes = 1
    if d is not None:
        shape = fleet.index.shape(d, o)
        # A replica its offer's nodes cannot hold (launched before its settings changed)
        # is priced as provisioning sized it: enough nodes for every rank.
        nodes = shape.nodes if shape else max(
            1, -(-d.tensor_parallel * d.pipeline_parallel // o.gpus_per_node))
    price = o.spot_usd_h if e.spot and o.spot_usd_h is not None else o.on_demand_usd_h
    return price * nodes


def _result(problem: PlacementProblem, fleet: _Fleet, plans: Mapping[int, _Plan], status: str,
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


def _changes(problem: PlacementProblem, fleet: _Fleet, plans: Mapping[int, _Plan]
             ) -> list[Change]:
    """Adds and removals per (deployment, offer, spot) against what runs today, each with
    its reason."""
    used = _usage(fleet, plans)
    offers = {o.id: o for o in problem.offers}
    penalty = problem.move_penalty_usd_h
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
                    explain.remove_reason(d, o.region, had - n, before, total_after,
                                          cost_before - cost_after, penalty),
                    o.region, o.gpu.name))
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


def lp_relaxation_bound(problem: PlacementProblem, time_limit_s: float = 60.0) -> float | None:
    """The LP relaxation of the compact whole-fleet model: a weaker bound than the one
    `solve` proves, reported so the strength of the decomposition can be seen."""
    fleet = _Fleet.prepare(problem)
    blocks = [fleet.blocks[d.id] for d in problem.deployments]
    m = _build(blocks, problem.quota, problem.move_penalty_usd_h)
    out = _run(m, time_limit_s, 0.0, lp_only=True)
    if out.x is None:
        return None
    return out.objective + fleet.forced_penalty(fleet.blocks)
