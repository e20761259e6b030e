"""A rollout's states and the actions that move it: start (a new revision and its first
step), pause, resume, advance, promote and roll back, each under the rollout's row lock and
each an audit event. An action the state does not allow raises RolloutStateError.

    running ⇄ paused; running or paused → promoted | rolled_back

The analysis (`analyst.check`) takes the same actions as an operator does."""

from __future__ import annotations

from collections.abc import Sequence

from django.db import IntegrityError, transaction
from django.utils import timezone

from controlplane.core.services import record_audit
from controlplane.deployments.lifecycle import LIVE_STATES
from controlplane.deployments.models import Deployment, Replica, Revision
from controlplane.deployments.revisions import take_revision
from controlplane.deployments.services import stable_revision
from controlplane.rollouts.models import IN_PROGRESS, Rollout, RolloutState, RolloutStep
from controlplane.rollouts.promotion import finish_promotion, old_fleet, retire, retiring
from controlplane.rollouts.steps import Figures, close_step, open_step, set_split
from controlplane.rollouts.validation import RevisionSpec, RolloutRequest

S = RolloutState


class RolloutStateError(Exception):
    """The rollout's state does not allow the action; the message says why."""


@transaction.atomic
def start(deployment: Deployment, request: RolloutRequest, *, actor: str) -> Rollout:
    """A new revision (unset settings: the stable revision's) and a rollout of it at its
    first step, the canary replicas that step needs asked for beside the stable ones (for
    blue/green: as many as them, all traffic switched once they serve)."""
    locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
    _refuse_second(locked)
    stable = stable_revision(locked)
    revision = _new_revision(locked, stable, request.revision)
    try:
        with transaction.atomic():
            rollout = Rollout.objects.create(
                deployment=locked, from_revision=stable, to_revision=revision,
                strategy=request.strategy, steps=request.steps, bake_s=request.bake_s,
                waves=request.waves, rollback_window_s=request.rollback_window_s,
                thresholds=request.thresholds, state=S.RUNNING,
                auto_promote=request.auto_promote, start_reason=request.reason,
                created_by=actor, started_at=timezone.now())
    except IntegrityError:
        raise RolloutStateError(f"deployment {locked.name} already has a rollout in "
                                "progress") from None
    # Listed in the tables at share 0 until its replicas serve the first step's weight.
    set_split(rollout, locked.pk, revision, 0)
    step, canaries = open_step(rollout, actor)
    record_audit(actor, "rollout.started", rollout, reason=request.reason, changes={
        "strategy": request.strategy, "from_revision": stable.number,
        "to_revision": revision.number, "steps": request.steps, "bake_s": request.bake_s,
        "rollback_window_s": request.rollback_window_s or None,
        "waves": request.waves or None, "auto_promote": request.auto_promote,
        "thresholds": request.thresholds, "weight": step.weight,
        "canary_replicas": [r.public_id for r in canaries]})
    return rollout


def _refuse_second(locked: Deployment) -> None:
    """One rollout per deployment at a time, including a promotion still retiring."""
    current = Rollout.objects.filter(deployment=locked, state__in=IN_PROGRESS).first()
    if current is not None:
        raise RolloutStateError(f"deployment {locked.name} already has rollout {current.pk} "
                                f"in progress ({current.state}); finish or roll it back first")
    waiting = retiring().filter(deployment=locked).first()
    if waiting is not None:
        raise RolloutStateError(f"deployment {locked.name}'s rollout {waiting.pk} was promoted "
                                "and its old revision's replicas are not retired yet (the new "
                                "ones do not all serve); start the next one once they are")


def _new_revision(locked: Deployment, stable: Revision, spec: RevisionSpec) -> Revision:
    """The deployment's next revision: `spec`'s settings over the stable revision's."""
    number = (locked.revisions.order_by("-number").values_list("number", flat=True).first()
              or 0) + 1
    return Revision.objects.create(
        deployment=locked, number=number, model=spec.model or stable.model,
        vllm_version=stable.vllm_version if spec.vllm_version is None else spec.vllm_version,
        engine_args={**stable.engine_args, **spec.engine_args},
        tensor_parallel=spec.tensor_parallel or stable.tensor_parallel,
        pipeline_parallel=spec.pipeline_parallel or stable.pipeline_parallel,
        preferred_gpu_type=spec.preferred_gpu_type or stable.preferred_gpu_type,
    )


def at_last_step(rollout: Rollout) -> bool:
    return (rollout.current_step >= len(rollout.steps) - 1
            and rollout.current_wave >= max(len(rollout.waves), 1) - 1)


def locked(rollout_id: int) -> Rollout:
    """The rollout, its row locked until the transaction ends."""
    return Rollout.objects.select_for_update().select_related("deployment").get(pk=rollout_id)


def refuse(rollout: Rollout, action: str, allowed: Sequence[str]) -> None:
    if rollout.state not in allowed:
        raise RolloutStateError(f"rollout {rollout.pk} is {rollout.state}: {action} needs it "
                                f"{' or '.join(allowed)}")


def pause(rollout_id: int, *, actor: str, reason: str = "") -> Rollout:
    """Hold the current step: the canary keeps its weight, steps stop moving."""
    return _hold_or_go(rollout_id, "pause", S.RUNNING, S.PAUSED, "rollout.paused",
                       actor=actor, reason=reason)


