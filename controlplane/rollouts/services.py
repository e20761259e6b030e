"""Rollouts: a deployment's new revision tried on a growing share of its traffic.

The traffic split lives on the deployment (`canary_revision`, `canary_weight`), which the
routing compiler turns into revision weights in every edge's table; the edge keeps each
conversation on one revision and counts its requests by revision. Make-before-break: a step
first asks for the canary replicas its weight needs (`canary_target`), placed like any
replica (`place_revision`), and its weight goes into the tables only once they serve
(`ready_at`); promotion brings the new revision up to the old one's count before the old
replicas are retired (`finish_promotion`). A running rollout's step, once baked, is judged
by `analysis` against the rollout's thresholds (`check`, every 2 s):
a failure rolls back at once, a pass moves to the next step, too little traffic extends the
step (a bounded number of times, then holds the rollout paused); the last step waits for an
operator's promote, and an operator may advance, pause, resume, promote or roll back at any
time.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Collection, Iterable, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.db import IntegrityError, transaction
from django.db.models import Q, QuerySet
from django.utils import timezone

from controlplane.core.services import record_audit
from controlplane.deployments.lifecycle import LIVE_STATES, SERVING_STATES
from controlplane.deployments.models import Deployment, Model, Replica, ReplicaState, Revision
from controlplane.deployments.services import stable_revision
from controlplane.provisioning.tasks import request_replicas
from controlplane.rollouts import analysis
from controlplane.rollouts.failures import failed_during
from controlplane.rollouts.models import (
    IN_PROGRESS,
    Rollout,
    RolloutState,
    RolloutStep,
    Strategy,
)
from controlplane.rollouts.spread import place_spread_first
from controlplane.scaling.autoscaler import (
    Placement,
    choose_retirements,
    place_scale_up,
    sized_for,
)
from controlplane.scaling.services import retire_replica
from controlplane.telemetry.models import ReplicaSample
from regions.models import GpuType, Region

DEFAULT_STEPS = (5, 25, 50, 100)
DEFAULT_ROLLBACK_WINDOW_S = 600
S = RolloutState


class RolloutInputError(ValueError):
    """Bad rollout settings; `field` names which."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


class RolloutStateError(Exception):
    """The rollout's state does not allow the action; the message says why."""


def check_strategy(strategy: Any, steps: Sequence[Any] | None,
                   rollback_window_s: Any) -> tuple[str, Sequence[Any], int]:
    """(strategy, steps, rollback window): blue/green is one step of 100% and a window;
    a canary has no window."""
    if strategy not in Strategy.values:
        raise RolloutInputError("strategy", f"strategy must be one of "
                                            f"{', '.join(Strategy.values)}, not {strategy!r}")
    if strategy == Strategy.CANARY:
        if rollback_window_s is not None:
            raise RolloutInputError("rollback_window_s", "rollback_window_s is for blue_green "
                                                         "rollouts only")
        return strategy, DEFAULT_STEPS if steps is None else steps, 0
    if steps is not None and list(steps) != [100]:
        raise RolloutInputError("steps", "a blue_green rollout switches all traffic at once: "
                                         "leave steps out (or give [100])")
    window = DEFAULT_ROLLBACK_WINDOW_S if rollback_window_s is None else rollback_window_s
    if isinstance(window, bool) or not isinstance(window, int) or not 0 < window <= 86400:
        raise RolloutInputError("rollback_window_s", f"rollback_window_s must be a whole "
                                                     f"number of seconds in (0, 86400], not "
                                                     f"{window!r}")
    return strategy, [100], window


def check_steps(steps: Sequence[Any], bake_s: Any) -> list[int]:
    if not isinstance(steps, (list, tuple)) or not steps:
        raise RolloutInputError("steps", "steps must be a non-empty list of weights (%)")
    weights: list[int] = []
    for weight in steps:
        if isinstance(weight, bool) or not isinstance(weight, int) or not 0 < weight <= 100:
            raise RolloutInputError("steps", f"each step is a whole percentage in (0, 100], "
                                             f"not {weight!r}")
        if weights and weight <= weights[-1]:
            raise RolloutInputError("steps", f"weights must increase: {weight} after "
                                             f"{weights[-1]}")
        weights.append(weight)
    if weights[-1] != 100:
        raise RolloutInputError("steps", f"the last step must be 100, not {weights[-1]}")
    if isinstance(bake_s, bool) or not isinstance(bake_s, int) or bake_s <= 0:
        raise RolloutInputError("bake_s", f"bake_s must be a whole number of seconds > 0, "
                                          f"not {bake_s!r}")
    return weights


