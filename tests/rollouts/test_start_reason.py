"""The reason a rollout is started with is kept: returned by the API as `start_reason` (its
`reason` says why it ended), shown on its page; fields the start does not take are refused."""

from __future__ import annotations

import pytest
from django.test import Client

from controlplane.core.models import AuditLog, Role
from controlplane.core.services import ensure_user
from controlplane.rollouts.models import Rollout
from tests.rollouts.test_api import start

pytestmark = pytest.mark.django_db


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

