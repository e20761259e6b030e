"""Two workers on one batch at the same time, each on its own database connection: SKIP
LOCKED gives them different lines, and every line reaches the engine exactly once."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from django.db import connection

from controlplane.batches import intake, runner
from controlplane.batches.models import Batch, BatchLine, LineState
from controlplane.core.models import Tenant

from .conftest import jsonl, line


@pytest.fixture
def concurrent_fleet(transactional_db: Any, fleet: Any) -> Any:
    return fleet


def test_two_workers_share_a_batch_without_sending_a_line_twice(
        concurrent_fleet: Any, batch_settings: Any) -> None:
    batch_settings.BATCH_CHUNK = 3
    # The fake engine answers at once; the fixture's 0.5 s limit (for the tests of timeouts)
    # could expire under load before a request is even accepted, and its retry would count a
    # second attempt that this test is not about.
    batch_settings.BATCH_REQUEST_TIMEOUT_S = 10.0
    tenant = Tenant.objects.get(name="acme")
    source = intake.store_file(
        tenant, "in.jsonl", jsonl(*(line(f"id-{i}", f"p{i}") for i in range(40))), "batch")
    batch = intake.create_batch(tenant, intake.BatchRequest(source.id, "/v1/chat/completions"))
    start = threading.Barrier(2)
    failures: list[BaseException] = []

    def work(name: str) -> None:
        try:
            start.wait()
            for _ in range(400):
                if runner.process(batch.pk, name, budget_s=0.0) is None:
                    return
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            failures.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=work, args=(f"w{i}",)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not failures, failures
    prompts = concurrent_fleet["eu"].prompts()
    assert sorted(prompts) == sorted(f"p{i}" for i in range(40))   # each once, none twice
    assert Batch.objects.get(pk=batch.pk).status == "completed"
    lines = BatchLine.objects.filter(batch=batch)
    assert lines.filter(state=LineState.DONE, attempts=1).count() == 40
    assert set(lines.values_list("worker", flat=True)) <= {"w0", "w1"}
