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
