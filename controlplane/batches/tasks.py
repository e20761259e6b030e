"""The batch runner: a thin Celery wrapper over `services.process` that comes back when the
next line is due, until the batch is finished."""

from __future__ import annotations

import os
import socket

from celery import shared_task
from django.conf import settings

from controlplane.batches import services


@shared_task(name="batches.run_batch")
def run_batch(batch_id: str) -> str:
    """Send a batch's due lines for up to BATCH_TASK_BUDGET_S, then queue itself again for
    when the next line is due (another worker may run the same batch meanwhile: lines are
    claimed with SKIP LOCKED)."""
    worker = f"{socket.gethostname()}:{os.getpid()}"
    wait = services.process(batch_id, worker,
                            budget_s=float(getattr(settings, "BATCH_TASK_BUDGET_S", 30.0)))
    if wait is None:
        return "finished"
    run_batch.apply_async((batch_id,), countdown=max(0.0, wait))
    return f"again in {wait:.1f}s"
