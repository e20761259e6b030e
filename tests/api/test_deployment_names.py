"""Deployments are addressed by name everywhere the API takes one, and by id as before."""

from __future__ import annotations

import pytest
from django.utils import timezone

from controlplane.core.models import Role
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.scaling.models import ScalingDecision
from tests.api.test_endpoints_crud import make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def deployment(catalog, tenants):  # type: ignore[no-untyped-def]
    return make_deployment({**catalog, **tenants}, "chat-eu")


def test_operator_reads_updates_scales_and_deletes_a_deployment_by_name(deployment, make_client):  # type: ignore[no-untyped-def]
    client = make_client(Role.OPERATOR)
    assert client.get("/api/v1/deployments/chat-eu/").json()["id"] == deployment.pk
    assert client.get(f"/api/v1/deployments/{deployment.pk}/").json()["name"] == "chat-eu"
    response = client.patch("/api/v1/deployments/chat-eu/", {"max_replicas": 5}, format="json")
    assert response.status_code == 200, response.content
    deployment.refresh_from_db()
    assert deployment.max_replicas == 5
    response = client.post("/api/v1/deployments/chat-eu/scale/",
                           {"region": "aws:eu-central-1", "replicas": 1}, format="json")
    assert response.status_code == 202, response.content
    Replica.objects.filter(deployment=deployment).delete()
    assert client.delete("/api/v1/deployments/chat-eu/").status_code == 204
    assert not Deployment.objects.filter(name="chat-eu").exists()


def test_unknown_name_and_another_tenants_deployment_answer_404(deployment, tenants, make_client):  # type: ignore[no-untyped-def]
    assert make_client(Role.OPERATOR).get("/api/v1/deployments/chat-us/").status_code == 404
    other = make_client(Role.ADMIN, tenants["globex"])
    assert other.get("/api/v1/deployments/chat-eu/").status_code == 404
    assert other.delete("/api/v1/deployments/chat-eu/").status_code == 404
    assert Deployment.objects.filter(name="chat-eu").exists()


@pytest.mark.parametrize("name", ["12", "007"])
def test_operator_cannot_name_a_deployment_with_digits_only(deployment, make_client, name):  # type: ignore[no-untyped-def]
    client = make_client(Role.OPERATOR)
    body = {"name": name, "served_model_name": "m", "model": "llama-3.1-8b-instruct",
            "tenant": "acme", "allowed_jurisdictions": ["EU"]}
    response = client.post("/api/v1/deployments/", body, format="json")
    assert response.status_code == 400, response.content
    assert "name" in response.json()
    response = client.patch("/api/v1/deployments/chat-eu/", {"name": name}, format="json")
    assert response.status_code == 400 and "name" in response.json()
    assert Deployment.objects.filter(name="chat-eu").exists()


def test_replicas_and_scaling_decisions_filter_by_name_or_id(deployment, catalog, make_client):  # type: ignore[no-untyped-def]
    Replica.objects.create(deployment=deployment, region=catalog["fra"], state=S.READY)
    ScalingDecision.objects.create(deployment=deployment, at=timezone.now(), direction="up",
                                   replicas_before=1, replicas_after=2, reason="test")
    client = make_client(Role.VIEWER)
    for ref in ("chat-eu", str(deployment.pk)):
        assert client.get(f"/api/v1/replicas/?deployment={ref}").json()["count"] == 1
        assert client.get(f"/api/v1/scaling-decisions/?deployment={ref}").json()["count"] == 1
    assert client.get("/api/v1/replicas/?deployment=nope").json()["count"] == 0


def test_plan_proposal_takes_deployments_by_name_or_id_and_refuses_unknown(deployment, make_client):  # type: ignore[no-untyped-def]
    client = make_client(Role.OPERATOR)
    for bad in (["nope"], [True], [""]):
        response = client.post("/api/v1/plans/propose/", {"deployments": bad}, format="json")
        assert response.status_code == 400, response.content
        assert "deployments" in response.json()
    for ref in ("chat-eu", deployment.pk):
        response = client.post("/api/v1/plans/propose/", {"deployments": [ref]}, format="json")
        assert response.status_code == 201, response.content
