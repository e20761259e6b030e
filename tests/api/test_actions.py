"""Operator actions and policy writes: who may, and what bad input gets."""

from __future__ import annotations

import pytest

from controlplane.core.models import Role
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.routing.models import RoutingPolicy
from tests.api.test_endpoints_crud import make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def deployment(catalog, tenants):  # type: ignore[no-untyped-def]
    return make_deployment({**catalog, **tenants}, "chat-eu")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"region": "aws:us-east-1", "replicas": 1}, "region"),  # outside EU residency
        ({"region": "aws:eu-central-1", "replicas": -1}, "replicas"),
        ({"region": "aws:eu-central-1", "replicas": 99}, "replicas"),
        ({"region": "nowhere", "replicas": 1}, "region"),
        ({"replicas": 1}, "region"),
    ],
)
def test_scale_refuses_bad_input(deployment, make_client, body, field):  # type: ignore[no-untyped-def]
    response = make_client(Role.OPERATOR).post(
        f"/api/v1/deployments/{deployment.pk}/scale/", body, format="json")
    assert response.status_code == 400, response.content
    assert field in response.json()
    assert not Replica.objects.exists()


def test_operator_scales_up_and_viewer_cannot(deployment, make_client):  # type: ignore[no-untyped-def]
    body = {"region": "aws:eu-central-1", "replicas": 2}
    url = f"/api/v1/deployments/{deployment.pk}/scale/"
    assert make_client(Role.VIEWER).post(url, body, format="json").status_code == 403
    response = make_client(Role.OPERATOR).post(url, body, format="json")
    assert response.status_code == 202, response.content
    assert len(response.json()["added"]) == 2
    assert Replica.objects.filter(deployment=deployment, state=S.PENDING).count() == 2


def test_drain_moves_ready_replica_and_refuses_pending(deployment, catalog, make_client):  # type: ignore[no-untyped-def]
    ready = Replica.objects.create(deployment=deployment, region=catalog["fra"], state=S.READY)
    pending = Replica.objects.create(deployment=deployment, region=catalog["fra"])
    client = make_client(Role.OPERATOR)
    assert make_client(Role.VIEWER).post(f"/api/v1/replicas/{ready.pk}/drain/").status_code == 403
    assert client.post(f"/api/v1/replicas/{ready.pk}/drain/", {}, format="json").status_code == 202
    ready.refresh_from_db()
    assert ready.state == S.DRAINING
    assert client.post(f"/api/v1/replicas/{ready.pk}/drain/", {}, format="json").status_code == 409
    assert client.post(f"/api/v1/replicas/{pending.pk}/drain/", {"reason": "x" * 600},
                       format="json").status_code == 400


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"scorers": {"speed": 1.0}}, "scorers"),
        ({"scorers": {"load": -1}}, "scorers"),
        ({"scorers": []}, "scorers"),
        ({"eject_after_failures": 0}, "eject_after_failures"),
        ({"aliases": ["auto"]}, "aliases"),
    ],
)
def test_policy_refuses_bad_input(db, make_client, body, field):  # type: ignore[no-untyped-def]
    client = make_client(Role.ADMIN)
    policy = client.get("/api/v1/routing-policy/").json()["results"][0]
    response = client.patch(f"/api/v1/routing-policy/{policy['id']}/", body, format="json")
    assert response.status_code == 400 and field in response.json()
    assert RoutingPolicy.objects.get().scorers == policy["scorers"]


def test_only_platform_admins_change_policy(db, tenants, make_client):  # type: ignore[no-untyped-def]
    make_client(Role.ADMIN).get("/api/v1/routing-policy/")
    pk = RoutingPolicy.objects.get().pk
    body = {"scorers": {"load": 1.0}}
    assert make_client(Role.OPERATOR).patch(f"/api/v1/routing-policy/{pk}/", body,
                                            format="json").status_code == 403
    assert make_client(Role.ADMIN, tenants["acme"]).patch(f"/api/v1/routing-policy/{pk}/", body,
                                                          format="json").status_code == 403
    assert make_client(Role.ADMIN).patch(f"/api/v1/routing-policy/{pk}/", body,
                                         format="json").status_code == 200