def resume(rollout_id: int, *, actor: str, reason: str = "") -> Rollout:
    """Go on; a step held for too little traffic gets its extensions again."""
    return _hold_or_go(rollout_id, "resume", S.PAUSED, S.RUNNING, "rollout.resumed",
                       actor=actor, reason=reason)


@transaction.atomic
def _hold_or_go(rollout_id: int, action: str, from_state: str, to_state: str, event: str, *,
                actor: str, reason: str) -> Rollout:
    """Pause or resume: one state for another, the weight untouched, an audit event."""
    rollout = locked(rollout_id)
    refuse(rollout, action, [from_state])
    rollout.state = to_state
    rollout.save(update_fields=["state"])
    if to_state == S.RUNNING:
        RolloutStep.objects.filter(rollout=rollout, wave=rollout.current_wave,
                                   step=rollout.current_step, ended_at__isnull=True
                                   ).update(decision="", extensions=0)
    record_audit(actor, event, rollout, reason=reason,
                 changes={"step": rollout.current_step, "weight": rollout.weight})
    return rollout


@transaction.atomic
def advance(rollout_id: int, *, actor: str, reason: str = "",
            figures: Figures | None = None) -> Rollout:
    """The next step's weight; at the last step (100) the rollout waits for promote."""
    rollout = locked(rollout_id)
    refuse(rollout, "advance", [S.RUNNING])
    if at_last_step(rollout):
        raise RolloutStateError(f"rollout {rollout.pk} is at its last step "
                                f"({rollout.weight}%): promote it or roll it back")
    close_step(rollout, "advanced", figures)
    previous = rollout.weight
    if rollout.current_step < len(rollout.steps) - 1:
        rollout.current_step += 1
    else:  # the wave is at 100%: the next wave from the first step
        rollout.current_wave += 1
        rollout.current_step = 0
    rollout.save(update_fields=["current_step", "current_wave"])
    step, made = open_step(rollout, actor)
    record_audit(actor, "rollout.advanced", rollout, reason=reason,
                 changes={"step": rollout.current_step, "weight": [previous, step.weight],
                          **({"wave": rollout.current_wave,
                              "regions": rollout.waves[rollout.current_wave]}
                             if rollout.waves else {}),
                          "live": step.ready_at is not None,
                          "canary_replicas": [r.public_id for r in made],
                          **({"analysis": figures} if figures is not None else {})})
    return rollout


def _end(rollout: Rollout, state: str, actor: str, reason: str) -> None:
    rollout.state = state
    rollout.ended_at = timezone.now()
    rollout.reason = reason
    rollout.ended_by = actor
    rollout.save(update_fields=["state", "ended_at", "reason", "ended_by"])


@transaction.atomic
def promote(rollout_id: int, *, actor: str, reason: str = "") -> Rollout:
    """The new revision becomes stable: the deployment takes its settings (so replicas
    launched from now on run it) and the split ends."""
    rollout = locked(rollout_id)
    refuse(rollout, "promote", [S.RUNNING, S.PAUSED])
    close_step(rollout, "promoted")
    _end(rollout, S.PROMOTED, actor, reason)
    revision = rollout.to_revision
    deployment = take_revision(Deployment.objects.get(pk=rollout.deployment_id), revision)
    deployment.stable_revision = revision
    deployment.canary_revision = None
    deployment.canary_weight = 0
    deployment.canary_region_weights = {}
    deployment.save()
    # Unmarked replicas ran the old stable revision's settings: mark them so, since from
    # now on an unmarked replica is one of the new stable revision.
    Replica.objects.filter(deployment=deployment, revision__isnull=True,
                           state__in=LIVE_STATES).update(revision=rollout.from_revision)
    # As many new replicas as the old revision ran, within the deployment's bounds, serve
    # before the old ones go (blue/green and a canary at 100% already have them).
    rollout.deployment = deployment
    rollout.replicas_wanted = max(deployment.min_replicas,
                                  min(deployment.max_replicas, old_fleet(rollout).count()))
    rollout.save(update_fields=["replicas_wanted"])
    retired, made, why = finish_promotion(rollout, actor)
    record_audit(actor, "rollout.promoted", rollout, reason=reason, changes={
        "stable_revision": [rollout.from_revision.number, revision.number],
        "replicas_wanted": rollout.replicas_wanted,
        "requested": [r.public_id for r in made],
        **({"retired": [r.public_id for r in retired]} if retired is not None
           else {"waiting": why})})
    return rollout


@transaction.atomic
def roll_back(rollout_id: int, *, actor: str, reason: str = "",
              figures: Figures | None = None) -> Rollout:
    """Canary weight 0 at once; the canary's replicas drained (launches not yet serving are
    terminated)."""
    rollout = locked(rollout_id)
    refuse(rollout, "rollback", [S.RUNNING, S.PAUSED, S.PENDING])
    close_step(rollout, "rolled_back", figures)
    _end(rollout, S.ROLLED_BACK, actor, reason)
    set_split(rollout, rollout.deployment_id, None, 0)
    canaries = retire(Replica.objects.filter(revision=rollout.to_revision,
                                             state__in=LIVE_STATES).order_by("id"),
                      actor=actor, reason=f"rollout {rollout.pk} rolled back")
    rollout.old_retired_at = timezone.now()
    rollout.save(update_fields=["old_retired_at"])
    record_audit(actor, "rollout.rolled_back", rollout, reason=reason, changes={
        "weight": 0, "retired": [r.public_id for r in canaries],
        **({"analysis": figures} if figures is not None else {})})
    return rollout
