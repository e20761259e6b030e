"""Batches written straight into the database for the dashboard's tests: a tenant's input
file, the batch and its lines in chosen states, finished at chosen times."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

from django.utils import timezone

from controlplane.batches.models import Batch, BatchFile, BatchLine, BatchStatus, LineState


def make_batch(tenant: Any, *, done: int = 0, failed: int = 0, running: int = 0,
               queued: int = 0, status: str = BatchStatus.IN_PROGRESS,
               finished_over_s: float = 120.0, now: datetime | None = None,
               model: str = "llama-3.1-8b") -> Batch:
    """A batch whose `done` and `failed` lines finished evenly over the last
    `finished_over_s` seconds; a completed line used 5 tokens; failed ones a 400 or a
    timeout."""
    now = now or timezone.now()
    total = done + failed + running + queued
    source = BatchFile.objects.create(tenant=tenant, purpose="batch", filename="in.jsonl",
                                      bytes=100 * total, line_count=total, content=b"{}\n")
    started = now - timedelta(seconds=finished_over_s)
    batch = Batch.objects.create(
        tenant=tenant, input_file=source, endpoint="/v1/chat/completions", model=model,
        status=status, expires_at=now + timedelta(hours=23), in_progress_at=started)
    states = ([LineState.DONE] * done + [LineState.FAILED] * failed
              + [LineState.RUNNING] * running + [LineState.QUEUED] * queued)
    finished = max(done + failed, 1)
    lines = []
    for i, state in enumerate(states):
        number = i + 1
        row = BatchLine(batch=batch, line_number=number, custom_id=f"req-{number}",
                        body={"model": model}, state=state, attempts=0)
        if state in (LineState.DONE, LineState.FAILED):
            row.finished_at = started + timedelta(seconds=finished_over_s * (i + 1) / finished)
            row.attempts = 1
        if state == LineState.DONE:
            row.response_status = 200
            row.result = {"usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                    "total_tokens": 5}}
        elif state == LineState.FAILED:
            timed_out = i % 2 == 1
            row.response_status = None if timed_out else 400
            row.attempts = 5 if timed_out else 1
            row.error = ({"code": "request_failed", "message": "TimeoutError (after 5 attempts)"}
                         if timed_out else
                         {"code": "http_400", "message": f"bad prompt on line {number}"})
        elif state == LineState.RUNNING:
            row.claimed_at = now
            row.worker = "w1"
            row.attempts = 1
        lines.append(row)
    BatchLine.objects.bulk_create(lines)
    return batch


def finish(batch: Batch, status: str = BatchStatus.COMPLETED) -> Batch:
    """Mark the batch ended as `status`, stamped now."""
    now = timezone.now()
    stamp = {BatchStatus.COMPLETED: "completed_at", BatchStatus.EXPIRED: "expired_at",
             BatchStatus.CANCELLED: "cancelled_at", BatchStatus.FAILED: "failed_at"}[
        BatchStatus(status)]
    Batch.objects.filter(pk=batch.pk).update(status=status, finalizing_at=now, **{stamp: now})
    batch.refresh_from_db()
    return batch
