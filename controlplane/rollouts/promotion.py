"""Make-before-break after promotion: as many replicas of the new revision as the old one
ran (`replicas_wanted`), placed where the old revision ran, spread as the rule asks, serve
before the old revision's replicas are drained (`finish_promotion`, from `lifecycle.promote`
and then from every check until it is done)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from django.db.models import Q, QuerySet
from django.utils import timezone

from controlplane.deployments.lifecycle import SERVING_STATES, STAYING_STATES
from controlplane.deployments.models import Replica
from controlplane.rollouts.models import Rollout, RolloutState
from controlplane.rollouts.placement import place_revision
from controlplane.scaling.autoscaler import choose_retirements
from controlplane.scaling.services import retire_replica


def retire(replicas: Iterable[Replica], *, actor: str, reason: str) -> list[Replica]:
    """Drain (serving) or terminate (still launching) each: the replica is out of the next
    tables before anything is stopped (scaling.services.retire_replica)."""
    retired = []
    for replica in replicas:
        if replica.state in STAYING_STATES:
            retire_replica(replica, actor=actor, reason=reason)
            retired.append(replica)
    return retired


def retiring() -> QuerySet[Rollout]:
    """Promoted rollouts whose old revision's replicas are not retired yet."""
    return Rollout.objects.filter(state=RolloutState.PROMOTED, replicas_wanted__isnull=False,
                                  old_retired_at__isnull=True)


def new_fleet(rollout: Rollout) -> QuerySet[Replica]:
    """After promotion, the new (now stable) revision's replicas that count: live, not
    draining; unmarked ones were launched since the promotion, with its settings."""
    return (Replica.objects.staying().filter(deployment_id=rollout.deployment_id)
            .filter(Q(revision=rollout.to_revision) | Q(revision__isnull=True)))


def old_fleet(rollout: Rollout) -> QuerySet[Replica]:
    """After promotion, the replicas of earlier revisions still to retire."""
    return (Replica.objects.staying().filter(deployment_id=rollout.deployment_id,
                                             revision__isnull=False)
            .exclude(revision=rollout.to_revision).order_by("id"))


def finish_promotion(rollout: Rollout, actor: str) -> tuple[list[Replica] | None,
                                                            list[Replica], str]:
    """Make-before-break after promotion: ask for the new revision's replicas still missing
    from `replicas_wanted` (placed like any replica); once that many serve, drain and retire
    the old revision's. Returns (retired, or None while waiting; replicas asked for; why it
    waits). The caller holds the rollout's row lock."""
    wanted = rollout.replicas_wanted or 0
    made, spread, how = _place_new(rollout, wanted, actor)
    serving_rows = list(new_fleet(rollout).filter(state__in=SERVING_STATES).select_related(
        "region__cloud", "offer", "deployment"))
    serving_regions = {r.region.key for r in serving_rows}
    if len(serving_rows) < wanted or len(serving_regions) < spread:
        why = (f"waiting for {wanted} replicas of revision {rollout.to_revision.number} in "
               f"{spread} region{'s' if spread != 1 else ''} to serve before the old "
               f"revision's are retired: {len(serving_rows)} serving in "
               f"{len(serving_regions)}")
        return None, made, f"{why}; {how}" if how else why
    return _retire_old(rollout, serving_rows, wanted, actor), made, ""


def _place_new(rollout: Rollout, wanted: int, actor: str) -> tuple[list[Replica], int, str]:
    """Ask for the new revision's missing replicas: first one in each region the spread
    rule lacks, where the old revision ran most; then where the old revision ran, region
    for region, so its users keep their distance to a replica; then wherever the solver
    finds room. Returns them, the regions the new revision must span, and how they were
    placed."""
    reason = (f"rollout {rollout.pk} promoted: revision {rollout.to_revision.number} "
              f"replaces the old revision's replicas")
    deployment, revision = rollout.deployment, rollout.to_revision
    new_rows = list(new_fleet(rollout).select_related("region__cloud"))
    old_regions = Counter(r.region.key for r in old_fleet(rollout)
                          .select_related("region__cloud"))
    have = Counter(r.region.key for r in new_rows)
    # As many regions as the spread rule asks (never more than the deployment serves in
    # now), before any old replica goes.
    spread = min(deployment.spread_regions, max(wanted, 1), len(set(have) | set(old_regions)))
    made: list[Replica] = []
    hows: list[str] = []
    if spread > len(have):
        made, how = place_revision(
            deployment, revision, spread - len(have), actor=actor, reason=reason,
            spread_only=True, prefer=sorted(old_regions, key=lambda key: (-old_regions[key], key)))
        have.update(r.region.key for r in made)
        hows += [how] if how else []
    missing = wanted - len(new_rows) - len(made)
    for key, n in sorted(old_regions.items()):
        short = min(n - have[key], missing)
        if short > 0:
            placed, how = place_revision(deployment, revision, short, actor=actor,
                                         reason=reason, regions={key})
            made += placed
            missing -= len(placed)
            hows += [how] if how else []
    if missing > 0:
        placed, how = place_revision(deployment, revision, missing, actor=actor, reason=reason)
        made += placed
        hows += [how] if how else []
    return made, spread, "; ".join(hows)


def _retire_old(rollout: Rollout, serving_rows: list[Replica], wanted: int,
                actor: str) -> list[Replica]:
    """The old revision's replicas drained, and the new revision's surplus over `wanted`
    (some went where the spread rule needed them), keeping the regions (the autoscaler's
    choice of whom to drain); the rollout marked retired."""
    number = rollout.to_revision.number
    retired = retire(old_fleet(rollout).select_related("deployment"), actor=actor,
                     reason=f"rollout {rollout.pk} promoted revision {number}")
    surplus = len(serving_rows) - wanted
    if surplus > 0:
        retired += retire(choose_retirements(serving_rows, surplus, {},
                                             rollout.deployment.spread_regions, wanted),
                          actor=actor, reason=f"rollout {rollout.pk} promoted revision "
                                              f"{number}: more of its replicas serve than "
                                              f"the {wanted} wanted")
    rollout.old_retired_at = timezone.now()
    rollout.save(update_fields=["old_retired_at"])
    return retired
