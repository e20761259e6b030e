"""Drills from the API and the command line: refused where they must be, and a real one
against local engine processes that the watch loop then fails and replaces."""

from __future__ import annotations

from io import StringIO

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from controlplane.core.models import AuditLog, Role
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.failover import services
from controlplane.failover.models import Incident, IncidentKind
from controlplane.lab.waiting import wait_until
from controlplane.provisioning import services as provisioning
from regions.models import Cloud, Offer, Quota, Region
from tests.provisioning.test_local import spec, wait_running

pytestmark = pytest.mark.django_db


@pytest.fixture
def lab(catalog, settings):  # type: ignore[no-untyped-def]
    """Local regions standing for Frankfurt and Amsterdam, with offers and quota; the
    solver may place only there (as in the lab)."""
    cloud = Cloud.objects.create(name="local", display_name="Local lab")
    now = timezone.now()
    made = {}
    for code, real in (("eu-frankfurt", catalog["fra"]), ("eu-amsterdam", catalog["ams"])):
        region = Region.objects.create(
            cloud=cloud, code=code, display_name=f"Lab {real.display_name}",
            latitude=real.latitude, longitude=real.longitude, country=real.country,
            jurisdiction=catalog["eu"])
        Offer.objects.create(region=region, gpu_type=catalog["h100"], gpus_per_node=1,
                             instance_type="enginesim", on_demand_usd_h=4, observed_at=now)
        Quota.objects.create(region=region, gpu_type=catalog["h100"], limit_gpus=8,
                             observed_at=now)
        made[code] = region
    settings.MERIDIAN = {**settings.MERIDIAN, "PLACEMENT_CLOUDS": ["local"]}
    return made


def test_a_drill_needs_a_platform_operator(make_client, lab, tenants):  # type: ignore[no-untyped-def]
    body = {"region": "local:eu-frankfurt"}
    assert make_client(Role.VIEWER).post("/api/v1/incidents/drill/", body).status_code == 403
    tenant_op = make_client(Role.OPERATOR, tenants["acme"])
    assert tenant_op.post("/api/v1/incidents/drill/", body).status_code == 403
    assert Incident.objects.count() == 0


@pytest.mark.parametrize(("region", "message"), [
    ("nowhere", "Expected a region as 'cloud:code'"),
    ("local:mars-1", "does not exist"),
    ("aws:eu-central-1", "drills kill local lab replicas only"),
    ("local:eu-frankfurt", "no local replica runs in local:eu-frankfurt"),
])
def test_bad_drills_are_refused_naming_the_region(make_client, lab, region, message):  # type: ignore[no-untyped-def]
    response = make_client(Role.OPERATOR).post("/api/v1/incidents/drill/", {"region": region},
                                               format="json")
    assert response.status_code == 400 and message in response.json()["region"][0]
    assert Incident.objects.count() == 0 and not AuditLog.objects.filter(
        action="failover.drill").exists()


def test_the_command_names_the_field_it_refuses(lab):  # type: ignore[no-untyped-def]
    with pytest.raises(CommandError, match="region: drills kill local lab replicas only"):
        call_command("failover_drill", "aws:eu-central-1", "--no-wait")


@pytest.mark.usefixtures("enginesim")
def test_a_drill_kills_the_region_and_the_watch_loop_takes_it_from_there(  # type: ignore[no-untyped-def]
        make_client, lab, catalog, local_provider, sent_tasks):
    from controlplane.deployments.models import Deployment

    provisioning.set_provider("local", local_provider)
    try:
        deployment = Deployment.objects.create(
            name="demo", served_model_name="llama-3.1-8b", model=catalog["llama8b"],
            min_replicas=2, max_replicas=4, max_model_len=4096)
        deployment.allowed_jurisdictions.set([catalog["eu"]])
        frankfurt = lab["eu-frankfurt"]
        victims = []
        for _ in range(2):
            replica = Replica.objects.create(deployment=deployment, region=frankfurt,
                                             offer=frankfurt.offers.get(), provider="local")
            handle = local_provider.launch(spec(replica.public_id, "eu-frankfurt"))
            wait_running(local_provider, handle)
            Replica.objects.filter(pk=replica.pk).update(
                state=S.READY, url=local_provider.endpoint(handle),
                provider_handle=provisioning.handle_json(handle), ready_at="2026-11-01T00:00:00Z")
            victims.append(replica)

        out = StringIO()
        call_command("failover_drill", "local:eu-frankfurt", "--no-wait", "--actor", "ops",
                     stdout=out)
        incident = Incident.objects.get()
        assert out.getvalue().startswith(f"drill #{incident.pk}: Drill: kill 2 replicas")
        assert incident.kind == IncidentKind.DRILL and incident.started_by == "ops"
        # A second drill while this one runs is refused.
        again = make_client(Role.OPERATOR).post("/api/v1/incidents/drill/",
                                                {"region": "local:eu-frankfurt"}, format="json")
        assert again.status_code == 400 and "still running" in again.json()["region"][0]

        def failures_seen() -> services.WatchReport | None:
            report = services.watch()
            return report if report.failed else None

        report = wait_until(failures_seen, 60, "failures seen")
        assert sorted(report.failed) == sorted(r.public_id for r in victims)
        incident.refresh_from_db()
        assert incident.kind == IncidentKind.DRILL and incident.detected_at is not None
        assert 0 <= (incident.detected_at - incident.started_at).total_seconds() < 30
        # Frankfurt is down: both replacements go to the other EU lab region.
        new = Replica.objects.filter(state=S.PENDING)
        assert {r.region.code for r in new} == {"eu-amsterdam"} and len(new) == 2
        assert sorted(incident.replacements) == sorted(r.public_id for r in new)
        detail = make_client(Role.VIEWER).get(f"/api/v1/incidents/{incident.pk}/").json()
        assert detail["timeline"]["detected_s"] is not None and detail["open"] is True
        assert detail["region"] == "local:eu-frankfurt"
    finally:
        provisioning.set_provider("local", None)
