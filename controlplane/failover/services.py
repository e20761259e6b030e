"""Failover (DESIGN §6): notice failed replicas fast, push tables without them at once, place
replacements inside the allowed jurisdictions through the solver, and keep a timeline.

`watch` is the loop, run every second under an advisory lock:

1. probe every serving replica's /health; fail the ones that are gone (health.py says when);
2. push routing tables right away when anything failed (the edges have already ejected the
   replica on their own after its first errors; this makes every edge agree);
3. record the failures on an incident: the open drill or incident of that region, else a
   new one (spot replicas that vanish are `spot_preempted`);
4. derive each region's health;
5. place replacements for failed replicas through the solver, leaving out regions that are
   down or keep failing, with the spread lowered to the regions that are left;
6. move open incidents along their timeline.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Count, Max, Q
from django.utils import timezone

from controlplane.core.certificates import engine_client_context
from controlplane.core.services import record_audit
from controlplane.core.status import redis_client
from controlplane.deployments.lifecycle import (
    LIVE_STATES,
    SERVING_STATES,
    IllegalTransition,
    transition,
)
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.failover.health import (
    DOWN_HOLD_S,
    TIMEOUTS_TO_FAIL,
    RegionCounts,
    cut_off_regions,
    region_state,
    replica_verdict,
)
from controlplane.failover.models import Health, Incident, IncidentKind, RegionHealth
from controlplane.failover.notes import failures, note, stage_note
from controlplane.failover.probes import probe_all
from controlplane.failover.timeline import QUIET_RESOLVE, timeline
from controlplane.placement import proposals
from controlplane.provisioning.local import LocalProvider
from controlplane.provisioning.services import get_provider, handle_of, terminate_failed
from controlplane.provisioning.tasks import request_replicas
from controlplane.routing import services as routing
from controlplane.telemetry.models import ReplicaSample
from regions.models import Region

log = logging.getLogger(__name__)

ACTOR = "system:failover"
HEALTH_WINDOW = timedelta(minutes=10)
DOWN_HOLD = timedelta(seconds=DOWN_HOLD_S)
# A region where a deployment lost this many replicas within the window gets no more of its
# replacements until the window passes (a backoff for regions that keep failing).
FLAPPING_FAILURES = 3
TIMEOUT_KEY = "meridian:failover:timeouts:{}"
NOTE_KEY = "meridian:failover:noted:{}"
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


# -- 3. incidents -----------------------------------------------------------------------------

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


# -- 4. replacements --------------------------------------------------------------------------

def excluded_regions(deployment: Deployment, now: datetime | None = None) -> dict[str, str]:
    """Region keys where no replacement should go, with why: down, under a drill that is
    still open, or failing again and again."""
    now = now or timezone.now()
    out: dict[str, str] = {}
    for cloud, code, reason in (RegionHealth.objects.filter(state=Health.DOWN)
                                .values_list("region__cloud__name", "region__code", "reason")):
        out[f"{cloud}:{code}"] = f"down: {reason}" if reason else "down"
    for cloud, code, pk in (Incident.objects.filter(kind=IncidentKind.DRILL,
                                                    resolved_at__isnull=True)
                            .values_list("region__cloud__name", "region__code", "pk")):
        out.setdefault(f"{cloud}:{code}", f"drill #{pk} is still open")
    flapping = (deployment.replicas.filter(last_error__gt="", state_changed_at__gte=now - HEALTH_WINDOW,
                                           state__in=(S.FAILED, S.TERMINATED))
                .values("region__cloud__name", "region__code").annotate(n=Count("id"))
                .filter(n__gte=FLAPPING_FAILURES))
    for row in flapping:
        out.setdefault(f"{row['region__cloud__name']}:{row['region__code']}",
                       f"{row['n']} of its replicas failed there within "
                       f"{HEALTH_WINDOW.total_seconds() / 60:.0f} min")
    return out


def replace_failed() -> list[str]:
    made: list[str] = []
    for deployment_id in (Replica.objects.filter(state=S.FAILED)
                          .values_list("deployment_id", flat=True).distinct()):
        made.extend(replace_for(deployment_id))
    return made


@dataclass
class Replacement:
    """Where replacements went and why, for the incident's timeline."""

    replicas: list[Replica]
    region: str
    why: str

    def text(self) -> str:
        names = ", ".join(r.public_id for r in self.replicas)
        return f"{names} → {self.region}: {self.why}"


