"""Placement tasks: drive applying plans; the periodic replan."""

from __future__ import annotations

from celery import shared_task

from controlplane.placement import plans
from controlplane.placement.models import PlanStatus

ADVANCE_EVERY_S = 1.0


@shared_task(name="placement.advance_plan")
def advance_plan(plan_id: int) -> str:
    status = plans.advance(plan_id)
    if status == PlanStatus.APPLYING:
        advance_plan.apply_async((plan_id,), countdown=ADVANCE_EVERY_S)
    return status


@shared_task(name="placement.replan")
def replan() -> dict[str, object]:
    """The periodic replan (see placement.replan); one at a time across workers."""
    from controlplane.core.locks import advisory_lock
    from controlplane.placement import replan as service

    with advisory_lock("placement.replan") as acquired:
        if not acquired:
            return {"action": "skipped", "reason": "another replan is running"}
        return service.replan().summary()
