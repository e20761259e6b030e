"""A revision's replicas keep the deployment's spread rule.

A canary at 100% and a promoted revision become the whole fleet, so the revision's own
replicas must span as many regions as `spread_regions` asks (or as many as they are, when
fewer). Each placement of a revision's replicas (a rollout's, and the autoscaler's share for
a canary) first puts one replica in each region it still lacks, preferring the regions given,
then wherever the solver finds room; every placement goes through the solver
(`scale_up.place_scale_up`), so residency, quota and latency targets hold. The caller asks
for each replica (`request`), since provisioning sits above placement.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from controlplane.deployments.models import Deployment, Replica, Revision
from controlplane.placement.proposals import offer_options
from controlplane.placement.scale_up import place_scale_up
from regions.models import Offer, Region

# Asks for one replica of the revision at (region, offer, spot); returns those made (none
# once the tenant's caps allow no more).
Request = Callable[[Region, Offer, bool], list[Replica]]


def regions_short(spread_regions: int, own_regions: Iterable[str], own: int, adding: int) -> int:
    """How many more regions the revision's replicas must cover once `adding` more join its
    `own`: the spread rule, or as many regions as it will have replicas."""
    return max(0, min(spread_regions, own + adding) - len(set(own_regions)))


def place_spread_first(deployment: Deployment, sized: Deployment, revision: Revision,
                       active: list[Replica], count: int, gpu_types: set[str],
                       tries: Sequence[set[str]], request: Request,
                       ) -> tuple[list[Replica], list[str]]:
    """Up to `count` replicas of `revision`, one in each region its replicas still lack for
    the spread rule: each in the first of `tries` (sets of regions; the solver picks the cheapest within one) that has a
    region they lack and room, else in any region they lack that the solver finds room in.
    `active` (the deployment's live replicas) grows by what is asked for. Returns the
    replicas asked for and how each was placed."""
    own = [r for r in active if r.revision_id == revision.pk]
    covered = {r.region.key for r in own}
    short = regions_short(deployment.spread_regions, covered, len(own), count)
    made: list[Replica] = []
    hows: list[str] = []
    anywhere = {o.region for o in offer_options()}
    while short > 0 and len(made) < count:
        placement = None
        for where in [*(set(t) - covered for t in tries), anywhere - covered]:
            if where:
                placement = place_scale_up(sized, active, 1, gpu_types=gpu_types,
                                           regions=where)
                if placement.slots:
                    break
        if placement is None or not placement.slots:
            break
        region, offer, spot, _ = placement.slots[0]
        new = request(region, offer, spot)
        if not new:
            break  # the tenant's caps: nothing more may be asked for
        made += new
        active.extend(new)
        covered.add(region.key)
        short -= 1
        hows.append(f"{region.key} for the spread rule ({deployment.spread_regions} "
                    f"regions): {placement.how}")
    return made, hows

