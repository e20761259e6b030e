"""The periodic replan: look for broken rules, solve the fleet, and propose only when it pays.

Every run (`placement.replan`, under an advisory lock):

1. finds the rules running replicas break — a region disabled (or its cloud), a region whose
   RegionHealth is down, an offer that no longer exists, a region outside the deployment's
   jurisdictions, a deployment in fewer regions than its spread asks while enough usable
   regions exist (failover placed its replacements elsewhere, or an earlier release's
   rollout squeezed it), a replica farther from the deployment's users than its latency
   target allows (spread and latency in `placement.rules`' words), a quota pool running more GPUs
   than its limit, a price that moved since the plan that placed the replica;
2. solves the whole fleet (offers in down regions are not options, so replicas there must go);
   a deployment no plan can place is left out, its replicas untouched, and marked with why
   (`placement_problem`), so it never blocks the others;
3. stores a Plan only when it changes something and either a rule is broken or the saving
   passes both thresholds (absolute $/h and a fraction of today's $/h); a plan identical to
   the one already proposed is kept, not repeated, and one an operator rejected recently is
   not proposed again;
4. records on the plan the fleet state it was computed from (its basis, read before the
   solve) and marks superseded the older open plans over any of the same deployments; an
   earlier proposed plan with the same changes is kept only while its basis still holds;
5. approves and applies the plan as `system:replan` when every deployment it changes allows
   `auto_apply_plans` — through `plans.approve`/`plans.start_apply`, so make-before-break
   holds — and otherwise leaves it for an operator.

Thresholds are settings, read and checked at start-up (controlplane/settings.py):
MERIDIAN_REPLAN_MIN_SAVING_USD_H (1.0), MERIDIAN_REPLAN_MIN_SAVING_FRACTION (0.05),
MERIDIAN_REPLAN_PRICE_CHANGE_FRACTION (0.02), MERIDIAN_REPLAN_REJECTED_COOLDOWN_H (24).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from decimal import Decimal
from typing import Any

from django.db import transaction
from django.utils import timezone

from controlplane.core.services import record_audit
from controlplane.deployments.caps import plan_allowances
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.deployments.services import mark_placeable, mark_unplaceable
from controlplane.placement import basis
from controlplane.placement.models import ChangeAction, Plan, PlanChange, PlanStatus
from controlplane.placement.problem import ExistingReplica, OfferOption, PlacementProblem
from controlplane.placement.proposals import (
    cap_shortfalls,
    deployment_request,
    offer_options,
    quota_left,
    store_plan,
    within_tenant_caps,
)
from controlplane.placement.result import PlacementResult
from controlplane.placement.search import solve_placeable
from controlplane.plans import apply as plans
from controlplane.plans import freshness
from controlplane.plans.broken_rules import (
    BrokenRule,
    Thresholds,
    down_regions,
    find_broken_rules,
)
from regions.models import Region

ACTOR = "system:replan"
IN_FLIGHT = (PlanStatus.APPLYING,)
ChangeRow = tuple[int, str, int | None, int, bool, int]  # deployment, action, offer, region…


@dataclass
class ReplanOutcome:
    action: str  # proposed | applied | unchanged | none | skipped | infeasible
    reason: str
    broken: list[BrokenRule] = field(default_factory=list)
    cost_before_usd_h: float = 0.0
    cost_after_usd_h: float = 0.0
    plan: Plan | None = None
    superseded: list[int] = field(default_factory=list)

    @property
    def saving_usd_h(self) -> float:
        return self.cost_before_usd_h - self.cost_after_usd_h

    def summary(self) -> dict[str, Any]:
        return {"action": self.action, "reason": self.reason,
                "plan": self.plan.pk if self.plan else None,
                "broken": [b.kind for b in self.broken], "superseded": self.superseded,
                "cost_before_usd_h": round(self.cost_before_usd_h, 4),
                "cost_after_usd_h": round(self.cost_after_usd_h, 4)}


# -- the problem and the run ------------------------------------------------------------------

def build_problem(deployments: list[Deployment], options: tuple[OfferOption, ...]
                  ) -> PlacementProblem:
    """Like proposals.build_problem, but draining replicas are leaving already: they are not
    kept by the plan, and the GPUs they still hold are not offered to it."""
    ids = [d.pk for d in deployments]
    quota = quota_left(ids)
    draining: Counter[tuple[str, str]] = Counter()
    for r in Replica.objects.filter(deployment_id__in=ids, state=S.DRAINING,
                                    offer__isnull=False).select_related(
            "region__cloud", "offer__gpu_type"):
        if r.offer is not None:
            draining[(r.region.key, r.offer.gpu_type.name)] += r.offer.gpus_per_node
    for pool, gpus in draining.items():
        if pool in quota:
            quota[pool] = max(quota[pool] - gpus, 0)
    counts: Counter[tuple[int, int, bool]] = Counter()
    for r in Replica.objects.staying().filter(deployment_id__in=ids, offer__isnull=False):
        if r.offer_id is not None:
            counts[(r.deployment_id, r.offer_id, r.spot)] += 1
    existing = tuple(ExistingReplica(d, o, s, n) for (d, o, s), n in counts.items())
    allowed = plan_allowances(deployments)
    return PlacementProblem(
        tuple(within_tenant_caps(deployment_request(d), allowed.get(d.pk)) for d in deployments),
        options, quota, existing)


def _signature(changes: list[ChangeRow]) -> list[list[Any]]:
    return sorted([list(c) for c in changes], key=repr)


def _result_signature(result: PlacementResult, broken: list[BrokenRule]) -> list[list[Any]]:
    rows: list[ChangeRow] = [(c.deployment_id, c.action, c.offer_id, 0, c.spot, c.count)
                             for c in result.changes]
    return _signature(rows + _orphan_rows(broken))


def _orphan_rows(broken: list[BrokenRule]) -> list[ChangeRow]:
    """Removals for replicas whose offer is gone (the solver cannot see them)."""
    rows: list[ChangeRow] = []
    orphans = Replica.objects.filter(pk__in=[pk for b in broken if b.kind == "offer_missing"
                                             for pk in b.replicas])
    grouped: Counter[tuple[int, int, bool]] = Counter(
        (r.deployment_id, r.region_id, r.spot) for r in orphans)
    for (deployment_id, region_id, spot), n in sorted(grouped.items()):
        rows.append((deployment_id, "remove", None, region_id, spot, n))
    return rows


def _plan_signature(plan: Plan) -> list[list[Any]]:
    rows: list[ChangeRow] = [
        (c.deployment_id, c.action, c.offer_id, 0 if c.offer_id else c.region_id, c.spot,
         c.count) for c in plan.changes.all()]
    return _signature(rows)


def replan(*, thresholds: Thresholds | None = None) -> ReplanOutcome:
    """One replan of the whole fleet; see the module's docstring."""
    thresholds = thresholds or Thresholds.from_settings()
    deployments = list(Deployment.objects.select_related("model").prefetch_related(
        "allowed_jurisdictions", "user_regions").order_by("name"))
    if not deployments:
        return ReplanOutcome("none", "no deployments")
    scope = sorted(d.name for d in deployments)
    busy = Plan.objects.filter(status__in=IN_FLIGHT).order_by("pk").first()
    if busy is not None:
        return ReplanOutcome("skipped", f"plan {busy.pk} is {busy.status}; replanning waits")

    taken = basis.snapshot(d.pk for d in deployments)
    down = {r.key for r in Region.objects.filter(pk__in=down_regions()).select_related("cloud")}
    options = tuple(o for o in offer_options() if o.region not in down)
    broken = find_broken_rules(deployments, options, thresholds)
    result = solve_placeable(build_problem(deployments, options))
    unplaced = dict(result.unplaced)
    if result.has_plan:
        mark_placeable(d.pk for d in deployments if d.pk not in unplaced)
    mark_unplaceable(unplaced)
    mark_unplaceable(cap_shortfalls(deployments))
    outcome = ReplanOutcome("none", "", broken, result.cost_before_usd_h,
                            result.cost_after_usd_h)
    orphans = _orphan_rows(broken)
    if result.status == "infeasible":
        if not broken:
            outcome.reason = "no feasible plan, and no rule broken today"
            return outcome
    elif not result.changes and not orphans:
        outcome.reason = "the fleet is where the solver would put it"
        return outcome
    elif not broken and not thresholds.saving_passes(result.cost_before_usd_h,
                                                     result.cost_after_usd_h):
        outcome.reason = (f"saving ${outcome.saving_usd_h:.2f}/h of "
                          f"${result.cost_before_usd_h:.2f}/h is below the thresholds "
                          f"(${thresholds.min_saving_usd_h:.2f}/h and "
                          f"{thresholds.min_saving_fraction:.0%})")
        return outcome

    earlier = _same_as_earlier(scope, thresholds, result, broken, outcome)
    if earlier is not None:
        return earlier
    return _propose(deployments, taken, result, broken, thresholds, outcome)


