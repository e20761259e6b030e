"""Operators' REST view of batches: every batch the caller may see with its counts, one
batch with its cost, and cancel (operators; 409 once finished; audited as the caller)."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.batches import intake
from controlplane.batches.models import Batch
from controlplane.core.models import AuditLog, Role, Tenant

from .conftest import jsonl, line

pytestmark = pytest.mark.django_db


def submit(tenant: Tenant, n: int = 3) -> Batch:
    source = intake.store_file(
        tenant, "in.jsonl", jsonl(*(line(f"id-{i}", f"p{i}") for i in range(n))), "batch")
    return intake.create_batch(tenant, intake.BatchRequest(source.id, "/v1/chat/completions"))


@pytest.fixture
def batches(fleet: Any) -> dict[str, Batch]:
    return {"acme": submit(Tenant.objects.get(name="acme")),
            "globex": submit(Tenant.objects.get(name="globex"), 2)}


def test_operators_list_every_batch_with_counts_and_read_one_with_its_cost(
        batches: dict[str, Batch], make_client: Any) -> None:
    client = make_client(Role.VIEWER)
    listed = client.get("/api/v1/batches/").json()
    rows = {row["id"]: row for row in listed["results"]}
    assert set(rows) == {b.pk for b in batches.values()}
    acme = rows[batches["acme"].pk]
    assert acme["tenant"] == "acme" and acme["status"] == "validating"
    assert acme["request_counts"] == {"total": 3, "completed": 0, "failed": 0, "running": 0}
    assert "cost" not in acme
    one = client.get(f"/api/v1/batches/{batches['acme'].pk}/").json()
    assert one["cost"]["tokens"] == 0 and one["cost"]["usd"] is None  # not started
    assert client.get("/api/v1/batches/?tenant=globex").json()["count"] == 1


def test_a_tenant_user_sees_only_its_own_batches(batches: dict[str, Batch],
                                                 make_client: Any) -> None:
    client = make_client(Role.VIEWER, Tenant.objects.get(name="acme"))
    assert [r["id"] for r in client.get("/api/v1/batches/").json()["results"]] == [
        batches["acme"].pk]
    assert client.get(f"/api/v1/batches/{batches['globex'].pk}/").status_code == 404
    operator = make_client(Role.OPERATOR, Tenant.objects.get(name="acme"))
    assert operator.post(f"/api/v1/batches/{batches['globex'].pk}/cancel/").status_code == 404
    assert Batch.objects.get(pk=batches["globex"].pk).status == "validating"


def test_an_operator_cancels_as_themselves_and_a_finished_batch_is_409(
        batches: dict[str, Batch], make_client: Any) -> None:
    batch = batches["acme"]
    assert make_client(Role.VIEWER).post(f"/api/v1/batches/{batch.pk}/cancel/").status_code \
        == 403
    client = make_client(Role.OPERATOR)
    answer = client.post(f"/api/v1/batches/{batch.pk}/cancel/", {"reason": "wrong file"},
                         format="json")
    assert answer.status_code == 200, answer.content
    assert answer.json()["status"] == "cancelled"   # nothing was in flight
    event = AuditLog.objects.filter(object_id=batch.pk, action="batch.cancelled").get()
    assert event.reason == "wrong file" and not event.actor.startswith("system:")
    again = client.post(f"/api/v1/batches/{batch.pk}/cancel/")
    assert again.status_code == 409 and "already cancelled" in again.json()["detail"]
    assert AuditLog.objects.filter(object_id=batch.pk, action="batch.cancelled").count() == 1
    too_long = client.post(f"/api/v1/batches/{batches['globex'].pk}/cancel/",
                           {"reason": "x" * 501}, format="json")
    assert too_long.status_code == 400 and "reason" in too_long.json()
    assert Batch.objects.get(pk=batches["globex"].pk).status == "validating"
