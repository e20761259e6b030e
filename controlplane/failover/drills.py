"""Failover drills, lab only: kill every local replica of a region (SIGKILL, no drain)
under a drill incident, and let the watch loop handle it as a real region loss."""

from __future__ import annotations

from django.db.models import QuerySet
from django.utils import timezone

from controlplane.core.services import record_audit
from controlplane.deployments.models import Replica
from controlplane.failover.models import Incident, IncidentKind
from controlplane.failover.notes import note
from controlplane.provisioning.local import LocalProvider
from controlplane.provisioning.services import get_provider, handle_of
from regions.models import Region


class DrillRefused(Exception):
    def __init__(self, field: str, message: str) -> None:
        self.field, self.message = field, message
        super().__init__(message)


def region_by_key(key: str) -> Region:
    region = Region.objects.select_related("cloud").filter(**Region.key_filter(key)).first()
    if region is None:
        raise DrillRefused("region", f"no region {key!r}; use cloud:code, e.g. local:ap-tokyo")
    return region


def drillable() -> QuerySet[Replica]:
    """Replicas a drill would kill: live local ones not already draining."""
    return Replica.objects.staying().filter(provider="local", region__cloud__name="local")


def drill_victims(region: Region) -> list[Replica]:
    """The replicas a drill in `region` would kill; DrillRefused says why there can be none."""
    if region.cloud.name != "local":
        raise DrillRefused("region", f"drills kill local lab replicas only; {region.key} is on "
                                     f"{region.cloud.name}")
    victims = list(drillable().filter(region=region).select_related("deployment"))
    if not victims:
        raise DrillRefused("region", f"no local replica runs in {region.key}")
    if Incident.objects.filter(region=region, kind=IncidentKind.DRILL,
                               resolved_at__isnull=True).exists():
        raise DrillRefused("region", f"a drill in {region.key} is still running")
    return victims


def start_drill(region: Region, *, actor: str) -> Incident:
    """Kill every local replica of `region` (SIGKILL, no drain) and open a drill incident;
    the watch loop then handles it as it would a real region loss."""
    victims = drill_victims(region)
    now = timezone.now()
    names = [r.public_id for r in victims]
    incident = Incident.objects.create(
        kind=IncidentKind.DRILL, region=region, started_by=actor, started_at=now,
        summary=f"Drill: kill {len(victims)} replica{'s' if len(victims) != 1 else ''} "
                f"in {region.key}")
    record_audit(actor, "failover.drill", incident, reason=incident.summary,
                 changes={"replicas": names})
    provider = get_provider("local")
    for replica in victims:
        handle = handle_of(replica)
        if handle is not None and isinstance(provider, LocalProvider):
            provider.kill(handle)
    note(incident, f"killed {', '.join(names)}")
    incident.save(update_fields=["notes"])
    return incident
