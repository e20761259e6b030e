"""Operator scaling: set a deployment's replica count in one region, drain one replica.

The REST API and the dashboard both call these functions, so the rules (residency, replica
bounds) and the audit trail are the same whichever door an operator comes through.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from django.db import transaction

from controlplane.core.services import record_audit
from controlplane.deployments import caps
from controlplane.deployments.lifecycle import SERVING_STATES
from controlplane.deployments.models import Deployment, Replica
from controlplane.provisioning import services as provisioning
from controlplane.provisioning.tasks import finish_drain, request_replicas, terminate_replica
from regions.models import Region

# How long a draining replica keeps finishing its in-flight requests before it is terminated,
# and how long after the drain starts its in-flight count is first checked.
DRAIN_DEADLINE_S = 30
DRAIN_GRACE_S = 2


class ScaleRefused(Exception):
    """The requested count breaks a rule; `field` names the input to correct."""

    def __init__(self, field: str, message: str) -> None:
        self.field, self.message = field, message
        super().__init__(message)


@dataclass(frozen=True)
class ScaleResult:
    """What a scale did (or, for a preview, would do)."""

    region: str
    before: int
    after: int
    added: list[str] = field(default_factory=list)
    draining: list[str] = field(default_factory=list)
    to_add: int = 0

    def as_dict(self) -> dict[str, object]:
        return {"region": self.region, "before": self.before, "after": self.after,
                "added": self.added, "draining": self.draining}


def _active(deployment: Deployment) -> list[Replica]:
    """Replicas that count towards the deployment's size: live and not on their way out."""
    return list(
        deployment.replicas.staying()
        .select_related("region").order_by("-created_at")
    )


def scale_in_region(
    deployment: Deployment, region: Region, replicas: int, *, actor: str, reason: str = "",
    spot: bool = False, preview: bool = False,
) -> ScaleResult:
    """Run `replicas` replicas of `deployment` in `region`: request new ones or drain extras.

    With `preview`, nothing changes and the result names the replicas that would drain.
    Raises ScaleRefused when the region is outside the deployment's jurisdictions or the
    total would leave [min_replicas, max_replicas].
    """
    with transaction.atomic():
        # One scale per deployment at a time: two operators cannot both pass the bounds check.
        Deployment.objects.select_for_update().filter(pk=deployment.pk).first()
        allowed = set(deployment.allowed_jurisdictions.values_list("pk", flat=True))
        if region.jurisdiction_id not in allowed:
            raise ScaleRefused(
                "region", f"{region.key} is in {region.jurisdiction.code}, outside this "
                          "deployment's allowed jurisdictions.")
        active = _active(deployment)
        here = [r for r in active if r.region_id == region.pk]
        others = len(active) - len(here)
        if others + replicas > deployment.max_replicas:
            raise ScaleRefused(
                "replicas", f"{others} replicas run elsewhere; {replicas} more would exceed "
                            f"max_replicas ({deployment.max_replicas}).")
        if others + replicas < deployment.min_replicas:
            raise ScaleRefused(
                "replicas", f"{others + replicas} in total would fall below min_replicas "
                            f"({deployment.min_replicas}).")
        extra = here[replicas:]
        to_add = max(replicas - len(here), 0)
        room = caps.headroom(deployment) if to_add else None
        if room is not None and room.replicas is not None and to_add > room.replicas:
            raise ScaleRefused(
                "replicas", f"{to_add} more replicas would pass the tenant's caps: {room.why}, "
                            f"so at most {room.replicas} more.")
        if preview:
            return ScaleResult(region.key, len(here), replicas,
                               draining=[r.public_id for r in extra], to_add=to_add)
        reason = reason or f"scaled by {actor}"
        added: list[str] = []
        if to_add:
            made = request_replicas(deployment, region, to_add, actor=actor, reason=reason,
                                    spot=spot)
            added = [r.public_id for r in made]
        for replica in extra:
            retire_replica(replica, actor=actor, reason=reason)
        return ScaleResult(region.key, len(here), replicas, added=added,
                           draining=[r.public_id for r in extra], to_add=to_add)


def retire_replica(replica: Replica, *, actor: str, reason: str) -> None:
    """Take a replica out: drain it if it serves, then terminate it after the deadline."""
    with transaction.atomic():
        if replica.state in SERVING_STATES:
            provisioning.drain(replica.pk, actor=actor, reason=reason)
        else:
            # No state change records the decision here, so record who asked for it.
            record_audit(actor, "replica.terminate_requested", replica, reason=reason,
                         changes={"state": replica.state, "after_s": DRAIN_DEADLINE_S})
        transaction.on_commit(lambda: _terminate_later(replica.pk, reason))


def drain_replica(replica: Replica, *, actor: str, reason: str = "") -> Replica:
    """ready/degraded → draining now, terminated after DRAIN_DEADLINE_S.

    Raises lifecycle.IllegalTransition when the replica is not serving (or moved meanwhile).
    """
    reason = reason or f"drained by {actor}"
    with transaction.atomic():
        drained = provisioning.drain(replica.pk, actor=actor, reason=reason)
        transaction.on_commit(lambda: _terminate_later(replica.pk, reason))
    return drained


def _terminate_later(replica_id: int, reason: str) -> None:
    """Terminate once nothing is in flight (checked from DRAIN_GRACE_S on, when every edge
    has had the table without it), and at DRAIN_DEADLINE_S whatever is still running."""
    finish_drain.apply_async((replica_id, reason, DRAIN_DEADLINE_S), countdown=DRAIN_GRACE_S)
    terminate_replica.apply_async((replica_id, reason), countdown=DRAIN_DEADLINE_S)
