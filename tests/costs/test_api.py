"""The costs API: grouping, bad parameters named, tenant isolation, budgets, the schema."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from controlplane.costs.models import CostRollup

pytestmark = pytest.mark.django_db
URL = "/api/v1/costs/"


@pytest.fixture
def rollups(tenants):  # type: ignore[no-untyped-def]
    hour = timezone.now().replace(minute=0, second=0, microsecond=0)
    rows = [
        ("llama", "aws:eu-central-1", "acme", 600_000, 150_000, "7.5"),
        ("llama", "aws:eu-central-1", "globex", 0, 250_000, "2.5"),
        ("llama", "aws:us-east-1", "", 0, 0, "2.765"),
        ("qwen", "aws:us-east-1", "acme", 1_000_000, 0, "4"),
    ]
    for model, region, tenant, prompt, completion, usd in rows:
        CostRollup.objects.create(hour=hour, model=model, region=region, tenant=tenant,
                                  prompt_tokens=prompt, completion_tokens=completion,
                                  usd=Decimal(usd), computed_at=hour)
    # Long ago: outside the default window (this month).
    CostRollup.objects.create(hour=hour - timedelta(days=40), model="llama", region="x",
                              tenant="acme", usd=Decimal(100), computed_at=hour)
    return hour


def test_spend_by_model_with_dollars_per_million_tokens(make_client, rollups) -> None:  # type: ignore[no-untyped-def]
    response = make_client("viewer").get(URL, {"group_by": "model"})
    assert response.status_code == 200, response.content
    body = response.json()
    by_key = {r["key"]: r for r in body["results"]}
    assert set(by_key) == {"llama", "qwen"}
    assert by_key["llama"]["usd"] == "12.77"  # to the cent, half up
    assert by_key["llama"]["tokens"] == 1_000_000
    assert by_key["llama"]["usd_per_mtok"] == 12.77  # four significant figures
    assert by_key["qwen"]["usd_per_mtok"] == pytest.approx(4.0)
    assert body["total"]["usd"] == "16.77"
    assert body["total"]["idle_usd"] == "2.77"
    assert body["results"][0]["key"] == "llama"  # most expensive first


def test_spend_by_tenant_and_region_and_hour(make_client, rollups) -> None:  # type: ignore[no-untyped-def]
    client = make_client("viewer")
    tenants = {r["key"]: Decimal(r["usd"]) for r in
               client.get(URL, {"group_by": "tenant"}).json()["results"]}
    # Idle spend has a name, never the empty key.
    assert tenants == {"acme": Decimal("11.5"), "globex": Decimal("2.5"),
                       "(idle)": Decimal("2.77")}
    idle = client.get(URL, {"group_by": "model", "tenant": "(idle)"}).json()
    assert Decimal(idle["total"]["usd"]) == Decimal("2.77")
    regions = {r["key"]: Decimal(r["usd"]) for r in
               client.get(URL, {"group_by": "region", "model": "llama"}).json()["results"]}
    assert regions == {"aws:eu-central-1": Decimal("10"), "aws:us-east-1": Decimal("2.77")}
    hours = client.get(URL, {"group_by": "hour"}).json()["results"]
    assert [datetime.fromisoformat(h["key"]) for h in hours] == [rollups]
    since = (rollups - timedelta(days=41)).isoformat()
    everything = client.get(URL, {"group_by": "day", "since": since}).json()
    assert everything["total"]["usd"] == "116.77"
    assert len(everything["results"]) == 2


@pytest.mark.parametrize(("params", "field"), [
    ({"group_by": "colour"}, "group_by"),
    ({"since": "yesterday"}, "since"),
    ({"until": "2026-13-45"}, "until"),
    ({"since": "2026-11-02T00:00:00Z", "until": "2026-11-01T00:00:00Z"}, "until"),
])
def test_bad_parameters_answer_400_naming_the_parameter(make_client, params, field) -> None:  # type: ignore[no-untyped-def]
    response = make_client("viewer").get(URL, params)
    assert response.status_code == 400
    assert field in response.json()


def test_rollup_rows_bad_filter_is_named(make_client) -> None:  # type: ignore[no-untyped-def]
    response = make_client("viewer").get("/api/v1/cost-rollups/", {"since": "soon"})
    assert response.status_code == 400
    assert "since" in response.json()


def test_tenant_users_see_only_their_tenant(make_client, tenants, rollups) -> None:  # type: ignore[no-untyped-def]
    client = make_client("viewer", tenants["globex"])
    body = client.get(URL, {"group_by": "tenant"}).json()
    assert [r["key"] for r in body["results"]] == ["globex"]
    assert Decimal(body["total"]["usd"]) == Decimal("2.5")
    assert Decimal(body["total"]["idle_usd"]) == 0
    # Asking for another tenant's rows finds nothing rather than widening the scope.
    assert client.get(URL, {"tenant": "acme"}).json()["results"] == []
    rows = client.get("/api/v1/cost-rollups/").json()["results"]
    assert {r["tenant"] for r in rows} == {"globex"}
    platform = make_client("viewer").get("/api/v1/cost-rollups/", {"tenant": "acme"}).json()
    assert platform["count"] == 3


def test_budgets(make_client, tenants, rollups) -> None:  # type: ignore[no-untyped-def]
    acme = tenants["acme"]
    acme.monthly_budget_usd = Decimal("23")
    acme.save()
    platform = make_client("viewer")
    budgets = {b["tenant"]: b for b in platform.get("/api/v1/budgets/").json()}
    assert set(budgets) == {"acme", "globex"}
    assert budgets["acme"]["spent_usd"] == pytest.approx(11.5)
    assert budgets["acme"]["budget_usd"] == 23.0
    assert budgets["acme"]["fraction"] == pytest.approx(0.5)
    assert budgets["globex"]["budget_usd"] is None and budgets["globex"]["fraction"] is None
    one = platform.get("/api/v1/budgets/acme/").json()
    assert one["spent_usd"] == pytest.approx(11.5) and one["over_budget"] is False

    mine = make_client("viewer", tenants["globex"], username="g-viewer")
    assert [b["tenant"] for b in mine.get("/api/v1/budgets/").json()] == ["globex"]
    assert mine.get("/api/v1/budgets/acme/").status_code == 404
    assert mine.get("/api/v1/budgets/globex/").status_code == 200


def test_costs_need_credentials_and_are_read_only(make_client) -> None:  # type: ignore[no-untyped-def]
    assert make_client(None).get(URL).status_code == 401
    admin = make_client("admin")
    assert admin.post(URL, {}).status_code == 405
    assert admin.post("/api/v1/cost-rollups/", {}).status_code == 405


def test_schema_documents_the_costs_endpoints(make_client) -> None:  # type: ignore[no-untyped-def]
    schema = make_client("viewer").get("/api/schema/", {"format": "json"}).json()
    costs = schema["paths"]["/api/v1/costs/"]["get"]
    assert {p["name"] for p in costs["parameters"]} >= {"group_by", "since", "until", "tenant"}
    assert "/api/v1/budgets/{name}/" in schema["paths"]
    assert "/api/v1/cost-rollups/" in schema["paths"]


def test_default_window_is_this_month(make_client, tenants) -> None:  # type: ignore[no-untyped-def]
    body = make_client("viewer").get(URL).json()
    since = datetime.fromisoformat(body["since"].replace("Z", "+00:00"))
    assert since.day == 1 and since.hour == 0 and since.tzinfo is not None
    assert since.astimezone(UTC).month == timezone.now().month


def test_budget_fractions_are_rounded_as_every_ratio_is(make_client, tenants, rollups) -> None:  # type: ignore[no-untyped-def]
    """spent ÷ budget to three decimals, as a batch's ratio_vs_interactive (core.money)."""
    acme = tenants["acme"]
    acme.monthly_budget_usd = Decimal("34.5")  # 11.5 spent: a third
    acme.save()
    one = make_client("viewer").get("/api/v1/budgets/acme/").json()
    assert one["fraction"] == 0.333
    assert one["projected_fraction"] is None or one["projected_fraction"] == round(
        one["projected_fraction"], 3)
