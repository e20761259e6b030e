"""The watch loop against real /health endpoints and Postgres: fail, push, record, replace."""

from __future__ import annotations

from datetime import timedelta

import psycopg
import pytest
from django.db import connection
from django.utils import timezone

from controlplane.core.locks import lock_id
from controlplane.core.models import AuditLog
from controlplane.deployments.lifecycle import transition
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.failover import incidents, services, tasks
from controlplane.failover.models import Health, Incident, IncidentKind, RegionHealth
from controlplane.failover.timeline import QUIET_RESOLVE, timeline
from controlplane.telemetry.models import ReplicaSample
from regions.models import GpuType, Offer, Quota

from .conftest import dead_url, fail_one_and_ready_its_replacement

pytestmark = pytest.mark.django_db


def provisioned(sent_tasks):  # type: ignore[no-untyped-def]
    return [args[0] for name, args, _ in sent_tasks if name == "provisioning.provision_replica"]


def test_a_refused_probe_fails_the_replica_and_a_replacement_is_placed_inside_the_jurisdiction(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica, engines, sent_tasks, django_capture_on_commit_callbacks):
    alive = ready_replica(deployment, catalog["fra"], engines().url)
    gone = ready_replica(deployment, catalog["fra"], dead_url())
    with django_capture_on_commit_callbacks(execute=True):
        report = services.watch()
    assert report.probed == 2 and report.failed == [gone.public_id]
    gone.refresh_from_db()
    assert gone.state == S.TERMINATED and gone.last_error.startswith("/health failed")
    assert Replica.objects.get(pk=alive.pk).state == S.READY
    (new,) = Replica.objects.filter(state=S.PENDING)
    assert new.region.jurisdiction.code == "EU" and new.offer is not None
    assert report.replacements == [new.public_id] and provisioned(sent_tasks) == [new.pk]
    incident = Incident.objects.get()
    assert incident.kind == IncidentKind.REPLICA_FAILED and incident.region == catalog["fra"]
    assert incident.failed_replicas == [gone.public_id] and incident.replacements == [new.public_id]
    assert incident.detected_at is not None and incident.tables_pushed_at is not None  # no edges
    assert RegionHealth.objects.get(region=catalog["fra"]).state == Health.DEGRADED
    assert AuditLog.objects.filter(action="replica.failed", object_id=str(gone.pk),
                                   actor=incidents.ACTOR).exists()


def test_watching_twice_acts_once(catalog, deployment, ready_replica, engines, sent_tasks):  # type: ignore[no-untyped-def]
    ready_replica(deployment, catalog["fra"], engines().url)
    ready_replica(deployment, catalog["fra"], dead_url())
    services.watch()
    second = services.watch()
    assert second.failed == [] and second.replacements == []
    assert Incident.objects.count() == 1 and Replica.objects.filter(state=S.PENDING).count() == 1


def test_a_slow_health_check_fails_only_on_the_second_timeout(catalog, deployment, ready_replica,  # type: ignore[no-untyped-def]
                                                             engines, sent_tasks):
    engine = engines()
    engine.mode = "slow"
    replica = ready_replica(deployment, catalog["fra"], engine.url)
    assert services.watch().failed == []
    assert Replica.objects.get(pk=replica.pk).state == S.READY
    assert services.watch().failed == [replica.public_id]


def test_a_region_whose_replicas_all_time_out_together_fails_in_one_pass(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica, engines, sent_tasks):
    hung = []
    for _ in range(2):
        engine = engines()
        engine.mode = "slow"
        hung.append(ready_replica(deployment, catalog["fra"], engine.url))
    alive = ready_replica(deployment, catalog["ams"], engines().url)
    report = services.watch()
    assert sorted(report.failed) == sorted(r.public_id for r in hung)
    assert Replica.objects.get(pk=alive.pk).state == S.READY
    assert "cut off" in Replica.objects.get(pk=hung[0].pk).last_error


