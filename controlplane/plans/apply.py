"""A plan's life after the solver: approve, reject, apply make-before-break, finish.

The solver (placement) proposes; applying acts across provisioning and scaling, so it lives
here, above them. `advance_plan` is the Celery task that drives an applying plan; it sits
beside what it drives so that `start_apply` can start it without a cycle (the periodic
replan, in tasks.py, applies plans through this module).

Applying adds the new replicas first; removals are drained only once every added replica
is ready, so capacity never dips below what the deployment had. Status changes are
conditional updates, so two operators clicking at once act once.

Plans are optimistic: approve and apply lock the plan, refuse a plan a newer one superseded,
and check in the same transaction that the fleet is still the one the plan was computed
from (plans.freshness); if it moved they refuse naming what moved, and nothing changes.
"""

from __future__ import annotations

from celery import shared_task
from django.db import transaction
from django.utils import timezone

from controlplane.core.services import record_audit
from controlplane.deployments import caps
from controlplane.deployments.lifecycle import SERVING_STATES
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.placement.models import ChangeAction, Plan, PlanChange, PlanStatus
from controlplane.plans import freshness
from controlplane.plans.errors import PlanStaleError, PlanStateError, PlanSupersededError
from controlplane.provisioning.tasks import request_replicas
from controlplane.scaling.services import retire_replica

__all__ = ["PlanStaleError", "PlanStateError", "PlanSupersededError", "advance",
           "advance_plan", "applying_plans", "approve", "reject", "start_apply"]

ADVANCE_EVERY_S = 1.0


def _locked(plan_id: int, allowed: tuple[str, ...]) -> Plan:
    """The plan, its row locked until the transaction ends, in one of the `allowed` states."""
    plan = Plan.objects.select_for_update().get(pk=plan_id)
    if plan.status == PlanStatus.SUPERSEDED:
        raise PlanSupersededError(plan_id, plan.superseded_by_id)
    if plan.status not in allowed:
        raise PlanStateError(
            f"plan {plan_id} is {plan.status}; this needs it to be {' or '.join(allowed)}")
    return plan


def _checked(plan_id: int, allowed: tuple[str, ...]) -> None:
    """Refuse unless the plan is in an `allowed` state, changes something, and was computed
    from the fleet as it is now."""
    plan = _locked(plan_id, allowed)
    _refuse_empty(plan_id)
    freshness.verify(plan)


def _move(plan_id: int, allowed: tuple[str, ...], to: str, **fields: object) -> Plan:
    moved = Plan.objects.filter(pk=plan_id, status__in=allowed).update(status=to, **fields)
    plan = Plan.objects.get(pk=plan_id)
    if moved != 1:
        raise PlanStateError(
            f"plan {plan_id} is {plan.status}; this needs it to be {' or '.join(allowed)}"
        )
    return plan


def _refuse_empty(plan_id: int) -> None:
    if not PlanChange.objects.filter(plan_id=plan_id).exists():
        raise PlanStateError(f"plan {plan_id} changes nothing: there is nothing to approve "
                             "or apply")


def _cost_words(plan: Plan) -> str:
    saving = plan.saving_usd_h
    if saving is None:
        return "no plan"
    return f"saves ${saving:.2f}/h" if saving >= 0 else f"costs ${-saving:.2f}/h more"


def _given(reason: str, what: str) -> str:
    """The reviewer's reason first, then what the step says of itself."""
    return f"{reason} ({what})" if reason else what


@transaction.atomic
def approve(plan_id: int, actor: str, reason: str = "") -> Plan:
    _checked(plan_id, (PlanStatus.PROPOSED,))
    plan = _move(plan_id, (PlanStatus.PROPOSED,), PlanStatus.APPROVED,
                 reviewed_by=actor, reviewed_at=timezone.now())
    record_audit(actor, "plan.approve", plan, reason=_given(reason, _cost_words(plan)))
    return plan


@transaction.atomic
def reject(plan_id: int, actor: str, reason: str = "") -> Plan:
    _locked(plan_id, (PlanStatus.PROPOSED, PlanStatus.APPROVED))
    plan = _move(plan_id, (PlanStatus.PROPOSED, PlanStatus.APPROVED), PlanStatus.REJECTED,
                 reviewed_by=actor, reviewed_at=timezone.now())
    record_audit(actor, "plan.reject", plan, reason=reason or "rejected")
    return plan


