"""`shared_prefix_cache` through the API: off unless asked, a shared deployment's opt-in
alone (a tenant's own deployment is refused naming the field), a boolean, and never set on
a shared deployment by a tenant's user."""

from __future__ import annotations

import pytest

from controlplane.core.models import Role
from controlplane.deployments.models import Deployment
from tests.api.test_endpoints_crud import make_deployment

pytestmark = pytest.mark.django_db

CHAT = {
    "name": "chat-eu", "served_model_name": "llama-3.1-8b", "model": "llama-3.1-8b-instruct",
    "allowed_jurisdictions": ["EU"], "user_regions": ["aws:eu-central-1"],
    "min_replicas": 1, "max_replicas": 2, "max_model_len": 8192,
}


def test_a_platform_operator_opts_a_shared_deployment_in(catalog, make_client) -> None:  # type: ignore[no-untyped-def]
    operator = make_client(Role.OPERATOR)
    response = operator.post("/api/v1/deployments/", CHAT, format="json")
    assert response.status_code == 201, response.json()
    assert response.json()["shared_prefix_cache"] is False and response.json()["tenant"] is None
    response = operator.patch(f"/api/v1/deployments/{response.json()['id']}/",
                              {"shared_prefix_cache": True}, format="json")
    assert response.status_code == 200, response.json()
    assert Deployment.objects.get(name="chat-eu").shared_prefix_cache is True


def test_a_tenants_own_deployment_is_refused_naming_the_field(catalog, tenants, make_client) -> None:  # type: ignore[no-untyped-def]
    tenant_operator = make_client(Role.OPERATOR, tenants["acme"])
    response = tenant_operator.post("/api/v1/deployments/",
                                    {**CHAT, "shared_prefix_cache": True}, format="json")
    assert response.status_code == 400
    assert "shared deployments" in str(response.json()["shared_prefix_cache"])
    assert not Deployment.objects.exists()
    own = make_deployment({**catalog, **tenants}, "acme-chat", tenants["acme"])
    response = make_client(Role.OPERATOR).patch(f"/api/v1/deployments/{own.pk}/",
                                                {"shared_prefix_cache": True}, format="json")
    assert response.status_code == 400 and "shared_prefix_cache" in response.json()
    own.refresh_from_db()
    assert own.shared_prefix_cache is False


def test_a_value_that_is_not_a_boolean_is_refused(catalog, make_client) -> None:  # type: ignore[no-untyped-def]
    response = make_client(Role.OPERATOR).post(
        "/api/v1/deployments/", {**CHAT, "shared_prefix_cache": "sometimes"}, format="json")
    assert response.status_code == 400 and "shared_prefix_cache" in response.json()
    assert not Deployment.objects.exists()


def test_a_tenants_user_cannot_open_a_shared_deployments_cache(catalog, tenants, make_client) -> None:  # type: ignore[no-untyped-def]
    shared = make_deployment({**catalog, **tenants}, "shared-chat")
    shared.tenant = None
    shared.save()
    for role in (Role.OPERATOR, Role.ADMIN):
        response = make_client(role, tenants["globex"]).patch(
            f"/api/v1/deployments/{shared.pk}/", {"shared_prefix_cache": True}, format="json")
        assert response.status_code in (403, 404), response.json()
    shared.refresh_from_db()
    assert shared.shared_prefix_cache is False
