"""The rules running replicas break, found for the periodic replan (plans.replan, step 1):
a region disabled (or its cloud) or down, an offer that no longer exists, a region outside
the deployment's jurisdictions, a deployment in fewer regions than its spread asks, a
replica farther from its users than its latency target allows, a quota pool over its limit,
and a price that moved since the plan that placed the replica. The replan's thresholds are
here too, as the price rule reads one of them."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import timedelta

from django.conf import settings

from controlplane.deployments.lifecycle import LIVE_STATES
from controlplane.deployments.models import Deployment, Replica
from controlplane.failover.models import Health, RegionHealth
from controlplane.placement import rules as placement_rules
from controlplane.placement.candidates import CandidateIndex
from controlplane.placement.capacity import replica_nodes
from controlplane.placement.models import ChangeAction, PlanChange, PlanStatus
from controlplane.placement.problem import OfferOption
from controlplane.placement.proposals import deployment_request
from regions.models import Quota


@dataclass(frozen=True)
class Thresholds:
    min_saving_usd_h: float = 1.0
    min_saving_fraction: float = 0.05
    price_change_fraction: float = 0.02
    rejected_cooldown: timedelta = timedelta(hours=24)

    @classmethod
    def from_settings(cls) -> Thresholds:
        meridian = settings.MERIDIAN
        return cls(meridian["REPLAN_MIN_SAVING_USD_H"], meridian["REPLAN_MIN_SAVING_FRACTION"],
                   meridian["REPLAN_PRICE_CHANGE_FRACTION"], meridian["REPLAN_REJECTED_COOLDOWN"])

    def saving_passes(self, before: float, after: float) -> bool:
        saving = before - after
        return (saving >= self.min_saving_usd_h and before > 0
                and saving / before >= self.min_saving_fraction)


@dataclass(frozen=True)
class BrokenRule:
    kind: str  # region_disabled | region_down | offer_missing | jurisdiction | spread | latency
    # | quota | price
    detail: str
    deployment: str = ""
    region: str = ""
    replicas: tuple[int, ...] = ()


def _live(deployments: list[Deployment]) -> list[Replica]:
    return list(Replica.objects.staying().filter(deployment__in=deployments)
                .select_related("deployment", "region__cloud", "region__jurisdiction",
                                "offer__gpu_type", "offer__region__cloud"))


def down_regions() -> dict[int, str]:
    return dict(RegionHealth.objects.filter(state=Health.DOWN).values_list("region_id", "reason"))


def plan_prices(replica_ids: list[int]) -> dict[int, float]:
    """$/h per replica as priced by the newest plan that added it."""
    wanted = set(replica_ids)
    prices: dict[int, float] = {}
    changes = PlanChange.objects.filter(
        action=ChangeAction.ADD, plan__status__in=(PlanStatus.APPLYING, PlanStatus.APPLIED),
        count__gt=0).exclude(replica_ids=[]).order_by("plan_id", "id")
    for change in changes.only("replica_ids", "usd_h_delta", "count"):
        each = float(change.usd_h_delta) / change.count
        for pk in change.replica_ids:
            if pk in wanted:
                prices[pk] = each
    return prices


def find_broken_rules(deployments: list[Deployment], options: tuple[OfferOption, ...],
                      thresholds: Thresholds) -> list[BrokenRule]:
    """Every rule the running replicas of `deployments` break, grouped per deployment/region."""
    replicas = _live(deployments)
    down = down_regions()
    groups: dict[tuple[str, str, str, str], list[int]] = defaultdict(list)
    allowed = {d.pk: {j.pk for j in d.allowed_jurisdictions.all()} for d in deployments}
    for r in replicas:
        region, name = r.region.key, r.deployment.name
        if not r.region.enabled or not r.region.cloud.enabled:
            what = "region" if not r.region.enabled else f"cloud {r.region.cloud.name}"
            groups[("region_disabled", name, region, f"{region}: {what} disabled")].append(r.pk)
        elif r.region_id in down:
            why = down[r.region_id] or "no healthy replicas"
            groups[("region_down", name, region, f"{region} is down ({why})")].append(r.pk)
        if r.offer_id is None:
            groups[("offer_missing", name, region,
                    f"no offer behind it in {region} any more")].append(r.pk)
        if r.region.jurisdiction_id not in allowed.get(r.deployment_id, set()):
            groups[("jurisdiction", name, region,
                    f"{region} is outside the jurisdictions {name} allows")].append(r.pk)
    broken = [BrokenRule(kind, detail, name, region, tuple(pks))
              for (kind, name, region, detail), pks in groups.items()]
    shapes = _Shapes(deployments, options)
    broken += _spread_broken(deployments, replicas, shapes)
    broken += _quota_broken(replicas, shapes)
    broken += _price_broken(replicas, shapes, thresholds)
    return broken


class _Shapes:
    """Nodes per replica, as provisioning launched it: the deployment's tp × pp ranks on
    its offer's nodes (`capacity.replica_nodes`). A layout the nodes cannot hold (settings
    changed since the launch) has no count of its own; it counts one node, like a replica
    that cannot be sized at all."""

    def __init__(self, deployments: list[Deployment], options: tuple[OfferOption, ...]) -> None:
        self.options = {o.id: o for o in options}
        self.requests = {d.pk: deployment_request(d) for d in deployments}
        self.index = CandidateIndex(options)

    def nodes(self, r: Replica) -> int:
        o = self.options.get(r.offer_id) if r.offer_id else None
        d = self.requests.get(r.deployment_id)
        if o is None or d is None:
            return 1
        shape = self.index.shape(d, o)
        if shape is not None:
            return shape.nodes
        return replica_nodes(d.tensor_parallel, d.pipeline_parallel, o.gpus_per_node) or 1


def _spread_broken(deployments: list[Deployment], replicas: list[Replica], shapes: _Shapes
                   ) -> list[BrokenRule]:
    """The spread and latency rules the live replicas break (`placement.rules.violations`,
    the words the API, the dashboard and the alert use); spread only where enough usable
    regions exist (failover lowers the spread while a region is down; this moves back).
    Residency is `find_broken_rules`' jurisdiction check, per region."""
    placed: dict[int, list[placement_rules.Placed]] = defaultdict(list)
    for r in replicas:
        placed[r.deployment_id].append(placement_rules.placed(r))
    out = []
    for d in deployments:
        allowed = shapes.requests[d.pk].allowed_jurisdictions
        usable = {o.region for o in shapes.options.values() if o.jurisdiction in allowed}
        for v in placement_rules.violations(placement_rules.Rules.of(d), placed.get(d.pk, [])):
            if v.kind == placement_rules.SPREAD and len(usable) >= d.spread_regions:
                out.append(BrokenRule("spread", f"{d.name}: {v.text}", d.name, "", v.replicas))
            elif v.kind == placement_rules.LATENCY:
                out.append(BrokenRule("latency", f"{d.name}: {v.text}", d.name, "", v.replicas))
    return out


