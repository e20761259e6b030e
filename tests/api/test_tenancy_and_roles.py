"""Who may do what: the permission matrix for tenant-owned rows and tenant isolation."""

from __future__ import annotations

import pytest

from controlplane.core.models import ApiKey, AuditLog, Role
from controlplane.core.services import issue_api_key
from tests.api.test_endpoints_crud import make_deployment

pytestmark = pytest.mark.django_db

DEPLOYMENT = {
    "name": "chat", "served_model_name": "llama-3.1-8b", "model": "llama-3.1-8b-instruct",
    "allowed_jurisdictions": ["EU"], "min_replicas": 1, "max_replicas": 2,
}


@pytest.fixture
def fx(catalog, tenants):  # type: ignore[no-untyped-def]
    return {**catalog, **tenants}


@pytest.mark.parametrize(
    ("role", "tenant", "expected"),
    [
        (Role.VIEWER, None, 403),
        (Role.OPERATOR, None, 200),
        (Role.ADMIN, None, 200),
        (Role.VIEWER, "acme", 403),
        (Role.OPERATOR, "acme", 200),
        (Role.ADMIN, "acme", 200),
        (Role.ADMIN, "globex", 404),
        (Role.OPERATOR, "globex", 404),
    ],
)
def test_deployment_update_matrix(fx, make_client, role, tenant, expected):  # type: ignore[no-untyped-def]
    deployment = make_deployment(fx, "chat-eu")
    client = make_client(role, fx[tenant] if tenant else None)
    response = client.patch(f"/api/v1/deployments/{deployment.pk}/", {"max_replicas": 5}, format="json")
    assert response.status_code == expected, response.content


@pytest.mark.parametrize(
    ("role", "tenant", "expected"),
    [
        (Role.VIEWER, None, 403),
        (Role.OPERATOR, None, 403),
        (Role.ADMIN, None, 204),
        (Role.OPERATOR, "acme", 403),
        (Role.ADMIN, "acme", 204),
        (Role.ADMIN, "globex", 404),
    ],
)
def test_api_key_revoke_matrix(fx, make_client, role, tenant, expected):  # type: ignore[no-untyped-def]
    key, _ = issue_api_key(fx["acme"], "web", "interactive")
    client = make_client(role, fx[tenant] if tenant else None)
    assert client.delete(f"/api/v1/api-keys/{key.pk}/").status_code == expected
    key.refresh_from_db()
    assert (key.revoked_at is not None) == (expected == 204)


def test_other_tenant_gets_404_for_tenant_row(fx, make_client):  # type: ignore[no-untyped-def]
    client = make_client(Role.ADMIN, fx["globex"])
    assert client.get(f"/api/v1/tenants/{fx['acme'].pk}/").status_code == 404
    assert client.get(f"/api/v1/tenants/{fx['globex'].pk}/").status_code == 200
    assert [t["name"] for t in client.get("/api/v1/tenants/").json()["results"]] == ["globex"]


def test_tenant_admin_cannot_create_for_another_tenant(fx, make_client):  # type: ignore[no-untyped-def]
    client = make_client(Role.ADMIN, fx["globex"])
    response = client.post("/api/v1/api-keys/", {"tenant": "acme", "name": "sneaky"}, format="json")
    assert response.status_code == 400
    assert "tenant" in response.json()
    assert not ApiKey.objects.filter(name="sneaky").exists()


def test_tenant_operator_deployment_defaults_to_own_tenant(fx, make_client):  # type: ignore[no-untyped-def]
    client = make_client(Role.OPERATOR, fx["acme"])
    response = client.post("/api/v1/deployments/", DEPLOYMENT, format="json")
    assert response.status_code == 201, response.content
    assert response.json()["tenant"] == "acme"


def test_tenant_sees_shared_deployment_but_cannot_change_it(fx, make_client):  # type: ignore[no-untyped-def]
    shared = make_deployment(fx, "shared-chat")
    shared.tenant = None
    shared.save()
    client = make_client(Role.ADMIN, fx["acme"])
    assert client.get(f"/api/v1/deployments/{shared.pk}/").status_code == 200
    response = client.patch(f"/api/v1/deployments/{shared.pk}/", {"max_replicas": 9}, format="json")
    assert response.status_code == 403


def test_tenant_sees_only_its_audit_events(fx, make_client):  # type: ignore[no-untyped-def]
    make_client(Role.OPERATOR, fx["acme"]).post("/api/v1/deployments/", DEPLOYMENT, format="json")
    globex_events = make_client(Role.VIEWER, fx["globex"]).get("/api/v1/audit-log/").json()
    acme_events = make_client(Role.VIEWER, fx["acme"]).get("/api/v1/audit-log/").json()
    assert globex_events["count"] == 0
    assert acme_events["count"] == 1
    assert acme_events["results"][0]["object_type"] == "deployments.deployment"


def test_new_api_key_is_shown_once(fx, make_client):  # type: ignore[no-untyped-def]
    client = make_client(Role.ADMIN)
    created = client.post("/api/v1/api-keys/", {"tenant": "acme", "name": "cli"}, format="json").json()
    assert created["key"].startswith("sk-mrd-")
    again = client.get(f"/api/v1/api-keys/{created['id']}/").json()
    assert again["key"] is None
    import hashlib

    stored = ApiKey.objects.get(pk=created["id"])
    assert stored.key_hash == hashlib.sha256(created["key"].encode()).hexdigest()
    assert created["key"] not in str(AuditLog.objects.values_list("changes", flat=True))


