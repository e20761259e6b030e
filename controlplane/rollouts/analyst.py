"""The rollouts' check (every 2 s): each running rollout's step, once live and baked, judged
by `analysis` against the rollout's thresholds. A failure rolls back at once, a pass moves
to the next step, too little traffic extends the step (a bounded number of times, then
holds the rollout paused); the last step waits for an operator's promote unless promotion
is automatic. A canary replica that fails during its step rolls the rollout back, and each
promotion still waiting for its new replicas is taken further (`promotion`). The check acts
through `lifecycle`, as an operator does, under the actor ANALYST."""

from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.utils import timezone

from controlplane.core.services import record_audit
from controlplane.rollouts import analysis
from controlplane.rollouts.failures import failed_during
from controlplane.rollouts.lifecycle import (
    RolloutStateError,
    advance,
    at_last_step,
    locked,
    promote,
    refuse,
    roll_back,
)
from controlplane.rollouts.models import Rollout, RolloutState, RolloutStep, Strategy
from controlplane.rollouts.placement import grow_canary
from controlplane.rollouts.promotion import finish_promotion, retiring
from controlplane.rollouts.steps import Figures, capacity_weight, go_live_if_ready, waiting_why

ANALYST = "rollouts.analysis"
S = RolloutState


def limits_of(rollout: Rollout) -> dict[str, float]:
    """The rollout's thresholds over the defaults (rows from before they were stored)."""
    return {**analysis.defaults_for(rollout.deployment.slo_ttft_p95_ms), **rollout.thresholds}


def step_figures(rollout: Rollout, since: datetime, until: datetime
                 ) -> tuple[str, str, Figures]:
    """The step's verdict, why, and the figures it rests on."""
    limits = limits_of(rollout)
    # A rollout in waves is judged at the current wave's edges only: elsewhere the canary
    # has all of the traffic or none.
    regions = rollout.waves[rollout.current_wave] if rollout.waves else None
    got = analysis.figures([rollout.to_revision_id, rollout.from_revision_id], since, until,
                           edge_regions=regions)
    canary, stable = got[rollout.to_revision_id], got[rollout.from_revision_id]
    compared = stable if rollout.weight < 100 else None
    verdict, why, done = analysis.judge(canary, compared, limits)
    return verdict, why, {
        "window": [since.isoformat(), until.isoformat()], "verdict": verdict, "why": why,
        **({"edge_regions": regions} if regions else {}),
        "thresholds": limits, "checks": [c.as_dict() for c in done],
        "canary": {"revision": rollout.to_revision.number, **canary.as_dict()},
        "stable": {"revision": rollout.from_revision.number, **stable.as_dict()},
    }


def check(now: datetime | None = None) -> dict[str, str]:
    """Roll back each running rollout whose canary replicas failed during its step
    (`failures.failed_during`: failover's replacement does not hide it); put each step live
    once its canary replicas serve; judge each whose live step has baked (its bake time
    once, and once more per extension): fail → rolled back, pass → the next step (past the
    last one: promoted, or, without auto_promote, waiting for an operator's promote, the
    figures kept on the step), too little traffic → extended or held; and finish each
    promotion still waiting for its new replicas (`promotion.finish_promotion`).
    Returns {rollout id: what was done}."""
    now = now or timezone.now()
    done: dict[str, str] = {}
    for rollout_id in retiring().values_list("pk", flat=True):
        done[str(rollout_id)] = _finish_retiring(rollout_id)
    running = Rollout.objects.filter(state=S.RUNNING).select_related(
        "deployment", "from_revision", "to_revision")
    for rollout in running:
        step = RolloutStep.objects.filter(rollout=rollout, wave=rollout.current_wave,
                                          step=rollout.current_step,
                                          ended_at__isnull=True).first()
        if step is None:
            continue
        try:
            outcome = _check_step(rollout, step, now)
        except RolloutStateError:
            outcome = "moved"  # an operator acted meanwhile
        if outcome is not None:
            done[str(rollout.pk)] = outcome
    return done


