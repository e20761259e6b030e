"""A worker that dies holding lines: the runner comes back when the oldest claim's lease
ends, not at the backoff cap, and then sends those lines once."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.batches import runner, transport
from controlplane.batches.models import Batch, BatchLine, LineState

from .conftest import drive, jsonl, line
from .test_batch_api import client, create, upload

pytestmark = pytest.mark.django_db


def test_the_runner_comes_back_when_a_dead_workers_lease_ends(fleet: Any,
                                                               batch_settings: Any) -> None:
    batch_settings.BATCH_LEASE_S = 20.0
    batch_settings.BATCH_BACKOFF_MAX_S = 60.0
    c = client(fleet["acme"])
    file_id = upload(c, jsonl(*(line(f"id-{i}", f"p{i}") for i in range(3)))).json()["id"]
    batch = Batch.objects.get(pk=create(c, file_id).json()["id"])
    held = runner.claim(batch, "dead-worker", 2)          # then its worker is SIGKILLed

    wait = runner.process(batch.pk, "w2", budget_s=5.0)
    assert wait is not None and 15.0 < wait <= 20.0        # the lease, not the 60 s cap
    assert fleet["eu"].prompts() == ["p2"]                  # only the line nobody held

    batch_settings.BATCH_LEASE_S = 0.0                      # the lease has run out
    drive(batch.pk)
    assert sorted(fleet["eu"].prompts()) == ["p0", "p1", "p2"]   # each sent once
    assert {x.custom_id for x in held} == {"id-0", "id-1"}
    assert not BatchLine.objects.filter(batch=batch).exclude(state=LineState.DONE).exists()


def test_a_worker_past_its_lease_stores_nothing_for_lines_claimed_again(
        fleet: Any, batch_settings: Any) -> None:
    c = client(fleet["acme"])
    file_id = upload(c, jsonl(line("id-0", "p0"))).json()["id"]
    batch = Batch.objects.get(pk=create(c, file_id).json()["id"])
    slow = runner.claim(batch, "slow-worker", 1)[0]      # its send outlives the lease
    batch_settings.BATCH_LEASE_S = 0.0
    again = runner.claim(batch, "w2", 1)[0]
    assert again.custom_id == "id-0" and again.attempts == 2

    late = transport.Outcome(200, {"from": "slow"}, "req_slow")
    assert runner.record(slow, "slow-worker", late) is False    # w2 holds the line now
    assert runner.record(slow, "slow-worker", transport.Outcome(400, {}, "r")) is False
    stored = BatchLine.objects.get(pk=again.pk)
    assert (stored.state, stored.result, stored.worker) == (LineState.RUNNING, None, "w2")

    assert runner.record(again, "w2", transport.Outcome(200, {"from": "w2"}, "req_w2"))
    stored.refresh_from_db()
    assert (stored.state, stored.result, stored.request_id) == (
        LineState.DONE, {"from": "w2"}, "req_w2")
    assert runner.claim(batch, "w3", 1) == []            # stored: never claimed again
