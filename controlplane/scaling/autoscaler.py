"""The autoscaler loop: for every deployment with autoscale on, read the engine samples the
telemetry loop stored for its serving replicas, decide (scaling.rules), record the
decision with the signal values that drove it, and act.

State: none of its own. Breach timers are read back from the stored samples (a breach has
lasted as long as the unbroken run of scrapes that show it), cooldowns from the stored
decisions, so any worker can run any tick and a restart loses nothing.

Acting: a scale-up asks the placement solver where the new replicas go (the deployment
solved alone with its count raised and its running replicas kept), then requests them
through provisioning; when the solver finds no plan, the new replicas go next to the running
ones (always inside the allowed jurisdictions and quota) or nowhere, and the decision says
so. A scale-down drains the idlest, most expensive replicas (scaling.services.
retire_replica), keeping the deployment spread over its regions.
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.conf import settings as django_settings
from django.db import transaction
from django.db.models import Count, Max
from django.db.models.functions import Coalesce
from django.utils import timezone

from controlplane.core.services import record_audit
from controlplane.costs.services import usd_h_for
from controlplane.deployments import caps
from controlplane.deployments.lifecycle import SERVING_STATES, STAYING_STATES
from controlplane.deployments.models import Deployment, Replica, Revision
from controlplane.deployments.models import ReplicaState as S
from controlplane.deployments.services import mark_placeable, mark_unplaceable
from controlplane.placement.models import PlanChange
from controlplane.placement.scale_up import (
    Placement,
    place_scale_up,
    preferred_gpu_types,
    sized_for,
)
from controlplane.placement.spread_first import place_spread_first
from controlplane.provisioning.tasks import request_replicas
from controlplane.scaling import rules as policy
from controlplane.scaling.models import ScalingDecision
from controlplane.scaling.rules import DOWN, UP, Decision, Fleet, History, Round, Settings
from controlplane.scaling.services import retire_replica
from controlplane.telemetry.edge_metrics import REQUEST_LABELS, split_key
from controlplane.telemetry.histograms import bucket_delta, histogram_quantile
from controlplane.telemetry.models import EdgeSample, ReplicaSample
from controlplane.telemetry.windows import growth
from regions.models import Offer, Region

log = logging.getLogger(__name__)

ACTOR = "system:autoscaler"
SCRAPE_INTERVAL_S = 2.0
# Edge statuses that mean "no replica could take it": what wakes a deployment from zero.
UNSERVED_STATUSES = frozenset({"404", "502", "503"})
STARTING_STATES = frozenset({S.PENDING, S.PROVISIONING, S.STARTING})


# -- samples into rounds (pure) ------------------------------------------------------------------

@dataclass(frozen=True)
class SampleRow:
    replica_id: int
    at: datetime
    up: bool
    running: float
    waiting: float
    kv_usage: float
    ttft_buckets: Mapping[str, float] | None = None  # None: not loaded for this sample


def rounds_from_samples(rows: Iterable[SampleRow]) -> list[Round]:
    """One Round per scrape time, oldest first: load summed over the replicas that answered,
    TTFT p95 over every first token all of them produced since their previous scrape."""
    by_at: dict[datetime, list[SampleRow]] = defaultdict(list)
    for row in rows:
        by_at[row.at].append(row)
    previous: dict[int, SampleRow] = {}
    rounds = []
    for at in sorted(by_at):
        up = [r for r in by_at[at] if r.up]
        merged: dict[str, float] = {}
        for r in up:
            before = previous.get(r.replica_id)
            if (r.ttft_buckets is not None and before is not None and before.up
                    and before.ttft_buckets is not None):
                for le, n in bucket_delta(r.ttft_buckets, before.ttft_buckets).items():
                    merged[le] = merged.get(le, 0.0) + n
        for r in by_at[at]:
            previous[r.replica_id] = r
        count = merged.get("+Inf", 0.0)
        kv = [r.kv_usage for r in up]
        rounds.append(Round(
            at=at.timestamp(), replicas=len(up),
            running=sum(r.running for r in up), waiting=sum(r.waiting for r in up),
            kv_mean=sum(kv) / len(kv) if kv else 0.0, kv_max=max(kv, default=0.0),
            ttft_p95_s=histogram_quantile(0.95, merged) if count > 0 else None,
            ttft_count=count,
        ))
    return [r for r in rounds if r.replicas > 0]


# -- loading state -----------------------------------------------------------------------------

@dataclass
class Snapshot:
    deployment: Deployment
    fleet: Fleet
    history: History
    rounds: list[Round]
    load: dict[int, float]  # serving replica → in-flight at its latest sample
    unserved: float = 0.0


def _fleets(ids: list[int]) -> dict[int, Fleet]:
    counts: dict[int, Counter[str]] = defaultdict(Counter)
    rows = (Replica.objects.filter(deployment_id__in=ids,
                                   state__in=STAYING_STATES | {S.FAILED})
            .values("deployment_id", "state").order_by().annotate(n=Count("id")))
    for row in rows:
        counts[row["deployment_id"]][row["state"]] = row["n"]
    return {
        pk: Fleet(serving=sum(counts[pk][s] for s in SERVING_STATES),
                  starting=sum(counts[pk][s] for s in STARTING_STATES),
                  failed_unreplaced=counts[pk][S.FAILED])
        for pk in ids
    }


def _histories(ids: list[int]) -> dict[int, History]:
    """When each deployment last scaled up and down. An applied placement plan that changed
    it counts as a scale-up: its replicas are not undone before the scale-down cooldown."""
    last: dict[int, dict[str, float]] = defaultdict(dict)
    # An open decision repeated on later ticks was last attempted at last_at.
    rows = (ScalingDecision.objects.filter(deployment_id__in=ids)
            .values("deployment_id", "direction").order_by()
            .annotate(at=Max(Coalesce("last_at", "at"))))
    for row in rows:
        last[row["deployment_id"]][row["direction"]] = row["at"].timestamp()
    plans = (PlanChange.objects.filter(deployment_id__in=ids, plan__applied_at__isnull=False)
             .values("deployment_id").order_by().annotate(at=Max("plan__applied_at")))
    for change in plans:
        applied = change["at"].timestamp()
        if applied > last[change["deployment_id"]].get(UP, 0.0):
            last[change["deployment_id"]][UP] = applied
    return {pk: History(last[pk].get(UP), last[pk].get(DOWN)) for pk in ids}


def _sample_rows(replica_ids: list[int], since: datetime, until: datetime | None,
                 with_ttft: bool) -> list[SampleRow]:
    rows = ReplicaSample.objects.filter(replica_id__in=replica_ids, at__gte=since)
    if until is not None:
        rows = rows.filter(at__lt=until)
    fields = ["replica_id", "at", "up", "running", "waiting", "kv_usage"]
    if with_ttft:
        return [SampleRow(*values) for values in rows.order_by().values_list(
            *fields, "buckets__ttft")]
    return [SampleRow(*values) for values in rows.order_by().values_list(*fields)]


def unserved_requests(deployments: Sequence[Deployment], now: datetime,
                      window_s: float) -> dict[int, float]:
    """Requests for each deployment's model that edges could not route in the last
    `window_s` (no replica in their tables): the demand of a deployment scaled to zero."""
    if not deployments:
        return {}
    series: dict[int, list[tuple[datetime, dict[str, float]]]] = defaultdict(list)
    rows = (EdgeSample.objects.filter(at__gte=now - timedelta(seconds=window_s), up=True)
            .order_by("edge_id", "at").values_list("edge_id", "at", "requests"))
    for edge_id, at, requests in rows:
        series[edge_id].append((at, requests))
    unrouted: defaultdict[tuple[str, str], float] = defaultdict(float)
    for samples in series.values():
        if len(samples) < 2:
            continue
        # Every scrape in the window: an edge restarted inside it counts from its new start.
        for key, n in growth([requests for _, requests in samples]).items():
            labels = split_key(key, REQUEST_LABELS)
            if labels["region"] == "" and labels["status"] in UNSERVED_STATUSES:
                unrouted[(labels["model"], labels["tenant"])] += n
    out: dict[int, float] = {}
    for d in deployments:
        tenant = d.tenant.name if d.tenant is not None else None
        out[d.pk] = sum(n for (model, who), n in unrouted.items()
                        if model == d.served_model_name and (tenant is None or who == tenant))
    return out


def snapshots(now: datetime | None = None) -> list[Snapshot]:
    """Everything the decisions need, for every autoscaled deployment, in a few queries."""
    now = now or timezone.now()
    deployments = list(Deployment.objects.filter(autoscale=True).select_related("tenant"))
    ids = [d.pk for d in deployments]
    fleets, histories = _fleets(ids), _histories(ids)
    serving = list(Replica.objects.filter(deployment_id__in=ids, state__in=SERVING_STATES)
                   .values_list("pk", "deployment_id"))
    owner = dict(serving)
    # Recent scrapes carry TTFT histograms; older ones are read only where a scale-down
    # could follow (its window is long), and without histograms.
    recent_s = policy.UP_WINDOW_S + 3 * SCRAPE_INTERVAL_S
    recent_from = now - timedelta(seconds=recent_s)
    rows = _sample_rows(list(owner), recent_from, None, with_ttft=True)
    settings = {d.pk: settings_of(d) for d in deployments}
    long_ids = [pk for pk, d_id in serving
                if _may_scale_down(settings[d_id], fleets[d_id], histories[d_id], now)]
    if long_ids:
        longest = max(s.down_window_s for s in settings.values())
        rows += _sample_rows(long_ids, now - timedelta(seconds=longest + 2 * SCRAPE_INTERVAL_S),
                             recent_from, with_ttft=False)
    per_deployment: dict[int, list[SampleRow]] = defaultdict(list)
    for row in rows:
        per_deployment[owner[row.replica_id]].append(row)
    zero = [d for d in deployments if fleets[d.pk].count == 0]
    unserved = unserved_requests(zero, now, recent_s)
    out = []
    for d in deployments:
        mine = per_deployment.get(d.pk, [])
        latest: dict[int, SampleRow] = {}
        for row in mine:
            if row.up and (row.replica_id not in latest or row.at > latest[row.replica_id].at):
                latest[row.replica_id] = row
        out.append(Snapshot(d, fleets[d.pk], histories[d.pk], rounds_from_samples(mine),
                            {pk: r.running + r.waiting for pk, r in latest.items()},
                            unserved.get(d.pk, 0.0)))
    return out


def settings_of(deployment: Deployment) -> Settings:
    """The deployment's autoscaling settings, with the scale-down window of the project's
    settings (SCALE_DOWN_WINDOW_S)."""
    return Settings.of(deployment, down_window_s=float(
        getattr(django_settings, "SCALE_DOWN_WINDOW_S", policy.DOWN_WINDOW_S)))


def _may_scale_down(s: Settings, fleet: Fleet, history: History, now: datetime) -> bool:
    last = history.last_at
    return (fleet.count > s.floor and not fleet.starting
            and (last is None or now.timestamp() - last >= s.scale_down_cooldown_s))


# -- the loop ----------------------------------------------------------------------------------

@dataclass
class Outcome:
    deployment: str
    decision: Decision
    recorded: ScalingDecision | None = None


def run(now: datetime | None = None) -> list[Outcome]:
    """One tick: decide for every autoscaled deployment and act on what changes."""
    now = now or timezone.now()
    outcomes = []
    for snap in snapshots(now):
        decision = policy.decide(settings_of(snap.deployment), snap.fleet, snap.rounds,
                                 snap.history, now.timestamp(), snap.unserved)
        outcome = Outcome(snap.deployment.name, decision)
        if decision.acts:
            try:
                outcome.recorded = act(snap, decision)
            except Exception:  # one deployment's failure must not stop the others
                log.exception("autoscaling %s failed", snap.deployment.name)
        outcomes.append(outcome)
    return outcomes


def act(snap: Snapshot, decision: Decision) -> ScalingDecision | None:
    """Record the decision and carry it out; None when the deployment changed meanwhile."""
    assert decision.direction is not None
    with transaction.atomic():
        # One scale per deployment at a time (operators scale under the same lock).
        deployment = (Deployment.objects.select_for_update(of=("self",))
                      .select_related("model", "tenant").get(pk=snap.deployment.pk))
        active = list(deployment.replicas.staying()
                      .select_related("region__cloud", "offer__gpu_type"))
        if len(active) != decision.before:
            return None  # someone scaled it since the snapshot: decide again next tick
        signals = dict(decision.signals)
        reason = decision.reason
        placed: list[str] = []
        if decision.direction == UP:
            reason, placed = _scale_up(deployment, active, decision, signals)
            after = decision.before + len(placed)
        else:
            after = decision.before - _scale_down(deployment, active, snap, decision, signals)
        unplaced = decision.direction == UP and after < decision.after
        if unplaced:
            mark_unplaceable({deployment.pk: reason})
        elif decision.direction == UP:
            mark_placeable([deployment.pk])
        if unplaced and not placed:
            again = _repeat_open(deployment, decision, reason, signals)
            if again is not None:
                return again
        ScalingDecision.objects.filter(deployment=deployment, open=True).update(open=False)
        row = ScalingDecision.objects.create(
            deployment=deployment, at=timezone.now(), direction=decision.direction,
            replicas_before=decision.before, replicas_after=after, reason=reason[:300],
            signals=signals, placed=placed, replicas_wanted=decision.after, open=unplaced,
        )
        record_audit(ACTOR, f"deployment.scale_{decision.direction}", deployment,
                     reason=reason, changes={"replicas": [decision.before, after],
                                             "placed": placed, "decision": row.pk,
                                             "retired": signals.get("retired", [])})
    return row


def _scale_up(deployment: Deployment, active: list[Replica], decision: Decision,
              signals: dict[str, Any]) -> tuple[str, list[str]]:
    """Ask for the new replicas, within the tenant's caps; during a rollout each revision
    gets its share. Returns the decision's reason (with what held it back) and the region
    of each replica asked for; `signals` gains what was requested and how it was placed."""
    reason = decision.reason
    add = decision.after - decision.before
    # Never past the tenant's caps: what they leave is all it may add.
    room = caps.headroom(deployment)
    if room.replicas is not None and room.replicas < add:
        reason = f"{reason}; {room.why}, so at most {room.replicas} more"
        signals["tenant_cap"] = room.why
        add = room.replicas
    shares: list[tuple[Revision | None, int]] = [(None, add)]
    canary = deployment.canary_revision if deployment.canary_revision_id else None
    if canary is not None:
        stable_n, canary_n = policy.split_scale_up(add, policy.canary_share(
            deployment.canary_weight, deployment.canary_region_weights))
        shares = [(None, stable_n), (canary, canary_n)]
        signals["revisions"] = {"stable": stable_n, f"canary {canary.number}": canary_n}
    placed: list[str] = []
    hows = []
    for revision, n in shares:
        if n <= 0:
            continue
        made, how = _place_share(deployment, active, n, reason, revision)
        placed.extend(r.region.key for r in made)
        signals.setdefault("requested", []).extend(r.public_id for r in made)
        active = [*active, *made]  # the next share sees their quota used
        hows.append(how)
    signals["placement"] = "; ".join(hows)
    if len(placed) < add:
        reason = f"{reason}; wanted {decision.after}, placed {len(placed)}: {signals['placement']}"
    return reason, placed


def _place_share(deployment: Deployment, active: Sequence[Replica], n: int, reason: str,
                 revision: Revision | None) -> tuple[list[Replica], str]:
    """`n` replicas of the stable revision (None) or of a canary, asked for. A canary's
    first go, as a rollout places them (`placement.spread_first`), one to each region its
    replicas lack for the spread rule, beside the stable replicas first; the rest, like the
    stable ones, where the solver's cheapest plan puts them."""
    if revision is None:
        placement = place_scale_up(deployment, active, n)
        return _ask(placement, deployment, reason, None), placement.how
    sized, gpu_types = sized_for(deployment, revision), preferred_gpu_types(revision)
    stable_regions = {r.region.key for r in active if r.revision_id != revision.pk}

    def one(region: Region, offer: Offer, spot: bool) -> list[Replica]:
        return _ask(Placement([(region, offer, spot, 1)], ""), deployment, reason, revision)

    made, hows = place_spread_first(deployment, sized, revision, list(active), n, gpu_types,
                                    [stable_regions], one)
    if len(made) < n:
        placement = place_scale_up(sized, [*active, *made], n - len(made),
                                   gpu_types=gpu_types)
        made += _ask(placement, deployment, reason, revision)
        hows.append(placement.how)
    return made, "; ".join(hows)


