"""Where a rollout's new revision's replicas go: placed like any replica
(`placement.scale_up.place_scale_up`: the solver, residency, quota, the revision's preferred
GPU type), one first in each region the revision lacks for the spread rule
(`placement.spread_first`), then beside the stable replicas that served the most, so that
the analysis compares the two revisions at the same network distance from the edges.
How many canary replicas a step needs (`canary_target`) is here too."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Collection, Iterable, Sequence
from datetime import datetime, timedelta

from django.utils import timezone

from controlplane.deployments.lifecycle import LIVE_STATES, SERVING_STATES
from controlplane.deployments.models import Deployment, Replica, Revision
from controlplane.placement.scale_up import (
    Placement,
    place_scale_up,
    preferred_gpu_types,
    sized_for,
)
from controlplane.placement.spread_first import Request, place_spread_first
from controlplane.provisioning.tasks import request_replicas
from controlplane.rollouts.models import Rollout
from controlplane.telemetry.models import ReplicaSample
from controlplane.telemetry.windows import growth
from regions.models import Offer, Region

# How far back the stable replicas' served requests are counted to find the busiest region.
BUSIEST_WINDOW = timedelta(minutes=5)


def canary_target(weight: int, stable_serving: int) -> int:
    """Canary replicas that carry `weight`% of the traffic at the load each stable replica
    carries: w / (100 − w) of the stable ones (as many as them at 100%), at least one."""
    if weight >= 100:
        return max(1, stable_serving)
    return max(1, math.ceil(stable_serving * weight / (100 - weight) - 1e-9))


def stable_serving(rollout: Rollout) -> list[Replica]:
    """The serving replicas of the revisions the rollout replaces."""
    return list(Replica.objects.filter(deployment_id=rollout.deployment_id,
                                       state__in=SERVING_STATES)
                .exclude(revision=rollout.to_revision)
                .select_related("region", "offer").order_by("id"))


def grow_canary(rollout: Rollout, weight: int, actor: str) -> tuple[list[Replica], str]:
    """Ask for the canary replicas `weight` needs beyond those live, placed like any
    replica (`place_revision`). Returns them and, when fewer could be placed than were
    missing, why."""
    live = Replica.objects.filter(revision=rollout.to_revision, state__in=LIVE_STATES).count()
    missing = canary_target(weight, len(stable_serving(rollout))) - live
    made, how = place_revision(rollout.deployment, rollout.to_revision, missing, actor=actor,
                               reason=f"canary of rollout {rollout.pk} at {weight}%")
    return made, how if len(made) < missing else ""


def place_revision(deployment: Deployment, revision: Revision, count: int, *, actor: str,
                   reason: str, regions: Collection[str] = (),
                   prefer: Sequence[str] | None = None,
                   spread_only: bool = False) -> tuple[list[Replica], str]:
    """`count` replicas of `revision`, placed as the autoscaler places a scale-up
    (`placement.scale_up.place_scale_up`): the solver's cheapest plan that keeps every
    running replica, within the allowed jurisdictions, latency targets and quota, on the
    revision's preferred GPU type (else the type running); else beside running replicas
    with quota left; else none. Without `regions`, one replica first goes to each region
    the revision's replicas lack for the spread rule (`spread_first.place_spread_first`;
    `prefer`: the regions to try first, else the stable revision's, busiest first). Returns
    the replicas asked for and how they were placed (or why not); with `spread_only`, only
    those the spread rule asks for."""
    if count <= 0:
        return [], ""
    active = list(Replica.objects.staying().filter(deployment=deployment)
                  .select_related("region__cloud", "offer__gpu_type"))
    gpu_types = preferred_gpu_types(revision)
    sized = sized_for(deployment, revision)
    made: list[Replica] = []
    hows: list[str] = []
    served = ({} if regions else
              served_by_region(r for r in active if r.revision_id != revision.pk))
    if not regions:
        tries = ([where for where, _ in _canary_regions(served) if where] if prefer is None
                 else [{key} for key in prefer])
        made, hows = place_spread_first(deployment, sized, revision, active, count, gpu_types,
                                        tries, _requester(deployment, revision, actor, reason))
    if count - len(made) <= 0 or spread_only:
        return made, "; ".join(hows)
    placement = None
    # Beside the stable replicas that serve the most; then anywhere they serve; then
    # wherever the solver finds room.
    rest = ([(set(regions), f"in {', '.join(sorted(regions))}"),
              (set(), "where the solver found room")] if regions
             else _canary_regions(served))
    for where_to, where in rest:
        placement = place_scale_up(sized, active, count - len(made), gpu_types=gpu_types,
                                   regions=where_to)
        if placement.slots:
            placement = Placement(placement.slots, f"{where}: {placement.how}")
            break
    assert placement is not None
    for region, offer, spot, n in placement.slots:
        made += request_replicas(deployment, region, n, actor=actor, reason=reason,
                                 spot=spot, offer=offer, revision=revision)
    return made, "; ".join([*hows, placement.how])


def _requester(deployment: Deployment, revision: Revision, actor: str, reason: str) -> Request:
    def request(region: Region, offer: Offer, spot: bool) -> list[Replica]:
        return request_replicas(deployment, region, 1, actor=actor, reason=reason,
                                spot=spot, offer=offer, revision=revision)
    return request


def served_by_region(replicas: Iterable[Replica],
                     now: datetime | None = None) -> dict[str, float]:
    """Requests these replicas finished in the last BUSIEST_WINDOW, by region (cloud:code),
    from the engines' counters as telemetry stored them, an engine restart inside the window
    counted from its new start (`telemetry.windows.growth`); 0 for a region without
    samples."""
    now = now or timezone.now()
    replicas = list(replicas)
    served = {r.region.key: 0.0 for r in replicas}
    region_of = {r.pk: r.region.key for r in replicas}
    readings: dict[int, list[dict[str, float]]] = defaultdict(list)
    rows = (ReplicaSample.objects.filter(replica_id__in=list(region_of), up=True,
                                         at__gte=now - BUSIEST_WINDOW, at__lte=now)
            .order_by("replica_id", "at").values_list("replica_id", "counters"))
    for replica_id, counters in rows:
        readings[replica_id].append(counters)
    for replica_id, counters_seen in readings.items():
        grew = growth(counters_seen, ("requests_ok",)).get("requests_ok", 0.0)
        served[region_of[replica_id]] += grew
    return served


def _canary_regions(served: dict[str, float]) -> list[tuple[set[str], str]]:
    """Where to try placing a revision's new replicas, in order, from what the other
    revisions' replicas `served` by region: the region whose stable replicas served the
    most, when one did; any region with stable replicas (the solver's cheapest of them);
    anywhere."""
    ranked = sorted(served, key=lambda key: (-served[key], key))
    tries: list[tuple[set[str], str]] = []
    if ranked and served[ranked[0]] > (served[ranked[1]] if len(ranked) > 1 else -1.0):
        tries.append(({ranked[0]}, f"beside the busiest stable replicas ({ranked[0]})"))
    if ranked:
        tries.append((set(ranked), "beside stable replicas"))
    tries.append((set(), "where the solver found room (no stable region had any)"
                  if ranked else "where the solver found room"))
    return tries
