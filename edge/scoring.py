"""What the scheduling pipeline (`edge.policy`) works with, and how it rates and chooses.

The request as the pipeline sees it (`RouteRequest`), the picker's memory (`PickerState`),
what scorers read (`ScoringContext`) and the answer (`Decision`); the scorers, which rate
candidates in [0, 1], and the pickers, which choose one, each registered by name (the
table's `policy.scorers` weighs scorers, `policy.picker` names the picker). Pure.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from edge.health import ReplicaStats
from edge.prefix import PrefixIndex, load_bound, rendezvous_weight, replica_id_hash
from edge.table import Policy, Replica

# A prompt's home is decided by its first blocks (≈ 64 tokens): users sharing a system prompt
# share a home, so their first turns reuse its cached blocks.
AFFINITY_BLOCKS = 4
# What being a prefix's home is worth when no replica is remembered to hold more of it.
HOME_SCORE = 0.5
# Consistent hashing with bounded loads: a replica attracts prefixes while its load is under
# max(LOAD_BOUND_FLOOR, LOAD_BOUND_FACTOR × mean load).
LOAD_BOUND_FACTOR = 1.25
LOAD_BOUND_FLOOR = 4.0
RTT_HALF_SCORE_MS = 25.0
TIE_EPSILON = 1e-9


class RouteRequest:
    """What the pipeline needs to know about one request.

    A plain class rather than a dataclass: one is made per request, and a dataclass's
    generated `__init__` stays interpreted Python in the compiled edge."""

    __slots__ = ("model", "tier", "prefix", "prompt_tokens")

    def __init__(self, model: str, tier: str = "interactive", prefix: Sequence[int] = (),
                 prompt_tokens: int = 0) -> None:
        self.model = model
        self.tier = tier
        self.prefix = prefix
        self.prompt_tokens = prompt_tokens

    def __repr__(self) -> str:
        return (f"RouteRequest(model={self.model!r}, tier={self.tier!r}, "
                f"prefix={list(self.prefix)!r}, prompt_tokens={self.prompt_tokens})")


@dataclass(slots=True)
class PickerState:
    """Mutable picker memory (round-robin positions, the random source), owned by the caller."""

    rng: random.Random = field(default_factory=random.Random)
    positions: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class Decision:
    replica: Replica | None
    reason: str  # "ok", or why nothing was picked: the error code the client sees
    candidates: Sequence[Replica] = ()
    candidate_scores: Sequence[float] = ()

    @property
    def scores(self) -> dict[str, float]:
        """Each scored candidate's combined score, by replica id (empty if none were scored)."""
        return {r.id: s for r, s in zip(self.candidates, self.candidate_scores, strict=False)}


@dataclass(slots=True)
class ScoringContext:
    """What scorers read: each candidate's stats, load and id hash, aligned with the
    candidates."""

    stats: Sequence[ReplicaStats]
    loads: Sequence[float]
    request: RouteRequest
    prefix_index: PrefixIndex | None
    policy: Policy
    id_hashes: Sequence[int] = ()


# --- scorers -------------------------------------------------------------------------------

Scorer = Callable[[Sequence[Replica], ScoringContext], list[float]]
SCORERS: dict[str, Scorer] = {}
# Scorers that read only the table (not stats or the request): run once per candidate set.
TABLE_SCORERS: set[str] = set()


def register_scorer(name: str, table_only: bool = False) -> Callable[[Scorer], Scorer]:
    def register(fn: Scorer) -> Scorer:
        SCORERS[name] = fn
        if table_only:
            TABLE_SCORERS.add(name)
        return fn
    return register


@register_scorer("latency", table_only=True)
def latency_score(candidates: Sequence[Replica], ctx: ScoringContext) -> list[float]:
    """1 at 0 ms, ½ at RTT_HALF_SCORE_MS, falling off beyond."""
    return [1.0 / (1.0 + r.rtt_ms / RTT_HALF_SCORE_MS) for r in candidates]


@register_scorer("cost", table_only=True)
def cost_score(candidates: Sequence[Replica], ctx: ScoringContext) -> list[float]:
    """Cheapest known $/token among the candidates over this one's; 0.5 when unknown."""
    known = [r.usd_per_mtok for r in candidates if r.usd_per_mtok is not None]
    cheapest = min(known) if known else None
    scores = []
    for replica in candidates:
        price = replica.usd_per_mtok
        if price is None or cheapest is None:
            scores.append(0.5)
        elif price <= 0:
            scores.append(1.0)
        else:
            scores.append(cheapest / price if cheapest > 0 else 0.0)
    return scores


