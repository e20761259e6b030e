"""A rollout's steps: each opens by asking for the canary replicas its weight needs
(`placement.grow_canary`), and its weight goes into the edges' tables only once they serve
(`go_live_if_ready`, make-before-break); until then the step says what it waits for. The
traffic split lives on the deployment (`canary_revision`, `canary_weight`, per region for a
rollout in waves), which the routing compiler turns into revision weights in every table."""

from __future__ import annotations

from django.utils import timezone

from controlplane.deployments.lifecycle import LIVE_STATES, SERVING_STATES
from controlplane.deployments.models import Deployment, Replica, ReplicaState, Revision
from controlplane.rollouts.models import Rollout, RolloutStep
from controlplane.rollouts.placement import canary_target, grow_canary, stable_serving

Figures = dict[str, object]


def set_split(rollout: Rollout | None, deployment_id: int, revision: Revision | None,
              weight: int) -> None:
    """The canary's share in the tables: everywhere, or, for a rollout in waves, `weight`
    at the current wave's edges, 100 at earlier waves', 0 elsewhere."""
    # update() skips post_save, so save() the row for routing's push trigger.
    deployment = Deployment.objects.get(pk=deployment_id)
    deployment.canary_revision = revision
    regions: dict[str, int] = {}
    if rollout is not None and rollout.waves and revision is not None:
        for i, wave in enumerate(rollout.waves[:rollout.current_wave + 1]):
            regions.update(dict.fromkeys(wave, weight if i == rollout.current_wave else 100))
        weight = 0
    deployment.canary_weight = weight
    deployment.canary_region_weights = regions
    deployment.save(update_fields=["canary_revision", "canary_weight",
                                   "canary_region_weights", "updated_at"])


def capacity_weight(rollout: Rollout, step: RolloutStep) -> int:
    """The share the canary replicas must carry: past the first wave, earlier waves' edges
    send it everything, so as many as the stable ones."""
    return 100 if rollout.current_wave > 0 else step.weight


def go_live_if_ready(rollout: Rollout, step: RolloutStep) -> bool:
    """The step's weight into the tables once enough canary replicas serve."""
    if step.ready_at is not None:
        return True
    serving = Replica.objects.filter(revision=rollout.to_revision,
                                     state__in=SERVING_STATES).count()
    if serving < canary_target(capacity_weight(rollout, step), len(stable_serving(rollout))):
        return False
    step.ready_at = timezone.now()
    step.analysis = {}  # no longer waiting; judged from now
    step.save(update_fields=["ready_at", "analysis"])
    set_split(rollout, rollout.deployment_id, rollout.to_revision, step.weight)
    return True


def waiting_why(rollout: Rollout, step: RolloutStep, unplaced: str = "") -> str:
    """Why a step is not live yet: its canary replicas, why the missing ones could not be
    placed (quota, residency), and the last launch failure."""
    canaries = Replica.objects.filter(revision=rollout.to_revision)
    serving = canaries.filter(state__in=SERVING_STATES).count()
    launching = canaries.filter(state__in=LIVE_STATES).exclude(
        state__in=SERVING_STATES).count()
    target = canary_target(capacity_weight(rollout, step), len(stable_serving(rollout)))
    why = (f"waiting for {target} canary replica{'s' if target != 1 else ''} to serve "
           f"{step.weight}%: {serving} serving, {launching} launching")
    failed = (canaries.filter(state=ReplicaState.FAILED).exclude(last_error="")
              .order_by("-state_changed_at", "-id").first())
    if unplaced:
        why += f"; not placed: {unplaced[:300]}"
    if failed is not None:
        why += f"; the last launch failed: {failed.last_error[:200]}"
    return why


def open_step(rollout: Rollout, actor: str) -> tuple[RolloutStep, list[Replica]]:
    """The next step: its canary replicas asked for, its weight live if they already
    serve (else the previous weight stays until the check sees them serving)."""
    step = RolloutStep.objects.create(rollout=rollout, wave=rollout.current_wave,
                                      step=rollout.current_step,
                                      weight=rollout.steps[rollout.current_step])
    made, unplaced = grow_canary(rollout, capacity_weight(rollout, step), actor)
    if not go_live_if_ready(rollout, step):
        step.analysis = {"verdict": "waiting", "why": waiting_why(rollout, step, unplaced)}
        step.save(update_fields=["analysis"])
    return step, made


def close_step(rollout: Rollout, decision: str, figures: Figures | None = None) -> None:
    """The current step ended with `decision` (and the figures it was judged on)."""
    changes: dict[str, object] = {"ended_at": timezone.now(), "decision": decision}
    if figures is not None:
        changes["analysis"] = figures
    RolloutStep.objects.filter(rollout=rollout, wave=rollout.current_wave,
                               step=rollout.current_step, ended_at__isnull=True
                               ).update(**changes)
