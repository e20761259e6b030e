"""Where a running deployment's new replicas go: the solver's cheapest plan that keeps every
running replica (`proposals.place_additions`), else beside the running ones, never outside
the allowed jurisdictions or quota. The autoscaler's scale-ups and a rollout's new
revision's replicas are both placed here; the callers ask provisioning for the replicas."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from controlplane.deployments.models import Deployment, Replica, Revision
from controlplane.deployments.revisions import take_revision
from controlplane.placement.proposals import place_additions, quota_left
from regions.models import Offer, Region

# Keep running replicas whatever the price difference: a scale-up adds, it never moves.
SOLVER_TIME_LIMIT_S = 5.0


@dataclass
class Placement:
    """Where to ask for replicas: (region, offer, spot, count) slots, and how they were
    found (or why none were)."""

    slots: list[tuple[Region, Offer, bool, int]]
    how: str


def place_scale_up(deployment: Deployment, active: Sequence[Replica], add: int,
                   gpu_types: Collection[str] = (), regions: Collection[str] = ()) -> Placement:
    """Where `add` new replicas go: the solver's cheapest plan that keeps every running
    replica; else beside the running ones; never outside the allowed jurisdictions or
    quota. `gpu_types`: only these (a revision's preferred GPU type), else those running;
    `regions` (cloud:code), when given: only there."""
    # New replicas are on the GPU type already running (or, from zero, last run): the
    # in-flight target is per replica, so the fleet stays uniform. Every replica runs the
    # deployment's one engine (TP × PP) whatever the node size, and the solver offers only
    # nodes that hold it, so the node size is the solver's to choose.
    placed = place_additions(deployment, active, add,
                             gpu_types=set(gpu_types) or _replica_kinds(deployment, active),
                             only_regions=regions, time_limit_s=SOLVER_TIME_LIMIT_S)
    if placed.slots:
        return Placement([(o.region, o, spot, n) for o, spot, n in placed.slots],
                         f"solver: {', '.join(f'{n} × {o}' for o, _, n in placed.slots)} "
                         f"(${placed.result.cost_after_usd_h:.2f}/h after)")
    result = placed.result
    why = "; ".join(result.explanation) or f"solver status {result.status}"
    beside = [r for r in active if (not gpu_types
              or (r.offer is not None and r.offer.gpu_type.name in gpu_types))
              and (not regions or r.region.key in regions)]
    return _beside_running(deployment, beside, add, quota_left([deployment.pk]),
                           f"solver found no plan ({why})")


def sized_for(deployment: Deployment, revision: Revision) -> Deployment:
    """The deployment as the solver must size it for `revision`'s engine (model, TP × PP,
    context), unsaved: residency, spread and spot rules stay the deployment's."""
    return take_revision(copy.copy(deployment), revision)


def preferred_gpu_types(revision: Revision) -> set[str]:
    """The revision's preferred GPU type, if it names one: its replicas go only there."""
    gpu = revision.preferred_gpu_type
    return {gpu.name} if gpu is not None else set()


def _replica_kinds(deployment: Deployment, active: Sequence[Replica]) -> set[str]:
    """GPU types of the running replicas; else of the newest one there was."""
    offers = [r.offer for r in active if r.offer is not None]
    if not offers:
        last = (deployment.replicas.filter(offer__isnull=False).select_related("offer__gpu_type")
                .order_by("-created_at").first())
        offers = [last.offer] if last is not None and last.offer is not None else []
    return {o.gpu_type.name for o in offers}


def _beside_running(deployment: Deployment, active: Sequence[Replica], add: int,
                    quota: Mapping[tuple[str, str], int], why: str) -> Placement:
    """Fallback: the regions and offers already running, least-filled first, within quota."""
    allowed = set(deployment.allowed_jurisdictions.values_list("pk", flat=True))
    used: Counter[tuple[str, str]] = Counter()
    per_region: Counter[int] = Counter()
    choices: dict[int, tuple[Replica, Offer]] = {}
    for r in active:
        per_region[r.region_id] += 1
        if r.offer is None:
            continue
        used[(r.region.key, r.offer.gpu_type.name)] += r.offer.gpus_per_node
        if r.region.jurisdiction_id in allowed and r.region.enabled:
            choices.setdefault(r.region_id, (r, r.offer))
    planned: Counter[tuple[int, bool]] = Counter()
    for _ in range(add):
        fits = []
        for region_id, (r, offer) in choices.items():
            pool = (r.region.key, offer.gpu_type.name)
            if pool in quota and quota[pool] - used[pool] < offer.gpus_per_node:
                continue
            fits.append((per_region[region_id], offer.on_demand_usd_h, region_id, r, offer))
        if not fits:
            break
        _, _, region_id, r, offer = min(fits, key=lambda f: f[:3])
        used[(r.region.key, offer.gpu_type.name)] += offer.gpus_per_node
        per_region[region_id] += 1
        planned[(region_id, r.spot)] += 1
    slots = [(choices[rid][0].region, choices[rid][1], spot, n)
             for (rid, spot), n in planned.items()]
    if not slots:
        return Placement([], f"{why}; no running region has room, nothing placed")
    return Placement(slots, f"{why}; placed beside running replicas")
