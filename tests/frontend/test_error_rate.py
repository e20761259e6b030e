"""The overview's error rate: 5xx answers over requests, from the edges' own counters."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.core.models import Role
from controlplane.routing.models import Edge
from controlplane.telemetry.models import EdgeSample
from frontend.traffic import edge_errors

OLD = {1: {"chat|r|acme|200": 100.0, "chat|r|acme|503": 1.0, "chat|r|globex|200": 50.0}}
NEW = {1: {"chat|r|acme|200": 190.0, "chat|r|acme|503": 11.0, "chat|r|globex|200": 150.0,
           "chat|r|globex|502": 2.0},
       2: {"chat|r|acme|200": 10.0}}  # no older sample: not compared


def test_errors_count_only_5xx_between_the_two_samples_of_each_edge() -> None:
    everyone = edge_errors(NEW, OLD, None)
    assert everyone is not None and (everyone.requests, everyone.errors) == (202.0, 12.0)
    acme = edge_errors(NEW, OLD, "acme")
    assert acme is not None and (acme.requests, acme.errors) == (100.0, 10.0) and acme.rate == 0.1
    assert edge_errors(NEW, {}, None) is None


@pytest.mark.django_db
def test_the_overview_shows_the_rate_to_platform_staff_and_each_tenant_its_own(  # type: ignore[no-untyped-def]
        signed_in, catalog, tenants):
    edge = Edge.objects.create(name="e", region=catalog["fra"], admin_url="http://127.0.0.1:9")
    now = timezone.now()
    EdgeSample.objects.create(edge=edge, at=now - timedelta(seconds=90), requests=OLD[1])
    EdgeSample.objects.create(edge=edge, at=now - timedelta(seconds=1), requests=NEW[1])
    platform = signed_in(Role.VIEWER).get("/live/overview/?part=figures").content.decode()
    assert "5.94%" in platform and "12 of 202 requests" in platform
    acme = signed_in(Role.VIEWER, tenants["acme"]).get("/live/overview/?part=figures")
    assert "10.00%" in acme.content.decode()
