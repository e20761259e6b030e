"""Every change to a batch or a file is an audit event: uploads and deletions, creation, each
stage a worker takes it through, cancel and expiry; with who did it (the tenant's key, an
operator, or system:batches) and the tenant it belongs to. A refused change writes none."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.test import Client
from django.utils import timezone

from controlplane.batches import audit, intake
from controlplane.batches.models import Batch, BatchStatus
from controlplane.core.models import AuditLog

from .conftest import drive, jsonl, line
from .test_batch_api import client, create, upload

pytestmark = pytest.mark.django_db

ACME = "key:acme/acme"


def events(object_id: str) -> list[tuple[str, str]]:
    rows = AuditLog.objects.filter(object_id=object_id).order_by("at", "id")
    return [(row.action, row.actor) for row in rows]


def new_batch(c: Client, *prompts: str) -> str:
    file_id = upload(c, jsonl(*(line(str(i), p) for i, p in enumerate(prompts)))).json()["id"]
    created = create(c, file_id)
    assert created.status_code == 200, created.content
    return str(created.json()["id"])


def test_an_upload_and_a_deletion_are_events_of_the_tenants_key(fleet: Any, tenants: Any) -> None:
    c = client(fleet["acme"])
    uploaded = upload(c, jsonl(line("a", "hi"), line("b", "ho")), name="nightly.jsonl")
    file_id = uploaded.json()["id"]
    event = AuditLog.objects.get(object_id=file_id)
    assert (event.action, event.actor, event.object_type) == (
        "file.uploaded", ACME, "batches.batchfile")
    assert event.tenant_id == tenants["acme"].pk
    assert event.changes == {"filename": "nightly.jsonl", "bytes": uploaded.json()["bytes"],
                             "lines": 2}
    assert event.object_repr == f"{file_id} nightly.jsonl"

    assert c.delete(f"/v1/files/{file_id}").status_code == 200
    assert events(file_id) == [("file.uploaded", ACME), ("file.deleted", ACME)]


def test_a_refused_upload_or_deletion_writes_no_event(fleet: Any) -> None:
    c = client(fleet["acme"])
    before = AuditLog.objects.count()
    assert upload(c, b'{"custom_id": "a"}\nnot json\n').status_code == 400
    assert upload(c, jsonl(line("a", "hi")), purpose="fine-tune").status_code == 400
    assert AuditLog.objects.count() == before

    batch_id = new_batch(c, "hi")
    file_id = Batch.objects.get(pk=batch_id).input_file_id
    count = AuditLog.objects.count()
    refused = c.delete(f"/v1/files/{file_id}")
    assert refused.status_code == 409 and batch_id in refused.json()["error"]["message"]
    assert AuditLog.objects.count() == count


def test_a_batch_run_to_the_end_records_each_stage_with_its_counts(fleet: Any,
                                                                  tenants: Any) -> None:
    c = client(fleet["acme"])
    batch_id = new_batch(c, "hello", "bad", "again")
    created = AuditLog.objects.get(object_id=batch_id, action="batch.created")
    assert created.actor == ACME and created.tenant_id == tenants["acme"].pk
    assert created.changes["lines"] == 3 and created.changes["model"] == "llama-3.1-8b"
    assert created.changes["status"] == "validating"

    drive(batch_id)

    batch = Batch.objects.get(pk=batch_id)
    assert events(batch_id) == [
        ("batch.created", ACME),
        ("batch.in_progress", audit.SYSTEM_ACTOR),
        ("batch.finalizing", audit.SYSTEM_ACTOR),
        ("batch.completed", audit.SYSTEM_ACTOR),
    ]
    completed = AuditLog.objects.get(object_id=batch_id, action="batch.completed")
    assert completed.changes == {
        "status": ["in_progress", "completed"],
        "request_counts": {"total": 3, "completed": 2, "failed": 1},
        "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id}
    assert completed.tenant_id == tenants["acme"].pk
    # The output files are named by the batch's last event, not events of their own.
    assert not AuditLog.objects.filter(object_id=batch.output_file_id).exists()


def test_a_cancel_through_the_api_is_the_keys_and_a_second_one_writes_nothing(fleet: Any) -> None:
    c = client(fleet["acme"])
    batch_id = new_batch(c, "hello")
    assert c.post(f"/v1/batches/{batch_id}/cancel").json()["status"] == "cancelled"
    assert events(batch_id) == [("batch.created", ACME), ("batch.cancelling", ACME),
                                ("batch.finalizing", ACME), ("batch.cancelled", ACME)]
    cancelled = AuditLog.objects.get(object_id=batch_id, action="batch.cancelled")
    assert cancelled.changes["status"] == ["cancelling", "cancelled"]
    assert cancelled.changes["request_counts"] == {"total": 1, "completed": 0, "failed": 0}

    count = AuditLog.objects.count()
    again = c.post(f"/v1/batches/{batch_id}/cancel")
    assert again.status_code == 409 and "already cancelled" in again.json()["error"]["message"]
    assert AuditLog.objects.count() == count


def test_an_operator_cancel_names_the_operator_and_the_reason(fleet: Any) -> None:
    batch_id = new_batch(client(fleet["acme"]), "hello")
    with audit.acting_as("olga", "runaway job"):
        intake.cancel_batch(batch_id)
    rows = AuditLog.objects.filter(object_id=batch_id).exclude(action="batch.created")
    assert {(row.action, row.actor, row.reason) for row in rows} == {
        ("batch.cancelling", "olga", "runaway job"), ("batch.finalizing", "olga", "runaway job"),
        ("batch.cancelled", "olga", "runaway job")}
    # Outside `acting_as` the connection is back to the system's name.
    Batch.objects.filter(pk=batch_id).update(status=BatchStatus.FAILED, failed_at=timezone.now())
    assert events(batch_id)[-1] == ("batch.failed", audit.SYSTEM_ACTOR)


def test_an_expired_batch_is_an_event_with_its_unsent_lines_counted_failed(fleet: Any) -> None:
    batch_id = new_batch(client(fleet["acme"]), "a", "b")
    Batch.objects.filter(pk=batch_id).update(expires_at=timezone.now() - timedelta(seconds=1))
    drive(batch_id)
    expired = AuditLog.objects.get(object_id=batch_id, action="batch.expired")
    assert expired.actor == audit.SYSTEM_ACTOR
    assert expired.changes["request_counts"] == {"total": 2, "completed": 0, "failed": 2}


def test_a_refused_batch_writes_no_event_and_a_rolled_back_change_keeps_none(
        fleet: Any) -> None:
    c = client(fleet["acme"])
    file_id = upload(c, jsonl(line("a", "hi", model="no-such-model"))).json()["id"]
    count = AuditLog.objects.count()
    refused = create(c, file_id)
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "model"
    refused = create(c, file_id, endpoint="/v1/embeddings")
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "endpoint"
    assert AuditLog.objects.count() == count and not Batch.objects.exists()

    batch_id = new_batch(c, "hello")
    count = AuditLog.objects.count()
    from django.db import transaction

    with pytest.raises(RuntimeError), transaction.atomic():
        Batch.objects.filter(pk=batch_id).update(status=BatchStatus.CANCELLING,
                                                  cancelling_at=timezone.now())
        raise RuntimeError("the change is rolled back")
    assert AuditLog.objects.count() == count


def test_a_change_that_touches_no_stage_is_not_an_event(fleet: Any) -> None:
    batch_id = new_batch(client(fleet["acme"]), "hello")
    count = AuditLog.objects.count()
    Batch.objects.filter(pk=batch_id).update(last_run_at=timezone.now(), metadata={"a": "b"})
    assert AuditLog.objects.count() == count


def test_a_change_made_in_the_admin_names_the_admin_user(fleet: Any, rf: Any,
                                                         admin_user: Any) -> None:
    from django.contrib import admin

    batch_id = new_batch(client(fleet["acme"]), "hello")
    batch = Batch.objects.get(pk=batch_id)
    request = rf.post("/admin/")
    request.user = admin_user
    batch.status, batch.failed_at = BatchStatus.FAILED, timezone.now()
    admin.site._registry[Batch].save_model(request, batch, _Form(["status"]), True)
    assert AuditLog.objects.get(object_id=batch_id, action="batch.failed").actor == "admin"
    assert events(batch_id)[-1] == ("update", "admin")  # the admin's own event


class _Form:
    """What AuditedAdmin reads of a change form."""

    def __init__(self, changed: list[str]) -> None:
        self.changed_data = changed
        self.cleaned_data = {name: "x" for name in changed}
