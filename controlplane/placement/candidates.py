"""Candidates: the (offer, spot) ways to run a replica of a deployment that pass every filter
(residency, latency, the engine's fit on the offer's nodes), and the pruning of those that
cannot matter to an optimum."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass, field

from controlplane.placement.capacity import (
    DEFAULT_PROFILE,
    ReplicaShape,
    ThroughputProfile,
    replica_shape,
)
from controlplane.placement.problem import (
    DeploymentRequest,
    OfferOption,
    Pool,
    network_budget_ms,
    worst_rtt_ms,
)


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

