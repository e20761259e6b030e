"""Batches on a batch-tier deployment of their model (a batch pool): its replicas alone take
the lines, and while it has none (scaled to zero, starting) the edge's "no replica" answer
is not an attempt: the runner sends one line now and then, which is what wakes the pool,
and holds the rest unclaimed, within the batch's window."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from controlplane.batches import runner, transport
from controlplane.batches.models import Batch, BatchLine
from controlplane.core.models import Tier
from controlplane.deployments.models import Deployment, Replica, ReplicaState
from tests.local_http import LocalServer, QuietHandler

from .conftest import FakeEngine, drive, jsonl, line
from .test_batch_api import client, create, output_lines, upload

pytestmark = pytest.mark.django_db


class PoolEdge:
    """An edge in front of a batch pool: it knows every key; while `serving` is off it
    answers completions as the edge does with no replica of the model (503 no_replicas)."""

    def __init__(self) -> None:
        self.serving = False
        self.sends: list[str] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802
                self.answer(200, {"object": "list", "data": []})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with fake.lock:
                    fake.sends.append(self.headers["x-request-id"])
                if not fake.serving:
                    self.answer(503, {"error": {
                        "message": f"No replica of model {body['model']} is serving right now.",
                        "type": "server_error", "param": None, "code": "no_replicas"}})
                    return
                self.answer(200, {"id": "chatcmpl-1", "object": "chat.completion",
                                  "model": body["model"], "choices": [],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                            "total_tokens": 5}})

        self.http = LocalServer(Handler)
        self.url = self.http.url

    def close(self) -> None:
        self.http.close()


@pytest.fixture
def pool(fleet: Any, catalog: Any) -> Deployment:
    """A shared batch-tier deployment of the fleet's model, at zero."""
    d = Deployment.objects.create(name="llama-batch", served_model_name="llama-3.1-8b",
                                  model=catalog["llama8b"], tier=Tier.BATCH, min_replicas=0)
    d.allowed_jurisdictions.set([catalog["eu"], catalog["us"]])
    return d


@pytest.fixture
def pool_edge(batch_settings: Any) -> Iterator[PoolEdge]:
    edge = PoolEdge()
    batch_settings.BATCH_EDGE_URL = edge.url
    batch_settings.BATCH_WAKE_RECHECK_S = 30.0
    yield edge
    edge.close()


def _submit(fleet: Any, n: int) -> str:
    c = client(fleet["acme"])
    file_id = upload(c, jsonl(*(line(f"l{i}", f"p{i}") for i in range(n)))).json()["id"]
    return str(create(c, file_id).json()["id"])


def _lines(batch_id: str) -> list[tuple[str, int]]:
    return list(BatchLine.objects.filter(batch_id=batch_id).order_by("line_number")
                .values_list("state", "attempts"))


def test_a_waking_pool_gets_one_line_at_a_time_and_no_attempt_is_spent(
        fleet: Any, pool: Deployment, pool_edge: PoolEdge, catalog: Any) -> None:
    batch_id = _submit(fleet, 5)
    # The interactive deployment's replicas are ready, but the pool has none: one line goes
    # (to wake it), the answer is "no replica", and the runner comes back later.
    wait = runner.process(batch_id, "w1", budget_s=5.0)
    assert wait == 30.0
    assert len(pool_edge.sends) == 1
    assert _lines(batch_id) == [("queued", 0)] * 5
    first = BatchLine.objects.get(batch_id=batch_id, line_number=1)
    assert first.error is not None and first.next_attempt_at is not None
    assert first.error["code"] == "no_replicas" and first.next_attempt_at > timezone.now()

    # More often than BATCH_MAX_ATTEMPTS (3): still no attempt spent, nothing failed.
    for _ in range(4):
        BatchLine.objects.filter(batch_id=batch_id).update(next_attempt_at=None)
        assert runner.process(batch_id, "w1", budget_s=5.0) == 30.0
    assert len(pool_edge.sends) == 5
    assert _lines(batch_id) == [("queued", 0)] * 5
    assert fleet["eu"].prompts() == [] and fleet["us"].prompts() == []

    # A replica of the pool serves: every line completes, each on its first attempt.
    engine = FakeEngine()
    try:
        Replica.objects.create(deployment=pool, region=catalog["fra"], url=engine.url,
                               state=ReplicaState.READY)
        pool_edge.serving = True
        BatchLine.objects.filter(batch_id=batch_id).update(next_attempt_at=None)
        drive(batch_id)
    finally:
        engine.close()
    assert _lines(batch_id) == [("done", 1)] * 5
    batch = Batch.objects.get(pk=batch_id)
    assert batch.status == "completed"
    assert len(output_lines(client(fleet["acme"]), batch.output_file_id)) == 5


def test_the_window_still_bounds_the_wait_for_a_pool(
        fleet: Any, pool: Deployment, pool_edge: PoolEdge) -> None:
    batch_id = _submit(fleet, 2)
    runner.process(batch_id, "w1", budget_s=5.0)
    Batch.objects.filter(pk=batch_id).update(expires_at=timezone.now() - timedelta(seconds=1))
    assert runner.process(batch_id, "w1", budget_s=5.0) is None
    batch = Batch.objects.get(pk=batch_id)
    assert batch.status == "expired"
    errors = output_lines(client(fleet["acme"]), batch.error_file_id)
    assert [e["error"]["code"] for e in errors] == ["batch_expired", "batch_expired"]


def test_with_a_pool_its_replicas_alone_take_the_lines(
        fleet: Any, pool: Deployment, catalog: Any) -> None:
    """No edge: lines go straight to the pool's ready replica, never the interactive ones;
    with no ready replica in the pool nothing is sent (only an edge's count wakes it)."""
    batch_id = _submit(fleet, 3)
    batch = Batch.objects.select_related("tenant").get(pk=batch_id)
    assert transport.has_batch_pool(batch)
    assert transport.eligible_replicas(batch, pool=True) == []
    assert runner.process(batch_id, "w1", budget_s=5.0) is not None
    assert _lines(batch_id) == [("queued", 0)] * 3

    engine = FakeEngine()
    try:
        Replica.objects.create(deployment=pool, region=catalog["fra"], url=engine.url,
                               state=ReplicaState.READY)
        drive(batch_id)
        assert sorted(engine.prompts()) == ["p0", "p1", "p2"]
    finally:
        engine.close()
    assert fleet["eu"].prompts() == [] and fleet["us"].prompts() == []


def test_another_tenants_pool_is_not_this_tenants(
        fleet: Any, pool: Deployment, tenants: Any) -> None:
    pool.tenant = tenants["globex"]
    pool.save()
    batch_id = _submit(fleet, 1)
    batch = Batch.objects.select_related("tenant").get(pk=batch_id)
    assert not transport.has_batch_pool(batch)   # acme's lines use the shared replicas
    drive(batch_id)
    assert fleet["eu"].prompts() == ["p0"]
