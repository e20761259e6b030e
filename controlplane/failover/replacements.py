"""Replacements for failed replicas: in their own region when it is usable, else elsewhere
inside the deployment's jurisdictions through the solver, each once per loss."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Count
from django.utils import timezone

from controlplane.core.redis_clients import redis_client
from controlplane.core.services import record_audit
from controlplane.deployments.lifecycle import LIVE_STATES
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.failover.incidents import ACTOR, HEALTH_WINDOW
from controlplane.failover.models import Health, Incident, IncidentKind, RegionHealth
from controlplane.failover.notes import note
from controlplane.placement import proposals
from controlplane.provisioning.services import terminate_failed
from controlplane.provisioning.tasks import request_replicas

# A region where a deployment lost this many replicas within the window gets no more of its
# replacements until the window passes (a backoff for regions that keep failing).
FLAPPING_FAILURES = 3
NOTE_KEY = "meridian:failover:noted:{}"


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
