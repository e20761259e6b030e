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

import copy
import logging
from collections import Counter, defaultdict
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
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
from controlplane.deployments.lifecycle import LIVE_STATES, SERVING_STATES
from controlplane.deployments.models import Deployment, Replica, Revision
from controlplane.deployments.models import ReplicaState as S
from controlplane.deployments.services import mark_placeable, mark_unplaceable
from controlplane.placement.models import PlanChange
from controlplane.placement.proposals import place_additions, quota_left
from controlplane.provisioning.tasks import request_replicas
from controlplane.scaling import rules as policy
from controlplane.scaling.models import ScalingDecision
from controlplane.scaling.rules import DOWN, UP, Decision, Fleet, History, Round, Settings
from controlplane.scaling.services import retire_replica
from controlplane.telemetry.edge_metrics import REQUEST_LABELS, counter_delta, split_key
from controlplane.telemetry.histograms import bucket_delta, histogram_quantile
from controlplane.telemetry.models import EdgeSample, ReplicaSample
from regions.models import Offer

log = logging.getLogger(__name__)

ACTOR = "system:autoscaler"
SCRAPE_INTERVAL_S = 2.0
# Keep running replicas whatever the price difference: a scale-up adds, it never moves.
SOLVER_TIME_LIMIT_S = 5.0
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
                                   state__in=(LIVE_STATES - {S.DRAINING}) | {S.FAILED})
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
        for key, n in counter_delta(samples[-1][1], samples[0][1]).items():
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
        deployment = (Deployment.objects.select_for_update(of=("self",)).select_related("model", "tenant")
                      .get(pk=snap.deployment.pk))
        active = list(deployment.replicas.filter(state__in=LIVE_STATES).exclude(
            state=S.DRAINING).select_related("region__cloud", "offer__gpu_type"))
        if len(active) != decision.before:
            return None  # someone scaled it since the snapshot: decide again next tick
        signals = dict(decision.signals)
        reason = decision.reason
        placed: list[str] = []
        canary = deployment.canary_revision if deployment.canary_revision_id else None
        if decision.direction == UP:
            add = decision.after - decision.before
            # Never past the tenant's caps: what they leave is all it may add.
            room = caps.headroom(deployment)
            if room.replicas is not None and room.replicas < add:
                reason = f"{reason}; {room.why}, so at most {room.replicas} more"
                signals["tenant_cap"] = room.why
                add = room.replicas
            # During a rollout each revision gets its share of the new replicas.
            shares: list[tuple[Revision | None, int]] = [(None, add)]
            if canary is not None:
                stable_n, canary_n = policy.split_scale_up(add, policy.canary_share(
                    deployment.canary_weight, deployment.canary_region_weights))
                shares = [(None, stable_n), (canary, canary_n)]
                signals["revisions"] = {"stable": stable_n, f"canary {canary.number}": canary_n}
            hows = []
            for revision, n in shares:
                if n <= 0:
                    continue
                placement = (place_scale_up(deployment, active, n) if revision is None else
                             place_scale_up(sized_for(deployment, revision), active, n,
                                            gpu_types=_preferred(revision)))
                for region_key, replicas in placement.request(deployment, reason, revision):
                    placed.extend([region_key] * len(replicas))
                    signals.setdefault("requested", []).extend(r.public_id for r in replicas)
                    active = [*active, *replicas]  # the next share sees their quota used
                hows.append(placement.how)
            signals["placement"] = "; ".join(hows)
            after = decision.before + len(placed)
            if len(placed) < add:
                reason = (f"{reason}; wanted {decision.after}, placed {len(placed)}: "
                          f"{signals['placement']}")
        else:
            # During a rollout no revision loses its last serving replica.
            revision_of = ({r.pk: r.revision_id or deployment.stable_revision_id
                            for r in active} if canary is not None else None)
            retired = choose_retirements(active, decision.before - decision.after,
                                         snap.load, deployment.spread_regions, decision.after,
                                         revision_of=revision_of)
            for replica in retired:
                retire_replica(replica, actor=ACTOR, reason=f"autoscaler: {reason}")
            signals["retired"] = [r.public_id for r in retired]
            after = decision.before - len(retired)
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


# -- placement ---------------------------------------------------------------------------------

@dataclass
class Placement:
    slots: list[tuple[Any, Any, bool, int]]  # (region, offer, spot, count)
    how: str

    def request(self, deployment: Deployment, reason: str,
                revision: Revision | None = None) -> list[tuple[str, list[Replica]]]:
        made = []
        for region, offer, spot, count in self.slots:
            replicas = request_replicas(deployment, region, count, actor=ACTOR,
                                        reason=f"autoscaler: {reason}", spot=spot, offer=offer,
                                        revision=revision)
            made.append((region.key, replicas))
        return made


