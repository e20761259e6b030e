"""Budgets: what a tenant has spent this UTC month, from the hourly rollups, against its
monthly budget, with the month-end spend projected at the last 24 hours' rate."""

from __future__ import annotations

import calendar
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import Q, Sum
from django.utils import timezone

from controlplane.core.models import Tenant
from controlplane.costs.models import CostRollup
from controlplane.costs.services import hour_of


def month_bounds(now: datetime) -> tuple[datetime, datetime]:
    """The UTC calendar month holding `now`: [start, end). Pure."""
    now = now.astimezone(UTC)
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    days = calendar.monthrange(now.year, now.month)[1]
    return start, start + timedelta(days=days)


def _tenant_name(tenant: Tenant | str) -> str:
    return tenant if isinstance(tenant, str) else tenant.name


def month_to_date_usd(tenant: Tenant | str, now: datetime | None = None) -> float:
    """What a tenant (object or name) has spent this UTC month, from the hourly rollups
    (the current hour up to its last rollup, a minute old at most)."""
    now = now or timezone.now()
    start, _ = month_bounds(now)
    total = (CostRollup.objects.filter(tenant=_tenant_name(tenant), hour__gte=start,
                                       hour__lte=now).aggregate(usd=Sum("usd"))["usd"])
    return float(total or 0)


RECENT = timedelta(hours=24)


@dataclass(frozen=True)
class BudgetStatus:
    tenant: str
    spent_usd: float
    budget_usd: float | None
    fraction: float | None  # spent ÷ budget; None without a (positive) budget
    projected_usd: float  # month-end spend at the last 24 hours' rate
    projected_fraction: float | None
    month_start: datetime
    month_end: datetime

    @property
    def over_budget(self) -> bool:
        return self.budget_usd is not None and self.spent_usd > self.budget_usd

    @property
    def projected_over(self) -> bool:
        return self.budget_usd is not None and self.projected_usd > self.budget_usd


def project_month_end(spent: float, recent_usd: float, recent_s: float,
                      remaining_s: float) -> float:
    """Spent so far plus the recent rate ($ over `recent_s` seconds) for what is left. Pure."""
    rate = recent_usd / recent_s if recent_s > 0 else 0.0
    return spent + rate * max(0.0, remaining_s)


def budget_fraction(spent: float, budget: float | None) -> float | None:
    if budget is None or budget <= 0:
        return None
    return spent / budget


def budget_statuses(tenants: Sequence[Tenant], now: datetime | None = None
                    ) -> list[BudgetStatus]:
    """Each tenant's month so far against its budget, in one query whatever their number."""
    now = now or timezone.now()
    start, end = month_bounds(now)
    names = [t.name for t in tenants]
    recent_from = max(start, now - RECENT)
    sums = {
        row["tenant"]: row for row in
        CostRollup.objects.filter(tenant__in=names, hour__gte=start, hour__lte=now)
        .values("tenant").order_by()
        .annotate(spent=Sum("usd"), recent=Sum("usd", filter=Q(hour__gte=hour_of(recent_from))))
    }
    # The recent window starts on an hour boundary, so it spans from there to now.
    recent_s = (now - hour_of(recent_from)).total_seconds()
    out = []
    for tenant in tenants:
        row: Mapping[str, Any] = sums.get(tenant.name, {})
        spent = float(row.get("spent") or 0)
        recent = float(row.get("recent") or 0)
        budget = float(tenant.monthly_budget_usd) if tenant.monthly_budget_usd is not None else None
        projected = project_month_end(spent, recent, recent_s, (end - now).total_seconds())
        out.append(BudgetStatus(
            tenant=tenant.name, spent_usd=spent, budget_usd=budget,
            fraction=budget_fraction(spent, budget), projected_usd=projected,
            projected_fraction=budget_fraction(projected, budget),
            month_start=start, month_end=end))
    return out


def budget_status(tenant: Tenant, now: datetime | None = None) -> BudgetStatus:
    """One tenant's spend this month, its budget, the fraction used and the month-end
    projection."""
    return budget_statuses([tenant], now)[0]