def test_a_region_whose_replicas_all_fail_is_down_and_replacements_avoid_it(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica, sent_tasks):
    deployment.spread_regions = 2
    deployment.save()
    lost = [ready_replica(deployment, catalog["fra"], dead_url()) for _ in range(2)]
    report = services.watch()
    assert sorted(report.failed) == sorted(r.public_id for r in lost)
    assert report.regions_down == ["aws:eu-central-1"]
    health = RegionHealth.objects.get(region=catalog["fra"])
    assert health.state == Health.DOWN and "none serves" in health.reason
    # Spread 2 cannot be met without Frankfurt: it is lowered to the one EU region left.
    new = list(Replica.objects.filter(state=S.PENDING))
    assert len(new) == 2 and {r.region for r in new} == {catalog["ams"]}
    assert Incident.objects.get().kind == IncidentKind.REGION_DOWN


def test_when_no_replacement_fits_the_failed_replica_waits_and_the_reason_is_recorded(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica, sent_tasks):
    Quota.objects.update(limit_gpus=0)  # H100 everywhere; L4 has no quota row: remove it
    Offer.objects.filter(gpu_type=catalog["l4"]).delete()
    failed = ready_replica(deployment, catalog["fra"], dead_url())
    report = services.watch()
    assert report.failed == [failed.public_id] and report.replacements == []
    assert Replica.objects.get(pk=failed.pk).state == S.FAILED  # kept: retried next round
    incident = Incident.objects.get()
    assert any("no replacement for chat" in text for _, text in incident.notes)
    assert AuditLog.objects.filter(action="failover.replacement_blocked").count() == 1
    services.watch()
    assert AuditLog.objects.filter(action="failover.replacement_blocked").count() == 1


def test_the_timeline_fills_in_until_traffic_is_back(catalog, deployment, ready_replica, engines,  # type: ignore[no-untyped-def]
                                                    sent_tasks):
    new = fail_one_and_ready_its_replacement(deployment, catalog["fra"], ready_replica, engines)
    services.watch()
    incident = Incident.objects.get()
    assert incident.replacement_ready_at == new.ready_at and incident.traffic_back_at is None
    ReplicaSample.objects.create(replica=new, at=timezone.now(), counters={"requests_ok": 3})
    services.watch()
    incident.refresh_from_db()
    assert incident.traffic_back_at is not None and incident.resolved_at is not None
    stamps = timeline(incident)
    assert 0 <= stamps["detected_s"] <= stamps["tables_pushed_s"] <= stamps["resolved_s"]


def test_a_quiet_incident_resolves_a_minute_after_its_replacements_are_ready(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica, engines, sent_tasks):
    ready_replica(deployment, catalog["fra"], engines().url)
    ready_replica(deployment, catalog["fra"], dead_url())
    services.watch()
    (new,) = Replica.objects.filter(state=S.PENDING)
    Replica.objects.filter(pk=new.pk).update(state=S.READY, ready_at=timezone.now(),
                                             url=engines().url)
    services.watch()
    assert Incident.objects.get().resolved_at is None
    later = timezone.now() + QUIET_RESOLVE + timedelta(seconds=1)
    assert incidents.progress_incidents(later) == [Incident.objects.get().pk]


def test_a_second_worker_skips_while_the_first_holds_the_lock(db):  # type: ignore[no-untyped-def]
    params = connection.get_connection_params()
    with psycopg.connect(**{k: v for k, v in params.items() if k in
                            ("dbname", "user", "host", "port", "password")}) as other:
        other.execute("SELECT pg_advisory_lock(%s)", [lock_id("failover.watch")])
        assert tasks.watch() == {"skipped": "another worker is watching"}
        other.execute("SELECT pg_advisory_unlock(%s)", [lock_id("failover.watch")])
    assert "probed" in tasks.watch()


