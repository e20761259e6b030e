"""How far batches have got, read from their lines: counts (one rule for the API's
`request_counts` and the dashboard's progress), tokens used, the rate of the last
minutes and the time left at that rate, what they cost so far (`batches.cost`), a batch's
failed lines and its progress over time. Read-only; the dashboard's Batches page shows what
these return.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.core.cache import cache
from django.db.models import Count, F, Q, Sum
from django.db.models.functions import TruncMinute
from django.utils import timezone

from controlplane.batches.cost import BatchCost, batch_cost
from controlplane.batches.lease import held
from controlplane.batches.models import FINISHED, Batch, BatchLine, BatchStatus, LineState
from controlplane.batches.usage import UsageTokens

# The rate behind an ETA is measured over this much of the recent past.
RATE_WINDOW = timedelta(minutes=5)
# How long a batch's cost is kept before it is worked out again: a running batch's grows,
# a finished one's only moves with late telemetry.
COST_TTL_RUNNING_S = 30
COST_TTL_FINISHED_S = 3600


def eta_s(remaining: int, finished_recently: int, window_s: float) -> float | None:
    """Seconds to finish `remaining` lines at the rate of `finished_recently` lines in the
    last `window_s` seconds; None when nothing finished in the window (no rate to go by)."""
    if remaining <= 0:
        return 0.0
    if finished_recently <= 0 or window_s <= 0:
        return None
    return remaining * window_s / finished_recently


@dataclass(frozen=True)
class Progress:
    total: int
    completed: int
    failed: int
    running: int  # held by a live worker (`lease`)
    tokens: int
    eta_s: float | None  # None: unknown, or the batch is not running

    @property
    def finished(self) -> int:
        return self.completed + self.failed

    @property
    def queued(self) -> int:
        """Lines not finished and not held by a worker now."""
        return self.total - self.finished - self.running

    @property
    def fraction(self) -> float:
        return self.finished / self.total if self.total else 0.0

    @property
    def percent(self) -> float:
        return round(100 * self.fraction, 1)

    @property
    def completed_percent(self) -> float:
        return round(100 * self.completed / self.total, 2) if self.total else 0.0

    @property
    def failed_percent(self) -> float:
        return round(100 * self.failed / self.total, 2) if self.total else 0.0


def _line_counts(batch_ids: list[str], now: datetime,
                 **more: Count | Sum) -> dict[str, dict[str, Any]]:
    """Each batch's lines, counted by one rule, by batch id: `total`, `completed`, `failed`,
    and `running`: held by a live worker. A running line whose lease ran out is pending work
    (the next runner claims it again), so it counts as neither running nor finished.
    `more`: further aggregates over the same lines."""
    return {
        row["batch_id"]: dict(row) for row in
        BatchLine.objects.filter(batch__in=batch_ids).values("batch_id").order_by()
        .annotate(total=Count("id"),
                  completed=Count("id", filter=Q(state=LineState.DONE)),
                  failed=Count("id", filter=Q(state=LineState.FAILED)),
                  running=Count("id", filter=held(now)), **more)
    }


def request_counts(batch: Batch) -> dict[str, int]:
    """OpenAI's `request_counts` of a batch: all its lines, the completed and the failed."""
    row = _line_counts([batch.pk], timezone.now()).get(batch.pk, {})
    return {key: int(row.get(key, 0)) for key in ("total", "completed", "failed")}


def progress_of(batches: Iterable[Batch], now: datetime | None = None) -> dict[str, Progress]:
    """Every batch's progress, by id, in one query over their lines."""
    now = now or timezone.now()
    rows = list(batches)
    if not rows:
        return {}
    since = now - RATE_WINDOW
    counts = _line_counts(
        [b.pk for b in rows], now, recent=Count("id", filter=Q(finished_at__gte=since)),
        tokens=Sum(UsageTokens(F("result")), filter=Q(state=LineState.DONE)))
    out = {}
    for batch in rows:
        row = counts.get(batch.pk, {})
        total, completed, failed = (int(row.get(k, 0)) for k in ("total", "completed", "failed"))
        eta = None
        # Only a running batch has an end to foresee: a cancelling one sends nothing more.
        if batch.status == BatchStatus.IN_PROGRESS and batch.in_progress_at is not None:
            # A batch running for less than the window is measured since it started.
            window = min(RATE_WINDOW, now - batch.in_progress_at).total_seconds()
            eta = eta_s(total - completed - failed, row.get("recent", 0), window)
        out[batch.pk] = Progress(total=total, completed=completed, failed=failed,
                                 running=int(row.get("running", 0)), tokens=int(row.get("tokens") or 0),
                                 eta_s=eta)
    return out


def finished_at(batch: Batch) -> datetime | None:
    """When the batch ended, however it ended; None while it runs."""
    return (batch.completed_at or batch.failed_at or batch.expired_at or batch.cancelled_at)


def failed_lines(batch: Batch) -> Any:
    """The batch's failed lines, in input order: line number, custom_id, status, error."""
    return (batch.lines.filter(state=LineState.FAILED).order_by("line_number")
            .only("line_number", "custom_id", "response_status", "error", "attempts",
                  "finished_at"))


def retrying(batch: Batch) -> int:
    """Lines waiting to be sent again after a retryable failure."""
    return batch.lines.filter(state=LineState.QUEUED, attempts__gt=0).count()


def finished_per_minute(batch: Batch) -> list[dict[str, Any]]:
    """Lines that finished in each minute, completed and failed: `minute`, `completed`,
    `failed`, oldest first (minutes with none left out)."""
    return [dict(row) for row in
        batch.lines.filter(finished_at__isnull=False)
        .annotate(minute=TruncMinute("finished_at")).values("minute").order_by("minute")
        .annotate(completed=Count("id", filter=Q(state=LineState.DONE)),
                  failed=Count("id", filter=Q(state=LineState.FAILED)))]


def costs_of(batches: Iterable[Batch]) -> dict[str, BatchCost]:
    """Each batch's cost (`cost.batch_cost`, a few queries a batch), kept in the cache for
    30 s while the batch runs and an hour once it has finished, so a list that refreshes
    every 2 s does not work every cost out again each time."""
    keys = {f"batches:cost:{batch.pk}:{batch.status}": batch for batch in batches}
    found: dict[str, BatchCost] = cache.get_many(list(keys))
    for key, batch in keys.items():
        if key not in found:
            found[key] = batch_cost(batch)
            cache.set(key, found[key], COST_TTL_FINISHED_S if batch.status in FINISHED
                      else COST_TTL_RUNNING_S)
    return {batch.pk: found[key] for key, batch in keys.items()}
