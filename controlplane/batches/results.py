"""A batch's results: the output and error files in OpenAI's line format, written once when
the batch ends (completed, expired, cancelled or failed), and the batch's end itself."""

from __future__ import annotations

import json
from collections.abc import Iterable

from django.db import transaction
from django.utils import timezone

from controlplane.batches.concurrency_cache import save_concurrency
from controlplane.batches.models import (
    FINISHED,
    Batch,
    BatchFile,
    BatchLine,
    BatchStatus,
    FilePurpose,
    LineState,
)
from controlplane.batches.runner_key import revoke_runner_key

# The field that stamps each way a batch ends.
ENDED_AT = {BatchStatus.COMPLETED: "completed_at", BatchStatus.EXPIRED: "expired_at",
            BatchStatus.CANCELLED: "cancelled_at", BatchStatus.FAILED: "failed_at"}


def output_line(line: BatchLine) -> dict[str, object]:
    """One line of the output or error file: OpenAI's `batch_req` object."""
    response = None
    if line.response_status is not None and line.result is not None:
        response = {"status_code": line.response_status, "request_id": line.request_id,
                    "body": line.result}
    return {"id": f"batch_req_{line.batch_id.removeprefix('batch_')}_{line.line_number}",
            "custom_id": line.custom_id, "response": response,
            "error": None if line.state == LineState.DONE else line.error}


def jsonl(rows: Iterable[dict[str, object]]) -> bytes:
    return b"".join(json.dumps(row, separators=(",", ":")).encode() + b"\n" for row in rows)


def finalize(batch_id: str, status: str) -> Batch:
    """Write the output and error files and end the batch, once: a finished batch is left
    as it is. Expired batches list their unsent lines in the error file; cancelled ones do
    not (as OpenAI's). The batch's key is revoked and what its runners learnt forgotten."""
    now = timezone.now()
    with transaction.atomic():
        batch = Batch.objects.select_for_update().get(pk=batch_id)
        if batch.status in FINISHED:
            return batch
        batch.finalizing_at = batch.finalizing_at or now
        if status == BatchStatus.EXPIRED:
            batch.lines.filter(state__in=[LineState.QUEUED, LineState.RUNNING]).update(
                state=LineState.FAILED, finished_at=now,
                error={"code": "batch_expired",
                       "message": "This request could not be executed before the completion "
                                  "window expired."})
        done = batch.lines.filter(state=LineState.DONE).order_by("line_number")
        failed = batch.lines.filter(state=LineState.FAILED).order_by("line_number")
        batch.output_file = _result_file(batch, "output", done)
        batch.error_file = _result_file(batch, "errors", failed)
        batch.status = status
        setattr(batch, ENDED_AT[BatchStatus(status)], now)
        batch.save()
    revoke_runner_key(batch.pk)
    save_concurrency(batch.pk, None)
    return batch


def _result_file(batch: Batch, kind: str, lines: Iterable[BatchLine]) -> BatchFile | None:
    rows = [output_line(line) for line in lines]
    if not rows:
        return None
    content = jsonl(rows)
    return BatchFile.objects.create(
        tenant_id=batch.tenant_id, purpose=FilePurpose.BATCH_OUTPUT,
        filename=f"{batch.id}_{kind}.jsonl", bytes=len(content), line_count=len(rows),
        content=content)
