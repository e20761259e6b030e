"""Lines sent through an edge at batch tier: with the batch's own key (the tenant's
identity) and `x-meridian-tier: batch`, one request id per send; nothing is claimed while
the edge does not know the key yet; the key is revoked when the batch finishes; with no
edge at all, lines go straight to the replicas."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from controlplane.batches import concurrency_cache, progress, runner, transport
from controlplane.batches.models import Batch, BatchLine, LineState
from controlplane.batches.runner_key import key_name, runner_secret
from controlplane.core.models import ApiKey
from tests.local_http import LocalServer, QuietHandler

from .conftest import drive, jsonl, line
from .test_batch_api import client, create, upload

pytestmark = pytest.mark.django_db


class FakeEdge:
    """An edge's client API as the batch runner meets it: /v1/models refuses keys it does not
    know (401), completions answer; "busy-N" prompts are refused 503 N times (at
    capacity). Every completion's headers are kept."""

    def __init__(self) -> None:
        self.known: set[str] = set()
        self.sends: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        fake = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802
                key = self.headers.get("Authorization", "").removeprefix("Bearer ")
                if key not in fake.known:
                    self.answer(401, {"error": {"message": "Incorrect API key provided.",
                                                "code": "invalid_api_key"}})
                else:
                    self.answer(200, {"object": "list", "data": []})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][-1]["content"]
                with fake.lock:
                    fake.sends.append({"path": self.path, "prompt": prompt,
                                       "headers": {k.lower(): v for k, v in
                                                   self.headers.items()}})
                    seen = sum(1 for s in fake.sends if s["prompt"] == prompt)
                if prompt.startswith("busy-") and seen <= int(prompt.removeprefix("busy-")):
                    self.answer(503, {"error": {"message": "at capacity",
                                                "code": "queue_timeout"}})
                    return
                self.answer(200, {"id": "chatcmpl-1", "object": "chat.completion",
                                  "model": body["model"],
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant",
                                                           "content": f"re: {prompt}"}}],
                                  "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                            "total_tokens": 5}})

        self.http = LocalServer(Handler)
        self.url = self.http.url

    def close(self) -> None:
        self.http.close()


@pytest.fixture
def fake_edge(batch_settings: Any) -> Iterator[FakeEdge]:
    edge = FakeEdge()
    batch_settings.BATCH_EDGE_URL = edge.url + "/"
    yield edge
    edge.close()


def test_lines_go_through_the_edge_at_batch_tier_with_the_batchs_own_key(
        fleet: Any, fake_edge: FakeEdge) -> None:
    c = client(fleet["acme"])
    file_id = upload(c, jsonl(line("a", "hello"), line("b", "busy-1"), line("c", "bye"))
                     ).json()["id"]
    batch_id = create(c, file_id).json()["id"]

    wait = runner.process(batch_id, "w1", budget_s=5.0)
    assert wait is not None and wait <= 1.0   # the edge does not know the key yet
    assert fake_edge.sends == []
    assert not BatchLine.objects.filter(batch_id=batch_id).exclude(
        state=LineState.QUEUED, attempts=0).exists()

    key = ApiKey.objects.get(name=key_name(batch_id))
    assert (key.tenant.name, key.tier, key.allowed_models, key.revoked_at) == (
        "acme", "batch", ["llama-3.1-8b"], None)
    secret = runner_secret(batch_id)
    fake_edge.known.add(secret)

    drive(batch_id)

    batch = Batch.objects.get(pk=batch_id)
    assert batch.status == "completed"
    assert progress.request_counts(batch) == {"total": 3, "completed": 3, "failed": 0}
    assert fleet["eu"].prompts() == [] and fleet["us"].prompts() == []   # not direct
    short = batch_id.removeprefix("batch_")
    assert sorted(s["headers"]["x-request-id"] for s in fake_edge.sends) == [
        f"req_{short}_1_1", f"req_{short}_2_1", f"req_{short}_2_2", f"req_{short}_3_1"]
    for sent in fake_edge.sends:
        assert sent["path"] == "/v1/chat/completions"
        assert sent["headers"]["authorization"] == f"Bearer {secret}"
        assert sent["headers"]["x-meridian-tier"] == "batch"
    stored = BatchLine.objects.get(batch_id=batch_id, custom_id="b")
    assert stored.request_id == f"req_{short}_2_2" and stored.attempts == 2

    key.refresh_from_db()
    assert key.revoked_at is not None   # the batch is finished: so is its key


def test_the_first_enabled_edge_is_the_default(fleet: Any, catalog: Any) -> None:
    from controlplane.routing.models import Edge

    assert transport.batch_edge_url() is None   # no edge at all: straight to the replicas
    Edge.objects.create(name="edge-off", region=catalog["fra"], admin_url="http://a:1",
                        public_url="http://off:8100", enabled=False)
    Edge.objects.create(name="edge-b", region=catalog["fra"], admin_url="http://a:2",
                        public_url="http://first:8100/")
    Edge.objects.create(name="edge-a", region=catalog["iad"], admin_url="http://a:3",
                        public_url="http://second:8101")
    assert transport.batch_edge_url() == "http://first:8100"


def test_concurrency_grows_after_full_rounds_halves_at_capacity_and_is_shared(
        fleet: Any, fake_edge: FakeEdge) -> None:
    c = client(fleet["acme"])
    prompts = ["a", "b", "c", "d", "e", "f", "busy-1", "g", "h", "i"]
    file_id = upload(c, jsonl(*(line(f"id-{i}", p) for i, p in enumerate(prompts)))
                     ).json()["id"]
    batch_id = create(c, file_id).json()["id"]
    fake_edge.known.add(runner_secret(batch_id))
    assert concurrency_cache.load_concurrency(batch_id) is None

    assert runner.process(batch_id, "w1", budget_s=0.0) == 0.0   # one round of 4 (BATCH_CHUNK)
    assert concurrency_cache.load_concurrency(batch_id) == {"n": 5, "ttft_baseline_s": None}
    # Another worker goes on from what the first learnt: 5 lines, one refused (503).
    assert runner.process(batch_id, "w2", budget_s=0.0) == 0.0
    assert len(fake_edge.sends) == 9
    assert concurrency_cache.load_concurrency(batch_id) == {"n": 2, "ttft_baseline_s": None}

    drive(batch_id)
    assert Batch.objects.get(pk=batch_id).status == "completed"
    assert concurrency_cache.load_concurrency(batch_id) is None   # forgotten with the batch


def test_while_the_edge_does_not_answer_no_line_is_claimed_nor_attempt_spent(
        fleet: Any, batch_settings: Any) -> None:
    from .conftest import FakeEngine

    c = client(fleet["acme"])
    file_id = upload(c, jsonl(line("a", "hello"), line("b", "bye"))).json()["id"]
    batch_id = create(c, file_id).json()["id"]
    gone = FakeEngine()
    batch_settings.BATCH_EDGE_URL = gone.url
    gone.close()                                       # the edge is down (restarting)

    for _ in range(3):
        wait = runner.process(batch_id, "w1", budget_s=5.0)
        assert wait is not None and wait <= transport.EDGE_RECHECK_S
    assert not BatchLine.objects.filter(batch_id=batch_id).exclude(
        state=LineState.QUEUED, attempts=0).exists()

    edge = FakeEdge()                                  # it is back
    try:
        batch_settings.BATCH_EDGE_URL = edge.url
        edge.known.add(runner_secret(batch_id))
        drive(batch_id)
        assert sorted(s["prompt"] for s in edge.sends) == ["bye", "hello"]
        assert Batch.objects.get(pk=batch_id).status == "completed"
    finally:
        edge.close()