def _same_as_earlier(scope: list[str], thresholds: Thresholds, result: PlacementResult,
                     broken: list[BrokenRule], outcome: ReplanOutcome) -> ReplanOutcome | None:
    """The outcome when an earlier replan plan already holds these changes: still proposed
    (applied now if allowed), infeasible for the same reason, or rejected by a person within
    the cooldown; None when none does and a new plan is to be proposed."""
    signature = _result_signature(result, broken)
    infeasible_text = "\n".join(result.explanation)
    for earlier in _replan_plans(scope, thresholds):
        same = (_plan_signature(earlier) == signature
                and (result.status != "infeasible" or earlier.explanation == infeasible_text))
        if not same or (earlier.status == PlanStatus.PROPOSED and freshness.moved(earlier)):
            continue  # a proposed plan whose fleet moved is superseded by the one below
        if earlier.status == PlanStatus.INFEASIBLE:
            outcome.action, outcome.plan = "unchanged", earlier
            outcome.reason = f"plan {earlier.pk} already says why no plan fits"
            return outcome
        if earlier.status == PlanStatus.PROPOSED:
            outcome.plan = earlier
            with transaction.atomic():
                if _apply_if_allowed(earlier, outcome):
                    return outcome
            outcome.action = "unchanged"
            outcome.reason = f"plan {earlier.pk} already proposes this; {outcome.reason}"
            return outcome
        outcome.action, outcome.plan = "none", earlier
        outcome.reason = (f"{earlier.reviewed_by} rejected the same changes in plan "
                          f"{earlier.pk} at {earlier.reviewed_at:%Y-%m-%d %H:%M}")
        return outcome
    return None


