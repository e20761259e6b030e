"""The reason a rollout is started with is kept: returned by the API as `start_reason` (its
`reason` says why it ended), shown on its page; fields the start does not take are refused."""

from __future__ import annotations

from typing import Any

import pytest
from django.test import Client

from controlplane.core.models import AuditLog, Role
from controlplane.core.services import ensure_user
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.rollouts.models import Rollout
from tests.api.test_endpoints_crud import make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def deployment(catalog, tenants):  # type: ignore[no-untyped-def]
    deployment = make_deployment({**catalog, **tenants}, "chat-eu", tenant=None)
    Replica.objects.create(deployment=deployment, region=catalog["fra"], state=S.READY,
                           url="http://10.0.0.1:8000")
    return deployment


@pytest.fixture
def operator(make_client):  # type: ignore[no-untyped-def]
    return make_client(Role.OPERATOR)


def start(client: Any, target: Deployment, **body: Any) -> Any:
    return client.post("/api/v1/rollouts/", {"deployment": target.name, "bake_s": 60, **body},
                       format="json")


def test_the_start_reason_round_trips(deployment, operator, make_client):  # type: ignore[no-untyped-def]
    created = start(operator, deployment, reason="vLLM 0.11 for the new sampler")
    assert created.status_code == 201, created.content
    body = created.json()
    assert body["start_reason"] == "vLLM 0.11 for the new sampler"
    assert body["reason"] == ""
    again = operator.get(f"/api/v1/rollouts/{body['id']}/").json()
    assert again["start_reason"] == "vLLM 0.11 for the new sampler"
    assert Rollout.objects.get(pk=body["id"]).start_reason == "vLLM 0.11 for the new sampler"
    assert AuditLog.objects.get(action="rollout.started").reason == "vLLM 0.11 for the new sampler"

    rolled = operator.post(f"/api/v1/rollouts/{body['id']}/rollback/", {"reason": "slow"},
                           format="json").json()
    assert (rolled["start_reason"], rolled["reason"]) == ("vLLM 0.11 for the new sampler", "slow")

    page = Client()
    page.force_login(ensure_user("viewer-platform", Role.VIEWER, None))
    html = page.get(f"/rollouts/{body['id']}/").content.decode()
    assert "vLLM 0.11 for the new sampler" in html


def test_fields_the_start_does_not_take_are_refused(deployment, operator):  # type: ignore[no-untyped-def]
    response = start(operator, deployment, reason="x", reasons="typo", id=7)
    assert response.status_code == 400
    assert set(response.json()) == {"reasons", "id"}
    assert "unknown field" in response.json()["reasons"][0]
    too_long = start(operator, deployment, reason="x" * 501)
    assert too_long.status_code == 400 and "reason" in too_long.json()
    assert not Rollout.objects.exists()


def test_another_tenant_cannot_start_one(deployment, make_client, tenants):  # type: ignore[no-untyped-def]
    acme = make_client(Role.OPERATOR, tenants["acme"])
    assert start(acme, deployment, reason="mine now").status_code == 403
    assert not Rollout.objects.exists()

