"""Why a plan is what it is, or why there is none, in words an operator can act on.

Infeasibility is explained in three steps, cheapest first:

1. Static checks per deployment (`precheck`): contradictory settings, no offer left after
   the residency, latency and fit filters (naming the filter that emptied the list), too
   few regions or clouds for the spread, demand beyond max_replicas of the fastest option.
2. Quota (`infeasible`): the problem is solved again with every quota pool elastic: GPUs
   over quota are allowed at a price far above any plan, so the solver uses what quota
   there is and exceeds it by as little as possible. The pools it exceeds are the binding
   quota, worded as "EU has 4 H100 left under quota; deployment X needs 8".
3. Other rule groups: with quota ignored, each group (spread, spot share, replica bounds,
   demand) is relaxed in turn for each deployment; the groups whose relaxation alone yields
   a plan are named.

The solving is done by a callback (`Feasibility`) so this module stays free of the model.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from controlplane.placement.capacity import replica_nodes, valid_tensor_parallel
from controlplane.placement.problem import (
    DeploymentRequest,
    OfferOption,
    PlacementProblem,
    Pool,
    network_budget_ms,
    offer_allowed,
)

if TYPE_CHECKING:
    from controlplane.placement.candidates import Candidate, CandidateIndex
    from controlplane.placement.milp import Block


@dataclass(frozen=True)
class Diagnosis:
    """A relaxed problem's plan (per deployment: option → replicas) and GPUs over quota."""

    plans: Mapping[int, Mapping[Candidate, int]]
    short: Mapping[Pool, int]


# ids of the deployments to solve together, constraint groups to relax → a plan, or None.
Feasibility = Callable[[Sequence[int], frozenset[str]], Diagnosis | None]

RELAXABLE = (
    ("spread_regions", "its spread over {d.spread_regions} regions"),
    ("spread_clouds", "its spread over {d.spread_clouds} clouds"),
    ("spot", "its spot share of at most {d.max_spot_fraction:.0%}"),
    ("max_replicas", "its max_replicas of {d.max_replicas}"),
    ("min_replicas", "its min_replicas of {d.min_replicas}"),
    ("demand", "its demand of {d.tokens_per_s:,.0f} tok/s"),
)


def _where(d: DeploymentRequest) -> str:
    where = ", ".join(sorted(d.allowed_jurisdictions)) or "no jurisdiction"
    if d.allowed_regions:
        where += f" (regions {', '.join(sorted(d.allowed_regions))})"
    return where


def _names(names: Sequence[str]) -> str:
    names = sorted(names)
    if len(names) == 1:
        return f"deployment {names[0]} needs"
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    return f"deployments {shown} need"


def why_not_an_option(d: DeploymentRequest, o: OfferOption | None, spot: bool,
                      index: CandidateIndex) -> str | None:
    """Why replicas on `o` may not stay (None: they may)."""
    if o is None:
        return "the offer is no longer listed (withdrawn, or its region or cloud disabled)"
    if not offer_allowed(d, o):
        if o.jurisdiction not in d.allowed_jurisdictions:
            return (f"{o.region} is in {o.jurisdiction}, outside the jurisdictions "
                    f"{d.name} allows ({_where(d)})")
        return f"{o.region} is not among the regions {d.name} allows"
    rtt, budget = index.rtt(d, o), network_budget_ms(d)
    if rtt > budget:
        return (f"{o.region} is {rtt:.0f} ms round trip from its users; its TTFT SLO of "
                f"{d.ttft_slo_ms:.0f} ms leaves {budget:.0f} ms for the network")
    if index.shape(d, o) is None:
        return unfit(d, o)
    if spot and (o.spot_usd_h is None or d.max_spot_fraction <= 0):
        return ("no spot market there any more" if o.spot_usd_h is None
                else f"{d.name} no longer allows spot replicas")
    return None


def layout(d: DeploymentRequest) -> str:
    """The engine layout a deployment's replicas are launched with."""
    return (f"tp {d.tensor_parallel}" if d.pipeline_parallel == 1
            else f"tp {d.tensor_parallel} × pp {d.pipeline_parallel}")


