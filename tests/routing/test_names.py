"""Served names and aliases share one namespace: the API refuses either side of a collision
with a 400 naming the field and the other side, and checks aliases by the edge's own rules."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.core.models import Role
from controlplane.deployments.models import Deployment
from controlplane.routing.models import RoutingPolicy
from controlplane.routing.services import current_policy
from tests.api.test_endpoints_crud import make_deployment

pytestmark = pytest.mark.django_db

AUTO = {"auto": {"rules": [{"max_prompt_tokens": 1000, "model": "llama-3.1-8b"}],
                 "default": "llama-3.1-8b"}}


def payload(tenant: str, served: str, name: str = "sneaky") -> dict[str, Any]:
    return {"name": name, "served_model_name": served, "model": "llama-3.1-8b-instruct",
            "tenant": tenant, "allowed_jurisdictions": ["EU"], "user_regions": ["aws:eu-central-1"],
            "min_replicas": 1, "max_replicas": 2, "max_model_len": 8192}


def policy_url() -> str:
    return f"/api/v1/routing-policy/{current_policy().pk}/"


@pytest.fixture
def with_alias(catalog):  # type: ignore[no-untyped-def]
    RoutingPolicy.objects.update_or_create(name="default", defaults={"aliases": AUTO})


def test_a_tenant_operator_cannot_create_a_deployment_named_like_an_alias(
        tenants, make_client, with_alias):  # type: ignore[no-untyped-def]
    client = make_client(Role.OPERATOR, tenants["acme"])
    # Aliases are readable by tenants: that is how the name is found.
    assert "auto" in client.get("/api/v1/routing-policy/").json()["results"][0]["aliases"]
    response = client.post("/api/v1/deployments/", payload("acme", "auto"), format="json")
    assert response.status_code == 400
    message = str(response.json()["served_model_name"])
    assert "alias" in message and "auto" in message
    assert not Deployment.objects.filter(served_model_name="auto").exists()


def test_nor_rename_one_into_an_alias(catalog, tenants, make_client, with_alias):  # type: ignore[no-untyped-def]
    deployment = make_deployment({**catalog, **tenants}, "chat-acme")
    client = make_client(Role.OPERATOR, tenants["acme"])
    response = client.patch(f"/api/v1/deployments/{deployment.pk}/",
                            {"served_model_name": "auto"}, format="json")
    assert response.status_code == 400 and "served_model_name" in response.json()
    deployment.refresh_from_db()
    assert deployment.served_model_name == "llama-3.1-8b"
    # Another tenant's operator does not even see it.
    other = make_client(Role.OPERATOR, tenants["globex"])
    assert other.patch(f"/api/v1/deployments/{deployment.pk}/", {"served_model_name": "auto"},
                       format="json").status_code == 404


def test_an_alias_may_not_be_a_served_name(catalog, tenants, make_client):  # type: ignore[no-untyped-def]
    make_deployment({**catalog, **tenants}, "chat-acme")
    client = make_client(Role.ADMIN)
    client.get("/api/v1/routing-policy/")
    response = client.patch(policy_url(), {"aliases": {"llama-3.1-8b": "small"}}, format="json")
    assert response.status_code == 400
    message = str(response.json()["aliases"])
    assert "llama-3.1-8b" in message and "chat-acme" in message
    assert current_policy().aliases == {}


@pytest.mark.parametrize(("aliases", "named"), [
    ({"auto": ""}, "aliases.auto"),
    ({"auto": 7}, "aliases.auto"),
    ({"auto": {"rules": "small"}}, "aliases.auto.rules"),
    ({"auto": {"rules": [{"model": "small", "shortest": 1}], "default": "x"}},
     "aliases.auto.rules[0]"),
    ({"auto": {"rules": [{"model": "small", "tier": "gold"}], "default": "x"}},
     "aliases.auto.rules[0].tier"),
    ({"auto": {"rules": [{"model": "small", "max_prompt_tokens": -1}], "default": "x"}},
     "aliases.auto.rules[0]"),
    ({"auto": {"rules": []}}, "aliases.auto.default"),
    ({"auto": {"rules": [], "default": "x", "fallback": "y"}}, "aliases.auto"),
])
def test_aliases_are_checked_by_the_edges_rules(db, make_client, aliases, named):  # type: ignore[no-untyped-def]
    client = make_client(Role.ADMIN)
    client.get("/api/v1/routing-policy/")
    response = client.patch(policy_url(), {"aliases": aliases}, format="json")
    assert response.status_code == 400
    assert named in str(response.json()["aliases"])
    assert current_policy().aliases == {}


def test_good_aliases_are_saved(db, make_client):  # type: ignore[no-untyped-def]
    client = make_client(Role.ADMIN)
    client.get("/api/v1/routing-policy/")
    assert client.patch(policy_url(), {"aliases": AUTO}, format="json").status_code == 200
    assert current_policy().aliases == AUTO


def test_tenant_admins_cannot_write_aliases(db, tenants, make_client):  # type: ignore[no-untyped-def]
    make_client(Role.ADMIN).get("/api/v1/routing-policy/")
    response = make_client(Role.ADMIN, tenants["acme"]).patch(
        policy_url(), {"aliases": AUTO}, format="json")
    assert response.status_code == 403
    assert current_policy().aliases == {}


@pytest.mark.parametrize(("body", "field"), [
    ({"max_table_age_s": 10}, "max_table_age_s"),
    ({"max_table_age_s": 31 * 24 * 3600}, "max_table_age_s"),
    ({"stale_table_mode": "open"}, "stale_table_mode"),
    ({"fail_open_tenants": ["nobody"]}, "fail_open_tenants"),
])
def test_freshness_settings_refuse_bad_input(db, tenants, make_client, body, field):  # type: ignore[no-untyped-def]
    client = make_client(Role.ADMIN)
    client.get("/api/v1/routing-policy/")
    response = client.patch(policy_url(), body, format="json")
    assert response.status_code == 400 and field in response.json()
    policy = current_policy()
    assert (policy.max_table_age_s, policy.stale_table_mode) == (86400, "last_known_good")


def test_freshness_settings_are_saved(db, tenants, make_client):  # type: ignore[no-untyped-def]
    client = make_client(Role.ADMIN)
    client.get("/api/v1/routing-policy/")
    response = client.patch(policy_url(), {"max_table_age_s": 3600,
                                           "stale_table_mode": "fail_closed",
                                           "fail_open_tenants": ["acme"]}, format="json")
    assert response.status_code == 200, response.json()
    assert response.json()["fail_open_tenants"] == ["acme"]
    policy = current_policy()
    assert (policy.max_table_age_s, policy.stale_table_mode) == (3600, "fail_closed")
    assert [t.name for t in policy.fail_open_tenants.all()] == ["acme"]