@transaction.atomic
def start_apply(plan_id: int, actor: str, reason: str = "") -> Plan:
    """approved → applying: request every added replica now; removals wait for them."""
    _checked(plan_id, (PlanStatus.APPROVED,))
    plan = _move(plan_id, (PlanStatus.APPROVED,), PlanStatus.APPLYING)
    record_audit(actor, "plan.apply", plan,
                 reason=_given(reason, "make-before-break: adds first"))
    adds = plan.changes.filter(action=ChangeAction.ADD).select_related(
        "deployment", "region__cloud", "offer"
    )
    for change in adds:
        made = request_replicas(
            change.deployment, change.region, change.count, actor=actor,
            reason=f"plan {plan.pk}: {change.reason}", spot=change.spot, offer=change.offer,
        )
        if len(made) < change.count:
            # Make-before-break needs every addition: none is made (the transaction ends).
            room = caps.headroom(change.deployment)
            raise PlanStateError(
                f"Plan {plan.pk} adds {change.count} replicas of {change.deployment.name} in "
                f"{change.region.key}, but only {len(made)} fit its tenant's caps: {room.why}.")
        change.replica_ids = [r.pk for r in made]
        change.save(update_fields=["replica_ids"])
    transaction.on_commit(lambda: _schedule_advance(plan.pk))
    return plan


def _schedule_advance(plan_id: int, countdown: float = 1.0) -> None:
    advance_plan.apply_async((plan_id,), countdown=countdown)


def advance(plan_id: int) -> str:
    """Drive an applying plan: wait for adds to be ready, then drain the removals.

    Returns the plan's status; the caller re-schedules while it is still applying.
    """
    plan = Plan.objects.get(pk=plan_id)
    if plan.status != PlanStatus.APPLYING:
        return plan.status
    added = [pk for change in plan.changes.filter(action=ChangeAction.ADD)
             for pk in change.replica_ids]
    states = dict(Replica.objects.filter(pk__in=added).values_list("pk", "state"))
    if any(states.get(pk) in (S.FAILED, S.TERMINATED) for pk in added):
        failed = [f"r-{pk}" for pk in added if states.get(pk) in (S.FAILED, S.TERMINATED)]
        if not Plan.objects.filter(pk=plan_id, status=PlanStatus.APPLYING).update(
                status=PlanStatus.FAILED, log=plan.log + f"added replicas failed: {failed}\n"):
            return Plan.objects.get(pk=plan_id).status  # another run got there first
        record_audit("system:placement", "plan.failed", plan,
                     reason=f"new replicas failed ({', '.join(failed)}); removals not started")
        return PlanStatus.FAILED
    if any(states.get(pk) not in SERVING_STATES for pk in added):
        return PlanStatus.APPLYING
    with transaction.atomic():
        # The conditional UPDATE first: it locks the plan's row, so of two runs at once (a
        # redelivered task beside the chain, or the periodic resume) one drains, the other
        # finds the plan applied and stops.
        if not Plan.objects.filter(pk=plan_id, status=PlanStatus.APPLYING).update(
                status=PlanStatus.APPLIED, applied_at=timezone.now()):
            return Plan.objects.get(pk=plan_id).status
        for change in plan.changes.filter(action=ChangeAction.REMOVE).select_related("deployment"):
            drained = _drain_for_change(change, plan)
            change.replica_ids = drained
            change.save(update_fields=["replica_ids"])
        record_audit("system:placement", "plan.applied", plan,
                     reason="added replicas ready; removals draining")
    return PlanStatus.APPLIED


def _drain_for_change(change: PlanChange, plan: Plan) -> list[int]:
    candidates = Replica.objects.staying().filter(
        deployment=change.deployment, region=change.region, spot=change.spot)
    if change.offer_id:
        candidates = candidates.filter(offer_id=change.offer_id)
    else:  # replicas whose offer is gone: drain those, not their neighbours
        candidates = candidates.filter(offer__isnull=True)
    chosen = list(candidates.order_by("created_at")[: change.count])
    reason = f"plan {plan.pk}: {change.reason}"
    for replica in chosen:
        retire_replica(replica, actor="system:placement", reason=reason)
    return [r.pk for r in chosen]


def applying_plans() -> list[int]:
    return list(Plan.objects.filter(status=PlanStatus.APPLYING).order_by("pk")
                .values_list("pk", flat=True))


@shared_task(name="placement.advance_plan")
def advance_plan(plan_id: int) -> str:
    """Advance an applying plan every ADVANCE_EVERY_S until it is applied or failed. The task
    keeps the name it had under placement: messages already queued still find it."""
    status = advance(plan_id)
    if status == PlanStatus.APPLYING:
        advance_plan.apply_async((plan_id,), countdown=ADVANCE_EVERY_S)
    return status
