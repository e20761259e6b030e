"""The rollouts' periodic check (every 2 s under beat)."""

from __future__ import annotations

from celery import shared_task

from controlplane.core.locks import advisory_lock
from controlplane.rollouts import analyst


@shared_task(name="rollouts.check")
def check() -> dict[str, object]:
    """Judge every running rollout whose step has baked; one worker at a time."""
    with advisory_lock("rollouts.check") as acquired:
        if not acquired:
            return {"skipped": 1}
        return dict(analyst.check())
