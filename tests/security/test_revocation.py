"""A key revoked by platform staff stays revoked for the tenant's own admins: who revoked is
recorded, and only platform staff may restore such a key."""

from __future__ import annotations

import pytest

from controlplane.core.models import ApiKey, AuditLog, Role
from controlplane.core.services import issue_api_key

pytestmark = pytest.mark.django_db


@pytest.fixture
def key(tenants):  # type: ignore[no-untyped-def]
    return issue_api_key(tenants["acme"], "web", "interactive")[0]


def _revoke(client, key: ApiKey) -> int:  # type: ignore[no-untyped-def]
    return client.patch(f"/api/v1/api-keys/{key.pk}/", {"revoked": True}, format="json").status_code


def _restore(client, key: ApiKey):  # type: ignore[no-untyped-def]
    return client.patch(f"/api/v1/api-keys/{key.pk}/", {"revoked": False}, format="json")


def test_platform_revocation_records_who_and_is_final_for_the_tenant_admin(
        tenants, make_client, key):  # type: ignore[no-untyped-def]
    staff = make_client(Role.ADMIN, username="sec-ops")
    assert _revoke(staff, key) == 200
    key.refresh_from_db()
    assert key.revoked_at is not None
    assert (key.revoked_by, key.revoked_by_platform) == ("sec-ops", True)

    response = _restore(make_client(Role.ADMIN, tenants["acme"]), key)
    assert response.status_code == 403, response.content
    assert "revoked by platform staff (sec-ops)" in response.json()["revoked"]
    key.refresh_from_db()
    assert key.revoked_at is not None
    assert not AuditLog.objects.filter(action="update", object_id=str(key.pk),
                                       changes__revoked=False).exists()


def test_delete_by_platform_staff_is_final_too(tenants, make_client, key):  # type: ignore[no-untyped-def]
    assert make_client(Role.ADMIN, username="sec-ops").delete(
        f"/api/v1/api-keys/{key.pk}/").status_code == 204
    key.refresh_from_db()
    assert (key.revoked_by, key.revoked_by_platform) == ("sec-ops", True)
    assert _restore(make_client(Role.ADMIN, tenants["acme"]), key).status_code == 403


def test_platform_staff_may_restore_it(tenants, make_client, key):  # type: ignore[no-untyped-def]
    staff = make_client(Role.ADMIN, username="sec-ops")
    _revoke(staff, key)
    assert _restore(staff, key).status_code == 200
    key.refresh_from_db()
    assert (key.revoked_at, key.revoked_by, key.revoked_by_platform) == (None, "", False)


def test_tenant_admin_may_undo_its_own_revocation(tenants, make_client, key):  # type: ignore[no-untyped-def]
    admin = make_client(Role.ADMIN, tenants["acme"], username="acme-boss")
    assert _revoke(admin, key) == 200
    key.refresh_from_db()
    assert (key.revoked_by, key.revoked_by_platform) == ("acme-boss", False)
    assert _restore(admin, key).status_code == 200
    key.refresh_from_db()
    assert key.revoked_at is None


def test_a_second_revocation_keeps_the_first_revoker(tenants, make_client, key):  # type: ignore[no-untyped-def]
    _revoke(make_client(Role.ADMIN, username="sec-ops"), key)
    assert _revoke(make_client(Role.ADMIN, tenants["acme"]), key) == 200
    key.refresh_from_db()
    assert (key.revoked_by, key.revoked_by_platform) == ("sec-ops", True)
    assert _restore(make_client(Role.ADMIN, tenants["acme"]), key).status_code == 403


@pytest.mark.parametrize("value", ["maybe", 2, None, [True]])
def test_a_bad_revoked_value_is_a_400_naming_the_field(make_client, key, value):  # type: ignore[no-untyped-def]
    response = make_client(Role.ADMIN).patch(f"/api/v1/api-keys/{key.pk}/", {"revoked": value},
                                             format="json")
    assert response.status_code == 400
    assert "revoked" in response.json()


def test_other_tenant_admin_cannot_revoke_or_restore(tenants, make_client, key):  # type: ignore[no-untyped-def]
    other = make_client(Role.ADMIN, tenants["globex"])
    assert _revoke(other, key) == 404
    key.refresh_from_db()
    assert key.revoked_at is None


def test_tenant_operator_cannot_restore(tenants, make_client, key):  # type: ignore[no-untyped-def]
    make_client(Role.ADMIN, tenants["acme"]).delete(f"/api/v1/api-keys/{key.pk}/")
    assert _restore(make_client(Role.OPERATOR, tenants["acme"]), key).status_code == 403


def test_the_dashboard_records_who_revoked(tenants, key, client):  # type: ignore[no-untyped-def]
    from controlplane.core.services import ensure_user

    client.force_login(ensure_user("acme-web-admin", Role.ADMIN, tenants["acme"]))
    response = client.post(f"/keys/{key.pk}/revoke/", {"reason": "leaked"})
    assert response.status_code == 302
    key.refresh_from_db()
    assert (key.revoked_by, key.revoked_by_platform) == ("acme-web-admin", False)


def test_a_finished_batchs_runner_key_is_revoked_by_the_platform(tenants, make_client):  # type: ignore[no-untyped-def]
    from datetime import UTC, datetime

    from controlplane.batches.models import Batch, BatchFile
    from controlplane.batches.runner_key import ensure_runner_key, revoke_runner_key

    source = BatchFile.objects.create(tenant=tenants["acme"], purpose="batch", filename="in.jsonl",
                                      bytes=2, line_count=1, content=b"{}")
    batch = Batch.objects.create(tenant=tenants["acme"], input_file=source, model="m",
                                 endpoint="/v1/chat/completions",
                                 expires_at=datetime(2026, 12, 1, tzinfo=UTC))
    ensure_runner_key(batch)
    revoke_runner_key(batch.pk)
    runner = ApiKey.objects.get(name=f"batch {batch.pk}")
    assert (runner.revoked_by, runner.revoked_by_platform) == ("system:batches", True)
    assert _restore(make_client(Role.ADMIN, tenants["acme"]), runner).status_code == 403