def _check_step(rollout: Rollout, step: RolloutStep, now: datetime) -> str | None:
    """What the check does with one running rollout's current step; None: nothing yet."""
    broken = failed_during(rollout, step)
    if broken:
        roll_back(rollout.pk, actor=ANALYST, reason=broken)
        return "rolled_back"
    if step.ready_at is None:
        return _wait_for_canaries(rollout, step)
    if (now - step.ready_at).total_seconds() < rollout.bake_s * (1 + step.extensions):
        return None
    verdict, why, figures = step_figures(rollout, step.ready_at, now)
    if verdict == "fail":
        roll_back(rollout.pk, actor=ANALYST, reason=why, figures=figures)
        return "rolled_back"
    if verdict == "no_data":
        return _extend_or_hold(rollout.pk, step.pk, why, figures)
    if not at_last_step(rollout):
        advance(rollout.pk, actor=ANALYST, reason=why, figures=figures)
        return "advanced"
    return _after_last_step(rollout, step, now, why, figures)


@transaction.atomic
def _wait_for_canaries(rollout: Rollout, step: RolloutStep) -> str | None:
    """A step not live yet: replace a failed launch, place what found no room before, and
    put it live once its canary replicas serve, else say what it waits for."""
    _, unplaced = grow_canary(rollout, capacity_weight(rollout, step), ANALYST)
    if go_live_if_ready(rollout, step):
        return "live"
    waiting = {"verdict": "waiting", "why": waiting_why(rollout, step, unplaced)}
    if step.analysis != waiting:
        RolloutStep.objects.filter(pk=step.pk).update(analysis=waiting)
    return None


def _after_last_step(rollout: Rollout, step: RolloutStep, now: datetime, why: str,
                     figures: Figures) -> str:
    """The last step passed: its figures kept on it, then promoted when its time has come
    (blue/green: its rollback window over) and promotion is automatic."""
    assert step.ready_at is not None
    RolloutStep.objects.filter(pk=step.pk).update(analysis=figures)
    if rollout.strategy == Strategy.BLUE_GREEN:
        if (now - step.ready_at).total_seconds() < rollout.rollback_window_s:
            return "in_window"
        reason = f"rollback window of {rollout.rollback_window_s} s passed: {why}"
    elif rollout.auto_promote:
        reason = f"last step passed: {why}"
    else:
        return "awaiting_promote"
    promote(rollout.pk, actor=ANALYST, reason=reason)
    return "promoted"


@transaction.atomic
def _extend_or_hold(rollout_id: int, step_id: int, why: str, figures: Figures) -> str:
    """Too little traffic: one more bake time, or, with the extensions spent, the rollout
    held (paused, the step's decision no_data) for an operator to resume, promote or roll
    back."""
    rollout = locked(rollout_id)
    refuse(rollout, "analysis", [S.RUNNING])
    step = RolloutStep.objects.select_for_update().get(pk=step_id)
    if step.extensions < limits_of(rollout)["max_extensions"]:
        step.extensions += 1
        step.analysis = figures
        step.save(update_fields=["extensions", "analysis"])
        return "extended"
    step.analysis = figures
    step.decision = "no_data"
    step.save(update_fields=["analysis", "decision"])
    rollout.state = S.PAUSED
    rollout.save(update_fields=["state"])
    record_audit(ANALYST, "rollout.held", rollout,
                 reason=f"held at {rollout.weight}% after {step.extensions} extensions: {why}",
                 changes={"step": rollout.current_step, "weight": rollout.weight,
                          "analysis": figures})
    return "held"


@transaction.atomic
def _finish_retiring(rollout_id: int) -> str:
    """A promotion waiting for its new replicas: ask again for what failed; once they
    serve, the old revision's replicas drained (a `rollout.old_retired` audit event)."""
    rollout = locked(rollout_id)
    if rollout.old_retired_at is not None:
        return "moved"
    retired, made, why = finish_promotion(rollout, ANALYST)
    if retired is None:
        if made:
            record_audit(ANALYST, "rollout.replicas_requested", rollout, reason=why,
                         changes={"requested": [r.public_id for r in made]})
        return "retiring"
    record_audit(ANALYST, "rollout.old_retired", rollout,
                 reason=f"{rollout.replicas_wanted} replicas of revision "
                        f"{rollout.to_revision.number} serve",
                 changes={"retired": [r.public_id for r in retired],
                          "requested": [r.public_id for r in made]})
    return "retired_old"
