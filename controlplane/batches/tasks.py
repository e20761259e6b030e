"""The batch runner: a thin Celery wrapper over `runner.process` that comes back when the
next line is due, until the batch is finished; and the sweep that finds batches whose
runner's message was lost (the rows are the truth, not the messages)."""

from __future__ import annotations

import os
import socket

from celery import shared_task
from django.conf import settings

from controlplane.batches import runner
from controlplane.core.locks import advisory_lock


@shared_task(name="batches.run_batch")
def run_batch(batch_id: str) -> str:
    """Send a batch's due lines for up to BATCH_TASK_BUDGET_S, then queue itself again for
    when the next line is due (another worker may run the same batch meanwhile: lines are
    claimed with SKIP LOCKED)."""
    worker = f"{socket.gethostname()}:{os.getpid()}"
    wait = runner.process(batch_id, worker,
                          budget_s=float(getattr(settings, "BATCH_TASK_BUDGET_S", 30.0)))
    if wait is None:
        return "finished"
    run_batch.apply_async((batch_id,), countdown=max(0.0, wait))
    return f"again in {wait:.1f}s"


@shared_task(name="batches.sweep")
def sweep() -> dict[str, int]:
    """Every 30 s: queue the runner again for every stalled batch."""
    with advisory_lock("batches.sweep") as acquired:
        if not acquired:
            return {"skipped": 1}
        stalled = runner.stalled_batches()
    for batch_id in stalled:
        run_batch.delay(batch_id)
    return {"requeued": len(stalled)}
