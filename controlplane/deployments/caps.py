"""Bounds on what a deployment, and a tenant in all, may make the fleet run.

Two kinds of bound:

- Absolute, for every deployment: `min_replicas` and `max_replicas` at most
  `MAX_REPLICAS_PER_DEPLOYMENT` (no single deployment asks for 500 replicas).
- Per tenant (`Tenant.max_replicas`, `Tenant.max_gpus`, set by platform staff): the live
  replicas of a tenant's own deployments, and the GPUs they hold (tensor × pipeline parallel
  each), together. Shared deployments (no tenant) count against no tenant.

They are checked at the door (`door_errors`, from `placement.admission.deployment_errors`:
a deployment whose max_replicas alone breaks a cap, or whose min_replicas with the tenant's
other deployments' minimums does, is refused with a 400 naming the cap), and wherever replicas
are added (`headroom`: the autoscaler, plans, operator scaling, failover and rollouts all go
through `provisioning.tasks.request_replicas`, which never creates more than it allows).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from django.db.models import Count, F, IntegerField, Sum
from django.db.models.functions import Coalesce

from controlplane.core.models import Tenant
from controlplane.deployments.lifecycle import LIVE_STATES
from controlplane.deployments.models import Deployment, Replica

# The most replicas one deployment may ask for, whoever owns it.
MAX_REPLICAS_PER_DEPLOYMENT = 100


def gpus_each(tensor_parallel: int, pipeline_parallel: int) -> int:
    """GPUs one replica's engine holds."""
    return max(int(tensor_parallel), 1) * max(int(pipeline_parallel), 1)


@dataclass(frozen=True)
class Usage:
    """What a tenant's own deployments run now: live replicas and the GPUs they hold."""

    replicas: int
    gpus: int


def usage(tenant_id: int) -> Usage:
    """Live replicas of the tenant's deployments and their GPUs (a replica of a revision
    counts that revision's engine, else the deployment's)."""
    per_replica = Coalesce(
        F("revision__tensor_parallel") * F("revision__pipeline_parallel"),
        F("deployment__tensor_parallel") * F("deployment__pipeline_parallel"),
        output_field=IntegerField())
    totals = (Replica.objects.filter(deployment__tenant_id=tenant_id, state__in=LIVE_STATES)
              .annotate(gpus=per_replica).aggregate(n=Count("id"),
                                                    g=Coalesce(Sum("gpus"), 0)))
    return Usage(int(totals["n"]), int(totals["g"]))


@dataclass(frozen=True)
class Headroom:
    """How many more replicas of one engine a deployment's tenant may run now; `why`
    names the cap that binds (empty when none does)."""

    replicas: int | None  # None: no cap (a shared deployment)
    why: str = ""


def headroom(deployment: Deployment, tensor_parallel: int | None = None,
             pipeline_parallel: int | None = None) -> Headroom:
    """Replicas of `deployment` (of tp × pp GPUs each: the deployment's unless given) its
    tenant may still add under both caps."""
    if deployment.tenant_id is None:
        return Headroom(None)
    tenant = Tenant.objects.get(pk=deployment.tenant_id)
    each = gpus_each(tensor_parallel or deployment.tensor_parallel,
                     pipeline_parallel or deployment.pipeline_parallel)
    now = usage(tenant.pk)
    by_replicas = max(tenant.max_replicas - now.replicas, 0)
    by_gpus = max(tenant.max_gpus - now.gpus, 0) // each
    if by_replicas <= by_gpus:
        return Headroom(by_replicas, (
            f"tenant {tenant.name} runs {now.replicas} of its max_replicas cap of "
            f"{tenant.max_replicas} replicas"))
    return Headroom(by_gpus, (
        f"tenant {tenant.name} holds {now.gpus} of its max_gpus cap of {tenant.max_gpus} GPUs "
        f"({each} per replica)"))


class TenantCapReached(Exception):
    """Adding replicas would break a tenant's cap; the message names the cap."""