def _ask(placement: Placement, deployment: Deployment, reason: str,
         revision: Revision | None) -> list[Replica]:
    """The replicas of each of the placement's slots, asked for."""
    made: list[Replica] = []
    for region, offer, spot, count in placement.slots:
        made += request_replicas(deployment, region, count, actor=ACTOR,
                                 reason=f"autoscaler: {reason}", spot=spot, offer=offer,
                                 revision=revision)
    return made


def _scale_down(deployment: Deployment, active: list[Replica], snap: Snapshot,
                decision: Decision, signals: dict[str, Any]) -> int:
    """Drain the replicas `choose_retirements` picks; returns how many."""
    # During a rollout no revision loses its last serving replica.
    canary = deployment.canary_revision_id is not None
    revision_of = ({r.pk: r.revision_id or deployment.stable_revision_id
                    for r in active} if canary else None)
    retired = choose_retirements(active, decision.before - decision.after,
                                 snap.load, deployment.spread_regions, decision.after,
                                 revision_of=revision_of)
    for replica in retired:
        retire_replica(replica, actor=ACTOR, reason=f"autoscaler: {decision.reason}")
    signals["retired"] = [r.public_id for r in retired]
    return len(retired)


def _repeat_open(deployment: Deployment, decision: Decision, reason: str,
                 signals: dict[str, Any]) -> ScalingDecision | None:
    """The open decision this attempt repeats (same direction, count and wish, and it too
    placed nothing), updated in place: one row and one audit event however many ticks it
    takes until the deployment can be placed again. None when there is none to repeat."""
    prior = (ScalingDecision.objects.select_for_update()
             .filter(deployment=deployment, open=True, direction=decision.direction,
                     replicas_before=decision.before, replicas_wanted=decision.after,
                     replicas_after=decision.before)
             .order_by("-at", "-id").first())
    if prior is None:
        return None
    prior.repeats += 1
    prior.last_at = timezone.now()
    prior.reason = reason[:300]
    prior.signals = signals
    prior.save(update_fields=["repeats", "last_at", "reason", "signals"])
    return prior


