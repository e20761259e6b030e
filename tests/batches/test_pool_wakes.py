"""A batch-tier deployment at zero, woken by a batch and taken back to zero after it, at the
service level with real Postgres, Redis and a real edge: the runner sends one line through
the edge, which answers 503 no_replicas and counts it; the edge's counters, scraped into
EdgeSample rows, are the autoscaler's demand for the pool, which scales it to one; once its
replica serves (the provider's part is played by the test: the pending row gets an engine
and is ready) and the tables carry it, every line completes there, none on the interactive
replicas; idle for SCALE_DOWN_WINDOW_S (shortened here), the pool goes back to zero.

The batches and scaling apps are siblings and never call each other: the signal between
them is the edge's count of requests it could not route, as for any request."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from controlplane.batches import progress, runner
from controlplane.batches.models import Batch, BatchLine
from controlplane.core.models import Tier
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.routing import edge_secrets
from controlplane.routing import services as routing
from controlplane.routing.models import Edge as EdgeRow
from controlplane.scaling import autoscaler
from controlplane.telemetry.models import ReplicaSample
from controlplane.telemetry.services import collect_edges
from edge.keys import load_public_key_file
from edge.server import Edge, EdgeConfig

from .conftest import FakeEngine, drive, jsonl, line
from .test_batch_api import client, create, upload

pytestmark = pytest.mark.django_db


@pytest.fixture
def edge(catalog: Any, tmp_path: Path, signing_key_file: Path) -> Iterator[EdgeRow]:
    """A real edge in a thread of its own, registered as the control plane's only edge (so
    the batch runner sends through it), verifying the tables the control plane signs with
    the routing tests' key and taking them on its admin port with its own secret."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = Edge(EdgeConfig(name="edge-eu", region="local:test-1", state_dir=tmp_path / "edge",
                             public_keys=[load_public_key_file(signing_key_file)],
                             admin_secret=edge_secrets.edge_secret("edge-eu"),
                             pull_interval_s=3600, probes=False))
    port, admin_port = asyncio.run_coroutine_threadsafe(
        server.start(("127.0.0.1", 0), ("127.0.0.1", 0)), loop).result(10)
    try:
        yield EdgeRow.objects.create(name="edge-eu", region=catalog["fra"],
                                     admin_url=f"http://127.0.0.1:{admin_port}",
                                     public_url=f"http://127.0.0.1:{port}")
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(drain_s=0.5), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _publish() -> None:
    report = routing.publish()
    assert report.acked == 1, report


def _decision(outcomes: list[autoscaler.Outcome], name: str) -> Any:
    [outcome] = [o for o in outcomes if o.deployment == name]
    return outcome.recorded


def test_a_batch_wakes_its_pool_from_zero_and_the_pool_goes_back_to_zero(
        fleet: Any, catalog: Any, edge: EdgeRow, batch_settings: Any) -> None:
    batch_settings.BATCH_WAKE_RECHECK_S = 0.2
    pool = Deployment.objects.create(
        name="llama-batch", served_model_name="llama-3.1-8b", model=catalog["llama8b"],
        tier=Tier.BATCH, min_replicas=0, max_replicas=2, scale_down_cooldown_s=0)
    pool.allowed_jurisdictions.set([catalog["eu"]])
    c = client(fleet["acme"])
    file_id = upload(c, jsonl(*(line(f"l{i}", f"p{i}") for i in range(3)))).json()["id"]
    batch_id = create(c, file_id).json()["id"]

    # An edge with no table yet (503 to everything): nothing is sent, no attempt spent.
    assert runner.process(batch_id, "w1", budget_s=5.0) == 0.05   # the backoff cap here
    assert list(BatchLine.objects.filter(batch_id=batch_id).values_list("state", "attempts")
                ) == [("queued", 0)] * 3
    _publish()   # with the batch's own key, made by that first run
    collect_edges()
    # The pool has no replica: one line goes, the edge answers 503 no_replicas and counts
    # it; no attempt is spent and the rest wait unclaimed.
    assert runner.process(batch_id, "w1", budget_s=5.0) == pytest.approx(0.2)
    assert list(BatchLine.objects.filter(batch_id=batch_id).values_list("state", "attempts")
                ) == [("queued", 0)] * 3
    collect_edges()

    woken = _decision(autoscaler.run(), "llama-batch")
    assert (woken.direction, woken.replicas_before, woken.replicas_after) == ("up", 0, 1)
    assert "scale from zero" in woken.reason and woken.signals["unserved_requests"] >= 1
    [replica] = Replica.objects.filter(deployment=pool)
    assert replica.state == S.PENDING

    engine = FakeEngine()
    try:
        # The provider launches it and the readiness check passes (provisioning's part).
        Replica.objects.filter(pk=replica.pk).update(url=engine.url, state=S.READY)
        _publish()
        drive(batch_id)
        assert sorted(engine.prompts()) == ["p0", "p1", "p2"]
    finally:
        engine.close()
    batch = Batch.objects.get(pk=batch_id)
    assert batch.status == "completed"
    assert progress.request_counts(batch) == {"total": 3, "completed": 3, "failed": 0}
    assert list(BatchLine.objects.filter(batch_id=batch_id).values_list("attempts", flat=True)
                ) == [1, 1, 1]
    assert fleet["eu"].prompts() == [] and fleet["us"].prompts() == []   # interactive's

    # Idle after the batch: the engine's scrapes (every 2 s, as telemetry.collect stores
    # them) show nothing running for longer than the window, and the pool goes to zero.
    batch_settings.SCALE_DOWN_WINDOW_S = 4.0
    now = timezone.now()
    ReplicaSample.objects.bulk_create([
        ReplicaSample(replica=replica, at=now - timedelta(seconds=s), up=True, running=0,
                      waiting=0, kv_usage=0.0) for s in (6, 4, 2, 0)])
    gone = _decision(autoscaler.run(), "llama-batch")
    assert (gone.direction, gone.replicas_before, gone.replicas_after) == ("down", 1, 0)
    assert "batch tier scales to zero" in gone.reason
    replica.refresh_from_db()
    assert replica.state == S.DRAINING