def _replan_plans(scope: list[str], thresholds: Thresholds) -> list[Plan]:
    """Earlier replan plans for this scope that still stand, or that a person rejected
    within the cooldown — newest first."""
    since = timezone.now() - thresholds.rejected_cooldown
    rows = Plan.objects.filter(trigger__startswith="replan").filter(
        status__in=(PlanStatus.PROPOSED, PlanStatus.INFEASIBLE, PlanStatus.REJECTED),
        created_at__gte=since).prefetch_related("changes").order_by("-pk")
    out = []
    for plan in rows:
        if sorted(plan.scope) != scope:
            continue
        if plan.status == PlanStatus.REJECTED and plan.reviewed_by.startswith("system:"):
            continue  # superseded, not refused by a person
        out.append(plan)
    return out


def _trigger(broken: list[BrokenRule]) -> str:
    kinds = sorted({b.kind for b in broken})
    return ("replan:" + ",".join(kinds) if kinds else "replan:saving")[:64]


@transaction.atomic
def _propose(deployments: list[Deployment], taken: dict[str, Any], result: PlacementResult,
             broken: list[BrokenRule], thresholds: Thresholds, outcome: ReplanOutcome
             ) -> ReplanOutcome:
    plan = store_plan(result, deployments, ACTOR, _trigger(broken), taken)
    by_region = _reasons_by_region(broken)
    _add_orphan_removals(plan, broken)
    for change in plan.changes.filter(action=ChangeAction.REMOVE).select_related(
            "region__cloud"):
        why = by_region.get((change.deployment_id, change.region_id))
        if why:
            change.reason = f"{change.count} × in {change.region.key}: {why}"
            change.save(update_fields=["reason"])
    figures = {
        "broken": [asdict(b) for b in broken],
        "cost_before_usd_h": round(result.cost_before_usd_h, 4),
        "cost_after_usd_h": round(result.cost_after_usd_h, 4),
        "saving_usd_h": round(outcome.saving_usd_h, 4),
        "thresholds": {"min_saving_usd_h": thresholds.min_saving_usd_h,
                       "min_saving_fraction": thresholds.min_saving_fraction,
                       "price_change_fraction": thresholds.price_change_fraction},
    }
    plan.inputs = {**plan.inputs, "replan": figures}
    plan.save(update_fields=["inputs"])
    why = ("; ".join(b.detail for b in broken) if broken
           else f"saves ${outcome.saving_usd_h:.2f}/h of ${result.cost_before_usd_h:.2f}/h")
    record_audit(ACTOR, "replan.proposed", plan, changes=figures,
                 reason=f"{plan.trigger}: {why}"[:2000])
    outcome.plan = plan
    if plan.status == PlanStatus.INFEASIBLE:
        outcome.action, outcome.reason = "infeasible", plan.explanation
        return outcome
    outcome.superseded = sorted(plan.supersedes.values_list("pk", flat=True))
    if not _apply_if_allowed(plan, outcome):
        outcome.action = "proposed"
    return outcome


