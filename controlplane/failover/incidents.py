"""Failover incidents: failures recorded on the open incident of their region (or a new
one), and each open incident moved along its timeline until it resolves."""

from __future__ import annotations

from collections import defaultdict
from datetime import datetime, timedelta

from django.db import transaction
from django.utils import timezone

from controlplane.core.services import record_audit
from controlplane.deployments.lifecycle import SERVING_STATES
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.failover.models import Incident, IncidentKind
from controlplane.failover.notes import failures, note, stage_note
from controlplane.failover.timeline import QUIET_RESOLVE, timeline
from controlplane.routing import services as routing
from controlplane.telemetry import windows
from controlplane.telemetry.models import ReplicaSample

ACTOR = "system:failover"
# The window failures count in: joining their region's open incident, the region's health
# and a deployment's flapping regions.
HEALTH_WINDOW = timedelta(minutes=10)


def record_failures(failed: list[Replica], *, tables_pushed: bool,
                    now: datetime | None = None) -> list[Incident]:
    now = now or timezone.now()
    by_region: dict[int, list[Replica]] = defaultdict(list)
    for replica in failed:
        by_region[replica.region_id].append(replica)
    incidents = []
    for region_id, replicas in by_region.items():
        with transaction.atomic():
            incident = (Incident.objects.select_for_update()
                        .filter(region_id=region_id, resolved_at__isnull=True,
                                started_at__gte=now - HEALTH_WINDOW)
                        .order_by("-started_at").first())
            names = [r.public_id for r in replicas]
            if incident is None:
                spot = all(r.spot for r in replicas)
                incident = Incident.objects.create(
                    kind=IncidentKind.SPOT_PREEMPTED if spot else IncidentKind.REPLICA_FAILED,
                    region_id=region_id, started_at=now, detected_at=now,
                    summary=f"{', '.join(names)} failed in {replicas[0].region.key}",
                )
                record_audit(ACTOR, "failover.incident", incident, reason=incident.summary,
                             changes={"replicas": names, "errors": [r.last_error for r in replicas]})
            incident.detected_at = incident.detected_at or now
            incident.failed_replicas = sorted(set(incident.failed_replicas) | set(names))
            if tables_pushed and incident.tables_pushed_at is None:
                incident.tables_pushed_at = timezone.now()
            note(incident, f"detected {', '.join(names)} failed: " + failures(
                (r.public_id, r.url, r.last_error) for r in replicas), at=now)
            incident.save()
        incidents.append(incident)
    return incidents


def progress_incidents(now: datetime | None = None) -> list[int]:
    """Fill in timeline stamps that became true; returns ids of incidents resolved now."""
    now = now or timezone.now()
    resolved: list[int] = []
    open_incidents = list(Incident.objects.filter(resolved_at__isnull=True, detected_at__isnull=False))
    if not open_incidents:
        return resolved
    behind = None
    for incident in open_incidents:
        changed = False
        if incident.tables_pushed_at is None:
            behind = routing.edges_behind() if behind is None else behind
            if not behind:
                incident.tables_pushed_at, changed = now, True
        ids = [int(name.removeprefix("r-")) for name in incident.replacements]
        replacements = list(Replica.objects.filter(pk__in=ids))
        if incident.replacement_ready_at is None and replacements and all(
                r.state in SERVING_STATES for r in replacements):
            incident.replacement_ready_at = max(r.ready_at or now for r in replacements)
            stage_note(incident, "replacement_ready_at", "replacements ready")
            changed = True
        if (incident.replacement_ready_at and incident.traffic_back_at is None
                and _served_requests(ids)):
            incident.traffic_back_at = now
            stage_note(incident, "traffic_back_at", "replacements serve traffic")
            changed = True
        nothing_to_replace = not incident.replacements and not Replica.objects.filter(
            pk__in=[int(n.removeprefix("r-")) for n in incident.failed_replicas],
            state=S.FAILED).exists()
        if incident.tables_pushed_at and (
                incident.traffic_back_at
                or (incident.replacement_ready_at and now - incident.replacement_ready_at > QUIET_RESOLVE)
                or (nothing_to_replace and incident.detected_at is not None
                    and now - incident.detected_at > QUIET_RESOLVE)):
            incident.resolved_at = now
            stage_note(incident, "resolved_at", "resolved")
            record_audit(ACTOR, "failover.resolved", incident, reason=incident.summary,
                         changes=timeline(incident))
            resolved.append(incident.pk)
            changed = True
        if changed:
            incident.save()
    return resolved


def _served_requests(replica_ids: list[int]) -> bool:
    """Whether any of the replicas' newest samples counts a finished request or a token."""
    if not replica_ids:
        return False
    rows = ReplicaSample.objects.filter(replica_id__in=replica_ids, up=True)
    for counters in windows.newest(rows, "replica_id").values_list("counters", flat=True):
        if counters.get("requests_ok", 0) > 0 or counters.get("generation_tokens", 0) > 0:
            return True
    return False