def unfit(d: DeploymentRequest, o: OfferOption) -> str:
    """Why `d`'s engine cannot run on `o`'s nodes."""
    tp, pp = d.tensor_parallel, d.pipeline_parallel
    if not valid_tensor_parallel(d.model, tp):
        return (f"tensor_parallel {tp} cannot shard {d.model.name}'s "
                f"{d.model.attention_heads} attention and {d.model.kv_heads} KV heads")
    if replica_nodes(tp, pp, o.gpus_per_node) is None:
        return (f"{o.gpus_per_node}× {o.gpu.name} nodes cannot hold {d.name}'s engine "
                f"({layout(d)}: a TP group stays in one node, pipeline stages split evenly "
                "over nodes)")
    return (f"{d.model.name} at {d.context:,} tokens × {d.batch} sequences does not fit "
            f"{tp * pp}× {o.gpu.name} ({layout(d)})")


def no_option(d: DeploymentRequest, problem: PlacementProblem, index: CandidateIndex
              ) -> tuple[str, str]:
    """Which filter left `d` without a single option: the deployment field it binds on
    (its jurisdictions, its users' regions, or its engine's layout) and why, in words."""
    allowed = [o for o in problem.offers if offer_allowed(d, o)]
    if not allowed:
        return ("allowed_jurisdictions",
                f"{d.name}: no offer in {_where(d)}, the only places its data may go")
    budget = network_budget_ms(d)
    near = [o for o in allowed if index.rtt(d, o) <= budget]
    if not near:
        nearest = min(allowed, key=lambda o: index.rtt(d, o))
        return ("user_regions",
                f"{d.name}: no offer in {_where(d)} is within {budget:.0f} ms round trip of "
                f"its users (half its TTFT SLO of {d.ttft_slo_ms:.0f} ms); the nearest, "
                f"{nearest.region}, is {index.rtt(d, nearest):.0f} ms away")
    biggest = max(near, key=lambda o: o.gpu.memory_gib * o.gpus_per_node)
    return ("tensor_parallel",
            f"{d.name}: its engine ({layout(d)}) with {d.model.name} at {d.context:,} tokens "
            f"× {d.batch} sequences runs on no offer in {_where(d)} near its users (the "
            f"largest node is {biggest.gpus_per_node}× {biggest.gpu.name}: "
            f"{unfit(d, biggest)}); change its tensor_parallel/pipeline_parallel or allow "
            "more places")


def precheck(problem: PlacementProblem, blocks: Mapping[int, Block],
             index: CandidateIndex) -> list[str]:
    """What makes a deployment impossible on its own, seen without solving."""
    return [text for found in precheck_each(problem, blocks, index).values()
            for _, text in found]


def precheck_each(problem: PlacementProblem, blocks: Mapping[int, Block],
                  index: CandidateIndex) -> dict[int, list[tuple[str, str]]]:
    """Per deployment id with a problem: (the deployment field the rule binds on, why)."""
    found: dict[int, list[tuple[str, str]]] = {}
    for d in problem.deployments:
        reasons = _precheck_one(d, problem, blocks, index)
        if reasons:
            found[d.id] = reasons
    return found


def _precheck_one(d: DeploymentRequest, problem: PlacementProblem,
                  blocks: Mapping[int, Block], index: CandidateIndex
                  ) -> list[tuple[str, str]]:
    if d.min_replicas > d.max_replicas:
        return [("min_replicas", f"{d.name}: min_replicas {d.min_replicas} exceeds "
                                 f"max_replicas {d.max_replicas}")]
    if not 0 <= d.max_spot_fraction <= 1:
        return [("max_spot_fraction", f"{d.name}: max_spot_fraction {d.max_spot_fraction} "
                                      "is not between 0 and 1")]
    if not d.must_run:
        return []
    cands = blocks[d.id].cands
    if not cands:
        return [no_option(d, problem, index)]
    reasons = []
    for attr, k, noun in (("region", d.spread_regions, "regions"),
                          ("cloud", d.spread_clouds, "clouds")):
        have = sorted({getattr(c.offer, attr) for c in cands})
        if len(have) < k:
            reasons.append((f"spread_{noun}",
                            f"{d.name}: needs {k} {noun} but only {len(have)} in "
                            f"{_where(d)} have an offer that fits near its users "
                            f"({', '.join(have)})"))
    spread = max(d.spread_regions, d.spread_clouds)
    if spread > d.max_replicas:
        reasons.append(("spread_regions",
                        f"{d.name}: spreading over {spread} places needs {spread} "
                        f"replicas but max_replicas is {d.max_replicas}"))
    fastest = max(cands, key=lambda c: c.rate)
    if d.required_tokens_per_s > fastest.rate * d.max_replicas:
        reasons.append((
            "demand_tokens_per_s",
            f"{d.name}: {d.required_tokens_per_s:,.0f} tok/s (demand × headroom "
            f"{d.headroom:g}) is more than max_replicas {d.max_replicas} × "
            f"{fastest.rate:,.0f} tok/s of its fastest option ({fastest.offer.gpu.name} "
            f"in {fastest.offer.region})"))
    return reasons