@register_scorer("load")
def load_score(candidates: Sequence[Replica], ctx: ScoringContext) -> list[float]:
    """1 when idle; 0.7 of it is occupancy (load / max_inflight), 0.3 the KV cache's use."""
    scores = []
    for replica, stats, load in zip(candidates, ctx.stats, ctx.loads, strict=True):
        occupancy = load / replica.max_inflight
        kv = stats.kv_usage
        scores.append(1.0 - 0.7 * (occupancy if occupancy < 1.0 else 1.0)
                      - 0.3 * (kv if 0.0 <= kv <= 1.0 else float(kv > 1.0)))
    return scores


@register_scorer("prefix")
def prefix_score(candidates: Sequence[Replica], ctx: ScoringContext) -> list[float]:
    """The share of the prompt's blocks a replica is remembered to hold; HOME_SCORE for the
    prefix's bounded-load home if that is more; 0 for a replica over the load bound."""
    keys = ctx.request.prefix
    if not keys:
        return [0.0] * len(candidates)
    id_hashes = ctx.id_hashes or [replica_id_hash(r.id) for r in candidates]
    return prefix_scores(candidates, id_hashes, keys, ctx.loads, ctx.prefix_index)


def prefix_scores(candidates: Sequence[Replica], id_hashes: Sequence[int], keys: Sequence[int],
                  loads: Sequence[float], index: PrefixIndex | None) -> list[float]:
    """`prefix_score`'s figures for a non-empty prompt `keys` (also `pick_common`'s)."""
    bound = load_bound(loads, LOAD_BOUND_FACTOR, LOAD_BOUND_FLOOR)
    affinity_key = keys[min(AFFINITY_BLOCKS, len(keys)) - 1]
    depth = len(keys)
    # Most prompts are either new or wholly known; one look at the deepest block settles
    # those, and only the rest need a search.
    whole = index.holders(keys[-1]) if index is not None else None
    scores = []
    home = -1
    home_weight = -1
    for i in range(len(candidates)):
        if loads[i] >= bound:
            # Over the bound a replica stops attracting prefixes, so a hot one spills over.
            scores.append(0.0)
            continue
        replica_id = candidates[i].id
        if whole is not None and replica_id in whole:
            scores.append(1.0)
        elif index is not None:
            scores.append(index.matched_blocks(keys, replica_id) / depth)
        else:
            scores.append(0.0)
        weight = rendezvous_weight(affinity_key, id_hashes[i])
        if weight > home_weight:
            home, home_weight = i, weight
    if home >= 0 and scores[home] < HOME_SCORE:
        scores[home] = HOME_SCORE
    return scores


# --- pickers -------------------------------------------------------------------------------

Picker = Callable[[Sequence[Replica], ScoringContext, Sequence[float], PickerState],
                  tuple[int, list[float]]]
PICKERS: dict[str, Picker] = {}


def register_picker(name: str) -> Callable[[Picker], Picker]:
    def register(fn: Picker) -> Picker:
        PICKERS[name] = fn
        return fn
    return register


@register_picker("max_score")
def pick_max_score(candidates: Sequence[Replica], ctx: ScoringContext, scores: Sequence[float],
                   state: PickerState) -> tuple[int, list[float]]:
    """Highest score; among ties, the less loaded of two drawn at random."""
    best = max(scores)
    tied = [i for i, s in enumerate(scores) if best - s <= TIE_EPSILON]
    return break_tie(tied, ctx.loads, state), list(scores)


def break_tie(tied: list[int], loads: Sequence[float], state: PickerState) -> int:
    """One of the tied candidates: the less loaded of two distinct ones drawn at random
    (power of two choices); the only one, without a draw."""
    if len(tied) == 1:
        return tied[0]
    rng, n = state.rng, len(tied)
    i = int(rng.random() * n)
    j = int(rng.random() * (n - 1))
    if j >= i:
        j += 1
    a, b = tied[i], tied[j]
    return a if loads[a] <= loads[b] else b


@register_picker("round_robin")
def pick_round_robin(candidates: Sequence[Replica], ctx: ScoringContext,
                     scores: Sequence[float], state: PickerState) -> tuple[int, list[float]]:
    model = ctx.request.model
    position = state.positions.get(model, 0)
    state.positions[model] = position + 1
    return position % len(candidates), []


@register_picker("random")
def pick_random(candidates: Sequence[Replica], ctx: ScoringContext, scores: Sequence[float],
                state: PickerState) -> tuple[int, list[float]]:
    return int(state.rng.random() * len(candidates)), []


# Pickers that choose without looking at scores; scoring is skipped for them.
SCORELESS_PICKERS = {"round_robin", "random"}
