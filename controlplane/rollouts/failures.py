"""A revision whose replicas fail during a step fails that step.

Failover replaces a failed replica with a healthy one of the same revision within seconds,
so the analysis of the step's traffic may never see the failure: a fault that also fails
`/health` would pass. A canary replica that had served and failed (a health verdict, then
usually replaced) since its step started is the step's failure, whatever the figures say.
"""

from __future__ import annotations

from django.db.models import Q

from controlplane.deployments.models import Replica, ReplicaState
from controlplane.rollouts.models import Rollout, RolloutStep


def failed_during(rollout: Rollout, step: RolloutStep) -> str:
    """Why the step fails for its revision's failed replicas ("canary replica r-7 failed and
    was replaced during step 2: …"), or "" when none failed since the step started. Only
    replicas that served count: a launch that fails is asked for again, not a verdict."""
    since = step.started_at
    failed = list(Replica.objects.filter(revision=rollout.to_revision, ready_at__isnull=False)
                  .filter(Q(state=ReplicaState.FAILED, state_changed_at__gte=since)
                          | Q(replacement_requested_at__gte=since))
                  .order_by("id"))
    if not failed:
        return ""
    names = ", ".join(r.public_id for r in failed)
    replaced = all(r.replacement_requested_at is not None for r in failed)
    what = "failed and was replaced" if replaced else "failed"
    if len(failed) > 1:
        what = "failed and were replaced" if replaced else "failed"
    where = (f"step {step.step + 1}" if not rollout.waves
             else f"step {step.step + 1} of wave {step.wave + 1}")
    errors = "; ".join(sorted({r.last_error[:160] for r in failed if r.last_error}))
    kind = "canary replica" if len(failed) == 1 else "canary replicas"
    return f"{kind} {names} {what} during {where}" + (f": {errors}" if errors else "")