def infeasible(problem: PlacementProblem, blocks: Mapping[int, Block], ids: Sequence[int],
               run: Feasibility) -> list[str]:
    """Why the deployments `ids` have no plan together (each was checked statically)."""
    diagnosis = run(ids, frozenset({"quota_elastic"}))
    if diagnosis is not None and diagnosis.short:
        return _quota_words(problem, blocks, diagnosis)
    reasons = []
    names = {d.id: d for d in problem.deployments}
    for i in ids:
        d = names[i]
        if run([i], frozenset({"quota"})) is not None:
            continue
        helps = [words.format(d=d) for group, words in RELAXABLE
                 if run([i], frozenset({"quota", group})) is not None]
        if helps:
            reasons.append(f"{d.name}: no plan meets all its rules at once; relaxing "
                           f"{' or '.join(helps)} would give one")
        else:
            reasons.append(f"{d.name}: no plan meets its replica bounds, demand, spread and "
                           "spot share together, even ignoring quota")
    return reasons or ["no plan satisfies every deployment's rules together within quota"]


def _quota_words(problem: PlacementProblem, blocks: Mapping[int, Block],
                 diagnosis: Diagnosis) -> list[str]:
    quota = problem.quota
    jurisdiction = {o.pool: o.jurisdiction for o in problem.offers}
    usable: dict[tuple[str, str], set[Pool]] = defaultdict(set)  # (jurisdiction, gpu) → pools
    for i in diagnosis.plans:
        for c in blocks[i].cands:
            usable[(c.offer.jurisdiction, c.offer.gpu.name)].add(c.pool)
    used: dict[Pool, int] = defaultdict(int)
    users: dict[Pool, set[str]] = defaultdict(set)
    names = {d.id: d.name for d in problem.deployments}
    for i, plan in diagnosis.plans.items():
        for c, n in plan.items():
            used[c.pool] += c.gpus * n
            users[c.pool].add(names[i])
    short_groups: dict[tuple[str, str], list[Pool]] = defaultdict(list)
    for pool in diagnosis.short:
        short_groups[(jurisdiction.get(pool, "?"), pool[1])].append(pool)
    reasons = []
    for (where, gpu), short_pools in sorted(short_groups.items()):
        pools = sorted(usable[(where, gpu)] & set(quota))
        short = sum(diagnosis.short[p] for p in short_pools)
        who = set().union(*(users[p] for p in short_pools))
        if all(used[p] >= quota[p] for p in pools):
            left = sum(quota[p] for p in pools)
            reasons.append(f"{where} has {left} {gpu} left under quota; {_names(list(who))} "
                           f"{left + short}")
        else:  # other rules keep them off part of the jurisdiction's quota: name the pools
            for p in sorted(short_pools):
                reasons.append(f"{p[0]} has {quota[p]} {gpu} left under quota; "
                               f"{_names(list(users[p]))} {quota[p] + diagnosis.short[p]} "
                               f"there")
    return [r + " (raise the quota, or allow more regions or GPU types)" for r in reasons]


# -- reasons for changes ----------------------------------------------------------------------

def describe_option(c: Candidate) -> str:
    s = c.shape
    engine = f"tp {s.tensor_parallel}"
    if s.pipeline_parallel > 1:
        engine += f", pp {s.pipeline_parallel}"
    if s.nodes > 1:
        engine += f" over {s.nodes} nodes"
    if s.ranks < s.gpus:
        engine += f"; {s.gpus - s.ranks} of {s.gpus} GPUs idle"
    market = "spot" if c.spot else "on demand"
    return f"{c.offer.gpu.name}×{c.offer.gpus_per_node} {market} ({engine})"