def replace_for(deployment_id: int) -> list[str]:
    """Place replacements for a deployment's failed replicas, then release the failed ones.

    In place first: a failed replica's region takes its replacement unless that region is
    excluded (down, drilled, flapping) or has no room. What is left goes elsewhere through
    the solver, inside the deployment's jurisdictions, with the spread lowered to the regions
    left; the periodic replan moves it back once the lost region is usable and the spread
    rule is broken.

    Idempotent on the loss: the failed replicas are stamped `replacement_requested_at` in
    the transaction that requests their replacements, and their resources are released only
    after it commits. A pass that dies in between (a killed worker) leaves them failed and
    stamped; the next pass only releases them, as their replacements already count among
    the live replicas.
    """
    with transaction.atomic():
        deployment = (Deployment.objects.select_for_update().select_related("model")
                      .prefetch_related("allowed_jurisdictions", "user_regions")
                      .get(pk=deployment_id))
        lost = list(deployment.replicas.filter(state=S.FAILED)
                    .select_related("region__cloud", "offer__gpu_type"))
        failed = [r for r in lost if r.replacement_requested_at is None]
        names: list[str] = []
        if failed:
            live = list(deployment.replicas.filter(state__in=LIVE_STATES)
                        .select_related("offer__gpu_type"))
            # Draining replicas are on their way out: neither counted nor kept.
            active = [r for r in live if r.state != S.DRAINING]
            target = min(deployment.max_replicas,
                         max(deployment.min_replicas, len(active) + len(failed)))
            placed: list[Replacement] = []
            if target > len(active):
                placed = _place_replacements(deployment, failed, live, active,
                                             target - len(active))
                if not placed:
                    failed = []  # retried on the next pass
            if failed:
                names = [r.public_id for p in placed for r in p.replicas]
                _keep_canary_revision(deployment, failed, placed)
                _attach_replacements(failed, names, placed)
                Replica.objects.filter(pk__in=[r.pk for r in failed]).update(
                    replacement_requested_at=timezone.now())
        answered = [r for r in lost if r.replacement_requested_at is not None] + failed
    for dead in answered:
        terminate_failed(dead)
    return names


def _place_replacements(deployment: Deployment, failed: list[Replica], live: list[Replica],
                        active: list[Replica], need: int) -> list[Replacement]:
    skip = excluded_regions(deployment)
    # Replacements are counted one for one, without demand, so they keep the GPU type of
    # what failed (or still runs): the same engine on it serves as much. Nodes that cannot
    # hold the deployment's TP × PP are no options of the solver's.
    gpus = {r.offer.gpu_type.name for r in [*live, *failed] if r.offer is not None}
    names = ", ".join(r.public_id for r in failed)
    lost = Counter(r.region.key for r in failed)
    everywhere = {o.region for o in proposals.offer_options()}
    placed: list[Replacement] = []
    kept: list[Replica] = list(active)
    why_not_here: dict[str, str] = {}
    for region, n in sorted(lost.items()):
        if need <= 0:
            break
        if region in skip:
            why_not_here[region] = skip[region]
            continue
        here = proposals.place_additions(deployment, kept, min(n, need), gpu_types=gpus,
                                         avoid_regions=everywhere - {region}, lower_spread=True)
        if not here.slots:
            why_not_here[region] = "no room: " + "; ".join(here.result.explanation[:1])
            continue
        made = _request(deployment, here.slots, f"replace {names} in place")
        placed.append(Replacement(made, region, "in place (the region is usable)"))
        kept += made
        need -= len(made)
    if need > 0:
        elsewhere = proposals.place_additions(deployment, kept, need, gpu_types=gpus,
                                              avoid_regions=set(skip), lower_spread=True)
        if not elsewhere.slots and not placed:
            _note_once(failed, f"no replacement for {deployment.name}: "
                       + "; ".join(elsewhere.result.explanation[:2]))
            return []
        away = "; ".join(f"{k} {v}" for k, v in sorted(why_not_here.items())) or "cheapest"
        reason = f"replace {names} elsewhere ({away})"
        for offer, spot, count in elsewhere.slots:
            made = _request(deployment, [(offer, spot, count)], reason)
            placed.append(Replacement(
                made, offer.region.key,
                f"elsewhere, inside the deployment's jurisdictions ({away}); the periodic "
                "replan moves it back once the spread rule is broken and the region is usable"))
    return placed