def check_waves(waves: Any, strategy: str) -> list[list[str]]:
    """Waves of edge regions: lists of known `cloud:code` keys, none twice."""
    if waves is None or waves == []:
        return []
    if strategy != Strategy.CANARY:
        raise RolloutInputError("waves", "waves are for canary rollouts only")
    if not isinstance(waves, list) or not all(isinstance(w, list) and w for w in waves):
        raise RolloutInputError("waves", "waves must be a list of non-empty lists of regions "
                                         "(cloud:code), such as [[\"aws:eu-central-1\"], "
                                         "[\"aws:us-east-1\"]]")
    seen: set[str] = set()
    for i, wave in enumerate(waves):
        for j, key in enumerate(wave):
            field = f"waves[{i}][{j}]"
            if not isinstance(key, str) or not Region.objects.filter(
                    **Region.key_filter(key)).exists():
                raise RolloutInputError(field, f"no region {key!r}; use cloud:code")
            if key in seen:
                raise RolloutInputError(field, f"region {key} is in two waves")
            seen.add(key)
    return [list(w) for w in waves]


def _set_split(rollout: Rollout | None, deployment_id: int, revision: Revision | None,
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


def _capacity_weight(rollout: Rollout, step: RolloutStep) -> int:
    """The share the canary replicas must carry: past the first wave, earlier waves' edges
    send it everything, so as many as the stable ones."""
    return 100 if rollout.current_wave > 0 else step.weight


def canary_target(weight: int, stable_serving: int) -> int:
    """Canary replicas that carry `weight`% of the traffic at the load each stable replica
    carries: w / (100 − w) of the stable ones (as many as them at 100%), at least one."""
    if weight >= 100:
        return max(1, stable_serving)
    return max(1, math.ceil(stable_serving * weight / (100 - weight) - 1e-9))


def _stable_serving(rollout: Rollout) -> list[Replica]:
    return list(Replica.objects.filter(deployment_id=rollout.deployment_id,
                                       state__in=SERVING_STATES)
                .exclude(revision=rollout.to_revision)
                .select_related("region", "offer").order_by("id"))


def place_revision(deployment: Deployment, revision: Revision, count: int, *, actor: str,
                   reason: str, regions: Collection[str] = (),
                   prefer: Sequence[str] | None = None,
                   spread_only: bool = False) -> tuple[list[Replica], str]:
    """`count` replicas of `revision`, placed as the autoscaler places a scale-up
    (`scaling.autoscaler.place_scale_up`): the solver's cheapest plan that keeps every
    running replica, within the allowed jurisdictions, latency targets and quota, on the
    revision's preferred GPU type (else the type running); else beside running replicas
    with quota left; else none. Without `regions`, one replica first goes to each region
    the revision's replicas lack for the spread rule (`spread.place_spread_first`; `prefer`:
    the regions to try first, else the stable revision's, busiest first). Returns the
    replicas asked for and how they were placed (or why not); with `spread_only`, only
    those the spread rule asks for."""
    if count <= 0:
        return [], ""
    active = list(Replica.objects.filter(deployment=deployment, state__in=LIVE_STATES)
                  .exclude(state=ReplicaState.DRAINING)
                  .select_related("region__cloud", "offer__gpu_type"))
    preferred = revision.preferred_gpu_type
    gpu_types = {preferred.name} if preferred is not None else set()
    sized = sized_for(deployment, revision)
    made: list[Replica] = []
    hows: list[str] = []
    served = ({} if regions else
              served_by_region(r for r in active if r.revision_id != revision.pk))
    if not regions:
        tries = ([where for where, _ in _canary_regions(served) if where] if prefer is None
                 else [{key} for key in prefer])
        made, hows = place_spread_first(deployment, sized, revision, active, count,
                                        gpu_types, tries, actor=actor, reason=reason)
    if count - len(made) <= 0 or spread_only:
        return made, "; ".join(hows)
    placement = None
    # Beside the stable replicas that serve the most, so that the analysis compares the two
    # revisions at the same network distance from the edges; then anywhere they serve;
    # then wherever the solver finds room.
    rest = ([(set(regions), f"in {', '.join(sorted(regions))}"),
              (set(), "where the solver found room")] if regions
             else _canary_regions(served))
    for where_to, where in rest:
        placement = place_scale_up(sized, active, count - len(made), gpu_types=gpu_types,
                                   regions=where_to)
        if placement.slots:
            placement = Placement(placement.slots, f"{where}: {placement.how}")
            break
    assert placement is not None
    for region, offer, spot, n in placement.slots:
        made += request_replicas(deployment, region, n, actor=actor, reason=reason,
                                 spot=spot, offer=offer, revision=revision)
    return made, "; ".join([*hows, placement.how])


# How far back the stable replicas' served requests are counted to find the busiest region.
BUSIEST_WINDOW = timedelta(minutes=5)


def served_by_region(replicas: Iterable[Replica],
                     now: datetime | None = None) -> dict[str, float]:
    """Requests these replicas finished in the last BUSIEST_WINDOW, by region (cloud:code),
    from the engines' counters as telemetry stored them; 0 for a region without samples."""
    now = now or timezone.now()
    served: dict[str, float] = {}
    for replica in replicas:
        key = replica.region.key
        served.setdefault(key, 0.0)
        rows = ReplicaSample.objects.filter(replica_id=replica.pk, up=True,
                                            at__gte=now - BUSIEST_WINDOW, at__lte=now)
        first, last = rows.order_by("at").first(), rows.order_by("-at").first()
        if first is not None and last is not None:
            grew = (last.counters.get("requests_ok", 0.0)
                    - first.counters.get("requests_ok", 0.0))
            served[key] += max(grew, 0.0)
    return served


def _ranked(served: dict[str, float]) -> list[str]:
    return sorted(served, key=lambda key: (-served[key], key))


def _canary_regions(served: dict[str, float]) -> list[tuple[set[str], str]]:
    """Where to try placing a revision's new replicas, in order, from what the other
    revisions' replicas `served` by region: the region whose stable replicas served the
    most, when one did; any region with stable replicas (the solver's cheapest of them);
    anywhere."""
    ranked = _ranked(served)
    tries: list[tuple[set[str], str]] = []
    if ranked and served[ranked[0]] > (served[ranked[1]] if len(ranked) > 1 else -1.0):
        tries.append(({ranked[0]}, f"beside the busiest stable replicas ({ranked[0]})"))
    if ranked:
        tries.append((set(ranked), "beside stable replicas"))
    tries.append((set(), "where the solver found room (no stable region had any)"
                  if ranked else "where the solver found room"))
    return tries


def _retire(replicas: Iterable[Replica], *, actor: str, reason: str) -> list[Replica]:
    """Drain (serving) or terminate (still launching) each: the replica is out of the next
    tables before anything is stopped (scaling.services.retire_replica)."""
    retired = []
    for replica in replicas:
        if replica.state in LIVE_STATES and replica.state != ReplicaState.DRAINING:
            retire_replica(replica, actor=actor, reason=reason)
            retired.append(replica)
    return retired


def _new_fleet(rollout: Rollout) -> QuerySet[Replica]:
    """After promotion, the new (now stable) revision's replicas that count: live, not
    draining; unmarked ones were launched since the promotion, with its settings."""
    return (Replica.objects.filter(deployment_id=rollout.deployment_id, state__in=LIVE_STATES)
            .exclude(state=ReplicaState.DRAINING)
            .filter(Q(revision=rollout.to_revision) | Q(revision__isnull=True)))


def _old_fleet(rollout: Rollout) -> QuerySet[Replica]:
    """After promotion, the replicas of earlier revisions still to retire."""
    return (Replica.objects.filter(deployment_id=rollout.deployment_id, state__in=LIVE_STATES,
                                   revision__isnull=False)
            .exclude(state=ReplicaState.DRAINING).exclude(revision=rollout.to_revision)
            .order_by("id"))


def finish_promotion(rollout: Rollout, actor: str) -> tuple[list[Replica] | None,
                                                            list[Replica], str]:
    """Make-before-break after promotion: ask for the new revision's replicas still missing
    from `replicas_wanted` (placed like any replica); once that many serve, drain and retire
    the old revision's. Returns (retired, or None while waiting; replicas asked for; why it
    waits). The caller holds the rollout's row lock."""
    wanted = rollout.replicas_wanted or 0
    new = _new_fleet(rollout)
    reason = (f"rollout {rollout.pk} promoted: revision {rollout.to_revision.number} "
              f"replaces the old revision's replicas")
    # Where the old revision ran first, region for region, so its users keep their
    # distance to a replica; what no such region takes, wherever the solver finds room.
    new_rows = list(new.select_related("region__cloud"))
    old_regions = Counter(r.region.key for r in _old_fleet(rollout)
                          .select_related("region__cloud"))
    have = Counter(r.region.key for r in new_rows)
    # The new revision spans as many regions as the spread rule asks (never more than the
    # deployment serves in now): one replica in each it lacks, where the old revision ran
    # most first, before any old replica goes.
    spread = min(rollout.deployment.spread_regions, max(wanted, 1),
                 len(set(have) | set(old_regions)))
    missing = wanted - len(new_rows)
    made: list[Replica] = []
    hows: list[str] = []
    if spread > len(have):
        made, how = place_revision(
            rollout.deployment, rollout.to_revision, spread - len(have), actor=actor,
            reason=reason, spread_only=True,
            prefer=sorted(old_regions, key=lambda key: (-old_regions[key], key)))
        have.update(r.region.key for r in made)
        hows += [how] if how else []
    missing -= len(made)
    placed_here = len(made)
    for key, n in sorted(old_regions.items()):
        short = min(n - have[key], missing - (len(made) - placed_here))
        if short > 0:
            placed, how = place_revision(rollout.deployment, rollout.to_revision, short,
                                         actor=actor, reason=reason, regions={key})
            made += placed
            hows += [how] if how else []
    if missing - (len(made) - placed_here) > 0:
        placed, how = place_revision(rollout.deployment, rollout.to_revision,
                                     missing - (len(made) - placed_here), actor=actor,
                                     reason=reason)
        made += placed
        hows += [how] if how else []
    how = "; ".join(hows)
    serving_rows = list(new.filter(state__in=SERVING_STATES).select_related(
        "region__cloud", "offer", "deployment"))
    serving_regions = {r.region.key for r in serving_rows}
    if len(serving_rows) < wanted or len(serving_regions) < spread:
        why = (f"waiting for {wanted} replicas of revision {rollout.to_revision.number} in "
               f"{spread} region{'s' if spread != 1 else ''} to serve before the old "
               f"revision's are retired: {len(serving_rows)} serving in "
               f"{len(serving_regions)}")
        return None, made, f"{why}; {how}" if how else why
    retired = _retire(_old_fleet(rollout).select_related("deployment"), actor=actor,
                      reason=f"rollout {rollout.pk} promoted revision "
                             f"{rollout.to_revision.number}")
    # More new replicas than wanted serve (some went where the spread rule needed them):
    # the surplus goes, keeping the regions (the autoscaler's choice of whom to drain).
    surplus = len(serving_rows) - wanted
    if surplus > 0:
        retired += _retire(choose_retirements(serving_rows, surplus, {},
                                              rollout.deployment.spread_regions, wanted),
                           actor=actor, reason=f"rollout {rollout.pk} promoted revision "
                                               f"{rollout.to_revision.number}: more of its "
                                               f"replicas serve than the {wanted} wanted")
    rollout.old_retired_at = timezone.now()
    rollout.save(update_fields=["old_retired_at"])
    return retired, made, ""


def _grow_canary(rollout: Rollout, weight: int, actor: str) -> tuple[list[Replica], str]:
    """Ask for the canary replicas `weight` needs beyond those live, placed like any
    replica (`place_revision`: the solver, residency, quota, the revision's preferred GPU
    type). Returns them and, when fewer could be placed than were missing, why."""
    live = Replica.objects.filter(revision=rollout.to_revision, state__in=LIVE_STATES).count()
    missing = canary_target(weight, len(_stable_serving(rollout))) - live
    made, how = place_revision(rollout.deployment, rollout.to_revision, missing, actor=actor,
                               reason=f"canary of rollout {rollout.pk} at {weight}%")
    return made, how if len(made) < missing else ""


def _go_live_if_ready(rollout: Rollout, step: RolloutStep) -> bool:
    """The step's weight into the tables once enough canary replicas serve."""
    if step.ready_at is not None:
        return True
    serving = Replica.objects.filter(revision=rollout.to_revision,
                                     state__in=SERVING_STATES).count()
    if serving < canary_target(_capacity_weight(rollout, step), len(_stable_serving(rollout))):
        return False
    step.ready_at = timezone.now()
    step.analysis = {}  # no longer waiting; judged from now
    step.save(update_fields=["ready_at", "analysis"])
    _set_split(rollout, rollout.deployment_id, rollout.to_revision, step.weight)
    return True


def _waiting_why(rollout: Rollout, step: RolloutStep, unplaced: str = "") -> str:
    """Why a step is not live yet: its canary replicas, why the missing ones could not be
    placed (quota, residency), and the last launch failure."""
    canaries = Replica.objects.filter(revision=rollout.to_revision)
    serving = canaries.filter(state__in=SERVING_STATES).count()
    launching = canaries.filter(state__in=LIVE_STATES).exclude(
        state__in=SERVING_STATES).count()
    target = canary_target(_capacity_weight(rollout, step), len(_stable_serving(rollout)))
    why = (f"waiting for {target} canary replica{'s' if target != 1 else ''} to serve "
           f"{step.weight}%: {serving} serving, {launching} launching")
    failed = (canaries.filter(state=ReplicaState.FAILED).exclude(last_error="")
              .order_by("-state_changed_at", "-id").first())
    if unplaced:
        why += f"; not placed: {unplaced[:300]}"
    if failed is not None:
        why += f"; the last launch failed: {failed.last_error[:200]}"
    return why


def _open_step(rollout: Rollout, actor: str) -> tuple[RolloutStep, list[Replica]]:
    """The next step: its canary replicas asked for, its weight live if they already
    serve (else the previous weight stays until `check` sees them serving)."""
    step = RolloutStep.objects.create(rollout=rollout, wave=rollout.current_wave,
                                      step=rollout.current_step,
                                      weight=rollout.steps[rollout.current_step])
    made, unplaced = _grow_canary(rollout, _capacity_weight(rollout, step), actor)
    if not _go_live_if_ready(rollout, step):
        step.analysis = {"verdict": "waiting", "why": _waiting_why(rollout, step, unplaced)}
        step.save(update_fields=["analysis"])
    return step, made


def _close_step(rollout: Rollout, decision: str, figures: dict[str, Any] | None = None) -> None:
    changes: dict[str, Any] = {"ended_at": timezone.now(), "decision": decision}
    if figures is not None:
        changes["analysis"] = figures
    RolloutStep.objects.filter(rollout=rollout, wave=rollout.current_wave,
                               step=rollout.current_step, ended_at__isnull=True
                               ).update(**changes)


@transaction.atomic
def start(deployment: Deployment, *, actor: str, steps: Sequence[Any] | None = None,
          bake_s: Any = 300, strategy: Any = Strategy.CANARY, rollback_window_s: Any = None,
          waves: Any = None, auto_promote: Any = True,
          model: Model | None = None, vllm_version: str | None = None,
          engine_args: dict[str, Any] | None = None, tensor_parallel: int | None = None,
          pipeline_parallel: int | None = None, preferred_gpu_type: GpuType | None = None,
          thresholds: Any = None, reason: str = "") -> Rollout:
    """A new revision (unset settings: the stable revision's) and a rollout of it at its
    first step, the canary replicas that step needs asked for beside the stable ones (for
    blue/green: as many as them, all traffic switched once they serve)."""
    strategy, steps, window = check_strategy(strategy, steps, rollback_window_s)
    weights = check_steps(steps, bake_s)
    wave_regions = check_waves(waves, strategy)
    if not isinstance(auto_promote, bool):
        raise RolloutInputError("auto_promote", f"auto_promote must be true or false, not "
                                f"{auto_promote!r}")
    try:
        limits = analysis.check_thresholds(
            thresholds, analysis.defaults_for(deployment.slo_ttft_p95_ms))
    except analysis.ThresholdError as exc:
        raise RolloutInputError(exc.field, str(exc)) from None
    locked = Deployment.objects.select_for_update().get(pk=deployment.pk)
    current = Rollout.objects.filter(deployment=locked, state__in=IN_PROGRESS).first()
    if current is not None:
        raise RolloutStateError(f"deployment {locked.name} already has rollout {current.pk} "
                                f"in progress ({current.state}); finish or roll it back first")
    retiring = _retiring().filter(deployment=locked).first()
    if retiring is not None:
        raise RolloutStateError(f"deployment {locked.name}'s rollout {retiring.pk} was promoted "
                                "and its old revision's replicas are not retired yet (the new "
                                "ones do not all serve); start the next one once they are")
    stable = stable_revision(locked)
    number = (locked.revisions.order_by("-number").values_list("number", flat=True).first()
              or 0) + 1
    revision = Revision.objects.create(
        deployment=locked, number=number, model=model or stable.model,
        vllm_version=stable.vllm_version if vllm_version is None else vllm_version,
        engine_args={**stable.engine_args, **(engine_args or {})},
        tensor_parallel=tensor_parallel or stable.tensor_parallel,
        pipeline_parallel=pipeline_parallel or stable.pipeline_parallel,
        preferred_gpu_type=preferred_gpu_type or stable.preferred_gpu_type,
    )
    now = timezone.now()
    try:
        with transaction.atomic():
            rollout = Rollout.objects.create(
                deployment=locked, from_revision=stable, to_revision=revision,
                strategy=strategy, steps=weights, bake_s=bake_s, waves=wave_regions,
                rollback_window_s=window, thresholds=limits, state=S.RUNNING,
                auto_promote=auto_promote, start_reason=reason,
                created_by=actor, started_at=now)
    except IntegrityError:
        raise RolloutStateError(f"deployment {locked.name} already has a rollout in "
                                "progress") from None
    # Listed in the tables at share 0 until its replicas serve the first step's weight.
    _set_split(rollout, locked.pk, revision, 0)
    step, canaries = _open_step(rollout, actor)
    record_audit(actor, "rollout.started", rollout, reason=reason, changes={
        "strategy": strategy, "from_revision": stable.number, "to_revision": revision.number,
        "steps": weights, "bake_s": bake_s, "rollback_window_s": window or None,
        "waves": wave_regions or None, "auto_promote": auto_promote,
        "thresholds": limits, "weight": step.weight,
        "canary_replicas": [r.public_id for r in canaries]})
    return rollout


def _at_last_step(rollout: Rollout) -> bool:
    return (rollout.current_step >= len(rollout.steps) - 1
            and rollout.current_wave >= max(len(rollout.waves), 1) - 1)


def _locked(rollout_id: int) -> Rollout:
    return Rollout.objects.select_for_update().select_related("deployment").get(pk=rollout_id)


def _refuse(rollout: Rollout, action: str, allowed: Sequence[str]) -> None:
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
    rollout = _locked(rollout_id)
    _refuse(rollout, action, [from_state])
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
            figures: dict[str, Any] | None = None) -> Rollout:
    """The next step's weight; at the last step (100) the rollout waits for promote."""
    rollout = _locked(rollout_id)
    _refuse(rollout, "advance", [S.RUNNING])
    if _at_last_step(rollout):
        raise RolloutStateError(f"rollout {rollout.pk} is at its last step "
                                f"({rollout.weight}%): promote it or roll it back")
    _close_step(rollout, "advanced", figures)
    previous = rollout.weight
    if rollout.current_step < len(rollout.steps) - 1:
        rollout.current_step += 1
    else:  # the wave is at 100%: the next wave from the first step
        rollout.current_wave += 1
        rollout.current_step = 0
    rollout.save(update_fields=["current_step", "current_wave"])
    step, made = _open_step(rollout, actor)
    record_audit(actor, "rollout.advanced", rollout, reason=reason,
                 changes={"step": rollout.current_step, "weight": [previous, step.weight],
                          **({"wave": rollout.current_wave,
                              "regions": rollout.waves[rollout.current_wave]}
                             if rollout.waves else {}),
                          "live": step.ready_at is not None,
                          "canary_replicas": [r.public_id for r in made],
                          **({"analysis": figures} if figures is not None else {})})
    return rollout