def _quota_broken(replicas: list[Replica], shapes: _Shapes) -> list[BrokenRule]:
    ours: Counter[tuple[int, int]] = Counter()
    who: dict[tuple[int, int], list[int]] = defaultdict(list)
    for r in replicas:
        if r.offer is not None:
            key = (r.region_id, r.offer.gpu_type_id)
            ours[key] += r.offer.gpus_per_node * shapes.nodes(r)
            who[key].append(r.pk)
    if not ours:
        return []
    mine = {r.pk for r in replicas}
    everyone = Counter(ours)
    for r in Replica.objects.filter(state__in=LIVE_STATES, offer__isnull=False).exclude(
            pk__in=mine).select_related("offer"):
        if r.offer is not None:
            everyone[(r.region_id, r.offer.gpu_type_id)] += (
                r.offer.gpus_per_node * shapes.nodes(r))
    out = []
    for q in Quota.objects.filter(region_id__in={k[0] for k in ours}).select_related(
            "region__cloud", "gpu_type"):
        key = (q.region_id, q.gpu_type_id)
        if key not in ours:
            continue
        used = max(q.in_use_gpus, everyone[key])
        if used > q.limit_gpus:
            out.append(BrokenRule(
                "quota", f"{q.region.key} runs {used} {q.gpu_type.name} GPUs under a quota of "
                f"{q.limit_gpus}", "", q.region.key, tuple(sorted(who[key]))))
    return out


def _price_broken(replicas: list[Replica], shapes: _Shapes, thresholds: Thresholds
                  ) -> list[BrokenRule]:
    then = plan_prices([r.pk for r in replicas])
    if not then:
        return []
    moved: dict[tuple[str, str, str], list[tuple[int, float, float]]] = defaultdict(list)
    for r in replicas:
        o = shapes.options.get(r.offer_id) if r.offer_id else None
        if r.pk not in then or o is None:
            continue
        nodes = shapes.nodes(r)
        per_node = o.spot_usd_h if r.spot and o.spot_usd_h is not None else o.on_demand_usd_h
        now, was = per_node * nodes, then[r.pk]
        if was > 0 and abs(now - was) / was > thresholds.price_change_fraction:
            moved[(r.deployment.name, r.region.key, o.label)].append((r.pk, was, now))
    return [BrokenRule("price", f"{label}: ${rows[0][1]:.2f}/h when placed, ${rows[0][2]:.2f}/h "
                       "now", name, region, tuple(pk for pk, _, _ in rows))
            for (name, region, label), rows in moved.items()]
