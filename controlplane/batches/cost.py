"""What a batch cost: its share, by tokens, of what its model's replicas cost while it ran.

The window is the batch's run, from in_progress to its end (or now). The replicas' $ over
the window is the costs app's (`costs.services.window_costs`: each replica's $/h × its
billed time in the window); the tokens they served in it are the engines' own counters
(prompt and generation tokens, from the telemetry samples at both ends of the window). The
batch's cost is

    its tokens / all tokens the replicas served in the window × the replicas' $ in the window

and its $/Mtok is set beside the interactive $/Mtok of the same model: the replicas' $ over
the same length of time just before the batch began, over the tokens they served then
(interactive traffic, paying for the capacity it leaves idle too). Batch work that fills
capacity interactive traffic leaves idle lowers the $/Mtok of its window. Where the
counters miss some of the batch's tokens (no samples yet), the batch's own tokens are the
floor of the window's, so its share is never over the whole, and the window says so: its
`tokens` are never fewer than the batch's.

The batch's tokens, its `usage` in the batch object and the floor are one record: the
engines' usage on its finished lines (`usage.batch_usage`). Amounts and ratios are rounded
by `core.money`, as on the costs API and the pages.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from decimal import Decimal
from typing import Any

from django.db.models import Q
from django.utils import timezone

from controlplane.batches.models import Batch
from controlplane.batches.usage import BatchUsage, batch_usage
from controlplane.core import money
from controlplane.costs.services import usd_per_mtok, window_costs
from controlplane.deployments.models import Replica
from controlplane.telemetry.models import ReplicaSample
from controlplane.telemetry.windows import Reading, from_start, growth

# How far before a window's start a sample may be to count as the replica's counters then.
SAMPLE_SLACK = timedelta(minutes=2)
# The interactive window is as long as the batch's run, within these bounds.
MIN_INTERACTIVE_WINDOW = timedelta(minutes=1)
MAX_INTERACTIVE_WINDOW = timedelta(hours=1)


@dataclass(frozen=True)
class WindowCost:
    """A model's replicas over a window: what they cost and the tokens they served."""

    start: datetime
    end: datetime
    usd: Decimal
    tokens: int

    @property
    def usd_per_mtok(self) -> float | None:
        return usd_per_mtok(self.usd, self.tokens)


def counter_growth(samples: Sequence[Reading], keys: tuple[str, ...], from_zero: bool) -> int:
    """How much a replica's counters grew over its samples in time order, summed over
    `keys`; an engine that restarted counts again from zero (`windows.growth`).
    `from_zero`: the replica began inside the window, so its first sample's counts were all
    served in it. Pure."""
    return int(sum(growth([counters for _, counters in samples], keys, from_zero).values()))


def served_tokens(model: str, start: datetime, end: datetime) -> int:
    """Prompt and generation tokens the model's replicas served between start and end (the
    counters at or just before the start, and at or before the end)."""
    replicas = dict(Replica.objects.filter(deployment__served_model_name=model,
                                           created_at__lt=end)
                    .filter(Q(terminated_at__isnull=True) | Q(terminated_at__gt=start))
                    .values_list("pk", "created_at"))
    if not replicas:
        return 0
    rows = (ReplicaSample.objects.filter(replica_id__in=replicas, up=True,
                                         at__gte=start - SAMPLE_SLACK, at__lte=end)
            .order_by("replica_id", "at").values_list("replica_id", "at", "counters"))
    by_replica: dict[int, list[Reading]] = {}
    for replica_id, at, counters in rows:
        by_replica.setdefault(replica_id, []).append((at, counters))
    # Per replica, its newest sample at or before the start, then the ones inside the window.
    return sum(counter_growth(from_start(samples, start), ("prompt_tokens", "generation_tokens"),
                              from_zero=replicas[rid] >= start)
               for rid, samples in by_replica.items())


def window_cost(model: str, start: datetime, end: datetime,
                now: datetime | None = None) -> WindowCost:
    now = now or timezone.now()
    groups = window_costs(start, end, now, model=model)
    usd = sum((g.shared + sum((g.dedicated or {}).values(), Decimal(0))
               for g in groups.values()), Decimal(0))
    return WindowCost(start, min(end, now), usd, served_tokens(model, start, end))


def batch_tokens(batch: Batch) -> int:
    return batch_usage(batch).total_tokens


def _end(batch: Batch, now: datetime) -> datetime:
    ends = [at for at in (batch.completed_at, batch.failed_at, batch.expired_at,
                          batch.cancelled_at) if at is not None]
    return min(ends) if ends else now


@dataclass(frozen=True)
class BatchCost:
    tokens: int  # the batch's, as the engines reported them
    usd: Decimal | None  # None: the batch has not started
    window: WindowCost | None
    interactive: WindowCost | None
    usage: BatchUsage = field(default_factory=BatchUsage)  # what `tokens` is the total of

    @property
    def usd_per_mtok(self) -> float | None:
        return usd_per_mtok(self.usd, self.tokens) if self.usd is not None else None

    @property
    def interactive_usd_per_mtok(self) -> float | None:
        return self.interactive.usd_per_mtok if self.interactive is not None else None

    @property
    def ratio_vs_interactive(self) -> float | None:
        batch, interactive = self.usd_per_mtok, self.interactive_usd_per_mtok
        if batch is None or not interactive:
            return None
        return money.ratio(batch / interactive)


def batch_cost(batch: Batch, now: datetime | None = None) -> BatchCost:
    """The batch's share of its replicas' cost, and the interactive price beside it."""
    now = now or timezone.now()
    usage = batch_usage(batch)
    tokens = usage.total_tokens
    start = batch.in_progress_at
    if start is None:
        return BatchCost(tokens, None, None, None, usage)
    counted = window_cost(batch.model, start, _end(batch, now), now)
    window = replace(counted, tokens=max(counted.tokens, tokens))  # the batch's at least
    usd = window.usd * tokens / window.tokens if window.tokens else Decimal(0)
    length = min(MAX_INTERACTIVE_WINDOW, max(MIN_INTERACTIVE_WINDOW, window.end - start))
    interactive = window_cost(batch.model, start - length, start, now)
    return BatchCost(tokens, usd, window, interactive, usage)


def cost_json(cost: BatchCost) -> dict[str, Any]:
    """The `meridian.cost` object of a batch's API answer."""

    def window(w: WindowCost | None) -> dict[str, Any] | None:
        if w is None:
            return None
        return {"start": int(w.start.timestamp()), "end": int(w.end.timestamp()),
                "usd": float(money.amount(w.usd)), "tokens": w.tokens,
                "usd_per_mtok": w.usd_per_mtok}

    return {"tokens": cost.tokens,
            "usd": None if cost.usd is None else float(money.amount(cost.usd)),
            "usd_per_mtok": cost.usd_per_mtok,
            "interactive_usd_per_mtok": cost.interactive_usd_per_mtok,
            "ratio_vs_interactive": cost.ratio_vs_interactive,
            "window": window(cost.window), "interactive_window": window(cost.interactive)}