@transaction.atomic
def promote(rollout_id: int, *, actor: str, reason: str = "") -> Rollout:
    """The new revision becomes stable: the deployment takes its settings (so replicas
    launched from now on run it) and the split ends."""
    rollout = _locked(rollout_id)
    _refuse(rollout, "promote", [S.RUNNING, S.PAUSED])
    _close_step(rollout, "promoted")
    rollout.state = S.PROMOTED
    rollout.ended_at = timezone.now()
    rollout.reason = reason
    rollout.ended_by = actor
    rollout.save(update_fields=["state", "ended_at", "reason", "ended_by"])
    revision = rollout.to_revision
    deployment = Deployment.objects.get(pk=rollout.deployment_id)
    args = revision.engine_args
    deployment.stable_revision = revision
    deployment.canary_revision = None
    deployment.canary_weight = 0
    deployment.canary_region_weights = {}
    deployment.model_id = revision.model_id
    deployment.tensor_parallel = revision.tensor_parallel
    deployment.pipeline_parallel = revision.pipeline_parallel
    deployment.max_model_len = int(args.get("max_model_len", deployment.max_model_len))
    deployment.enable_prefix_caching = bool(args.get("enable_prefix_caching",
                                                     deployment.enable_prefix_caching))
    deployment.save()
    # Unmarked replicas ran the old stable revision's settings: mark them so, since from
    # now on an unmarked replica is one of the new stable revision.
    old = Replica.objects.filter(deployment=deployment, revision__isnull=True,
                                 state__in=LIVE_STATES)
    old.update(revision=rollout.from_revision)
    # As many new replicas as the old revision ran, within the deployment's bounds, serve
    # before the old ones go (blue/green and a canary at 100% already have them).
    rollout.deployment = deployment
    rollout.replicas_wanted = max(deployment.min_replicas,
                                  min(deployment.max_replicas, _old_fleet(rollout).count()))
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
              figures: dict[str, Any] | None = None) -> Rollout:
    """Canary weight 0 at once; the canary's replicas drained (launches not yet serving are
    terminated)."""
    rollout = _locked(rollout_id)
    _refuse(rollout, "rollback", [S.RUNNING, S.PAUSED, S.PENDING])
    _close_step(rollout, "rolled_back", figures)
    rollout.state = S.ROLLED_BACK
    rollout.ended_at = timezone.now()
    rollout.reason = reason
    rollout.ended_by = actor
    rollout.save(update_fields=["state", "ended_at", "reason", "ended_by"])
    _set_split(rollout, rollout.deployment_id, None, 0)
    canaries = _retire(Replica.objects.filter(revision=rollout.to_revision,
                                              state__in=LIVE_STATES).order_by("id"),
                       actor=actor, reason=f"rollout {rollout.pk} rolled back")
    rollout.old_retired_at = timezone.now()
    rollout.save(update_fields=["old_retired_at"])
    record_audit(actor, "rollout.rolled_back", rollout, reason=reason, changes={
        "weight": 0, "retired": [r.public_id for r in canaries],
        **({"analysis": figures} if figures is not None else {})})
    return rollout