def add_reason(d: DeploymentRequest, c: Candidate, count: int, best: Candidate,
               plan: Mapping[Candidate, int], used: Mapping[Pool, int],
               quota: Mapping[Pool, int], index: CandidateIndex) -> str:
    """Why `count` more replicas of `d` go on option `c` (`best`: its cheapest option per
    token): the facts, then the choice."""
    o = c.offer
    facts = (f"{count} × {describe_option(c)} in {o.region} ({o.jurisdiction}, allowed for "
             f"{d.name}) at ${c.usd_h:.2f}/h each, ~{c.rate:,.0f} tok/s "
             f"(${c.usd_per_mtok:.3f}/M tokens), {index.rtt(d, o):.0f} ms from its users")
    if c.usd_per_mtok <= best.usd_per_mtok + 1e-12:
        return f"{facts}: the cheapest allowed option per token"
    why = []
    if best.pool in quota and used.get(best.pool, 0) + best.gpus > quota[best.pool]:
        why.append(f"the cheaper {best.offer.gpu.name} in {best.offer.region} is at its quota")
    regions = {a.offer.region for a in plan}
    if d.spread_regions > 1 and len(regions) <= d.spread_regions:
        why.append(f"it spreads {d.name} over {d.spread_regions} regions")
    clouds = {a.offer.cloud for a in plan}
    if d.spread_clouds > 1 and len(clouds) <= d.spread_clouds:
        why.append(f"it spreads {d.name} over {d.spread_clouds} clouds")
    spot = sum(n for a, n in plan.items() if a.spot)
    total = sum(plan.values())
    if best.spot and (spot + 1) > d.max_spot_fraction * (total + 1):
        why.append(f"spot is at its {d.max_spot_fraction:.0%} share")
    if not why and c.usd_h < best.usd_h:
        why.append(f"a smaller replica tops up demand for less than another "
                   f"{best.offer.gpu.name}×{best.offer.gpus_per_node} at ${best.usd_h:.2f}/h")
    if not why:
        why.append("the cheapest mix of whole replicas that meets demand and the minimum")
    return f"{facts}: {'; '.join(why)}"


def remove_reason(d: DeploymentRequest, where: str, count: int, before: int, after: int,
                  saving_usd_h: float, move_penalty_usd_h: float, *,
                  pool_over_quota: bool = False) -> str:
    """Why `count` replicas of `d` leave `where`, when no rule forces it.

    `saving_usd_h` is what the deployment's whole plan saves per hour; a plan that costs
    more never claims a saving: it says what it costs and which rule makes it worth it."""
    if after < before and saving_usd_h > 0 and after == max(d.min_replicas, 0) \
            and d.tokens_per_s <= 0:
        return (f"{count} × in {where}: min_replicas {d.min_replicas} and no demand need "
                f"{after} replicas, not {before}")
    if after < before:
        need = (f"{count} × in {where}: demand of {d.tokens_per_s:,.0f} tok/s (× "
                f"{d.headroom:g} headroom) and min_replicas {d.min_replicas} need {after} "
                f"replicas, not {before}")
        if saving_usd_h > 0:
            return f"{need}; saves ${saving_usd_h:.2f}/h"
        return f"{need}; {_dearer(d, saving_usd_h, pool_over_quota)}"
    if saving_usd_h > move_penalty_usd_h * count:
        return (f"{count} × in {where}: moving to cheaper allowed options saves "
                f"${saving_usd_h:.2f}/h, more than the ${move_penalty_usd_h:.2f}/h move "
                "penalty per moved replica")
    return f"{count} × in {where}: moving {_dearer(d, saving_usd_h, pool_over_quota)}"


def _dearer(d: DeploymentRequest, saving_usd_h: float, pool_over_quota: bool) -> str:
    """What a change that saves little or nothing costs, and the rules it is made for."""
    rules = []
    if pool_over_quota:
        rules.append("to stay within quota")
    if d.spread_regions > 1 or d.spread_clouds > 1:
        rules.append("to meet the spread rule")
    if d.tokens_per_s > 0:
        rules.append(f"to meet its demand of {d.tokens_per_s:,.0f} tok/s")
    if not rules:
        rules.append("to meet its replica bounds, spread, spot share and quota together")
    if saving_usd_h < -0.005:
        cost = f"costs ${-saving_usd_h:.2f}/h more"
    elif saving_usd_h > 0.005:
        cost = f"saves only ${saving_usd_h:.2f}/h"
    else:
        cost = "costs the same"
    return f"{cost}, {' and '.join(rules)}"
