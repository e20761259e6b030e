"""No query parameter silently ignored. Every list of /api/v1/ (the GET operations without a
path parameter in the OpenAPI schema, so a new one is walked without naming it here) answers
400 naming an unknown ordering, an unknown parameter and a bad value of each filter it
declares; `?ordering=-id` orders by id descending; and pages never shuffle."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from controlplane.core.models import Role
from tests.security.world import build_world
from tests.tenant_rows import NOW

pytestmark = pytest.mark.django_db

# Parameters every list takes whatever its rows: paging, the renderer, ordering.
COMMON = {"page", "page_size", "format", "ordering"}
# A list that holds one row at most, so no order can be seen in it.
SINGLETONS = {"/api/v1/routing-policy/"}


@pytest.fixture
def world(catalog, tenants):  # type: ignore[no-untyped-def]
    """The security tests' fleet (three rows of every tenant's model), with a second row of
    each platform model it makes one of."""
    from controlplane.deployments.models import Model
    from controlplane.failover.models import Incident, RegionHealth
    from controlplane.placement.models import Plan
    from controlplane.routing.models import Edge

    fx = {**catalog, **tenants}
    built = build_world(fx)
    Plan.objects.create(proposed_by="system", explanation="a second plan")
    Model.objects.create(name="qwen-2.5-7b", hf_id="Qwen/Qwen2.5-7B-Instruct", family="qwen",
                         parameters_b=7.6, layers=28, hidden_size=3584, attention_heads=28,
                         kv_heads=4, head_dim=128, max_context=32768)
    Incident.objects.create(kind="drill", region=fx["iad"], summary="second", started_at=NOW)
    Edge.objects.create(name="edge-us", region=fx["iad"], admin_url="http://127.0.0.1:8111",
                        public_url="https://us.example.org")
    for region in (fx["fra"], fx["iad"]):
        RegionHealth.objects.get_or_create(region=region, defaults={
            "state": "healthy", "changed_at": NOW, "checked_at": NOW})
    return built


@pytest.fixture
def admin(make_client):  # type: ignore[no-untyped-def]
    return make_client(Role.ADMIN)


def list_endpoints(client: Any) -> list[tuple[str, dict[str, Any]]]:
    schema = client.get("/api/schema/", {"format": "json"}).json()
    found = [(path, item["get"]) for path, item in schema["paths"].items()
             if path.startswith("/api/v1/") and "{" not in path and "get" in item]
    assert len(found) >= 25, [path for path, _ in found]
    return found


def query_params(operation: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {p["name"]: p for p in operation.get("parameters", []) if p["in"] == "query"}


def bad_value(schema: dict[str, Any]) -> str | None:
    """A value the parameter's schema does not allow, or None where any string is a value."""
    if "enum" in schema or "enum" in schema.get("items", {}):
        return "no-such-choice"
    kind = schema.get("type")
    if kind in ("integer", "number"):
        return "abc"
    if kind == "boolean":
        return "maybe"
    if schema.get("format") in ("date-time", "date"):
        return "soon"
    return None


def rows(response: Any) -> list[Any]:
    assert response.status_code == 200, response.content
    body = response.json()
    return body["results"] if isinstance(body, dict) and "results" in body else body


def test_every_list_refuses_a_bad_ordering_and_bad_filters(world, admin):  # type: ignore[no-untyped-def]
    for path, operation in list_endpoints(admin):
        wrong = admin.get(path, {"ordering": "bogus,-id"})
        assert wrong.status_code == 400, (path, wrong.status_code, wrong.content)
        # Named as the unknown field, or (where the list takes no ordering) as a parameter.
        said = str(wrong.json()["ordering"])
        assert ("bogus" in said if "ordering" in query_params(operation)
                else "unknown query parameter" in said), (path, said)

        unknown = admin.get(path, {"no_such_filter": "1"})
        assert unknown.status_code == 400, (path, unknown.status_code, unknown.content)
        assert "no_such_filter" in unknown.json(), (path, unknown.json())

        for name, parameter in query_params(operation).items():
            value = bad_value(parameter.get("schema", {}))
            if name in COMMON or value is None:
                continue
            response = admin.get(path, {name: value})
            assert response.status_code == 400, (path, name, value, response.content)
            assert name in response.json(), (path, name, response.json())


