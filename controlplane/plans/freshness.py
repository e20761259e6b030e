"""Optimistic plans: a plan acts only on the fleet it was computed from.

A plan carries its basis (controlplane.placement.basis): the rule inputs and the counted
replicas of every deployment in its scope when it was proposed. Approving and applying call
`verify` inside their transaction: it locks those deployments' rows and their live replicas
(so a failover, a scale or a rules change waits for the plan's step, or the step sees its
result), reads the basis again and refuses, naming what moved, when it differs. The
caller's transaction then ends with nothing changed.
"""

from __future__ import annotations

from django.db.models import Q

from controlplane.deployments.lifecycle import LIVE_STATES
from controlplane.deployments.models import Deployment, Replica
from controlplane.placement import basis
from controlplane.placement.models import Plan
from controlplane.plans.errors import PlanStaleError

NO_BASIS = "the plan records no fleet state to check (it was stored before plans did)"


def moved(plan: Plan) -> list[str]:
    """What moved since `plan` was computed ([] when nothing did); reads, locks nothing."""
    if not plan.basis_fingerprint:
        return [NO_BASIS]
    now = basis.snapshot(basis.deployments_of(plan.basis))
    if basis.fingerprint(now) == plan.basis_fingerprint:
        return []
    return basis.differences(plan.basis, now) or ["the fleet state it was computed from"]


def verify(plan: Plan) -> None:
    """Lock the plan's deployments and replicas, then refuse if its basis moved. Call it
    inside the transaction that acts on the plan."""
    ids = basis.deployments_of(plan.basis or {})
    then = [int(pk) for entry in (plan.basis or {}).values() for pk in entry["replicas"]]
    list(Deployment.objects.select_for_update().filter(pk__in=ids).order_by("pk")
         .values_list("pk", flat=True))
    list(Replica.objects.select_for_update().filter(
        Q(deployment_id__in=ids, state__in=LIVE_STATES) | Q(pk__in=then)).order_by("pk")
        .values_list("pk", flat=True))
    changed = moved(plan)
    if changed:
        raise PlanStaleError(plan.pk, changed)
