"""Costs: what a replica costs per hour, who used it, and what each tenant has spent.

- A replica's $/h is its offer's price (spot when it runs on spot and the offer has a spot
  price) × the nodes it spans, `deployments.shape.replica_nodes` — the rule placement sizes
  offers by and provisioning launches (`provisioning.services.spec_for`). A layout its
  offer's nodes cannot hold has no node count: provisioning refuses to launch it, and it has
  no $/h (0 in Python, NULL in SQL, as for a replica without an offer).
  `replica_usd_h_sql` is that rule in SQL for aggregates; `usd_h_for` is it in Python. Both
  are used everywhere a $/h shows.
- The edges count tokens per (model, region, tenant); `record_usage` adds each scrape's
  growth to hourly `TokenUsage` rows in one INSERT … ON CONFLICT DO UPDATE.
- `rollup_hour` prices each (model, region) for an hour — Σ replica $/h × the part of the
  hour each was billed — and allocates it with `allocate`: a tenant-dedicated deployment's
  cost to its tenant, shared cost to tenants by the tokens each was served there, and shared
  cost with no tokens to tenant "" (idle). Re-running an hour rewrites its rows at once.
- Budgets: `costs/budgets.py`.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import ROUND_HALF_EVEN, Decimal
from typing import Any

from django.db import connection, transaction
from django.db.models import (
    Case,
    DecimalField,
    ExpressionWrapper,
    F,
    IntegerField,
    Q,
    QuerySet,
    Sum,
    Value,
    When,
)
from django.db.models.functions import Mod
from django.db.models.lookups import GreaterThan
from django.utils import timezone

from controlplane.core import money
from controlplane.core.locks import lock_id
from controlplane.costs.models import CostRollup, RollupHour, TokenUsage
from controlplane.deployments.lifecycle import LIVE_STATES
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.deployments.shape import replica_nodes

HOUR = timedelta(hours=1)
USD_PLACES = Decimal("0.000001")
# A replica costs money from the moment its machine is asked for until it is terminated;
# a pending one has no machine yet.
BILLED_STATES = tuple(sorted(LIVE_STATES - {S.PENDING}))
# A closed hour is rolled up once more this long after it ends, for the edges' scrapes that
# straddle its end; that pass is its last.
FINAL_GRACE = timedelta(minutes=2)
# How far back the periodic rollup looks for hours that never had their final pass.
BACKFILL = timedelta(hours=48)
TOKEN_KINDS = {"prompt": 0, "completion": 1}
TOKEN_LABELS = ("model", "region", "tenant", "kind")


# -- $/h of a replica -----------------------------------------------------------------------

def usd_h_for(offer: Any, spot: bool, tensor_parallel: int, pipeline_parallel: int) -> Decimal:
    """$/h of one replica of a deployment with this TP × PP on `offer`; 0 when there is no
    price: no offer, or nodes that cannot hold the layout (it is never launched)."""
    if offer is None:
        return Decimal(0)
    nodes = replica_nodes(tensor_parallel, pipeline_parallel, offer.gpus_per_node)
    if nodes is None:
        return Decimal(0)
    price = offer.spot_usd_h if spot and offer.spot_usd_h is not None else offer.on_demand_usd_h
    return Decimal(price) * nodes


def replica_usd_h_sql(replica: str = "", deployment: str = "deployment__") -> ExpressionWrapper:
    """SQL for one replica's $/h (the rule of `usd_h_for`); NULL when it has no offer.

    `replica` and `deployment` are the lookup paths from the queried model to the replica and
    to its deployment.
    """
    price = Case(
        When(**{f"{replica}spot": True, f"{replica}offer__spot_usd_h__isnull": False},
             then=F(f"{replica}offer__spot_usd_h")),
        default=F(f"{replica}offer__on_demand_usd_h"),
    )
    tp, pp = f"{deployment}tensor_parallel", f"{deployment}pipeline_parallel"
    gpus = F(f"{replica}offer__gpus_per_node")
    # Integer division rounds down, so (a + b - 1) / b is the ceiling of a / b.
    ceil = (F(tp) * F(pp) + gpus - Value(1)) / gpus
    # `replica_nodes` in SQL: NULL where the offer's nodes cannot hold the layout.
    nodes = Case(
        When(Q(**{f"{tp}__lt": 1}) | Q(**{f"{pp}__lt": 1})
             | Q(**{f"{replica}offer__gpus_per_node__lt": 1}), then=Value(None)),
        When(Q(**{f"{tp}__gt": gpus}), then=Value(None)),  # a TP group crosses a node
        When(GreaterThan(Mod(F(pp), ceil), 0), then=Value(None)),  # stages do not split
        default=ceil, output_field=IntegerField(),
    )
    return ExpressionWrapper(price * nodes,
                             output_field=DecimalField(max_digits=14, decimal_places=4))


def billed_usd_h_sql(replica: str = "", deployment: str = "deployment__") -> Sum:
    """Sum of $/h over billed replicas, for aggregates."""
    return Sum(replica_usd_h_sql(replica, deployment),
               filter=Q(**{f"{replica}state__in": BILLED_STATES}))


def billed_interval(created_at: datetime, terminated_at: datetime | None, state: str,
                    state_changed_at: datetime, now: datetime) -> tuple[datetime, datetime] | None:
    """When a replica was billed: from its creation until it was terminated, or until it
    failed while it stays failed, or until now while it lives. Pending: not yet. Pure."""
    if terminated_at is not None:
        return created_at, terminated_at
    if state == S.PENDING:
        return None
    if state == S.FAILED:
        return created_at, state_changed_at
    return created_at, now


def overlap_s(start: datetime, end: datetime, lo: datetime, hi: datetime) -> float:
    """Seconds [start, end) and [lo, hi) share. Pure."""
    return max(0.0, (min(end, hi) - max(start, lo)).total_seconds())


# -- usage from the edges -------------------------------------------------------------------

def hour_of(at: datetime) -> datetime:
    """The start of the UTC hour `at` falls in."""
    return at.astimezone(UTC).replace(minute=0, second=0, microsecond=0)


def split_by_hour(since: datetime | None, at: datetime, amount: int) -> dict[datetime, int]:
    """Spread `amount` evenly over [since, at) by hour, in whole units that add up to it.

    Without a usable `since` (none, or not before `at`) all of it goes to `at`'s hour. Pure.
    """
    if since is None or since >= at or hour_of(since) == hour_of(at):
        return {hour_of(at): amount} if amount else {}
    total_s = (at - since).total_seconds()
    out: dict[datetime, int] = {}
    given = 0
    hour = hour_of(since)
    while hour < at:
        end = min(hour + HOUR, at)
        # Cumulative rounding: the parts always sum to `amount` exactly.
        upto = round(amount * (end - since).total_seconds() / total_s)
        if upto - given:
            out[hour] = upto - given
        given = upto
        hour += HOUR
    return out


UsageKey = tuple[datetime, str, str, str]  # hour, model, region, tenant


def usage_rows(deltas: Iterable[Any]) -> dict[UsageKey, list[int]]:
    """[prompt, completion] tokens per (hour, model, region, tenant) from edge deltas. Pure.

    Each delta is what one edge counted over [since, at) (`telemetry.services.EdgeDelta`),
    its tokens keyed "model|region|tenant|kind"; other kinds than prompt and completion are
    ignored.
    """
    rows: dict[UsageKey, list[int]] = {}
    for delta in deltas:
        for joined, value in delta.tokens.items():
            parts = (joined.split("|") + ["", "", "", ""])[:4]
            model, region, tenant, kind = parts
            slot = TOKEN_KINDS.get(kind)
            amount = round(value)
            if slot is None or amount <= 0 or not model:
                continue
            for hour, part in split_by_hour(delta.since, delta.at, amount).items():
                row = rows.setdefault((hour, model, region, tenant), [0, 0])
                row[slot] += part
    return rows


_UPSERT_SQL = """
INSERT INTO costs_tokenusage (hour, model, region, tenant, prompt_tokens, completion_tokens)
VALUES {values}
ON CONFLICT (hour, model, region, tenant) DO UPDATE SET
    prompt_tokens = costs_tokenusage.prompt_tokens + EXCLUDED.prompt_tokens,
    completion_tokens = costs_tokenusage.completion_tokens + EXCLUDED.completion_tokens