def test_ordering_by_id_descending_really_descends(world, admin):  # type: ignore[no-untyped-def]
    ordered = [(path, operation) for path, operation in list_endpoints(admin)
               if "ordering" in query_params(operation)]
    assert len(ordered) >= 20
    for path, operation in ordered:
        paging = {"page_size": 500} if "page_size" in query_params(operation) else {}
        up = rows(admin.get(path, {"ordering": "id", **paging}))
        down = rows(admin.get(path, {"ordering": "-id", **paging}))
        if path in SINGLETONS:
            assert len(up) == 1, path
            continue
        assert len(up) >= 2, (path, "needs rows to show an order")
        assert [_key(r) for r in down] == [_key(r) for r in reversed(up)], path
        if "id" in up[0]:
            ids = [r["id"] for r in down]
            assert ids == sorted(ids, reverse=True), (path, ids)


def test_a_descending_field_then_an_ascending_one(world, admin):  # type: ignore[no-untyped-def]
    names = [r["name"] for r in rows(admin.get("/api/v1/clouds/", {"ordering": "-name"}))]
    assert names == sorted(names, reverse=True) and len(names) >= 2
    keyed = rows(admin.get("/api/v1/replicas/", {"ordering": "state,-id", "page_size": 500}))
    assert keyed == sorted(keyed, key=lambda r: (r["state"], -r["id"]))


def test_default_order_is_stable_across_pages(world, admin):  # type: ignore[no-untyped-def]
    for path, operation in list_endpoints(admin):
        if "page_size" not in query_params(operation):
            continue
        whole = [_key(r) for r in rows(admin.get(path, {"page_size": 500}))]
        paged: list[Any] = []
        for page in range(1, len(whole) // 2 + 2):
            response = admin.get(path, {"page_size": 2, "page": page})
            if response.status_code == 404:
                break
            paged += [_key(r) for r in rows(response)]
        assert paged == whole, path


def test_a_name_or_id_filter_takes_both_and_a_repeated_one_is_refused(world, admin):  # type: ignore[no-untyped-def]
    from controlplane.deployments.models import Deployment

    target = Deployment.objects.filter(replicas__isnull=False).distinct()[0]
    by_name = rows(admin.get("/api/v1/replicas/", {"deployment": target.name}))
    assert by_name and by_name == rows(admin.get("/api/v1/replicas/", {"deployment": target.pk}))
    assert rows(admin.get("/api/v1/replicas/", {"deployment": "no-such-deployment"})) == []
    twice = admin.get("/api/v1/replicas/?state=ready&state=failed")
    assert twice.status_code == 400 and "state" in twice.json()


def test_a_tenant_user_gets_the_same_400s(world, make_client, tenants):  # type: ignore[no-untyped-def]
    acme = make_client(Role.VIEWER, tenants["acme"])
    response = acme.get("/api/v1/deployments/", {"ordering": "tenant__name"})
    assert response.status_code == 400 and "tenant__name" in str(response.json()["ordering"])
    assert acme.get("/api/v1/deployments/", {"tenant": "globex"}).json()["results"] == []


def test_costs_and_since_filters_refuse_what_they_would_ignore(world, admin):  # type: ignore[no-untyped-def]
    assert admin.get("/api/v1/costs/", {"group_by": "model", "grup_by": "x"}).status_code == 400
    since = (NOW - timedelta(days=1)).isoformat()
    assert admin.get("/api/v1/scaling-decisions/", {"since": since}).status_code == 200


def _key(row: Any) -> Any:
    if isinstance(row, dict):
        return row.get("id", row.get("tenant", repr(sorted(row.items()))))
    return row

