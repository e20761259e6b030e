"""Compiling, signing, pushing and acking tables; drift; the pull endpoint."""

from __future__ import annotations

import pytest

from controlplane.core.models import Role
from controlplane.core.services import issue_api_key
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.routing import services
from controlplane.routing.models import Edge, RoutingTable
from tests.api.test_endpoints_crud import make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def fleet(catalog, tenants, admin_endpoints):  # type: ignore[no-untyped-def]
    fx = {**catalog, **tenants}
    deployment = make_deployment(fx, "chat")
    Replica.objects.create(deployment=deployment, region=catalog["fra"], state=S.READY,
                           url="http://127.0.0.1:9101")
    Replica.objects.create(deployment=deployment, region=catalog["ams"], state=S.STARTING,
                           url="http://127.0.0.1:9102")
    issue_api_key(tenants["acme"], "web", "interactive")
    edges = [
        Edge.objects.create(name=f"edge-{i}", region=region, admin_url=endpoint.url)
        for i, (region, endpoint) in enumerate(
            zip([catalog["fra"], catalog["iad"], catalog["ams"]], admin_endpoints, strict=True))
    ]
    return {**fx, "deployment": deployment, "edges": edges, "endpoints": admin_endpoints}


def test_publish_pushes_signed_tables_to_every_edge(fleet):  # type: ignore[no-untyped-def]
    report = services.publish()
    assert report.acked == 3
    for endpoint, edge in zip(fleet["endpoints"], fleet["edges"], strict=True):
        table = endpoint.received[-1]
        assert table["edge"] == edge.name
        replicas = table["models"]["llama-3.1-8b"]["replicas"]
        assert [r["state"] for r in replicas] == ["ready"], "starting replicas are not routed"
        assert len(table["tenants"]) == 1
        edge.refresh_from_db()
        assert edge.last_acked_version == table["version"] == report.version


def test_a_batch_tier_deployment_at_zero_makes_its_model_a_batch_pool(fleet):  # type: ignore[no-untyped-def]
    """A batch-tier deployment of the same served name, with no replica: the tables say that
    batch work for the model goes to it alone (for its tenant), and keep the interactive
    deployment's replicas for interactive work."""
    batch = make_deployment(fleet, "chat-batch")
    batch.tier, batch.min_replicas = "batch", 0
    batch.save()
    assert services.batch_pools() == {"llama-3.1-8b": ["acme"]}
    services.publish()
    entry = fleet["endpoints"][0].received[-1]["models"]["llama-3.1-8b"]
    assert entry["batch_pool"] == ["acme"]
    assert [r["tier"] for r in entry["replicas"]] == ["interactive"]


def test_unchanged_inputs_push_nothing_new(fleet):  # type: ignore[no-untyped-def]
    first = services.publish()
    second = services.publish()
    assert second.results == []
    assert second.version == first.version
    assert RoutingTable.objects.count() == 3


def test_a_change_gets_a_newer_version(fleet):  # type: ignore[no-untyped-def]
    first = services.publish()
    Replica.objects.filter(state=S.STARTING).update(state=S.READY)
    second = services.publish()
    assert first.version is not None and second.version is not None
    assert second.version > first.version
    assert all(len(e.received[-1]["models"]["llama-3.1-8b"]["replicas"]) == 2
               for e in fleet["endpoints"])


def test_edge_that_was_down_is_caught_up_by_drift_check(fleet):  # type: ignore[no-untyped-def]
    from controlplane.routing.tasks import check_drift

    down = fleet["endpoints"][1]
    down.up = False
    report = services.publish()
    assert report.acked == 2
    edge = Edge.objects.get(name="edge-1")
    assert edge.last_acked_version is None
    assert edge.last_error == "down for the test"
    assert [e.name for e in services.edges_behind()] == ["edge-1"]
    down.up = True
    check_drift()
    assert services.edges_behind() == []
    assert down.received[-1]["version"] == report.version


