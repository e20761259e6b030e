"""The failover page: region health and incident timelines; drills reviewed before they run."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.core.models import Role
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.failover.models import Health, Incident, IncidentKind, RegionHealth
from regions.models import Cloud, Region

pytestmark = pytest.mark.django_db


@pytest.fixture
def local_region(catalog):  # type: ignore[no-untyped-def]
    cloud = Cloud.objects.create(name="local", display_name="Local lab")
    return Region.objects.create(cloud=cloud, code="eu-frankfurt", display_name="Lab Frankfurt",
                                 latitude=50.1, longitude=8.7, country="DE",
                                 jurisdiction=catalog["eu"])


def test_health_and_timelines_are_shown_worst_first(signed_in, fleet, catalog):  # type: ignore[no-untyped-def]
    now = timezone.now()
    RegionHealth.objects.create(region=catalog["iad"], state=Health.HEALTHY, serving=2,
                                changed_at=now, checked_at=now, reason="2 replicas serve")
    RegionHealth.objects.create(region=catalog["fra"], state=Health.DOWN, failing=2,
                                changed_at=now, checked_at=now, reason="2 replicas failed")
    Incident.objects.create(
        kind=IncidentKind.DRILL, region=catalog["fra"], summary="Drill: kill 2 replicas",
        started_by="ops", started_at=now, detected_at=now + timedelta(seconds=0.4),
        tables_pushed_at=now + timedelta(seconds=0.9),
        replacement_ready_at=now + timedelta(seconds=4.5))
    response = signed_in(Role.VIEWER).get("/failover/")
    assert response.status_code == 200
    assert [h.state for h in response.context["health"]] == ["down", "healthy"]
    html = response.content.decode()
    assert "+0.40 s" in html and "+0.90 s" in html and "+4.50 s" in html
    figure = response.context["figure"]
    detected = next(t for t in figure["data"] if t.get("name") == "detected")
    assert detected["x"] == [0.4]


def test_an_operator_reviews_what_a_drill_kills_before_it_runs(signed_in, fleet, local_region):  # type: ignore[no-untyped-def]
    replica = Replica.objects.create(deployment=fleet.acme, region=local_region, provider="local",
                                     state=S.READY)
    client = signed_in(Role.OPERATOR)
    page = client.get("/failover/").content.decode()
    assert "local:eu-frankfurt (1 replica)" in page
    review = client.post("/failover/drill/", {"region": "local:eu-frankfurt"})
    assert review.status_code == 200 and replica.public_id in review.content.decode()
    assert b"Confirm: kill 1 replica" in review.content
    assert Incident.objects.count() == 0  # nothing happened yet


@pytest.mark.parametrize(("region", "message"), [
    ("aws:eu-central-1", "drills kill local lab replicas only"),
    ("local:eu-frankfurt", "no local replica runs in local:eu-frankfurt"),
    ("bogus", "use cloud:code, e.g. local:ap-tokyo"),
])
def test_drills_that_cannot_run_say_why(signed_in, fleet, local_region, region, message):  # type: ignore[no-untyped-def]
    response = signed_in(Role.OPERATOR).post("/failover/drill/", {"region": region, "confirm": "yes"},
                                             follow=True)
    assert message in response.content.decode()
    assert Incident.objects.count() == 0


def test_tenant_operators_may_not_drill(signed_in, fleet, local_region, tenants):  # type: ignore[no-untyped-def]
    client = signed_in(Role.OPERATOR, tenants["acme"])
    assert b"Start a drill" not in client.get("/failover/").content
    response = client.post("/failover/drill/", {"region": "local:eu-frankfurt", "confirm": "yes"})
    assert response.status_code == 403 and Incident.objects.count() == 0


def test_the_live_part_refreshes_quickly_while_an_incident_is_open_and_says_why_stages_are_missing(  # type: ignore[no-untyped-def]
        signed_in, fleet, catalog):
    now = timezone.now()
    incident = Incident.objects.create(
        kind=IncidentKind.DRILL, region=catalog["fra"], summary="Drill: kill 2 replicas",
        started_by="ops", started_at=now, detected_at=now, tables_pushed_at=now,
        replacements=["r-7"], replacement_ready_at=now + timedelta(seconds=3))
    client = signed_in(Role.VIEWER)
    page = client.get("/failover/").content.decode()
    assert 'hx-get="/failover/live/"' in page and 'hx-trigger="every 2s"' in page
    assert "Traffic back</dt>" in page  # the stages are defined on the page
    live = client.get("/failover/live/").content.decode()
    assert live.startswith("\n<div id=\"failover-live\"") or 'id="failover-live"' in live
    assert "no request yet; resolves without one in" in live
    # Resolved without traffic: the dash says why, and the page settles to a slow refresh.
    Incident.objects.filter(pk=incident.pk).update(resolved_at=now + timedelta(seconds=63))
    live = client.get("/failover/live/").content.decode()
    assert "other replicas" in live and "+63.00 s" in live
    assert 'hx-trigger="every 15s"' in live