def _apply_if_allowed(plan: Plan, outcome: ReplanOutcome) -> bool:
    """Approve and apply `plan` as system:replan when every deployment it changes allows it."""
    touched = Deployment.objects.filter(pk__in=plan.changes.values("deployment_id"))
    manual = sorted(touched.filter(auto_apply_plans=False).values_list("name", flat=True))
    if manual:
        outcome.reason = f"waits for an operator: {', '.join(manual)} apply plans by hand"
        return False
    try:
        with transaction.atomic():
            plans.approve(plan.pk, ACTOR)
            outcome.plan = plans.start_apply(plan.pk, ACTOR)
    except plans.PlanStaleError as exc:  # the fleet moved during the solve
        outcome.reason = f"left proposed: {exc}"
        return False
    outcome.action = "applied"
    outcome.reason = "every deployment it changes applies plans automatically"
    return True


def _reasons_by_region(broken: list[BrokenRule]) -> dict[tuple[int, int], str]:
    """The broken rule behind removals, per (deployment, region), for their reasons."""
    replicas = Replica.objects.filter(pk__in=[pk for b in broken for pk in b.replicas])
    where = {r.pk: (r.deployment_id, r.region_id) for r in replicas}
    out: dict[tuple[int, int], str] = {}
    for b in broken:
        if b.kind in ("region_disabled", "region_down", "jurisdiction", "offer_missing",
                      "latency"):
            for pk in b.replicas:
                if pk in where:
                    out.setdefault(where[pk], b.detail)
    return out


def _add_orphan_removals(plan: Plan, broken: list[BrokenRule]) -> None:
    orphans = list(Replica.objects.filter(pk__in=[
        pk for b in broken if b.kind == "offer_missing" for pk in b.replicas]).select_related(
        "region__cloud"))
    grouped: dict[tuple[int, int, bool], list[Replica]] = defaultdict(list)
    for r in orphans:
        grouped[(r.deployment_id, r.region_id, r.spot)].append(r)
    for (deployment_id, region_id, spot), rows in sorted(grouped.items()):
        PlanChange.objects.create(
            plan=plan, deployment_id=deployment_id, action=ChangeAction.REMOVE,
            region_id=region_id, offer=None, count=len(rows), spot=spot,
            usd_h_delta=Decimal("0"),
            reason=f"{len(rows)} × in {rows[0].region.key}: no offer behind it any more")
