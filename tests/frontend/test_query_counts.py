"""Pages stay fast with large fleets: each page runs as many queries for 200 regions and
1,000 replicas as for a handful, and never more than a small fixed number."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext

from controlplane.core.models import Role
from tests.frontend.fleet import Fleet, grow_fleet, seed_fleet

pytestmark = pytest.mark.django_db

# Session, user and role lookups included; a page over this budget is doing too much.
MOST_QUERIES = 15


def _pages(fleet: Fleet) -> list[str]:
    deployment = f"/deployments/{fleet.acme.name}/"
    return [
        "/", "/live/overview/?part=figures", "/live/overview/?part=attention",
        "/inventory/", "/inventory/?tab=regions", "/inventory/?jurisdiction=EU&gpu=H100",
        "/deployments/", deployment, deployment + "replicas/", deployment + "?replicas=all",
        "/plans/", f"/plans/{fleet.plan.pk}/",
        "/routing/", "/routing/edges/", f"/routing/{fleet.edges[0].name}/diff/",
        "/events/", "/events/?action=replica.ready", "/failover/",
        "/alerts/", "/alerts/?rule=region_down&severity=critical",
        "/costs/", "/costs/?period=24h",
        "/tenants/", "/tenants/acme/",
    ]


def _counts(client: Any, urls: list[str]) -> dict[str, int]:
    counts = {}
    for url in urls:
        with CaptureQueriesContext(connection) as queries:
            response = client.get(url)
        assert response.status_code == 200, url
        counts[url] = len(queries)
    return counts


@pytest.mark.parametrize("scope", ["platform", "tenant"])
def test_page_queries_do_not_grow_with_the_fleet(  # type: ignore[no-untyped-def]
    scope, client, make_user, catalog, tenants,
):
    fleet = seed_fleet(catalog, tenants, regions=5, replicas=15, edges=2)
    user = make_user(Role.ADMIN, tenants["acme"] if scope == "tenant" else None)
    client.force_login(user)
    urls = _pages(fleet)
    if scope == "tenant":  # pages for platform staff only
        for url in (f"/routing/{fleet.edges[0].name}/diff/", "/plans/", f"/plans/{fleet.plan.pk}/",
                    "/failover/"):
            urls.remove(url)
    small = _counts(client, urls)
    grow_fleet(fleet, catalog, regions=200, replicas=1000, edges=20)
    large = _counts(client, urls)
    grown = {url: (small[url], large[url]) for url in urls if large[url] != small[url]}
    assert grown == {}, "queries per page grew with the fleet (small, large)"
    heavy = {url: n for url, n in large.items() if n > MOST_QUERIES}
    assert heavy == {}, f"pages over {MOST_QUERIES} queries"