ANALYST = "rollouts.analysis"


def limits_of(rollout: Rollout) -> dict[str, float]:
    """The rollout's thresholds over the defaults (rows from before they were stored)."""
    return {**analysis.defaults_for(rollout.deployment.slo_ttft_p95_ms), **rollout.thresholds}


def step_figures(rollout: Rollout, since: Any, until: Any) -> tuple[str, str, dict[str, Any]]:
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


@transaction.atomic
def _extend_or_hold(rollout_id: int, step_id: int, why: str, figures: dict[str, Any]) -> str:
    """Too little traffic: one more bake time, or, with the extensions spent, the rollout
    held (paused, the step's decision no_data) for an operator to resume, promote or roll
    back."""
    rollout = _locked(rollout_id)
    _refuse(rollout, "analysis", [S.RUNNING])
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


def _retiring() -> QuerySet[Rollout]:
    """Promoted rollouts whose old revision's replicas are not retired yet."""
    return Rollout.objects.filter(state=S.PROMOTED, replicas_wanted__isnull=False,
                                  old_retired_at__isnull=True)


@transaction.atomic
def _finish_retiring(rollout_id: int) -> str:
    """A promotion waiting for its new replicas: ask again for what failed; once they
    serve, the old revision's replicas drained (a `rollout.old_retired` audit event)."""
    rollout = _locked(rollout_id)
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


