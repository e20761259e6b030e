"""Month-to-date spend, budget fractions and the month-end projection."""

from __future__ import annotations

from datetime import UTC, datetime
from decimal import Decimal

import pytest

from controlplane.costs import budgets
from controlplane.costs.models import CostRollup


def _row(hour: datetime, tenant: str, usd: str, model: str = "m", region: str = "aws:x") -> None:
    CostRollup.objects.create(hour=hour, model=model, region=region, tenant=tenant,
                              usd=Decimal(usd), computed_at=hour)


def test_month_bounds_cover_the_utc_calendar_month() -> None:
    start, end = budgets.month_bounds(datetime(2024, 2, 10, 5, 30, tzinfo=UTC))
    assert start == datetime(2024, 2, 1, tzinfo=UTC)
    assert end == datetime(2024, 3, 1, tzinfo=UTC)  # 2024 is a leap year: 29 days
    start, end = budgets.month_bounds(datetime(2026, 12, 31, 23, 59, tzinfo=UTC))
    assert (start, end) == (datetime(2026, 12, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC))


def test_projection_adds_the_recent_rate_for_the_rest_of_the_month() -> None:
    # $48 over the last 24 h is $2/h; 10 days left → 240 h × $2 on top of $100 spent.
    assert budgets.project_month_end(100.0, 48.0, 24 * 3600, 10 * 24 * 3600) == 580.0
    assert budgets.project_month_end(7.0, 0.0, 0.0, 3600) == 7.0
    assert budgets.project_month_end(7.0, 1.0, 3600, -5) == 7.0


def test_budget_fraction() -> None:
    assert budgets.budget_fraction(25.0, 100.0) == 0.25
    assert budgets.budget_fraction(25.0, None) is None
    assert budgets.budget_fraction(25.0, 0.0) is None


@pytest.mark.django_db
def test_month_to_date_counts_only_this_tenant_this_month(tenants) -> None:  # type: ignore[no-untyped-def]
    now = datetime(2026, 11, 20, 12, 30, tzinfo=UTC)
    _row(datetime(2026, 11, 1, 0, tzinfo=UTC), "acme", "10.5")
    _row(datetime(2026, 11, 20, 12, tzinfo=UTC), "acme", "1.25")          # the current hour
    _row(datetime(2026, 11, 20, 12, tzinfo=UTC), "acme", "2", model="n")
    _row(datetime(2026, 10, 31, 23, tzinfo=UTC), "acme", "100")           # last month
    _row(datetime(2026, 11, 20, 13, tzinfo=UTC), "acme", "100")           # after now
    _row(datetime(2026, 11, 5, 0, tzinfo=UTC), "globex", "7")
    _row(datetime(2026, 11, 5, 0, tzinfo=UTC), "", "3")                   # idle cost
    assert budgets.month_to_date_usd(tenants["acme"], now=now) == pytest.approx(13.75)
    assert budgets.month_to_date_usd("globex", now=now) == pytest.approx(7.0)
    assert budgets.month_to_date_usd("nobody", now=now) == 0.0


@pytest.mark.django_db
def test_budget_status_against_the_tenants_budget(tenants) -> None:  # type: ignore[no-untyped-def]
    acme = tenants["acme"]
    acme.monthly_budget_usd = Decimal("1000")
    acme.save()
    now = datetime(2026, 11, 21, 0, 0, tzinfo=UTC)  # 10 days (240 h) left in November
    _row(datetime(2026, 11, 2, 0, tzinfo=UTC), "acme", "400")  # long ago: not recent
    for h in range(24):  # $1/h over the last 24 hours
        _row(datetime(2026, 11, 20, h, tzinfo=UTC), "acme", "1")
    status = budgets.budget_status(acme, now=now)
    assert status.spent_usd == pytest.approx(424.0)
    assert status.budget_usd == 1000.0
    assert status.fraction == pytest.approx(0.424)
    assert status.projected_usd == pytest.approx(424.0 + 240.0)
    assert status.projected_fraction == pytest.approx(0.664)
    assert not status.over_budget and not status.projected_over
    assert status.month_end == datetime(2026, 12, 1, tzinfo=UTC)

    globex = budgets.budget_status(tenants["globex"], now=now)  # no budget
    assert (globex.spent_usd, globex.budget_usd, globex.fraction) == (0.0, None, None)
    assert not globex.over_budget


@pytest.mark.django_db
def test_over_budget_and_projected_over(tenants) -> None:  # type: ignore[no-untyped-def]
    acme = tenants["acme"]
    acme.monthly_budget_usd = Decimal("50")
    acme.save()
    now = datetime(2026, 11, 3, 0, 0, tzinfo=UTC)
    _row(datetime(2026, 11, 2, 5, tzinfo=UTC), "acme", "40")
    status = budgets.budget_status(acme, now=now)
    assert not status.over_budget and status.projected_over  # $40/day for 28 more days
    _row(datetime(2026, 11, 2, 6, tzinfo=UTC), "acme", "20")
    assert budgets.budget_status(acme, now=now).over_budget
