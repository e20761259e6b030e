"""Platform data tenant users never see: plans and incidents (platform-only), edges' admin
addresses and errors, replicas' engine addresses, operations' tracebacks; in the API and on
the dashboard alike. Platform staff see all of it."""

from __future__ import annotations

import pytest

from controlplane.core.models import Role
from controlplane.core.services import ensure_user
from tests.security.world import build_world

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(catalog, tenants):  # type: ignore[no-untyped-def]
    return build_world({**catalog, **tenants})


@pytest.mark.parametrize("prefix", ["plans", "incidents"])
@pytest.mark.parametrize("role", [Role.VIEWER, Role.OPERATOR, Role.ADMIN])
def test_plans_and_incidents_are_platform_only(world, make_client, prefix, role):  # type: ignore[no-untyped-def]
    response = make_client(role, world["acme"]).get(f"/api/v1/{prefix}/")
    assert response.status_code == 403
    assert "Only platform staff" in response.json()["detail"]
    listing = make_client(Role.VIEWER).get(f"/api/v1/{prefix}/")
    assert listing.status_code == 200 and listing.json()["count"] >= 1


def test_edges_hide_admin_address_and_error_from_tenant_users(world, make_client):  # type: ignore[no-untyped-def]
    [edge] = make_client(Role.ADMIN, world["acme"]).get("/api/v1/edges/").json()["results"]
    assert (edge["admin_url"], edge["last_error"]) == ("", "")
    assert edge["public_url"] == "https://edge.example.org"
    [seen] = make_client(Role.VIEWER).get("/api/v1/edges/").json()["results"]
    assert seen["admin_url"] == "http://10.66.0.1:8110"
    assert seen["last_error"] == "push to 10.66.0.1 failed"


def test_replica_addresses_are_hidden_from_tenant_users(world, make_client):  # type: ignore[no-untyped-def]
    own = world["rows"]["deployments.Replica"][0]
    body = make_client(Role.ADMIN, world["acme"]).get(f"/api/v1/replicas/{own.pk}/").json()
    assert body["url"] == ""
    assert body["last_error"] == "connect to [address hidden] refused"
    staff = make_client(Role.VIEWER).get(f"/api/v1/replicas/{own.pk}/").json()
    assert staff["url"].startswith("http://10.77.0.")


def test_operation_logs_shown_to_tenants_are_a_summary(world, make_client):  # type: ignore[no-untyped-def]
    from controlplane.provisioning.models import Operation

    failed = Operation.objects.get(status="failed")
    tenant = make_client(Role.VIEWER, world["acme"]).get(f"/api/v1/operations/{failed.pk}/")
    assert tenant.status_code == 200
    assert tenant.json()["log"] == ("launch failed (capacity); the full log is for platform "
                                    "staff.")
    staff = make_client(Role.VIEWER).get(f"/api/v1/operations/{failed.pk}/").json()
    assert staff["log"].startswith("Traceback (most recent call last):")


def test_the_audit_log_hides_addresses_in_reasons(world, make_client):  # type: ignore[no-untyped-def]
    from controlplane.core.services import record_audit

    own = world["rows"]["deployments.Replica"][0]
    record_audit("system", "replica.failed", own, reason="probe of http://10.77.0.5:8000 failed")
    [event] = [e for e in make_client(Role.VIEWER, world["acme"]).get(
        "/api/v1/audit-log/").json()["results"] if e["action"] == "replica.failed"]
    assert event["reason"] == "probe of [address hidden] failed"


# -- the dashboard ----------------------------------------------------------------------------------

def _signed_in(client, world, tenant: str | None):  # type: ignore[no-untyped-def]
    client.force_login(ensure_user(f"web-{tenant or 'staff'}", Role.ADMIN,
                                   world[tenant] if tenant else None))
    return client


@pytest.mark.parametrize("page", ["/plans/", "/failover/", "/failover/live/"])
def test_platform_pages_are_refused_to_tenant_users(world, client, page):  # type: ignore[no-untyped-def]
    response = _signed_in(client, world, "acme").get(page)
    assert response.status_code == 403
    assert b"Only platform staff" in response.content


def test_tenant_users_nav_leaves_out_platform_pages(world, client):  # type: ignore[no-untyped-def]
    page = _signed_in(client, world, "acme").get("/deployments/").content.decode()
    assert 'href="/deployments/"' in page
    assert 'href="/plans/"' not in page and 'href="/failover/"' not in page


def test_staff_see_platform_pages(world, client):  # type: ignore[no-untyped-def]
    client = _signed_in(client, world, None)
    plans = client.get("/plans/")
    assert plans.status_code == 200 and b'href="/plans/' in plans.content
    failover = client.get("/failover/")
    assert failover.status_code == 200 and b"globex replicas killed" in failover.content


def test_routing_page_hides_edge_addresses_and_errors_from_tenants(world, client):  # type: ignore[no-untyped-def]
    tenant = _signed_in(client, world, "acme").get("/routing/").content.decode()
    assert "edge-eu" in tenant
    assert "10.66." not in tenant
    staff = _signed_in(client, world, None).get("/routing/").content.decode()
    assert "http://10.66.0.1:8110" in staff and "push to 10.66.0.1 failed" in staff


def test_replica_table_hides_endpoints_from_tenants(world, client):  # type: ignore[no-untyped-def]
    own = world["rows"]["deployments.Replica"][0]
    url = f"/deployments/{own.deployment.name}/replicas/"
    tenant = _signed_in(client, world, "acme").get(url).content.decode()
    assert own.public_id in tenant
    assert "10.77." not in tenant and "Endpoint" not in tenant
    assert "connect to [address hidden] refused" in tenant
    staff = _signed_in(client, world, None).get(url).content.decode()
    assert "http://10.77.0." in staff


def test_region_health_counts_are_platform_data(world, make_client):  # type: ignore[no-untyped-def]
    from django.utils import timezone

    from controlplane.failover.models import Health, RegionHealth

    region = world["rows"]["deployments.Replica"][0].region
    now = timezone.now()
    RegionHealth.objects.update_or_create(region=region, defaults={
        "state": Health.DEGRADED, "reason": "1 of 3 replicas failing (r-7 of globex)",
        "serving": 2, "failing": 1, "changed_at": now, "checked_at": now})
    for role in (Role.VIEWER, Role.ADMIN):
        rows = make_client(role, world["acme"]).get("/api/v1/region-health/").json()["results"]
        [row] = [r for r in rows if r["region"] == region.key]
        assert row["state"] == "degraded"  # the state is for everyone
        assert (row["reason"], row["serving"], row["failing"]) == ("", None, None)
    staff = make_client(Role.VIEWER).get("/api/v1/region-health/").json()["results"]
    [row] = [r for r in staff if r["region"] == region.key]
    assert (row["reason"], row["serving"], row["failing"]) == (
        "1 of 3 replicas failing (r-7 of globex)", 2, 1)
