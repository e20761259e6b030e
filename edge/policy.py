"""The scheduling pipeline: filters drop replicas, scorers rate the rest in [0, 1], a picker
chooses. Pure: everything it reads (candidates, their stats, the tenant, the request, the
prefix index, the random source) comes in as arguments, so a test builds the state in a line.

Filters run in a fixed order and residency is one of them, not a scorer: no weight, picker
or alias can send a request to a replica outside the tenant's jurisdictions. Scorers and
pickers are registered by name (`edge.scoring`); the table's `policy.scorers` weighs them
and `policy.picker` names the picker.

This runs for every request, so the loops are written out plainly: each replica's stats are
looked up once, and scorers get them (and its load) aligned with the candidates.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from edge.health import ReplicaStats
from edge.prefix import PrefixIndex, replica_id_hash, tenant_seed
from edge.scoring import (
    AFFINITY_BLOCKS,
    PICKERS,
    SCORELESS_PICKERS,
    SCORERS,
    TABLE_SCORERS,
    TIE_EPSILON,
    Decision,
    PickerState,
    RouteRequest,
    Scorer,
    ScoringContext,
    break_tie,
    load_score,
    pick_max_score,
    prefix_score,
    prefix_scores,
)
from edge.table import ROUTABLE_STATES, Policy, Replica, TenantRules

_NO_STATS = ReplicaStats()


# --- filters -------------------------------------------------------------------------------
# Table filters depend only on the table, the tenant and the tier, so they run once per
# (table, tenant, model, tier) in `candidate_set`; state filters run for every request.

def inflight_limit(replica: Replica, tier: str, policy: Policy) -> int:
    """Batch requests may fill only a share of an interactive replica, leaving the rest for
    interactive traffic."""
    if tier == "batch" and replica.tier == "interactive":
        return max(1, int(replica.max_inflight * policy.batch_max_share))
    return replica.max_inflight


TableFilter = Callable[[Replica, TenantRules, str], bool]


def routable(replica: Replica, tenant: TenantRules, tier: str) -> bool:
    return replica.state in ROUTABLE_STATES and replica.weight > 0


def residency(replica: Replica, tenant: TenantRules, tier: str) -> bool:
    return tenant.may_use_replica(replica)


def tier_allows(replica: Replica, tenant: TenantRules, tier: str) -> bool:
    # Batch replicas take batch work only; interactive ones take both (batch up to a share).
    return replica.tier == "interactive" or tier == "batch"


# The state filters (healthy: probe up and not ejected; under capacity: in-flight below the
# tier's limit) run for every request and are written out in `schedule_set`.


# --- batch pools ---------------------------------------------------------------------------
# A model whose table entry has `batch_pool` (`RoutingTable.batch_pools`: the control
# plane's compiler writes it for a model with a batch-tier deployment, its tenants or "*"
# for a shared one) takes the batch requests of those tenants on its batch-tier replicas
# alone, never on interactive ones, also while it has none (a pool scaled to zero): the edge
# answers 503 no_replicas and counts the request, which is what wakes the pool.

def in_batch_pool(replicas: tuple[Replica, ...], pool: frozenset[str] | None,
                  tenant: TenantRules, tier: str) -> tuple[Replica, ...]:
    """The replicas a request may be scheduled on given the model's batch pool: a batch
    request of a tenant the pool names gets the batch-tier ones only; anything else, all."""
    if tier != "batch" or pool is None or not ("*" in pool or tenant.tenant in pool):
        return replicas
    return tuple(r for r in replicas if r.tier == "batch")


# (name, filter, the reason given when it is the last stage any replica reached)
TABLE_FILTERS: tuple[tuple[str, TableFilter, str], ...] = (
    ("routable", routable, "no_replicas"),
    ("residency", residency, "residency_unavailable"),
    ("tier", tier_allows, "no_replicas"),
)


# --- revision split ------------------------------------------------------------------------

# A conversation's point in [0, 100) comes from its key (`revision_key`), the same for every
# turn, so it stays on one revision and that revision's prefix caches.
REVISION_POINTS = 10_000


def revision_point(key: int) -> float:
    """Where a prefix key falls in [0, 100): a multiply-xorshift of its CRC, the same on
    every edge and in every process."""
    value = (key & 0xFFFFFFFF) * 0x2C1B3C6D & 0xFFFFFFFF
    value ^= value >> 15
    value = value * 0x297A2D39 & 0xFFFFFFFF
    value ^= value >> 15
    return (value % REVISION_POINTS) * (100.0 / REVISION_POINTS)


def pick_revision(shares: Sequence[tuple[str, float]], point: float) -> str:
    """The revision whose slice of [0, 100) holds `point`, slices laid out in `shares` order
    (newest revision first) and scaled to their total; a revision with share 0 has no slice."""
    total = 0.0
    for _, share in shares:
        total += share
    target = point * total / 100.0
    cumulative = 0.0
    chosen = ""
    for revision, share in shares:
        if share <= 0:
            continue
        chosen = revision
        cumulative += share
        if target < cumulative:
            return revision
    return chosen


def revision_key(prefix: Sequence[int], prompt: bytes) -> int:
    """The key a completion's revision is chosen by (a chat's is its `conversation_key`): its
    affinity block (the prompt's first blocks), or for a prompt shorter than one block the CRC
    of the whole prompt."""
    if prefix:
        return prefix[min(AFFINITY_BLOCKS, len(prefix)) - 1]
    return zlib.crc32(prompt)


# --- candidate sets ------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class CandidateSet:
    """The replicas of a model that the table lets a tenant's requests of one tier use, with
    everything about them that only the table decides. Valid for the life of one table."""

    model: str
    tier: str
    policy: Policy
    replicas: tuple[Replica, ...]
    reason: str  # why `replicas` is empty, when it is
    residency_removed: bool  # residency rules left out some replica of the model
    limits: tuple[int, ...]  # each replica's in-flight limit for this tier
    table_scores: tuple[float, ...]  # Σ weight × score of the table-only scorers
    request_scorers: tuple[tuple[Scorer, float], ...]  # the rest, with their weights
    scale: tuple[float, ...]  # 1 / Σ weights × the replica's table weight (≤ 1)
    id_hashes: tuple[int, ...]  # for rendezvous hashing
    # The common policy (max_score over the load and prefix scorers, load first), which
    # `pick_common` scores inline: those two weights, or None for any other policy.
    common: tuple[float, float] | None = None
    max_inflight: tuple[int, ...] = ()
    # Where the prompt's prefix keys start (`edge.prefix.block_keys`): the tenant's own
    # chain when some replica here keeps tenants' caches apart, 0 when all share theirs.
    prefix_seed: int = 0


def candidate_set(replicas: Sequence[Replica], tenant: TenantRules, tier: str,
                  policy: Policy, model: str = "") -> CandidateSet:
    kept: list[Replica] = []
    furthest = -1
    residency_removed = False
    for replica in replicas:
        for i, (name, keep, _) in enumerate(TABLE_FILTERS):
            if not keep(replica, tenant, tier):
                furthest = max(furthest, i)
                residency_removed = residency_removed or name == "residency"
                break
        else:
            kept.append(replica)
    reason = "ok" if kept else TABLE_FILTERS[furthest][2] if furthest >= 0 else "no_replicas"
    table_scores = [0.0] * len(kept)
    request_scorers = []
    weight_sum = 0.0
    if kept:
        ctx = ScoringContext([], [], RouteRequest(model, tier), None, policy)
        for name, weight in policy.scorers.items():
            scorer = SCORERS.get(name)
            if weight <= 0 or scorer is None:
                continue
            weight_sum += weight
            if name in TABLE_SCORERS:
                table_scores = [t + weight * s for t, s in
                                zip(table_scores, scorer(kept, ctx), strict=True)]
            else:
                request_scorers.append((scorer, weight))
    norm = 1.0 / weight_sum if weight_sum > 0 else 1.0
    common = None
    if (policy.picker == "max_score" and len(request_scorers) == 2
            and request_scorers[0][0] is load_score and request_scorers[1][0] is prefix_score):
        common = (request_scorers[0][1], request_scorers[1][1])
    return CandidateSet(
        model=model or (kept[0].model if kept else ""), tier=tier, policy=policy,
        replicas=tuple(kept), reason=reason, residency_removed=residency_removed,
        limits=tuple(inflight_limit(r, tier, policy) for r in kept),
        table_scores=tuple(table_scores), request_scorers=tuple(request_scorers),
        scale=tuple(norm * min(1.0, r.weight) for r in kept),
        id_hashes=tuple(replica_id_hash(r.id) for r in kept),
        common=common, max_inflight=tuple(r.max_inflight for r in kept),
        prefix_seed=tenant_seed(tenant.tenant) if any(r.cache_isolated for r in kept) else 0,
    )


# --- the pipeline --------------------------------------------------------------------------

def pick_common(cset: CandidateSet, prefix: Sequence[int], stats: Mapping[str, ReplicaStats],
                now: float, prefix_index: PrefixIndex, state: PickerState) -> Replica | None:
    """`schedule_set`'s pick, written out flat for the common case: the load and prefix
    scorers under max_score, with every replica of the set healthy and under its limit. None
    when the case is not that one (the caller then runs `schedule_set`), so the two always
    agree: the same arithmetic in the same order, and the same random draws."""
    weights = cset.common
    replicas = cset.replicas
    n = len(replicas)
    if weights is None or n < 2:
        return None
    limits = cset.limits
    loads = [0.0] * n
    kvs = [0.0] * n
    for i in range(n):
        s = stats.get(replicas[i].id)
        if s is None or not s.probe_ok or now < s.ejected_until or s.inflight >= limits[i]:
            return None
        inflight, running = s.inflight, s.running
        loads[i] = (inflight if inflight > running else running) + s.waiting
        kvs[i] = s.kv_usage
    load_weight, prefix_weight = weights
    table_scores = cset.table_scores
    max_inflight = cset.max_inflight
    # load_score, weighted onto the table scores
    totals = [0.0] * n
    for i in range(n):
        occupancy = loads[i] / max_inflight[i]
        kv = kvs[i]
        totals[i] = table_scores[i] + load_weight * (
            1.0 - 0.7 * (occupancy if occupancy < 1.0 else 1.0)
            - 0.3 * (kv if 0.0 <= kv <= 1.0 else float(kv > 1.0)))
    if prefix:
        pscores = common_prefix_scores(cset, prefix, loads, prefix_index)
        for i in range(n):
            totals[i] = totals[i] + prefix_weight * pscores[i]
    # pick_max_score over the scaled totals
    scale = cset.scale
    best = float("-inf")
    for i in range(n):
        score = totals[i] = totals[i] * scale[i]
        if score > best:
            best = score
    tied = [i for i in range(n) if best - totals[i] <= TIE_EPSILON]
    return replicas[break_tie(tied, loads, state)]


def common_prefix_scores(cset: CandidateSet, prefix: Sequence[int], loads: list[float],
                         prefix_index: PrefixIndex) -> list[float]:
    """`prefix_score` for `pick_common`, on the whole candidate set."""
    return prefix_scores(cset.replicas, cset.id_hashes, prefix, loads, prefix_index)


def schedule_set(
    cset: CandidateSet,
    request: RouteRequest,
    stats: Mapping[str, ReplicaStats],
    now: float,
    prefix_index: PrefixIndex | None = None,
    state: PickerState | None = None,
    exclude: frozenset[str] | set[str] = frozenset(),
) -> Decision:
    """Pick from a candidate set for `request`, or say why none may take it. `exclude`:
    replicas already tried for this request."""
    replicas = cset.replicas
    if not replicas:
        return Decision(None, cset.reason)
    candidates: list[Replica] = []
    candidate_stats: list[ReplicaStats] = []
    kept: list[int] = []
    unhealthy = full = 0
    limits = cset.limits
    for i, replica in enumerate(replicas):
        if exclude and replica.id in exclude:
            continue
        replica_stats = stats.get(replica.id, _NO_STATS)
        # State filters. Healthy: its probe answers and it is not ejected.
        if not replica_stats.probe_ok or now < replica_stats.ejected_until:
            unhealthy += 1
        # Under capacity: fewer requests in flight than this tier may have on it.
        elif replica_stats.inflight >= limits[i]:
            full += 1
        else:
            candidates.append(replica)
            candidate_stats.append(replica_stats)
            kept.append(i)
    if not candidates:
        if full:
            return Decision(None, "at_capacity")
        if unhealthy:
            return Decision(None, "residency_unavailable" if cset.residency_removed
                            else "no_healthy_replica")
        return Decision(None, "no_replicas")  # every replica was already tried
    if len(candidates) == 1 and cset.policy.picker not in SCORELESS_PICKERS:
        return Decision(candidates[0], "ok", candidates)
    return score_and_pick(cset, request, candidates, candidate_stats, kept, prefix_index,
                          state)


def score_and_pick(cset: CandidateSet, request: RouteRequest, candidates: list[Replica],
                   candidate_stats: list[ReplicaStats], kept: list[int],
                   prefix_index: PrefixIndex | None, state: PickerState | None) -> Decision:
    """`schedule_set`'s choice among the `candidates` left by the state filters (`kept`:
    their places in the set)."""
    policy = cset.policy
    picker = policy.picker
    replicas = cset.replicas
    # A replica's load: the edge's own in-flight count or, when other edges add to it, what
    # the engine last reported running; plus the engine's queue.
    loads = [(s.inflight if s.inflight > s.running else s.running) + s.waiting
             for s in candidate_stats]
    if state is None:
        state = PickerState()
    if len(kept) == len(replicas):
        totals = list(cset.table_scores)
        scale: Sequence[float] = cset.scale
        id_hashes: Sequence[int] = cset.id_hashes
    else:
        totals = [cset.table_scores[i] for i in kept]
        scale = [cset.scale[i] for i in kept]
        id_hashes = [cset.id_hashes[i] for i in kept]
    ctx = ScoringContext(candidate_stats, loads, request, prefix_index, policy, id_hashes)
    if picker in SCORELESS_PICKERS:
        choice, scores = PICKERS[picker](candidates, ctx, (), state)
        return Decision(candidates[choice], "ok", candidates, scores)
    for scorer, weight in cset.request_scorers:
        totals = [t + weight * s for t, s in zip(totals, scorer(candidates, ctx), strict=True)]
    scores = [t * k for t, k in zip(totals, scale, strict=True)]
    choice, scores = PICKERS.get(picker, pick_max_score)(candidates, ctx, scores, state)
    return Decision(candidates[choice], "ok", candidates, scores)


def schedule(
    replicas: Sequence[Replica],
    tenant: TenantRules,
    request: RouteRequest,
    stats: Mapping[str, ReplicaStats],
    policy: Policy,
    now: float,
    prefix_index: PrefixIndex | None = None,
    state: PickerState | None = None,
) -> Decision:
    """The whole pipeline in one call: table filters, then `schedule_set`."""
    cset = candidate_set(replicas, tenant, request.tier, policy, request.model)
    return schedule_set(cset, request, stats, now, prefix_index, state)