def test_pull_endpoint_answers_304_when_unchanged(fleet, make_client):  # type: ignore[no-untyped-def]
    services.publish()
    client = make_client(Role.VIEWER)
    first = client.get("/api/v1/edges/edge-0/table")
    assert first.status_code == 200
    etag = first.headers["ETag"]
    assert client.get("/api/v1/edges/edge-0/table", HTTP_IF_NONE_MATCH=etag).status_code == 304
    assert client.get("/api/v1/edges/nowhere/table").status_code == 404


def test_tenant_users_may_not_pull_tables(fleet, make_client, tenants):  # type: ignore[no-untyped-def]
    """A table holds every tenant's hashed keys and rules: tenant users, even admins, are
    refused, and so is a caller without a token."""
    services.publish()
    for role in (Role.VIEWER, Role.ADMIN):
        answer = make_client(role, tenants["acme"]).get("/api/v1/edges/edge-0/table")
        assert answer.status_code == 403, answer.content
        assert "platform staff" in answer.json()["detail"]
    assert make_client(None).get("/api/v1/edges/edge-0/table").status_code in (401, 403)


def test_signing_refuses_a_missing_key(db, tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    from django.core.exceptions import ImproperlyConfigured

    from controlplane.routing import signing

    monkeypatch.setenv("MERIDIAN_SIGNING_KEY_FILE", str(tmp_path / "absent.pem"))
    monkeypatch.delenv("MERIDIAN_SIGNING_KEY", raising=False)
    signing.signing_key.cache_clear()
    with pytest.raises(ImproperlyConfigured, match="generate_signing_key"):
        signing.signing_key()
    signing.signing_key.cache_clear()


def test_publish_costs_the_same_queries_whatever_the_number_of_edges(fleet):  # type: ignore[no-untyped-def]
    """Acks are read and recorded for all edges at once: adding edges adds no queries."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    fleet["endpoints"][1].up = False  # one edge that refuses: its error goes in the same UPDATE
    services.publish()  # the policy row and the first tables exist from here on

    def queries() -> int:
        with CaptureQueriesContext(connection) as captured:
            report = services.publish(force=True)
        assert len(report.results) == Edge.objects.count()
        return len(captured.captured_queries)

    few = queries()
    for i in range(3, 12):  # more edges on the same endpoints (409 for older versions is an ack)
        endpoint = fleet["endpoints"][i % 3]
        Edge.objects.create(name=f"edge-{i}", region=fleet["fra"], admin_url=endpoint.url)
    many = queries()
    assert many == few
    down = Edge.objects.filter(admin_url=fleet["endpoints"][1].url)
    assert set(down.values_list("last_error", flat=True)) == {"down for the test"}
    assert set(down.values_list("last_acked_version", flat=True)) == {None}
    up = Edge.objects.exclude(admin_url=fleet["endpoints"][1].url)
    assert len(set(up.values_list("last_acked_version", flat=True))) == 1
    assert set(up.values_list("last_error", flat=True)) == {""}


def test_failover_push_takes_the_publish_lock(fleet, monkeypatch):  # type: ignore[no-untyped-def]
    """Failover's immediate push is the scheduled publish's path: while another publisher
    holds the lock it waits, and pushes once the lock is free."""
    import threading

    import psycopg
    from django.db import connection

    from controlplane.core.locks import lock_id
    from controlplane.failover import services as failover

    params = connection.get_connection_params()
    with psycopg.connect(**{k: v for k, v in params.items() if k in
                            ("dbname", "user", "host", "port", "password")}) as other:
        other.execute("SELECT pg_advisory_lock(%s)", [lock_id(services.PUBLISH_LOCK)])
        monkeypatch.setattr(failover, "PUBLISH_WAIT_S", 0.2)
        assert failover.push_tables_now("held elsewhere") is None
        assert all(e.received == [] for e in fleet["endpoints"])

        monkeypatch.setattr(failover, "PUBLISH_WAIT_S", 30.0)
        release = threading.Timer(
            0.3, lambda: other.execute("SELECT pg_advisory_unlock(%s)",
                                       [lock_id(services.PUBLISH_LOCK)]))
        release.start()
        try:
            version = failover.push_tables_now("released meanwhile")
        finally:
            release.join()
    assert version is not None
    assert all(e.received[-1]["version"] == version for e in fleet["endpoints"])
