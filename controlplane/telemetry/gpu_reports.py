"""GPU reports from the nodes' agents: store the readings, judge the node, act on the replica.

A node linked to a replica that turns unhealthy moves the replica ready → degraded (the
compiler gives degraded replicas half weight and the edges prefer others); once the node is
healthy again, a replica this node degraded goes back to ready. Every health change is an
audit event with the figures behind it.

Settings (read and checked at start-up, controlplane/settings.py): MERIDIAN_GPU_TEMP_LIMIT_C
(85), MERIDIAN_GPU_XID_HOLD_MIN (60: how long a critical XID keeps a node unhealthy),
MERIDIAN_GPU_READING_RETENTION_H (24).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from controlplane.core.services import record_audit
from controlplane.deployments.lifecycle import IllegalTransition, transition
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.telemetry.gpu_health import (
    GpuState,
    Verdict,
    gpu_health,
)
from controlplane.telemetry.models import GpuHealth, GpuNode, GpuReading

ACTOR = "system:gpu-health"
READING_FIELDS = (
    "index", "uuid", "name", "memory_total_bytes", "memory_used_bytes", "utilization_gpu_pct",
    "utilization_memory_pct", "temperature_c", "power_w", "power_limit_w", "ecc_corrected",
    "ecc_uncorrected", "xid_supported", "xid_errors", "lost", "errors",
)


def temperature_limit_c() -> float:
    return settings.MERIDIAN["GPU_TEMP_LIMIT_C"]


def xid_hold() -> timedelta:
    return settings.MERIDIAN["GPU_XID_HOLD"]


def retention() -> timedelta:
    return settings.MERIDIAN["GPU_READING_RETENTION"]


def degraded_marker(node: GpuNode) -> str:
    """The start of `last_error` on a replica this node degraded; only those are restored."""
    return f"GPU node {node.name}: "


@dataclass(frozen=True)
class ReportOutcome:
    node: GpuNode
    verdict: Verdict
    readings: int
    changed: bool  # the node's health changed with this report
    replica_action: str  # "", "degraded", "restored"


@transaction.atomic
def ingest_report(data: dict[str, Any], *, actor: str, now: datetime | None = None
                  ) -> ReportOutcome:
    """Store one validated report and apply the health rule; all or nothing.

    `data` has node, gpus (each with READING_FIELDS), and optionally at, interval_s,
    driver_version, nvml_version, cuda_driver_version and replica (a Replica or None; absent
    keeps the node's link)."""
    now = now or timezone.now()
    at = data.get("at") or now
    node, created = GpuNode.objects.select_for_update().get_or_create(name=data["node"])
    if created:
        record_audit(actor, "gpu_node.registered", node, reason="first report",
                     changes={"gpus": len(data["gpus"])})
    if "replica" in data and data["replica"] != node.replica:
        previous = node.replica
        node.replica = data["replica"]
        record_audit(actor, "gpu_node.linked", node,
                     changes={"from": previous.public_id if previous else None,
                              "to": node.replica.public_id if node.replica else None},
                     reason="reported by the node's agent")
    GpuReading.objects.bulk_create([
        GpuReading(node=node, at=at, **{k: g[k] for k in READING_FIELDS if k in g})
        for g in data["gpus"]
    ])
    recent = GpuReading.objects.filter(node=node, at__gte=at - xid_hold(), at__lte=at).exclude(
        xid_errors=[]).values_list("index", "xid_errors")
    recent_xids = [(index, int(x)) for index, xids in recent for x in xids]
    limit = temperature_limit_c()
    verdict = gpu_health(
        [GpuState(g["index"], g.get("temperature_c"), g.get("ecc_uncorrected"),
                  bool(g.get("lost"))) for g in data["gpus"]],
        recent_xids, temperature_limit_c=limit, hot_before=frozenset(node.hot_gpus or []),
    )
    health = GpuHealth.HEALTHY if verdict.healthy else GpuHealth.UNHEALTHY
    changed = health != node.health
    node.health, node.health_reason = health, verdict.reason[:500]
    if changed:
        node.health_changed_at = now
    node.hot_gpus = sorted(verdict.hot)
    node.last_seen_at = now
    node.gpu_count = len(data["gpus"])
    for key in ("driver_version", "nvml_version", "cuda_driver_version", "interval_s"):
        if data.get(key) is not None:
            setattr(node, key, data[key])
    node.save()
    if changed:
        record_audit(actor, f"gpu_node.{health}", node, reason=verdict.reason or "all checks pass",
                     changes=_figures(data["gpus"], limit, recent_xids))
    replica_action = _act_on_replica(node, verdict)
    GpuReading.objects.filter(node=node, at__lt=now - retention()).delete()
    return ReportOutcome(node, verdict, len(data["gpus"]), changed, replica_action)


def _figures(gpus: list[dict[str, Any]], limit: float, xids: list[tuple[int, int]]
             ) -> dict[str, Any]:
    return {
        "temperature_limit_c": limit,
        "gpus": [{k: g.get(k) for k in ("index", "uuid", "temperature_c", "ecc_uncorrected",
                                        "xid_errors", "lost")} for g in gpus],
        "xids_in_hold_window": sorted({x for _, x in xids}),
    }


def _act_on_replica(node: GpuNode, verdict: Verdict) -> str:
    """Degrade the node's ready replica while the node is unhealthy; restore what it degraded."""
    if node.replica_id is None:
        return ""
    replica = Replica.objects.filter(pk=node.replica_id).values("state", "last_error").first()
    if replica is None:
        return ""
    marker = degraded_marker(node)
    try:
        if not verdict.healthy and replica["state"] == S.READY:
            transition(node.replica_id, S.DEGRADED, actor=ACTOR,
                       reason=f"GPU node {node.name} unhealthy: {verdict.reason}",
                       last_error=(marker + verdict.reason)[:2000])
            return "degraded"
        if (verdict.healthy and replica["state"] == S.DEGRADED
                and replica["last_error"].startswith(marker)):
            transition(node.replica_id, S.READY, actor=ACTOR,
                       reason=f"GPU node {node.name} healthy again", last_error="")
            return "restored"
    except IllegalTransition:  # another worker moved it first; the next report looks again
        return ""
    return ""
