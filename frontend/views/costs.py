"""Costs: spend by model, region and tenant from the hourly rollups; $ per million tokens;
tenants' spend this month against their budgets.

Every figure is an aggregate in Postgres (a fixed number of queries whatever the fleet's or
the tenants' number); the numbers come from controlplane.costs (services, budgets), as in the API.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from django import forms
from django.db.models import Q, Sum
from django.db.models.functions import TruncDay
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

from controlplane.core.models import Tenant
from controlplane.costs import budgets, services
from controlplane.costs.models import CostRollup, RollupHour
from frontend import charts
from frontend.access import principal_of
from frontend.views.common import dashboard_view, render_page

# period → (label, how far back, chart bucket); "month" is the UTC calendar month so far.
PERIODS: dict[str, tuple[str, timedelta | None, str]] = {
    "24h": ("last 24 hours", timedelta(hours=24), "hour"),
    "7d": ("last 7 days", timedelta(days=7), "hour"),
    "month": ("this month", None, "day"),
    "30d": ("last 30 days", timedelta(days=30), "day"),
}
BUDGET_ROWS = 100


class PeriodForm(forms.Form):
    period = forms.ChoiceField(choices=[(k, v[0]) for k, v in PERIODS.items()], required=False)


def window(period: str, now: datetime) -> tuple[datetime, datetime, str]:
    """[since, until) and the chart bucket of a period; since on an hour boundary. Pure."""
    _, back, bucket = PERIODS[period]
    since = budgets.month_bounds(now)[0] if back is None else services.hour_of(now - back)
    return since, now, bucket


def _over_time(rows: Any, bucket: str) -> list[dict[str, Any]]:
    if bucket == "day":
        rows = rows.annotate(time=TruncDay("hour", tzinfo=UTC))
        time_field = "time"
    else:
        time_field = "hour"
    grouped = rows.order_by().values(time_field, "model").annotate(spent=Sum("usd"))
    return [{"time": r[time_field], "model": r["model"], "usd": r["spent"] or 0}
            for r in grouped]


def _budgets(principal: Any, now: datetime) -> tuple[list[dict[str, Any]], int]:
    """Tenants with a budget or spend this month, nearest their budget first."""
    start, _ = budgets.month_bounds(now)
    tenants = Tenant.objects.visible_to(principal).order_by("name")
    spenders = (CostRollup.objects.filter(hour__gte=start, usd__gt=0).exclude(tenant="")
                .values("tenant"))
    tenants = tenants.filter(Q(monthly_budget_usd__isnull=False) | Q(name__in=spenders))
    chosen = list(tenants[:BUDGET_ROWS + 1])
    more = max(len(chosen) - BUDGET_ROWS, 0)
    statuses = sorted(budgets.budget_statuses(chosen[:BUDGET_ROWS], now),
                      key=lambda b: (-(b.projected_fraction or -1), b.tenant))
    return [{"status": status, "scale": _bar_scale(status)} for status in statuses], more


def _bar_scale(status: budgets.BudgetStatus) -> dict[str, float]:
    """Where the spent bar, the projection and the budget line fall, in % of the bar. Pure."""
    top = max(status.budget_usd or 0.0, status.projected_usd, status.spent_usd)
    if top <= 0:
        return {"spent": 0.0, "projected": 0.0, "budget": 0.0}
    return {
        "spent": round(100 * status.spent_usd / top, 1),
        "projected": round(100 * status.projected_usd / top, 1),
        "budget": round(100 * (status.budget_usd or 0.0) / top, 1),
    }


@dashboard_view()
def costs(request: HttpRequest) -> HttpResponse:
    principal = principal_of(request)
    form = PeriodForm(request.GET or None)
    period = "month"
    if form.is_valid() and form.cleaned_data["period"]:
        period = form.cleaned_data["period"]
    now = timezone.now()
    since, until, bucket = window(period, now)
    rows = CostRollup.objects.visible_to(principal).filter(hour__gte=since, hour__lt=until)
    by_model = services.summarize(rows, "model")
    by_region = services.summarize(rows, "region")
    by_tenant = services.summarize(rows, "tenant")
    total = services.totals(rows)
    budgets, budgets_more = _budgets(principal, now)
    last = RollupHour.objects.order_by("-computed_at").values_list("computed_at", flat=True).first()
    spent = float(total["usd"])
    for groups in (by_model, by_region, by_tenant):
        for g in groups:
            g["share"] = float(g["usd"]) / spent if spent else None
    return render_page(request, "frontend/costs.html", {
        "form": form, "period": period, "period_label": PERIODS[period][0],
        "periods": [(k, v[0]) for k, v in PERIODS.items()],
        "since": since, "until": until, "total": total,
        "by_model": by_model, "by_region": by_region, "by_tenant": by_tenant,
        "over_time": charts.spend_over_time_figure(_over_time(rows, bucket), since, until,
                                                   bucket) if by_model else None,
        "model_bars": charts.spend_bars_figure(by_model, "model") if by_model else None,
        "region_bars": charts.spend_bars_figure(by_region, "region") if by_region else None,
        "tenant_bars": charts.spend_bars_figure(by_tenant, "tenant") if by_tenant else None,
        "budgets": budgets, "budgets_more": budgets_more, "last_rollup": last,
    })