def test_user_without_role_is_refused(db, make_client):  # type: ignore[no-untyped-def]
    from django.contrib.auth import get_user_model
    from rest_framework.test import APIClient

    from controlplane.core.services import issue_api_token

    user = get_user_model().objects.create(username="norole")
    _, token = issue_api_token(user)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    response = client.get("/api/v1/clouds/")
    assert response.status_code == 403
    assert "no role" in response.json()["detail"]


def test_revoked_token_gets_401(db, make_client):  # type: ignore[no-untyped-def]
    from django.utils import timezone
    from rest_framework.test import APIClient

    from controlplane.core.models import ApiToken
    from controlplane.core.services import ensure_user, issue_api_token

    row, token = issue_api_token(ensure_user("ops", Role.OPERATOR))
    ApiToken.objects.filter(pk=row.pk).update(revoked_at=timezone.now())
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {token}")
    assert client.get("/api/v1/clouds/").status_code == 401


# -- the tenancy rule over every endpoint that serves a tenant-owned model -----------------

from controlplane.api.urls import router  # noqa: E402
from controlplane.core.services import Principal  # noqa: E402
from controlplane.core.tenancy import tenancy_of, tenant_owned_models  # noqa: E402
from tests.tenant_rows import BUILDERS  # noqa: E402

OWNED = {model._meta.label: model for model in tenant_owned_models()}
ENDPOINTS = [
    pytest.param(prefix, viewset, id=prefix)
    for prefix, viewset, _ in router.registry
    if getattr(getattr(viewset, "queryset", None), "model", None) in OWNED.values()
]
# Tenant-owned models no endpoint lists on their own, and why.
NOT_SERVED = {
    "core.Membership": "roles are granted in the admin and the dashboard",
    "placement.PlanChange": "read inside plans, which are platform-wide",
    "telemetry.ReplicaSample": "read through the dashboard's charts",
    "telemetry.GpuReading": "read inside gpu-nodes",
    "costs.TokenUsage": "read through costs and cost-rollups",
    "alerts.AlertDelivery": "webhook bookkeeping, shown in the admin",
    "batches.BatchFile": "served to the tenant's inference key at /v1/files (tests/batches)",
    "batches.Batch": "served to the tenant's inference key at /v1/batches (tests/batches)",
    "batches.BatchLine": "read through a batch's output and error files",
    "deployments.Revision": "read inside rollouts (from_revision, to_revision)",
    "rollouts.RolloutStep": "read inside rollouts (step_rows)",
}


def test_every_tenant_owned_model_is_served_or_accounted_for() -> None:
    # ViewSetMixin, the registry's type, declares no queryset; the model viewsets have one.
    querysets = [getattr(viewset, "queryset", None) for _, viewset, _ in router.registry]
    served = {qs.model._meta.label for qs in querysets if qs is not None}
    missing = sorted(set(OWNED) - served - set(NOT_SERVED))
    assert not missing, f"tenant-owned but neither served nor in NOT_SERVED: {missing}"


def _detail(prefix: str, viewset, row) -> str:  # type: ignore[no-untyped-def]
    return f"/api/v1/{prefix}/{getattr(row, viewset.lookup_field or 'pk')}/"


@pytest.mark.parametrize(("prefix", "viewset"), ENDPOINTS)
def test_other_tenant_gets_404_and_lists_only_what_it_may_see(  # type: ignore[no-untyped-def]
    fx, make_client, prefix, viewset,
):
    model = viewset.queryset.model
    build = BUILDERS[model._meta.label]
    own, others, unowned = build(fx, fx["acme"]), build(fx, fx["globex"]), build(fx, None)
    acme = make_client(Role.ADMIN, fx["acme"])
    listing = acme.get(f"/api/v1/{prefix}/")
    assert listing.status_code == 200, listing.content
    expected = model._default_manager.visible_to(Principal("a", Role.ADMIN, fx["acme"].pk))
    assert listing.json()["count"] == expected.count()
    platform = make_client(Role.VIEWER).get(f"/api/v1/{prefix}/").json()
    assert platform["count"] == model._default_manager.count() > listing.json()["count"]
    if not hasattr(viewset, "retrieve"):
        return
    assert acme.get(_detail(prefix, viewset, own)).status_code == 200
    assert acme.get(_detail(prefix, viewset, others)).status_code == 404
    if unowned is not None:
        shared = tenancy_of(model).shared
        assert acme.get(_detail(prefix, viewset, unowned)).status_code == (200 if shared else 404)
    # Another tenant's row is not there to change (404), unless tenant users may change
    # nothing here at all (403 before any row is looked up).
    refused = 403 if getattr(viewset, "platform_only_writes", False) else 404
    if hasattr(viewset, "partial_update"):
        response = acme.patch(_detail(prefix, viewset, others), {}, format="json")
        assert response.status_code == refused, response.content
        if unowned is not None and tenancy_of(model).shared:
            response = acme.patch(_detail(prefix, viewset, unowned), {}, format="json")
            assert response.status_code == 403, response.content
    if hasattr(viewset, "destroy"):
        assert acme.delete(_detail(prefix, viewset, others)).status_code == refused
    for extra in viewset.get_extra_actions():
        if extra.detail and "post" in extra.mapping:
            url = f"{_detail(prefix, viewset, others)}{extra.url_path}/"
            assert acme.post(url, {}, format="json").status_code == refused, url