def _keep_canary_revision(deployment: Deployment, failed: list[Replica],
                          placed: list[Replacement]) -> None:
    """While a rollout is in progress, a failed canary replica's replacement runs the canary
    revision (those in its region first): otherwise the canary's capacity would quietly
    become the stable revision's. Set before the launches, which are enqueued on commit."""
    canary = deployment.canary_revision_id
    lost = [r for r in failed if canary is not None and r.revision_id == canary]
    if not lost:
        return
    regions = {r.region_id for r in lost}
    made = sorted((r for p in placed for r in p.replicas), key=lambda r: r.region_id not in regions)
    chosen = made[:len(lost)]
    Replica.objects.filter(pk__in=[r.pk for r in chosen]).update(revision_id=canary)
    for replica in chosen:
        replica.revision_id = canary


def _request(deployment: Deployment, slots: list[tuple[Any, bool, int]], reason: str
             ) -> list[Replica]:
    made: list[Replica] = []
    for offer, spot, count in slots:
        made += request_replicas(deployment, offer.region, count, actor=ACTOR, reason=reason,
                                 spot=spot, offer=offer)
    return made


def _attach_replacements(failed: list[Replica], names: list[str],
                         placed: list[Replacement]) -> None:
    ids = {r.public_id for r in failed}
    for incident in Incident.objects.select_for_update().filter(resolved_at__isnull=True):
        if ids & set(incident.failed_replicas):
            incident.replacements = sorted(set(incident.replacements) | set(names))
            if not placed:
                note(incident, "replacements requested: none needed (enough replicas serve)")
            for p in placed:
                note(incident, "replacement requested: " + p.text())
            incident.save(update_fields=["replacements", "notes"])


def _note_once(failed: list[Replica], text: str) -> None:
    """Record why replacement is stuck, once a minute at most (the loop runs every second)."""
    if not redis_client().set(NOTE_KEY.format(hash(text)), "1", nx=True, ex=60):
        return
    ids = {r.public_id for r in failed}
    for incident in Incident.objects.filter(resolved_at__isnull=True):
        if ids & set(incident.failed_replicas):
            note(incident, text)
            incident.save(update_fields=["notes"])
    record_audit(ACTOR, "failover.replacement_blocked", object_type="deployments.deployment",
                 object_id=str(failed[0].deployment_id), reason=text)


# -- 5. region health -------------------------------------------------------------------------

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


# -- 6. timelines -----------------------------------------------------------------------------

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
                and _served_requests(ReplicaSample, ids)):
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


def _served_requests(sample_model: Any, replica_ids: list[int]) -> bool:
    if not replica_ids:
        return False
    for counters in (sample_model.objects.filter(replica_id__in=replica_ids, up=True)
                     .order_by("replica_id", "-at").distinct("replica_id")
                     .values_list("counters", flat=True)):
        if counters.get("requests_ok", 0) > 0 or counters.get("generation_tokens", 0) > 0:
            return True
    return False


# -- drills -----------------------------------------------------------------------------------

class DrillRefused(Exception):
    def __init__(self, field: str, message: str) -> None:
        self.field, self.message = field, message
        super().__init__(message)


def region_by_key(key: str) -> Region:
    region = Region.objects.select_related("cloud").filter(**Region.key_filter(key)).first()
    if region is None:
        raise DrillRefused("region", f"no region {key!r}; use cloud:code, e.g. local:ap-tokyo")
    return region


def drillable() -> Any:
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
