"""The periodic replan. Its name and lock (`placement.replan`) are those it had under
placement: beat rows and running workers know it by them."""

from __future__ import annotations

from celery import shared_task

from controlplane.core.locks import advisory_lock
from controlplane.plans import apply
from controlplane.plans import replan as service


@shared_task(name="placement.replan")
def replan() -> dict[str, object]:
    """The periodic replan (see plans.replan); one at a time across workers."""
    with advisory_lock("placement.replan") as acquired:
        if not acquired:
            return {"action": "skipped", "reason": "another replan is running"}
        return service.replan().summary()


@shared_task(name="plans.resume_applying")
def resume_applying() -> dict[str, object]:
    """Every 5 s: advance each applying plan. The `advance_plan` chain does this every second,
    but its next message may have been lost with the worker holding it; `advance` is safe to
    run beside the chain (its status changes are conditional)."""
    with advisory_lock("plans.resume_applying") as acquired:
        if not acquired:
            return {"skipped": 1}
        return {str(pk): apply.advance(pk) for pk in apply.applying_plans()}