"""


def record_usage(deltas: Iterable[Any], batch: int = 500) -> int:
    """Add the edges' token counts to the hourly usage rows; returns the rows touched.

    One INSERT … ON CONFLICT DO UPDATE adds to existing rows inside Postgres, so two workers
    recording at once both count; rows go in key order so concurrent batches cannot
    deadlock.
    """
    rows = sorted(usage_rows(deltas).items())
    with transaction.atomic(), connection.cursor() as cursor:
        for i in range(0, len(rows), batch):
            chunk = rows[i:i + batch]
            params: list[Any] = []
            for (hour, model, region, tenant), (prompt, completion) in chunk:
                params += [hour, model, region, tenant, prompt, completion]
            values = ", ".join(["(%s, %s, %s, %s, %s, %s)"] * len(chunk))
            cursor.execute(_UPSERT_SQL.format(values=values), params)
    return len(rows)


# -- allocation and hourly rollups ----------------------------------------------------------

@dataclass(frozen=True)
class Share:
    tenant: str
    prompt_tokens: int
    completion_tokens: int
    usd: Decimal

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def allocate(shared_usd: Decimal, dedicated_usd: Mapping[str, Decimal],
             tokens: Mapping[str, tuple[int, int]]) -> list[Share]:
    """Split one (model, region)'s cost for an hour among tenants. Pure.

    `shared_usd`: cost of shared replicas, divided in proportion to the (prompt + completion)
    tokens each tenant was served; with no tokens at all it is idle cost (tenant "").
    `dedicated_usd`: cost of tenant-dedicated replicas, each tenant's own whatever it used.
    `tokens`: (prompt, completion) per tenant. Amounts are rounded to 1e-6 $ and still add
    up to the total exactly; every tenant with tokens gets a share, even of $0.
    """
    usd: dict[str, Decimal] = defaultdict(Decimal)
    for tenant, amount in dedicated_usd.items():
        usd[tenant] += amount
    weights = {t: p + c for t, (p, c) in tokens.items() if p + c > 0}
    total_tokens = sum(weights.values())
    if shared_usd:
        if total_tokens:
            shared = shared_usd.quantize(USD_PLACES, ROUND_HALF_EVEN)
            given = Decimal(0)
            ordered = sorted(weights, key=lambda t: (-weights[t], t))
            for tenant in ordered[1:]:
                part = (shared * weights[tenant] / total_tokens).quantize(USD_PLACES,
                                                                          ROUND_HALF_EVEN)
                usd[tenant] += part
                given += part
            usd[ordered[0]] += shared - given  # the largest user absorbs the rounding
        else:
            usd[""] += shared_usd
    shares = []
    for tenant in sorted(set(usd) | set(weights)):
        prompt, completion = tokens.get(tenant, (0, 0))
        amount = usd.get(tenant, Decimal(0)).quantize(USD_PLACES, ROUND_HALF_EVEN)
        shares.append(Share(tenant, prompt, completion, amount))
    return shares


@dataclass
class GroupCost:
    shared: Decimal = Decimal(0)
    dedicated: dict[str, Decimal] | None = None

    def add(self, tenant: str | None, usd: Decimal) -> None:
        if tenant:
            self.dedicated = self.dedicated or {}
            self.dedicated[tenant] = self.dedicated.get(tenant, Decimal(0)) + usd
        else:
            self.shared += usd


def replica_costs(hour: datetime, now: datetime) -> dict[tuple[str, str], GroupCost]:
    """What each (served model, region) cost over [hour, min(hour + 1 h, now))."""
    return window_costs(hour, hour + HOUR, now)


def window_costs(start: datetime, end: datetime, now: datetime,
                 model: str | None = None) -> dict[tuple[str, str], GroupCost]:
    """What each (served model, region) cost over [start, min(end, now)); one model's only
    when `model` names it."""
    end = min(end, now)
    rows = (
        Replica.objects.filter(offer__isnull=False, created_at__lt=end)
        .filter(Q(terminated_at__isnull=True) | Q(terminated_at__gt=start))
        .exclude(state=S.PENDING, terminated_at__isnull=True)
        # Failed before the window and never terminated: nothing billed since it failed.
        .exclude(state=S.FAILED, terminated_at__isnull=True, state_changed_at__lte=start)
        .filter(**({"deployment__served_model_name": model} if model is not None else {}))
        .annotate(usd_h=replica_usd_h_sql())
        .values("deployment__served_model_name", "deployment__tenant__name",
                "region__cloud__name", "region__code", "usd_h", "created_at",
                "terminated_at", "state", "state_changed_at")
        .order_by()
    )
    groups: dict[tuple[str, str], GroupCost] = defaultdict(GroupCost)
    for row in rows:
        interval = billed_interval(row["created_at"], row["terminated_at"], row["state"],
                                   row["state_changed_at"], now)
        if interval is None or row["usd_h"] is None:  # no price: nodes cannot hold its layout
            continue
        seconds = overlap_s(interval[0], interval[1], start, end)
        if seconds <= 0:
            continue
        region = f"{row['region__cloud__name']}:{row['region__code']}"
        usd = Decimal(row["usd_h"]) * Decimal(seconds) / Decimal(3600)
        groups[(row["deployment__served_model_name"], region)].add(
            row["deployment__tenant__name"], usd)
    return groups


def compute_hour(hour: datetime, now: datetime) -> list[CostRollup]:
    """The rollup rows of one hour (unsaved): every (model, region, tenant) with cost or
    tokens."""
    hour = hour_of(hour)
    costs = replica_costs(hour, now)
    tokens: dict[tuple[str, str], dict[str, tuple[int, int]]] = defaultdict(dict)
    for usage in TokenUsage.objects.filter(hour=hour).order_by():
        tokens[(usage.model, usage.region)][usage.tenant] = (usage.prompt_tokens,
                                                            usage.completion_tokens)
    rows = []
    for group in sorted(set(costs) | set(tokens)):
        cost = costs.get(group, GroupCost())
        for share in allocate(cost.shared, cost.dedicated or {}, tokens.get(group, {})):
            rows.append(CostRollup(
                hour=hour, model=group[0], region=group[1], tenant=share.tenant,
                prompt_tokens=share.prompt_tokens, completion_tokens=share.completion_tokens,
                usd=share.usd, computed_at=now))
    return rows


def rollup_hour(hour: datetime, now: datetime | None = None) -> RollupHour:
    """Compute one hour's rollup and replace its rows in one transaction.

    Idempotent: running it again (by another worker too: a transaction-level advisory lock
    per hour serialises them) leaves the same rows, recomputed from the same inputs.
    """
    now = now or timezone.now()
    hour = hour_of(hour)
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)",
                           [lock_id(f"costs.rollup:{hour.isoformat()}")])
        rows = compute_hour(hour, now)
        CostRollup.objects.filter(hour=hour).delete()
        CostRollup.objects.bulk_create(rows)
        marker, _ = RollupHour.objects.update_or_create(hour=hour, defaults={
            "computed_at": now,
            "usd": sum((r.usd for r in rows), Decimal(0)),
            "tokens": sum(r.tokens for r in rows),
        })
    return marker


def hours_due(now: datetime, done: Mapping[datetime, datetime]) -> list[datetime]:
    """Hours to roll up now: the current one, and every closed hour within BACKFILL whose
    last rollup (`done`: hour → when) ran before it closed plus FINAL_GRACE. Pure."""
    current = hour_of(now)
    hours = []
    hour = hour_of(now - BACKFILL)
    while hour < current:
        last = done.get(hour)
        if last is None or last < hour + HOUR + FINAL_GRACE:
            hours.append(hour)
        hour += HOUR
    hours.append(current)
    return hours


def rollup_due(now: datetime | None = None) -> list[datetime]:
    """Roll up the current hour and every closed hour still owed its final pass."""
    now = now or timezone.now()
    done = dict(RollupHour.objects.filter(hour__gte=hour_of(now - BACKFILL))
                .values_list("hour", "computed_at"))
    hours = hours_due(now, done)
    for hour in hours:
        rollup_hour(hour, now)
    return hours


# -- reading rollups ------------------------------------------------------------------------

GROUPS = ("model", "region", "tenant", "hour", "day")


# What the API and the dashboard call the tenant "" of the rollups: cost no tokens used.
IDLE_TENANT = "(idle)"


def usd_per_mtok(usd: Decimal | float | None, tokens: int | None) -> float | None:
    """$ per million tokens to four significant figures; None without tokens. Pure."""
    if not tokens:
        return None
    return money.rate(Decimal(str(usd or 0)) * 1_000_000 / tokens)


def summarize(rows: QuerySet[CostRollup], group_by: str) -> list[dict[str, Any]]:
    """Spend and tokens per model, region, tenant, hour or day, most expensive first (by
    time for hour and day); each with $ per million tokens."""
    if group_by not in GROUPS:
        raise ValueError(f"group_by must be one of {', '.join(GROUPS)}, got {group_by!r}")
    if group_by == "day":
        from django.db.models.functions import TruncDay
        rows = rows.annotate(day=TruncDay("hour", tzinfo=UTC))
    grouped = (rows.order_by().values(group_by)
               .annotate(sum_usd=Sum("usd"), sum_prompt=Sum("prompt_tokens"),
                         sum_completion=Sum("completion_tokens")))
    out: list[dict[str, Any]] = []
    for row in grouped:
        prompt, completion = row["sum_prompt"] or 0, row["sum_completion"] or 0
        out.append({
            "key": IDLE_TENANT if group_by == "tenant" and not row[group_by] else row[group_by],
            "usd": row["sum_usd"] or Decimal(0),
            "prompt_tokens": prompt, "completion_tokens": completion,
            "tokens": prompt + completion,
            "usd_per_mtok": usd_per_mtok(row["sum_usd"], prompt + completion),
        })
    if group_by in ("hour", "day"):
        out.sort(key=lambda r: r["key"])
    else:
        out.sort(key=lambda r: (-r["usd"], r["key"]))
    return out


def totals(rows: QuerySet[CostRollup]) -> dict[str, Any]:
    agg = rows.aggregate(sum_usd=Sum("usd"), sum_prompt=Sum("prompt_tokens"),
                         sum_completion=Sum("completion_tokens"),
                         idle_usd=Sum("usd", filter=Q(tenant="")))
    prompt, completion = agg["sum_prompt"] or 0, agg["sum_completion"] or 0
    return {"usd": agg["sum_usd"] or Decimal(0), "idle_usd": agg["idle_usd"] or Decimal(0),
            "prompt_tokens": prompt, "completion_tokens": completion,
            "tokens": prompt + completion,
            "usd_per_mtok": usd_per_mtok(agg["sum_usd"], prompt + completion)}
