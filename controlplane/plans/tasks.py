"""The periodic replan. Its name and lock (`placement.replan`) are those it had under
placement: beat rows and running workers know it by them."""

from __future__ import annotations

from celery import shared_task

from controlplane.core.locks import advisory_lock
from controlplane.plans import replan as service


@shared_task(name="placement.replan")
def replan() -> dict[str, object]:
    """The periodic replan (see plans.replan); one at a time across workers."""
    with advisory_lock("placement.replan") as acquired:
        if not acquired:
            return {"action": "skipped", "reason": "another replan is running"}
        return service.replan().summary()
