"""From the database to a plan: load deployments, offers, quota and running replicas, solve,
and store the result as a Plan with its changes and reasons."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

from django.conf import settings
from django.db import transaction

from controlplane.core.services import record_audit
from controlplane.deployments.caps import plan_allowances
from controlplane.deployments.lifecycle import LIVE_STATES
from controlplane.deployments.models import ENGINE_CLOUDS, Deployment, Model, Replica
from controlplane.deployments.services import mark_placeable, mark_unplaceable
from controlplane.placement import basis
from controlplane.placement.capacity import GpuSpec, ModelSpec
from controlplane.placement.models import (
    OPEN_STATUSES,
    ChangeAction,
    Plan,
    PlanChange,
    PlanStatus,
)
from controlplane.placement.problem import (
    DeploymentRequest,
    ExistingReplica,
    OfferOption,
    PlacementProblem,
)
from controlplane.placement.result import PlacementResult
from controlplane.placement.search import solve, solve_placeable
from regions.models import Offer, Quota


def model_spec(deployment: Deployment) -> ModelSpec:
    return spec_of(deployment.model)


def spec_of(m: Model) -> ModelSpec:
    return ModelSpec(m.name, m.parameters_b, m.layers, m.attention_heads, m.kv_heads,
                     m.head_dim, m.dtype, m.active_parameters_b)


def deployment_request(d: Deployment) -> DeploymentRequest:
    return DeploymentRequest(
        id=d.pk, name=d.name, model=model_spec(d), context=d.max_model_len,
        tokens_per_s=d.demand_tokens_per_s, min_replicas=d.min_replicas,
        max_replicas=d.max_replicas,
        allowed_jurisdictions=frozenset(j.code for j in d.allowed_jurisdictions.all()),
        spread_regions=d.spread_regions, max_spot_fraction=d.max_spot_fraction,
        ttft_slo_ms=d.slo_ttft_p95_ms,
        user_locations=tuple((r.latitude, r.longitude) for r in d.user_regions.all()),
        # Provisioning launches every replica with these (`provisioning.services.spec_for`),
        # so the plan is sized and priced for them.
        tensor_parallel=d.tensor_parallel, pipeline_parallel=d.pipeline_parallel,
        allowed_clouds=ENGINE_CLOUDS.get(d.engine, frozenset()),
    )


def within_tenant_caps(request: DeploymentRequest, most: int | None) -> DeploymentRequest:
    """The request with its replica bounds narrowed to `most` (`caps.plan_allowances`: what
    its tenant's caps leave it), so that no plan places past them; unchanged when None."""
    if most is None or most >= request.max_replicas:
        return request
    return dataclasses.replace(request, max_replicas=most,
                               min_replicas=min(request.min_replicas, most),
                               spread_regions=min(request.spread_regions, max(most, 1)))


def offer_options() -> tuple[OfferOption, ...]:
    """Every offer of an enabled region and cloud, narrowed to settings' PLACEMENT_CLOUDS."""
    rows = Offer.objects.select_related("region__cloud", "region__jurisdiction", "gpu_type")
    clouds = settings.MERIDIAN.get("PLACEMENT_CLOUDS") or []
    if clouds:
        rows = rows.filter(region__cloud__name__in=clouds)
    return tuple(
        OfferOption(
            o.pk, o.region.key, o.region.cloud.name, o.region.jurisdiction.code,
            GpuSpec(o.gpu_type.name, o.gpu_type.memory_gib, o.gpu_type.memory_bandwidth_gbps),
            o.gpus_per_node, float(o.on_demand_usd_h),
            None if o.spot_usd_h is None else float(o.spot_usd_h),
            o.region.latitude, o.region.longitude, str(o),
        )
        for o in rows if o.region.enabled and o.region.cloud.enabled
    )


def quota_left(planned: Iterable[int]) -> dict[tuple[str, str], int]:
    """GPUs the planned deployments may use per pool: the limit less what others run."""
    planned = set(planned)
    used_by_others: Counter[tuple[str, str]] = Counter()
    others = Replica.objects.filter(state__in=LIVE_STATES).exclude(
        deployment_id__in=planned).select_related("region__cloud", "offer__gpu_type")
    for r in others:
        if r.offer is not None:
            used_by_others[(r.region.key, r.offer.gpu_type.name)] += r.offer.gpus_per_node
    return {
        (q.region.key, q.gpu_type.name): max(q.limit_gpus - used_by_others[(q.region.key, q.gpu_type.name)], 0)
        for q in Quota.objects.select_related("region__cloud", "gpu_type")
    }


def existing_replicas(deployments: Iterable[Deployment]) -> tuple[ExistingReplica, ...]:
    """Replicas the plan keeps or removes: live ones the plan may count on (`basis.counted`).
    A draining replica is leaving already; counted, a plan would remove others in its place."""
    counts: Counter[tuple[int, int, bool]] = Counter()
    for r in basis.counted([d.pk for d in deployments]).filter(offer__isnull=False):
        assert r.offer_id is not None  # filtered on offer__isnull=False
        counts[(r.deployment_id, r.offer_id, r.spot)] += 1
    return tuple(ExistingReplica(d, o, s, n) for (d, o, s), n in counts.items())


def build_problem(deployments: list[Deployment]) -> PlacementProblem:
    allowed = plan_allowances(deployments)
    return PlacementProblem(
        tuple(within_tenant_caps(deployment_request(d), allowed.get(d.pk)) for d in deployments),
        offer_options(),
        quota_left(d.pk for d in deployments), existing_replicas(deployments),
    )


@transaction.atomic
def store_plan(result: PlacementResult, deployments: list[Deployment], actor: str,
               trigger: str, taken: dict[str, Any] | None = None) -> Plan:
    """Store the solver's result as a plan with its basis (`taken` before the solve: the
    fleet state it was computed from; read now when None), superseding older open plans
    over any of the same deployments."""
    by_id = {d.pk: d for d in deployments}
    offers = {o.pk: o for o in Offer.objects.filter(
        pk__in=[c.offer_id for c in result.changes]).select_related("region")}
    unplaced = [{"deployment": by_id[i].name, "reason": why}
                for i, why in result.unplaced if i in by_id]
    inputs: dict[str, object] = {"deployments": len(deployments),
                                 "offers_considered": result.variables}
    if unplaced:
        inputs["unplaced"] = unplaced
    explanation = list(result.explanation) if not result.has_plan else [
        f"not placed: {u['reason']}" for u in unplaced] + list(result.explanation)
    plan = Plan.objects.create(
        status=PlanStatus.PROPOSED if result.has_plan else PlanStatus.INFEASIBLE,
        trigger=trigger, scope=[d.name for d in deployments], inputs=inputs,
        explanation="\n".join(explanation),
        cost_before_usd_h=Decimal(f"{result.cost_before_usd_h:.4f}"),
        cost_after_usd_h=(Decimal(f"{result.cost_after_usd_h:.4f}") if result.has_plan
                          else None),
        solver={"status": result.status, "solve_s": round(result.solve_s, 4),
                "gap_to_lp_bound": result.gap_to_lp_bound, "lp_bound_usd_h": result.lp_bound_usd_h},
        proposed_by=actor,
    )
    PlanChange.objects.bulk_create([
        PlanChange(plan=plan, deployment=by_id[c.deployment_id],
                   action=ChangeAction.ADD if c.action == "add" else ChangeAction.REMOVE,
                   region=offers[c.offer_id].region, offer=offers[c.offer_id], count=c.count,
                   spot=c.spot, usd_h_delta=Decimal(f"{c.usd_h_delta:.4f}"), reason=c.reason)
        for c in result.changes
    ])
    if result.has_plan:
        mark_placeable(set(by_id) - {i for i, _ in result.unplaced})
    mark_unplaceable({i: why for i, why in result.unplaced if i in by_id})
    basis.record(plan, taken if taken is not None else basis.snapshot(by_id))
    record_audit(actor, "plan.propose", plan, reason=plan.explanation or (
        "no changes: nothing to do" if not result.changes else
        f"${result.cost_before_usd_h:.2f}/h → ${result.cost_after_usd_h:.2f}/h"))
    supersede_older(plan, actor)
    return plan


def supersede_older(plan: Plan, actor: str) -> list[int]:
    """Mark superseded by `plan` every older open plan (proposed, or approved and not
    applying) over any of its deployments; an infeasible plan supersedes nothing. Each move
    is conditional, so a plan that an operator starts applying at the same moment is either
    applying or superseded, never both."""
    if plan.status != PlanStatus.PROPOSED:
        return []
    mine = set(plan.scope)
    done = []
    for older in Plan.objects.filter(status__in=OPEN_STATUSES, pk__lt=plan.pk).only(
            "pk", "scope").order_by("pk"):
        if mine and older.scope and not mine & set(older.scope):
            continue
        if Plan.objects.filter(pk=older.pk, status__in=OPEN_STATUSES).update(
                status=PlanStatus.SUPERSEDED, superseded_by=plan):
            record_audit(actor, "plan.superseded", older, reason=f"superseded by plan {plan.pk}")
            done.append(older.pk)
    return done


def propose_plan(deployments: Iterable[Deployment] | None, *, actor: str, trigger: str) -> Plan:
    chosen = list(deployments) if deployments else list(Deployment.objects.all())
    chosen = list(Deployment.objects.filter(pk__in=[d.pk for d in chosen]).select_related(
        "model").prefetch_related("allowed_jurisdictions", "user_regions"))
    taken = basis.snapshot(d.pk for d in chosen)
    result = solve_placeable(build_problem(chosen))
    plan = store_plan(result, chosen, actor, trigger, taken)
    mark_unplaceable(cap_shortfalls(chosen))
    return plan


def cap_shortfalls(deployments: Sequence[Deployment]) -> dict[int, str]:
    """Why deployments whose min_replicas is more than their tenant's caps leave them run
    fewer: the plan places what the caps allow, and this says so on the deployment."""
    allowed = plan_allowances(deployments)
    return {d.pk: (f"min_replicas ({d.min_replicas}) is more than tenant caps leave it: "
                   f"{allowed[d.pk]} replicas (max_replicas and max_gpus of its tenant)")
            for d in deployments if d.pk in allowed and allowed[d.pk] < d.min_replicas}


# A removal so dear that the solver never gives up a running replica to place new ones.
KEEP_RUNNING_USD_H = 1e4


@dataclass(frozen=True)
class Additions:
    """Where new replicas go: (offer with its region loaded, spot, count), cheapest per
    replica first; empty when the solver found no plan (`result` says why)."""

    slots: list[tuple[Offer, bool, int]]
    result: PlacementResult


def place_additions(deployment: Deployment, keep: Sequence[Replica], add: int, *,
                    gpu_types: Collection[str] = (), avoid_regions: Collection[str] = (),
                    only_regions: Collection[str] = (), lower_spread: bool = False,
                    time_limit_s: float = 5.0) -> Additions:
    """The solver's cheapest way to run `add` replicas beside `keep`, which all stay.

    The deployment is solved alone for exactly len(kept) + add replicas with no demand of
    its own (more replicas for demand are the plans' job), over the offers of
    `gpu_types` (all when empty) outside `avoid_regions` (and, when given, inside
    `only_regions`: the additions go there, the spread rule then counting none beyond them);
    replicas of `keep` on other offers
    run on but do not count. With `lower_spread`, the spread rule asks for no more regions
    than those left (failover: a lost region is what spread is for). Residency holds as in
    every plan: only offers in the allowed jurisdictions are options.
    """
    options = tuple(o for o in offer_options() if o.region not in avoid_regions
                    and (not gpu_types or o.gpu.name in gpu_types)
                    and (not only_regions or o.region in only_regions))
    listed = {o.id for o in options}
    kept = [r for r in keep if r.offer_id in listed]
    total = len(kept) + add
    request = dataclasses.replace(deployment_request(deployment), min_replicas=total,
                                  max_replicas=total, tokens_per_s=0.0)
    if lower_spread or only_regions:
        usable = {o.region for o in options if o.jurisdiction in request.allowed_jurisdictions}
        request = dataclasses.replace(
            request, spread_regions=max(1, min(request.spread_regions, len(usable))))
    running = Counter((r.offer_id, r.spot) for r in kept if r.offer_id is not None)
    result = solve(PlacementProblem(
        (request,), options, quota_left([deployment.pk]),
        tuple(ExistingReplica(deployment.pk, o, s, n) for (o, s), n in running.items()),
        move_penalty_usd_h=KEEP_RUNNING_USD_H, time_limit_s=time_limit_s))
    if not result.has_plan:
        return Additions([], result)
    adds = sorted((c for c in result.changes if c.action == "add"),
                  key=lambda c: c.usd_h_delta / max(c.count, 1))
    offers = Offer.objects.select_related("region__cloud").in_bulk([c.offer_id for c in adds])
    slots, left = [], add
    for c in adds:
        n = min(c.count, left)
        if n > 0:
            slots.append((offers[c.offer_id], c.spot, n))
            left -= n
    return Additions(slots, result)