def check(now: Any = None) -> dict[str, str]:
    """Roll back each running rollout whose canary replicas failed during its step
    (`failures.failed_during`: failover's replacement does not hide it); put each step live
    once its canary replicas serve; judge each whose
    live step has baked (its bake time once, and once more per extension): fail → rolled
    back, pass → the next step (past the last one: promoted, or, without auto_promote, waiting
    for an operator's promote, the figures kept on the step), too little traffic → extended
    or held; and
    finish each promotion still waiting for its new replicas (`finish_promotion`).
    Returns {rollout id: what was done}."""
    now = now or timezone.now()
    done: dict[str, str] = {}
    for rollout_id in _retiring().values_list("pk", flat=True):
        done[str(rollout_id)] = _finish_retiring(rollout_id)
    running = Rollout.objects.filter(state=S.RUNNING).select_related(
        "deployment", "from_revision", "to_revision")
    for rollout in running:
        step = RolloutStep.objects.filter(rollout=rollout, wave=rollout.current_wave,
                                          step=rollout.current_step,
                                          ended_at__isnull=True).first()
        if step is None:
            continue
        broken = failed_during(rollout, step)
        if broken:
            try:
                roll_back(rollout.pk, actor=ANALYST, reason=broken)
                done[str(rollout.pk)] = "rolled_back"
            except RolloutStateError:
                done[str(rollout.pk)] = "moved"
            continue
        if step.ready_at is None:
            with transaction.atomic():
                # replaces a failed launch, places what found no room before
                _, unplaced = _grow_canary(rollout, _capacity_weight(rollout, step), ANALYST)
                if _go_live_if_ready(rollout, step):
                    done[str(rollout.pk)] = "live"
                else:
                    waiting = {"verdict": "waiting",
                               "why": _waiting_why(rollout, step, unplaced)}
                    if step.analysis != waiting:
                        RolloutStep.objects.filter(pk=step.pk).update(analysis=waiting)
            continue
        if (now - step.ready_at).total_seconds() < rollout.bake_s * (1 + step.extensions):
            continue
        verdict, why, figures = step_figures(rollout, step.ready_at, now)
        try:
            if verdict == "fail":
                roll_back(rollout.pk, actor=ANALYST, reason=why, figures=figures)
                done[str(rollout.pk)] = "rolled_back"
            elif verdict == "no_data":
                done[str(rollout.pk)] = _extend_or_hold(rollout.pk, step.pk, why, figures)
            elif not _at_last_step(rollout):
                advance(rollout.pk, actor=ANALYST, reason=why, figures=figures)
                done[str(rollout.pk)] = "advanced"
            else:
                # The last step passed: its figures kept on it, then promoted when its time
                # has come (blue/green: its rollback window over) and promotion is automatic.
                RolloutStep.objects.filter(pk=step.pk).update(analysis=figures)
                if rollout.strategy == Strategy.BLUE_GREEN:
                    if (now - step.ready_at).total_seconds() < rollout.rollback_window_s:
                        done[str(rollout.pk)] = "in_window"
                        continue
                    reason = f"rollback window of {rollout.rollback_window_s} s passed: {why}"
                elif rollout.auto_promote:
                    reason = f"last step passed: {why}"
                else:
                    done[str(rollout.pk)] = "awaiting_promote"
                    continue
                promote(rollout.pk, actor=ANALYST, reason=reason)
                done[str(rollout.pk)] = "promoted"
        except RolloutStateError:
            done[str(rollout.pk)] = "moved"  # an operator acted meanwhile
    return done
