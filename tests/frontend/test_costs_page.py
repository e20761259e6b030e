"""The Costs page: spend by model, region and tenant, $/Mtok, budgets; tenancy; query counts;
and its figure builders (pure)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from controlplane.core.models import Role, Tenant
from controlplane.costs import budgets, services
from controlplane.costs.models import CostRollup
from frontend import charts
from frontend.views.costs import _bar_scale, window

pytestmark = pytest.mark.django_db


def _rollup(hour: datetime, model: str, region: str, tenant: str, tokens: int, usd: str) -> None:
    CostRollup.objects.create(hour=hour, model=model, region=region, tenant=tenant,
                              prompt_tokens=tokens, completion_tokens=0, usd=Decimal(usd),
                              computed_at=hour)


@pytest.fixture
def spend(tenants):  # type: ignore[no-untyped-def]
    hour = services.hour_of(timezone.now())
    _rollup(hour, "llama", "aws:eu-central-1", "acme", 2_000_000, "6")
    _rollup(hour, "llama", "aws:eu-central-1", "globex", 1_000_000, "3")
    _rollup(hour, "llama", "aws:us-east-1", "", 0, "1.5")
    _rollup(hour - timedelta(days=3), "qwen", "aws:us-east-1", "acme", 500_000, "2")
    acme = tenants["acme"]
    acme.monthly_budget_usd = Decimal("10")
    acme.save()
    return hour


def test_platform_sees_spend_by_model_region_tenant_with_idle_and_budgets(signed_in, spend):  # type: ignore[no-untyped-def]
    response = signed_in(Role.VIEWER).get("/costs/?period=7d")
    assert response.status_code == 200
    ctx = response.context
    assert {g["key"]: g["usd"] for g in ctx["by_model"]} == {
        "llama": Decimal("10.5"), "qwen": Decimal("2")}
    assert {g["key"]: g["usd"] for g in ctx["by_tenant"]} == {
        "acme": Decimal("8"), "globex": Decimal("3"), "(idle)": Decimal("1.5")}
    assert {g["key"] for g in ctx["by_region"]} == {"aws:eu-central-1", "aws:us-east-1"}
    llama = next(g for g in ctx["by_model"] if g["key"] == "llama")
    assert llama["usd_per_mtok"] == pytest.approx(3.5)
    assert ctx["total"]["idle_usd"] == Decimal("1.5")
    html = response.content.decode()
    for element in ("cost-over-time", "cost-by-model", "cost-by-region", "cost-by-tenant"):
        assert f'id="{element}"' in html
    assert "idle (no tokens)" in html and "$3.500" in html
    [acme] = [r for r in ctx["budgets"] if r["status"].tenant == "acme"]
    assert acme["status"].budget_usd == 10.0
    assert 'class="budget-bar"' in html


def test_the_period_narrows_what_is_counted(signed_in, spend):  # type: ignore[no-untyped-def]
    client = signed_in(Role.VIEWER)
    day = client.get("/costs/?period=24h").context
    assert {g["key"] for g in day["by_model"]} == {"llama"}
    bad = client.get("/costs/?period=fortnight")
    assert bad.status_code == 200 and bad.context["period"] == "month"
    assert "period:" in bad.content.decode()


def test_tenant_users_see_their_own_spend_and_budget_only(signed_in, spend, tenants):  # type: ignore[no-untyped-def]
    response = signed_in(Role.VIEWER, tenants["globex"]).get("/costs/?period=7d")
    ctx = response.context
    assert [g["key"] for g in ctx["by_tenant"]] == ["globex"]
    assert ctx["total"]["usd"] == Decimal("3")
    assert [r["status"].tenant for r in ctx["budgets"]] == ["globex"]
    html = response.content.decode()
    assert "acme" not in html and "Idle cost" not in html


def test_page_shows_the_rollup_of_the_fleets_replicas(signed_in, fleet):  # type: ignore[no-untyped-def]
    now = timezone.now()
    marker = services.rollup_hour(now, now)
    ctx = signed_in(Role.VIEWER).get("/costs/?period=24h").context
    assert marker.usd > 0
    assert ctx["total"]["usd"] == marker.usd


def test_costs_page_queries_do_not_grow_with_tenants_or_rollups(signed_in, spend, tenants):  # type: ignore[no-untyped-def]
    client = signed_in(Role.VIEWER)

    def count() -> int:
        with CaptureQueriesContext(connection) as queries:
            assert client.get("/costs/").status_code == 200
        return len(queries)

    small = count()
    hour = spend
    for i in range(60):
        tenant = Tenant.objects.create(name=f"t{i:03d}", monthly_budget_usd=Decimal(100))
        for h in range(3):
            _rollup(hour - timedelta(hours=h), f"m{i % 7}", f"c:r{i % 11}", tenant.name, 10, "1")
    assert count() == small


def test_window() -> None:
    now = datetime(2026, 11, 20, 12, 34, tzinfo=UTC)
    assert window("24h", now) == (datetime(2026, 11, 19, 12, tzinfo=UTC), now, "hour")
    assert window("month", now) == (datetime(2026, 11, 1, tzinfo=UTC), now, "day")


def _status(spent: float, budget: float | None, projected: float) -> Any:
    start, end = budgets.month_bounds(datetime(2026, 11, 20, tzinfo=UTC))
    return budgets.BudgetStatus("acme", spent, budget, None, projected, None, start, end)


def test_budget_bar_scale() -> None:
    assert _bar_scale(_status(50, 100, 80)) == {"spent": 50.0, "projected": 80.0, "budget": 100.0}
    # Projected past the budget: the bar's end is the projection.
    assert _bar_scale(_status(50, 100, 200)) == {"spent": 25.0, "projected": 100.0,
                                                 "budget": 50.0}
    assert _bar_scale(_status(0, None, 0)) == {"spent": 0.0, "projected": 0.0, "budget": 0.0}


def test_spend_bars_put_the_largest_on_top_and_idle_in_grey() -> None:
    groups = [{"key": "acme", "usd": Decimal("8"), "tokens": 2_500_000, "usd_per_mtok": 3.2},
              {"key": "", "usd": Decimal("1.5"), "tokens": 0, "usd_per_mtok": None},
              {"key": "globex", "usd": Decimal("3"), "tokens": 1_000_000, "usd_per_mtok": 3.0}]
    figure = charts.spend_bars_figure(groups, "tenant")
    [bars] = figure["data"]
    assert bars["y"] == ["idle (no tokens)", "globex", "acme"]  # drawn bottom-up
    assert bars["x"] == [1.5, 3.0, 8.0]
    assert bars["marker"]["color"][0] == charts.IDLE_COLOUR
    assert bars["customdata"][2] == ["2,500,000", "$3.200/Mtok"]
    assert bars["customdata"][0][1] == "no tokens"


def test_spend_over_time_stacks_models_most_expensive_first() -> None:
    h = datetime(2026, 11, 20, 10, tzinfo=UTC)
    rows = [{"time": h, "model": "small", "usd": Decimal("1")},
            {"time": h, "model": "big", "usd": Decimal("5")},
            {"time": h + timedelta(hours=1), "model": "big", "usd": Decimal("4")}]
    figure = charts.spend_over_time_figure(rows, h, h + timedelta(hours=2))
    assert [t["name"] for t in figure["data"]] == ["big", "small"]
    assert figure["data"][0]["x"] == ["2026-11-20 10:00:00", "2026-11-20 11:00:00"]
    assert figure["data"][0]["y"] == [5.0, 4.0]
    assert figure["layout"]["barmode"] == "stack"
    daily = charts.spend_over_time_figure(rows, h, h + timedelta(days=2), bucket="day")
    assert daily["data"][0]["width"] == charts.HOUR_MS * 24 * 0.9


def test_a_tenant_without_a_budget_gets_no_budget_bar(signed_in, spend):  # type: ignore[no-untyped-def]
    html = signed_in(Role.VIEWER).get("/costs/").content.decode()
    rows = {row.split("</a>")[0].rsplit("<b>", 1)[-1]: row
            for row in html.split('<tr>') if "frontend" not in row and "<b>" in row}
    # acme has a budget; globex spends without one.
    assert 'class="budget-bar"' in rows["acme</b>"]
    assert 'class="budget-bar"' not in rows["globex</b>"]
    assert "no budget" in rows["globex</b>"]


def test_money_is_shown_to_the_cent_and_rates_to_four_figures() -> None:
    from frontend.templatetags.meridian import usd, usd_per_mtok

    assert usd(Decimal("1982.995")) == "$1,983.00"
    assert usd(-12.294) == "−$12.29" and usd(None) == "—"
    assert usd_per_mtok(984.736040609137) == "$984.7"
    assert usd_per_mtok(3.5) == "$3.500" and usd_per_mtok(0.21345) == "$0.2135"
    assert usd_per_mtok(12345.6) == "$12,350"
