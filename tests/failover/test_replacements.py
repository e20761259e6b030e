"""Where replacements go, deterministically: in place when the failed replica's region is
usable, elsewhere inside the jurisdictions when it is down or drilled, and why, on the
incident's timeline. And what region health says about the past."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.failover import services
from controlplane.failover.models import Health, Incident, IncidentKind, RegionHealth

from .conftest import dead_url

pytestmark = pytest.mark.django_db


def test_a_lost_replica_is_replaced_in_place_though_another_region_is_cheaper(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica, engines, sent_tasks):
    # Amsterdam's H100 costs less than Frankfurt's: the solver alone would move it there.
    ready_replica(deployment, catalog["fra"], engines().url)
    gone = ready_replica(deployment, catalog["fra"], dead_url())
    services.watch()
    (new,) = Replica.objects.filter(state=S.PENDING)
    assert new.region == catalog["fra"]
    notes = [text for _, text in Incident.objects.get().notes]
    assert f"replacement requested: {new.public_id} → aws:eu-central-1: in place" in " ".join(notes)
    assert gone.public_id in Incident.objects.get().failed_replicas


def test_a_drilled_region_gets_no_replacement_even_for_a_single_replica(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica, engines, sent_tasks):
    deployment.min_replicas = 1
    deployment.save()
    victim = ready_replica(deployment, catalog["fra"], dead_url())
    drill = Incident.objects.create(kind=IncidentKind.DRILL, region=catalog["fra"],
                                    summary="Drill: kill 1 replica", started_at=timezone.now())
    report = services.watch()
    assert report.failed == [victim.public_id]
    (new,) = Replica.objects.filter(state=S.PENDING)
    assert new.region == catalog["ams"]
    health = RegionHealth.objects.get(region=catalog["fra"])
    assert health.state == Health.DOWN and health.reason.startswith("drill: 1 replica killed")
    drill.refresh_from_db()
    text = " ".join(t for _, t in drill.notes)
    assert f"detected {victim.public_id} failed" in text  # named once
    assert f"{new.public_id} → gcp:europe-west4: elsewhere" in text
    assert "aws:eu-central-1 down: drill" in text and "moves it back" in text


def test_a_down_region_recovers_once_its_incident_is_answered_and_the_hold_has_passed(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica, sent_tasks):
    for _ in range(2):
        ready_replica(deployment, catalog["fra"], dead_url())
    services.watch()
    assert RegionHealth.objects.get(region=catalog["fra"]).state == Health.DOWN
    Incident.objects.update(resolved_at=timezone.now())  # replacements serve elsewhere
    services.update_region_health()
    assert RegionHealth.objects.get(region=catalog["fra"]).state == Health.DOWN
    later = timezone.now() + services.DOWN_HOLD + timedelta(seconds=1)
    services.update_region_health(later)
    health = RegionHealth.objects.get(region=catalog["fra"])
    assert health.state == Health.IDLE and health.reason.startswith("recovered from 2 failures")


def test_failures_older_than_the_regions_newest_replica_do_not_make_it_down(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica):
    # A restarted lab: the last run's replicas were failed and are terminated at start (their
    # state_changed_at is now), and new ones are starting in the same region.
    for _ in range(2):
        old = ready_replica(deployment, catalog["fra"], dead_url())
        Replica.objects.filter(pk=old.pk).update(state=S.TERMINATED, last_error="process gone",
                                                 state_changed_at=timezone.now())
    Replica.objects.create(deployment=deployment, region=catalog["fra"], state=S.STARTING,
                           offer=old.offer, created_at=timezone.now() + timedelta(seconds=1))
    services.update_region_health()
    health = RegionHealth.objects.get(region=catalog["fra"])
    assert health.state == Health.IDLE and "1 replica starting" in health.reason


def test_a_region_whose_only_replica_drains_is_not_healthy(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica, engines):
    leaving = ready_replica(deployment, catalog["fra"], engines().url)
    Replica.objects.filter(pk=leaving.pk).update(state=S.DRAINING)
    services.update_region_health()
    health = RegionHealth.objects.get(region=catalog["fra"])
    assert (health.state, health.serving) == (Health.IDLE, 0)
    assert health.reason == "nothing serves: 1 replica draining"