def plan_allowances(deployments: Sequence[Deployment]) -> dict[int, int]:
    """The most replicas each tenant-owned deployment of `deployments` may run in all when
    they are planned together: what it runs now plus its share of its tenant's headroom
    (split evenly between the tenant's deployments in the plan, so that together they never
    pass a cap). Shared deployments are not in the answer: no cap binds them."""
    owned = [d for d in deployments if d.tenant_id is not None]
    live = dict(Replica.objects.filter(deployment__in=owned, state__in=LIVE_STATES)
                .values_list("deployment").annotate(n=Count("id")))
    by_tenant: dict[int, list[Deployment]] = defaultdict(list)
    for d in owned:
        assert d.tenant_id is not None  # filtered above
        by_tenant[d.tenant_id].append(d)
    tenants = Tenant.objects.in_bulk(list(by_tenant))
    allowed: dict[int, int] = {}
    for tenant_id, group in by_tenant.items():
        tenant, now = tenants[tenant_id], usage(tenant_id)
        left_r = max(tenant.max_replicas - now.replicas, 0)
        left_g = max(tenant.max_gpus - now.gpus, 0)
        for i, d in enumerate(sorted(group, key=lambda d: d.pk)):
            share_r = left_r // len(group) + (1 if i < left_r % len(group) else 0)
            share_g = left_g // len(group) + (1 if i < left_g % len(group) else 0)
            more = min(share_r, share_g // gpus_each(d.tensor_parallel, d.pipeline_parallel))
            allowed[d.pk] = live.get(d.pk, 0) + more
    return allowed


def door_errors(fields: Mapping[str, Any], deployment_id: int | None = None) -> dict[str, str]:
    """Field-named errors for a deployment's replica bounds (as `services.merged_fields`
    gives them): the absolute bounds, then its tenant's caps. `deployment_id`: the row
    being changed, whose old minimum is not counted twice."""
    low, high = fields.get("min_replicas"), fields.get("max_replicas")
    errors: dict[str, str] = {}
    for name, value in (("min_replicas", low), ("max_replicas", high)):
        if value is not None and value > MAX_REPLICAS_PER_DEPLOYMENT:
            errors[name] = (f"{name} ({value}) exceeds the most one deployment may ask for "
                            f"({MAX_REPLICAS_PER_DEPLOYMENT}).")
    tenant: Tenant | None = fields.get("tenant")
    if errors or tenant is None or low is None or high is None:
        return errors
    each = gpus_each(fields.get("tensor_parallel") or 1, fields.get("pipeline_parallel") or 1)
    if high > tenant.max_replicas:
        errors["max_replicas"] = (
            f"max_replicas ({high}) exceeds tenant {tenant.name}'s max_replicas cap of "
            f"{tenant.max_replicas} replicas.")
    elif high * each > tenant.max_gpus:
        errors["max_replicas"] = (
            f"max_replicas ({high}) × {each} GPUs per replica (tensor × pipeline parallel) "
            f"= {high * each} GPUs exceeds tenant {tenant.name}'s max_gpus cap of "
            f"{tenant.max_gpus} GPUs.")
    others = Deployment.objects.filter(tenant=tenant)
    if deployment_id is not None:
        others = others.exclude(pk=deployment_id)
    committed = others.aggregate(
        n=Coalesce(Sum("min_replicas"), 0),
        g=Coalesce(Sum(F("min_replicas") * F("tensor_parallel") * F("pipeline_parallel")), 0))
    if committed["n"] + low > tenant.max_replicas:
        errors["min_replicas"] = (
            f"min_replicas ({low}) with the {committed['n']} that tenant {tenant.name}'s other "
            f"deployments keep running exceeds its max_replicas cap of {tenant.max_replicas} "
            "replicas.")
    elif committed["g"] + low * each > tenant.max_gpus:
        errors["min_replicas"] = (
            f"min_replicas ({low}) × {each} GPUs per replica with the {committed['g']} GPUs "
            f"that tenant {tenant.name}'s other deployments keep running exceeds its max_gpus "
            f"cap of {tenant.max_gpus} GPUs.")
    return errors
