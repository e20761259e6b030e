"""GPU reports through the API: the agent end to end over HTTP, validation, roles, health
changes acting on replicas."""

from __future__ import annotations

import sys
from datetime import timedelta

import pytest
from django.conf import settings
from django.utils import timezone

from controlplane.core.models import AuditLog, Role
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.telemetry import gpu_agent
from controlplane.telemetry.models import GpuHealth, GpuNode, GpuReading
from tests.api.test_endpoints_crud import make_deployment
from tests.telemetry.fake_nvml import FakeGpu, FakeNvml

URL = "/api/v1/gpu-reports/"


def gpu(index: int = 0, **overrides):  # type: ignore[no-untyped-def]
    reading = {
        "index": index, "uuid": f"GPU-{index:04d}", "name": "NVIDIA H100 80GB HBM3",
        "memory_total_bytes": 85_520_809_984, "memory_used_bytes": 10_000_000_000,
        "utilization_gpu_pct": 50.0, "utilization_memory_pct": 20.0, "temperature_c": 45.0,
        "power_w": 300.5, "power_limit_w": 700.0, "ecc_corrected": 0, "ecc_uncorrected": 0,
        "xid_supported": True, "xid_errors": [], "lost": False,
    }
    reading.update(overrides)
    return reading


def report(node: str = "node-1", gpus=None, **overrides):  # type: ignore[no-untyped-def]
    body = {"node": node, "interval_s": 15, "driver_version": "550.54.15",
            "gpus": gpus if gpus is not None else [gpu(0), gpu(1)]}
    body.update(overrides)
    return body


@pytest.fixture
def replica(catalog, tenants):  # type: ignore[no-untyped-def]
    deployment = make_deployment({**catalog, **tenants}, "chat-eu")
    return Replica.objects.create(deployment=deployment, region=catalog["fra"], state=S.READY,
                                  offer=catalog["fra"].offers.first(), url="http://127.0.0.1:1")


@pytest.fixture
def operator(make_client):  # type: ignore[no-untyped-def]
    return make_client(Role.OPERATOR)


def test_agent_reports_over_http_and_a_bad_gpu_degrades_its_replica(
        live_server, replica, monkeypatch, capsys):  # type: ignore[no-untyped-def]
    from controlplane.core.services import ensure_user, issue_api_token

    _, token = issue_api_token(ensure_user("gpu-agent", Role.OPERATOR))
    nvml = FakeNvml([FakeGpu(uuid="GPU-a"), FakeGpu(uuid="GPU-b")])
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module)
    argv = ["--api", live_server.url, "--token", token, "--node", "gpu-node-7",
            "--replica", replica.public_id, "--once"]

    assert gpu_agent.main(argv) == 0
    node = GpuNode.objects.get(name="gpu-node-7")
    assert node.health == GpuHealth.HEALTHY and node.replica_id == replica.pk
    assert node.driver_version == "550.54.15" and node.gpu_count == 2
    assert sorted(GpuReading.objects.filter(node=node).values_list("uuid", flat=True)) == [
        "GPU-a", "GPU-b"]
    replica.refresh_from_db()
    assert replica.state == S.READY

    nvml.gpus[1].ecc_uncorrected = 2
    assert gpu_agent.main(argv) == 0
    node.refresh_from_db()
    replica.refresh_from_db()
    assert node.health == GpuHealth.UNHEALTHY
    assert "gpu1 has 2 uncorrected ECC errors" in node.health_reason
    assert replica.state == S.DEGRADED
    assert AuditLog.objects.filter(action="gpu_node.unhealthy", object_id=str(node.pk)).exists()
    moved = AuditLog.objects.get(action="replica.degraded", object_id=str(replica.pk))
    assert moved.actor == "system:gpu-health" and "uncorrected ECC" in moved.reason
    assert "unhealthy" in capsys.readouterr().err


def test_agent_with_a_refused_token_exits_3(live_server, db, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml().module)
    argv = ["--api", live_server.url, "--token", "mrd_not-a-token", "--node", "n", "--once"]
    assert gpu_agent.main(argv) == gpu_agent.EXIT_AUTH
    assert not GpuNode.objects.exists()


def test_agent_loop_reports_xids_as_they_happen(live_server, db, monkeypatch):  # type: ignore[no-untyped-def]
    from controlplane.core.services import ensure_user, issue_api_token

    _, token = issue_api_token(ensure_user("gpu-agent", Role.OPERATOR))
    nvml = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml.module)
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:  # between readings: a GPU falls off the bus, then stop
        sleeps.append(seconds)
        if len(sleeps) == 1:
            nvml.xid(0, 79)
        else:
            raise KeyboardInterrupt

    argv = ["--api", live_server.url, "--token", token, "--node", "n2", "--interval", "5"]
    assert gpu_agent.main(argv, sleep=sleep) == 0
    assert nvml.shutdowns == 1
    node = GpuNode.objects.get(name="n2")
    assert list(node.readings.order_by("at").values_list("xid_errors", flat=True)) == [[], [79]]
    assert node.health == GpuHealth.UNHEALTHY and "XID 79" in node.health_reason


