"""A batch's lines are counted by one rule for the API's `request_counts` and the
dashboard's progress. A running line whose worker's lease ran out is pending work (the next
runner claims it again): it counts as waiting, not running."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.batches import progress, runner, transport
from controlplane.batches.models import Batch

from .conftest import jsonl, line
from .test_batch_api import client, create, upload

pytestmark = pytest.mark.django_db


def test_a_line_past_its_lease_is_pending_not_running(fleet: Any, batch_settings: Any) -> None:
    batch_settings.BATCH_LEASE_S = 600.0
    c = client(fleet["acme"])
    file_id = upload(c, jsonl(*(line(f"id-{i}", f"p{i}") for i in range(4)))).json()["id"]
    batch = Batch.objects.get(pk=create(c, file_id).json()["id"])
    held = runner.claim(batch, "dead-worker", 2)
    assert runner.record(held[0], "dead-worker", transport.Outcome(200, {"ok": 1}, "r"))

    live = progress.progress_of([batch])[batch.pk]
    assert (live.total, live.completed, live.failed, live.running, live.queued) == (
        4, 1, 0, 1, 2)

    batch_settings.BATCH_LEASE_S = 0.0   # the worker died: its claim ran out
    lapsed = progress.progress_of([batch])[batch.pk]
    assert (lapsed.running, lapsed.queued) == (0, 3)
    assert progress.request_counts(batch) == {
        "total": lapsed.total, "completed": lapsed.completed, "failed": lapsed.failed}