# -- scale-down --------------------------------------------------------------------------------

def _usd_h(replica: Replica) -> Decimal:
    """What the replica costs per hour, as billed (costs.usd_h_for)."""
    d = replica.deployment
    return usd_h_for(replica.offer, replica.spot, d.tensor_parallel, d.pipeline_parallel)


def choose_retirements(active: Sequence[Replica], k: int, load: Mapping[int, float],
                       spread_regions: int, after: int,
                       revision_of: Mapping[int, Hashable] | None = None) -> list[Replica]:
    """The `k` replicas to drain: not yet serving first, then the least loaded, then the most
    expensive, newest first; none whose loss would leave fewer regions than the spread asks
    (unless no replica is left at all); with `revision_of` (a rollout in progress: replica
    → revision), none that is its revision's last serving replica. Pure apart from reading
    loaded rows."""
    order = sorted(active, key=lambda r: (
        r.state in SERVING_STATES, load.get(r.pk, 0.0), -_usd_h(r), -r.created_at.timestamp()))
    regions = Counter(r.region_id for r in active)
    serving_left: Counter[Hashable] = Counter(
        revision_of[r.pk] for r in active
        if revision_of is not None and r.state in SERVING_STATES)
    need_regions = min(spread_regions, after) if after > 0 else 0
    chosen: list[Replica] = []
    for r in order:
        if len(chosen) == k:
            break
        leaves_region = regions[r.region_id] == 1
        if leaves_region and len([n for n in regions.values() if n > 0]) - 1 < need_regions:
            continue
        serving = r.state in SERVING_STATES
        if revision_of is not None:
            if not policy.keeps_each_revision(revision_of[r.pk], serving, serving_left):
                continue
            if serving:
                serving_left[revision_of[r.pk]] -= 1
        regions[r.region_id] -= 1
        chosen.append(r)
    return chosen