def test_viewer_and_tenant_operator_cannot_report(make_client, tenants):  # type: ignore[no-untyped-def]
    assert make_client(Role.VIEWER).post(URL, report(), format="json").status_code == 403
    tenant_op = make_client(Role.OPERATOR, tenants["acme"])
    assert tenant_op.post(URL, report(), format="json").status_code == 403
    assert make_client(None).post(URL, report(), format="json").status_code == 401
    assert not GpuNode.objects.exists()


@pytest.mark.parametrize(("body", "field"), [
    ({"gpus": [gpu()]}, "node"),
    (report(node="bad name!"), "node"),
    (report(gpus=[]), "gpus"),
    (report(gpus="x"), "gpus"),
    (report(gpus=[gpu(0), gpu(0)]), "gpus"),
    (report(gpus=[gpu(0), gpu(1, uuid="GPU-0000")]), "gpus"),
    (report(gpus=[gpu(0)] * 65), "gpus"),
    (report(replica="node-12"), "replica"),
    (report(replica="r-999999"), "replica"),
    (report(replica=True), "replica"),
    (report(at="yesterday"), "at"),
    (report(at=(timezone.now() + timedelta(hours=1)).isoformat()), "at"),
    (report(at=(timezone.now() - timedelta(days=30)).isoformat()), "at"),
    (report(interval_s=0), "interval_s"),
    (report(cuda_driver_version=-1), "cuda_driver_version"),
])
def test_bad_reports_name_the_field_and_store_nothing(operator, body, field):  # type: ignore[no-untyped-def]
    response = operator.post(URL, body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json(), response.json()
    assert not GpuNode.objects.exists() and not GpuReading.objects.exists()


@pytest.mark.parametrize(("overrides", "field"), [
    ({"index": -1}, "index"),
    ({"index": 64}, "index"),
    ({"uuid": "x" * 97}, "uuid"),
    ({"temperature_c": "hot"}, "temperature_c"),
    ({"temperature_c": "nan"}, "temperature_c"),
    ({"temperature_c": 400}, "temperature_c"),
    ({"utilization_gpu_pct": 101}, "utilization_gpu_pct"),
    ({"power_w": -1}, "power_w"),
    ({"memory_used_bytes": 10**12}, "memory_used_bytes"),
    ({"ecc_uncorrected": -3}, "ecc_uncorrected"),
    ({"ecc_corrected": 1.5}, "ecc_corrected"),
    ({"xid_errors": ["79"] + ["x"]}, "xid_errors"),
    ({"xid_errors": 79}, "xid_errors"),
    ({"errors": {"k" * 65: "v"}}, "errors"),
])
def test_bad_gpu_fields_are_named_per_gpu(operator, overrides, field):  # type: ignore[no-untyped-def]
    response = operator.post(URL, report(gpus=[gpu(0), {**gpu(1), **overrides}]), format="json")
    assert response.status_code == 400, response.content
    errors = response.json()["gpus"]  # keyed by the GPU's position in the list
    assert list(errors) == ["1"] and field in errors["1"], errors
    assert not GpuNode.objects.exists() and not GpuReading.objects.exists()


def test_a_missing_figure_is_refused_but_null_is_accepted(operator):  # type: ignore[no-untyped-def]
    reading = gpu(0)
    del reading["temperature_c"]
    response = operator.post(URL, report(gpus=[reading]), format="json")
    assert response.status_code == 400 and "temperature_c" in response.json()["gpus"]["0"]
    response = operator.post(URL, report(gpus=[gpu(0, temperature_c=None, ecc_corrected=None,
                                                    ecc_uncorrected=None)]), format="json")
    assert response.status_code == 201, response.content
    assert response.json()["health"] == "healthy"


def test_health_changes_are_audited_and_the_replica_comes_back(operator, replica):  # type: ignore[no-untyped-def]
    hot = report(replica=replica.public_id, gpus=[gpu(0, temperature_c=91)])
    answer = operator.post(URL, hot, format="json").json()
    assert answer["health"] == "unhealthy" and answer["replica_action"] == "degraded"
    replica.refresh_from_db()
    assert replica.state == S.DEGRADED and replica.last_error.startswith("GPU node node-1: ")
    # cooling but not yet below limit − margin: still unhealthy, no second move
    answer = operator.post(URL, report(gpus=[gpu(0, temperature_c=83)]), format="json").json()
    assert answer["health"] == "unhealthy" and answer["replica_action"] == ""
    answer = operator.post(URL, report(gpus=[gpu(0, temperature_c=70)]), format="json").json()
    assert answer["health"] == "healthy" and answer["replica_action"] == "restored"
    replica.refresh_from_db()
    assert replica.state == S.READY and replica.last_error == ""
    node = GpuNode.objects.get(name="node-1")
    actions = list(AuditLog.objects.filter(object_type="telemetry.gpunode", object_id=str(node.pk))
                   .order_by("id").values_list("action", flat=True))
    assert actions == ["gpu_node.registered", "gpu_node.linked", "gpu_node.unhealthy",
                       "gpu_node.healthy"]
    unhealthy = AuditLog.objects.get(action="gpu_node.unhealthy")
    assert unhealthy.changes["temperature_limit_c"] == 85.0
    assert unhealthy.changes["gpus"][0]["temperature_c"] == 91


def test_a_replica_degraded_for_another_reason_is_left_alone(operator, replica):  # type: ignore[no-untyped-def]
    Replica.objects.filter(pk=replica.pk).update(state=S.DEGRADED, last_error="slow TTFT")
    answer = operator.post(URL, report(replica=replica.public_id), format="json").json()
    assert answer["health"] == "healthy" and answer["replica_action"] == ""
    replica.refresh_from_db()
    assert replica.state == S.DEGRADED


def test_critical_xid_holds_the_node_unhealthy_for_the_hold_window(operator, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setitem(settings.MERIDIAN, "GPU_XID_HOLD", timedelta(minutes=10))
    now = timezone.now()
    at = (now - timedelta(minutes=20)).isoformat()
    assert operator.post(URL, report(at=at, gpus=[gpu(0, xid_errors=[79])]),
                         format="json").json()["health"] == "unhealthy"
    at = (now - timedelta(minutes=15)).isoformat()
    assert operator.post(URL, report(at=at, gpus=[gpu(0)]),
                         format="json").json()["health"] == "unhealthy"
    # 20 minutes later the XID has left the 10-minute window
    assert operator.post(URL, report(gpus=[gpu(0)]), format="json").json()["health"] == "healthy"
    assert operator.post(URL, report(gpus=[gpu(0, xid_errors=[13])]),
                         format="json").json()["health"] == "healthy"


def test_old_readings_are_pruned(operator, monkeypatch):  # type: ignore[no-untyped-def]
    monkeypatch.setitem(settings.MERIDIAN, "GPU_READING_RETENTION", timedelta(hours=1))
    old = (timezone.now() - timedelta(minutes=59)).isoformat()
    operator.post(URL, report(at=old), format="json")
    assert GpuReading.objects.count() == 2
    GpuReading.objects.update(at=timezone.now() - timedelta(hours=2))
    operator.post(URL, report(), format="json")
    assert GpuReading.objects.count() == 2
    assert not GpuReading.objects.filter(at__lt=timezone.now() - timedelta(hours=1)).exists()


def test_nodes_list_with_latest_readings_and_tenancy(make_client, operator, replica, tenants):  # type: ignore[no-untyped-def]
    operator.post(URL, report(node="a", replica=replica.public_id,
                              at=(timezone.now() - timedelta(minutes=1)).isoformat(),
                              gpus=[gpu(0, temperature_c=40)]), format="json")
    operator.post(URL, report(node="a", gpus=[gpu(0, temperature_c=44)]), format="json")
    operator.post(URL, report(node="b", gpus=[gpu(0), gpu(1)]), format="json")
    listing = make_client(Role.VIEWER).get("/api/v1/gpu-nodes/").json()
    by_name = {n["name"]: n for n in listing["results"]}
    assert set(by_name) == {"a", "b"}
    assert by_name["a"]["replica"] == replica.public_id and by_name["a"]["stale"] is False
    assert [g["temperature_c"] for g in by_name["a"]["gpus"]] == [44.0]
    assert [g["index"] for g in by_name["b"]["gpus"]] == [0, 1]
    one = make_client(Role.VIEWER).get("/api/v1/gpu-nodes/a/").json()
    assert one["gpus"][0]["temperature_c"] == 44.0
    # acme owns chat-eu, so its users see node a only; globex sees none
    acme = make_client(Role.VIEWER, tenants["acme"]).get("/api/v1/gpu-nodes/").json()
    assert [n["name"] for n in acme["results"]] == ["a"]
    globex = make_client(Role.VIEWER, tenants["globex"]).get("/api/v1/gpu-nodes/").json()
    assert globex["results"] == []
    unhealthy = make_client(Role.VIEWER).get("/api/v1/gpu-nodes/?health=unhealthy").json()
    assert unhealthy["results"] == []


def test_nodes_list_query_count_does_not_grow_with_nodes(make_client, operator):  # type: ignore[no-untyped-def]
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    viewer = make_client(Role.VIEWER)
    operator.post(URL, report(node="n0"), format="json")
    viewer.get("/api/v1/gpu-nodes/")
    with CaptureQueriesContext(connection) as one:
        viewer.get("/api/v1/gpu-nodes/")
    for i in range(1, 6):
        operator.post(URL, report(node=f"n{i}"), format="json")
    with CaptureQueriesContext(connection) as six:
        assert len(viewer.get("/api/v1/gpu-nodes/").json()["results"]) == 6
    assert 0 < len(six.captured_queries) == len(one.captured_queries) <= 8