def place_scale_up(deployment: Deployment, active: Sequence[Replica], add: int,
                   gpu_types: Collection[str] = (), regions: Collection[str] = ()) -> Placement:
    """Where `add` new replicas go: the solver's cheapest plan that keeps every running
    replica; else beside the running ones; never outside the allowed jurisdictions or
    quota. `gpu_types`: only these (a revision's preferred GPU type), else those running;
    `regions` (cloud:code), when given: only there."""
    # New replicas are on the GPU type already running (or, from zero, last run): the
    # in-flight target is per replica, so the fleet stays uniform. Every replica runs the
    # deployment's one engine (TP × PP) whatever the node size, and the solver offers only
    # nodes that hold it, so the node size is the solver's to choose.
    placed = place_additions(deployment, active, add,
                             gpu_types=set(gpu_types) or _replica_kinds(deployment, active),
                             only_regions=regions, time_limit_s=SOLVER_TIME_LIMIT_S)
    if placed.slots:
        return Placement([(o.region, o, spot, n) for o, spot, n in placed.slots],
                         f"solver: {', '.join(f'{n} × {o}' for o, _, n in placed.slots)} "
                         f"(${placed.result.cost_after_usd_h:.2f}/h after)")
    result = placed.result
    why = "; ".join(result.explanation) or f"solver status {result.status}"
    beside = [r for r in active if (not gpu_types
              or (r.offer is not None and r.offer.gpu_type.name in gpu_types))
              and (not regions or r.region.key in regions)]
    return _beside_running(deployment, beside, add, quota_left([deployment.pk]),
                           f"solver found no plan ({why})")


def sized_for(deployment: Deployment, revision: Revision) -> Deployment:
    """The deployment as the solver must size it for `revision`'s engine (model, TP × PP,
    context), unsaved: residency, spread and spot rules stay the deployment's."""
    view = copy.copy(deployment)
    view.model = revision.model
    view.tensor_parallel = revision.tensor_parallel
    view.pipeline_parallel = revision.pipeline_parallel
    view.max_model_len = int(revision.engine_args.get("max_model_len",
                                                      deployment.max_model_len))
    return view


def _preferred(revision: Revision) -> set[str]:
    gpu = revision.preferred_gpu_type
    return {gpu.name} if gpu is not None else set()


def _replica_kinds(deployment: Deployment, active: Sequence[Replica]) -> set[str]:
    """GPU types of the running replicas; else of the newest one there was."""
    offers = [r.offer for r in active if r.offer is not None]
    if not offers:
        last = (deployment.replicas.filter(offer__isnull=False).select_related("offer__gpu_type")
                .order_by("-created_at").first())
        offers = [last.offer] if last is not None and last.offer is not None else []
    return {o.gpu_type.name for o in offers}


def _beside_running(deployment: Deployment, active: Sequence[Replica], add: int,
                    quota: Mapping[tuple[str, str], int], why: str) -> Placement:
    """Fallback: the regions and offers already running, least-filled first, within quota."""
    allowed = set(deployment.allowed_jurisdictions.values_list("pk", flat=True))
    used: Counter[tuple[str, str]] = Counter()
    per_region: Counter[int] = Counter()
    choices: dict[int, tuple[Replica, Offer]] = {}
    for r in active:
        per_region[r.region_id] += 1
        if r.offer is None:
            continue
        used[(r.region.key, r.offer.gpu_type.name)] += r.offer.gpus_per_node
        if r.region.jurisdiction_id in allowed and r.region.enabled:
            choices.setdefault(r.region_id, (r, r.offer))
    planned: Counter[tuple[int, bool]] = Counter()
    for _ in range(add):
        fits = []
        for region_id, (r, offer) in choices.items():
            pool = (r.region.key, offer.gpu_type.name)
            if pool in quota and quota[pool] - used[pool] < offer.gpus_per_node:
                continue
            fits.append((per_region[region_id], offer.on_demand_usd_h, region_id, r, offer))
        if not fits:
            break
        _, _, region_id, r, offer = min(fits, key=lambda f: f[:3])
        used[(r.region.key, offer.gpu_type.name)] += offer.gpus_per_node
        per_region[region_id] += 1
        planned[(region_id, r.spot)] += 1
    slots = [(choices[rid][0].region, choices[rid][1], spot, n)
             for (rid, spot), n in planned.items()]
    if not slots:
        return Placement([], f"{why}; no running region has room, nothing placed")
    return Placement(slots, f"{why}; placed beside running replicas")


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