def test_a_spot_replica_the_provider_reports_gone_takes_the_same_path(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica, engines, sent_tasks):
    ready_replica(deployment, catalog["fra"], engines().url)
    spot = ready_replica(deployment, catalog["fra"], engines().url)
    Replica.objects.filter(pk=spot.pk).update(spot=True)
    # The provider's reconcile saw the node reclaimed (SkyPilot: cluster preempted).
    transition(spot, S.FAILED, actor="system:reconcile", reason="provider reports terminated",
               last_error="spot instance reclaimed")
    report = services.watch()
    assert report.failed == [] and len(report.replacements) == 1
    incident = Incident.objects.get()
    assert incident.kind == IncidentKind.SPOT_PREEMPTED
    assert incident.failed_replicas == [spot.public_id]
    assert Replica.objects.get(pk=spot.pk).state == S.TERMINATED


def test_replacements_use_the_gpu_type_that_failed(catalog, deployment, ready_replica, sent_tasks):  # type: ignore[no-untyped-def]
    # A bigger GPU is on sale for less, but the deployment's engine was launched on H100s.
    h200 = GpuType.objects.create(name="H200", memory_gib=141, memory_bandwidth_gbps=4800,
                                  bf16_tflops=989, fp16_tflops=989, skypilot_name="H200")
    Offer.objects.create(region=catalog["fra"], gpu_type=h200, gpus_per_node=1,
                         instance_type="h200x1", on_demand_usd_h=1, observed_at=timezone.now())
    ready_replica(deployment, catalog["fra"], dead_url())
    services.watch()
    new = Replica.objects.filter(state=S.PENDING)
    assert new and set(new.values_list("offer__gpu_type__name", flat=True)) == {"H100"}


def test_a_replacement_replaces_what_was_lost_and_does_not_scale_for_demand(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica, engines, sent_tasks):
    deployment.demand_tokens_per_s = 50_000  # far beyond what two replicas make
    deployment.save()
    ready_replica(deployment, catalog["fra"], engines().url)
    ready_replica(deployment, catalog["fra"], dead_url())
    assert len(services.watch().replacements) == 1


def test_replacements_go_on_nodes_that_hold_the_deployments_engine(catalog, deployment,  # type: ignore[no-untyped-def]
                                                                   sent_tasks):
    from controlplane.provisioning.services import spec_for

    # TP 2: the catalog's cheaper single-H100 nodes cannot run the deployment's engine.
    Deployment.objects.filter(pk=deployment.pk).update(tensor_parallel=2)
    wide = Offer.objects.create(region=catalog["ams"], gpu_type=catalog["h100"], gpus_per_node=2,
                                instance_type="h100x2", on_demand_usd_h=30,
                                observed_at=timezone.now())
    Replica.objects.create(deployment=deployment, region=catalog["ams"], offer=wide,
                           url=dead_url(), state=S.READY, provider="skypilot",
                           ready_at=timezone.now())
    services.watch()
    new = list(Replica.objects.filter(state=S.PENDING).select_related(
        "deployment__model", "region__cloud", "offer__gpu_type"))
    assert len(new) == 2 and {r.offer_id for r in new} == {wide.pk}
    spec = spec_for(new[0])
    assert (spec.gpus_per_node, spec.nodes, spec.tensor_parallel) == (2, 1, 2)


def test_a_draining_replica_does_not_count_as_one_that_stays(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica, engines, sent_tasks):
    ready_replica(deployment, catalog["fra"], engines().url)
    leaving = ready_replica(deployment, catalog["fra"], engines().url)
    Replica.objects.filter(pk=leaving.pk).update(state=S.DRAINING)
    ready_replica(deployment, catalog["fra"], dead_url())
    # min 2: one serves, one drains, one failed → one replacement.
    assert len(services.watch().replacements) == 1


def test_a_quiet_second_writes_one_update_for_region_health(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica, engines, sent_tasks):
    from django.test.utils import CaptureQueriesContext

    for region in (catalog["fra"], catalog["ams"]):
        ready_replica(deployment, region, engines().url)
    services.update_region_health()
    with CaptureQueriesContext(connection) as queries:
        services.update_region_health()
    writes = [q["sql"] for q in queries.captured_queries
              if q["sql"].startswith(("UPDATE", "INSERT"))]
    assert len(writes) == 1 and "checked_at" in writes[0]
    assert RegionHealth.objects.count() == 2
