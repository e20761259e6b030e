"""Failover (DESIGN §6): notice failed replicas fast, push tables without them at once, place
replacements inside the allowed jurisdictions through the solver, and keep a timeline.

`watch` is the loop, run every second under an advisory lock:

1. probe every serving replica's /health; fail the ones that are gone (health.py says when);
2. push routing tables right away when anything failed (the edges have already ejected the
   replica on their own after its first errors; this makes every edge agree);
3. record the failures on an incident: the open drill or incident of that region, else a
   new one (spot replicas that vanish are `spot_preempted`; `incidents`);
4. derive each region's health;
5. place replacements for failed replicas through the solver, leaving out regions that are
   down or keep failing, with the spread lowered to the regions that are left
   (`replacements`);
6. move open incidents along their timeline (`incidents`).

Drills, which kill a lab region's replicas on purpose, are in `drills`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db.models import Count, Max, Q
from django.utils import timezone

from controlplane.core.certificates import engine_client_context
from controlplane.core.redis_clients import redis_client
from controlplane.core.services import record_audit
from controlplane.deployments.lifecycle import (
    LIVE_STATES,
    SERVING_STATES,
    IllegalTransition,
    transition,
)
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.failover.health import (
    DOWN_HOLD_S,
    TIMEOUTS_TO_FAIL,
    RegionCounts,
    cut_off_regions,
    region_state,
    replica_verdict,
)
from controlplane.failover.incidents import (
    ACTOR,
    HEALTH_WINDOW,
    progress_incidents,
    record_failures,
)
from controlplane.failover.models import Health, Incident, IncidentKind, RegionHealth
from controlplane.failover.notes import note
from controlplane.failover.probes import probe_all
from controlplane.failover.replacements import replace_failed
from controlplane.routing import services as routing

log = logging.getLogger(__name__)

DOWN_HOLD = timedelta(seconds=DOWN_HOLD_S)
TIMEOUT_KEY = "meridian:failover:timeouts:{}"
STARTING_STATES = (S.PENDING, S.PROVISIONING, S.STARTING)


@dataclass
class WatchReport:
    probed: int = 0
    failed: list[str] = field(default_factory=list)
    tables_version: int | None = None
    replacements: list[str] = field(default_factory=list)
    regions_down: list[str] = field(default_factory=list)
    resolved: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def watch(now: datetime | None = None) -> WatchReport:
    report = WatchReport()
    failed = probe_and_fail(report)
    failed += [r for r in failed_elsewhere() if r.pk not in {f.pk for f in failed}]
    if failed:
        pushed = push_tables_now(f"failover: {', '.join(r.public_id for r in failed)} failed")
        report.tables_version = pushed
        record_failures(failed, tables_pushed=pushed is not None)
    report.regions_down = update_region_health(now)
    report.replacements = replace_failed()
    report.resolved = progress_incidents(now)
    return report


# -- 1. probes --------------------------------------------------------------------------------

def probe_and_fail(report: WatchReport) -> list[Replica]:
    replicas = {r.pk: r for r in Replica.objects.filter(state__in=SERVING_STATES).exclude(url="")
                .select_related("deployment", "region__cloud")}
    report.probed = len(replicas)
    probes = probe_all({pk: r.url for pk, r in replicas.items()},
                       context=engine_client_context() if replicas else None)
    cut_off = cut_off_regions((replicas[pk].region_id, probe) for pk, probe in probes.items())
    cache = redis_client()
    failed = []
    for pk, probe in probes.items():
        key = TIMEOUT_KEY.format(pk)
        stored: Any = cache.get(key) if probe.timed_out else None
        before = int(stored or 0)
        is_failed, timeouts = replica_verdict(probe, before,
                                              region_cut_off=replicas[pk].region_id in cut_off)
        if timeouts:
            cache.set(key, timeouts, ex=60)
        elif before or not probe.ok:
            cache.delete(key)
        if not is_failed:
            continue
        why = probe.detail
        if probe.timed_out and timeouts < TIMEOUTS_TO_FAIL:
            why += "; so did every replica probed in its region (cut off)"
        try:
            failed.append(transition(replicas[pk], S.FAILED, actor=ACTOR, reason=why,
                                     last_error=why))
        except IllegalTransition:
            continue  # drained or failed by another path meanwhile
    report.failed = [r.public_id for r in failed]
    return failed


def failed_elsewhere() -> list[Replica]:
    """Replicas that served and were failed by another path (the provider reconcile, a spot
    preemption) and that no open incident records yet."""
    recorded: set[str] = set()
    for names in Incident.objects.filter(resolved_at__isnull=True).values_list(
            "failed_replicas", flat=True):
        recorded.update(names)
    return [r for r in Replica.objects.filter(state=S.FAILED, ready_at__isnull=False)
            .select_related("deployment", "region__cloud") if r.public_id not in recorded]


# -- 2. tables --------------------------------------------------------------------------------

# How long failover waits for a publish in progress (whose tables may still hold the failed
# replicas) before leaving the push to the publish the failure's commit requested.
PUBLISH_WAIT_S = 5.0


def push_tables_now(reason: str) -> int | None:
    """Compile and push at once, on the scheduled publish's path and lock; the version when
    every edge took it, else None (the drift check and the incident's progress pick it up)."""
    try:
        result = routing.publish_exclusive(reason=reason, wait_s=PUBLISH_WAIT_S)
    except Exception:  # a broken edge must not stop failover
        log.exception("table push after a failure did not complete")
        return None
    if result is None:
        log.warning("another publisher held %s for %.0f s; the failure's push is queued",
                    routing.PUBLISH_LOCK, PUBLISH_WAIT_S)
        return None
    if all(r.acked for r in result.results):
        return result.version
    return None


# -- 4. region health -------------------------------------------------------------------------

def region_counts(now: datetime | None = None) -> dict[int, RegionCounts]:
    now = now or timezone.now()
    since = now - HEALTH_WINDOW
    failure = Q(state__in=(S.FAILED, S.TERMINATED), last_error__gt="", state_changed_at__gte=since)
    rows = (Replica.objects.filter(Q(state__in=LIVE_STATES) | Q(state_changed_at__gte=since))
            .values("region_id").annotate(
                serving=Count("id", filter=Q(state__in=SERVING_STATES)),
                starting=Count("id", filter=Q(state__in=STARTING_STATES)),
                draining=Count("id", filter=Q(state=S.DRAINING)),
                failed=Count("id", filter=failure),
                newest_live=Max("created_at", filter=Q(state__in=LIVE_STATES))))
    # Failures recent enough to keep a region down: within the hold, and later than the
    # region's newest live replica (a region given a replica since is not written off).
    lately: dict[int, list[datetime]] = defaultdict(list)
    for region_id, at in (Replica.objects.filter(failure, state_changed_at__gte=now - DOWN_HOLD)
                          .values_list("region_id", "state_changed_at")):
        lately[region_id].append(at)
    answering: dict[int | None, bool] = {}
    for region_id, kind in Incident.objects.filter(resolved_at__isnull=True).values_list(
            "region_id", "kind"):
        answering[region_id] = answering.get(region_id, False) or kind == IncidentKind.DRILL
    out = {}
    for row in rows:
        newest = row["newest_live"]
        failed_lately = sum(1 for at in lately.get(row["region_id"], ())
                            if newest is None or at > newest)
        out[row["region_id"]] = RegionCounts(
            row["serving"], row["starting"], row["failed"], row["region_id"] in answering,
            draining=row["draining"], failed_lately=failed_lately,
            drill=answering.get(row["region_id"], False))
    return out


def update_region_health(now: datetime | None = None) -> list[str]:
    """Write each region's health; returns the keys of regions that just went down."""
    now = now or timezone.now()
    counts = region_counts(now)
    current = {h.region_id: h for h in RegionHealth.objects.all()}
    went_down: list[str] = []
    for region_id in set(counts) | set(current):
        c = counts.get(region_id, RegionCounts(0, 0, 0))
        state, reason = region_state(c)
        row = current.get(region_id) or RegionHealth(region_id=region_id, state=Health.HEALTHY,
                                                      changed_at=now, checked_at=now)
        seen = (state, reason, c.serving, c.failed_recently)
        if row.pk is not None and seen == (row.state, row.reason, row.serving, row.failing):
            continue  # unchanged: only checked_at moves, for every row at once below
        if row.state != state:
            record_audit(ACTOR, f"region.{state}", row.region, reason=reason,
                         changes={"from": row.state, "to": state})
            row.state, row.changed_at = state, now
            if state == Health.DOWN:
                went_down.append(row.region.key)
                _mark_region_down(region_id, now)
        row.reason, row.serving, row.failing, row.checked_at = reason, c.serving, c.failed_recently, now
        row.save()
    # The loop runs every second: one UPDATE stamps the check instead of a save per region.
    RegionHealth.objects.update(checked_at=now)
    return went_down


def _mark_region_down(region_id: int, now: datetime) -> None:
    incident = (Incident.objects.filter(region_id=region_id, resolved_at__isnull=True)
                .order_by("-started_at").first())
    if incident is not None and incident.kind != IncidentKind.DRILL:
        incident.kind = IncidentKind.REGION_DOWN
        note(incident, "region is down: no replica serves there")
        incident.save(update_fields=["kind", "notes"])
    elif incident is not None:
        note(incident, "region is down: no replica serves there")
        incident.save(update_fields=["notes"])
