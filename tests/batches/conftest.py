"""A scripted engine over HTTP, a shared deployment with a replica in each jurisdiction, and
a tenant key: what the Batch API's tests run against."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.local_http import LocalServer, QuietHandler
from tests.routing.conftest import signing_key_file

__all__ = ["signing_key_file"]  # the routing tests' fixture: lines past the edges are salted


class FakeEngine:
    """Answers /v1/chat/completions and /v1/completions like vLLM. A prompt names what to do:
    "fail-N" answers 500 N times then 200, "busy-N" 429 N times, "bad" 400 always, "slow"
    answers only once the engine is closed, past any request timeout however loaded the
    machine. Every request is kept, by prompt."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.released = threading.Event()
        engine = self

        class Handler(QuietHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
                with engine.lock:
                    engine.requests.append({"path": self.path, "body": body})
                    seen = sum(1 for r in engine.requests if _prompt(r["body"]) == prompt)
                status = 200
                for kind, code in (("fail-", 500), ("busy-", 429)):
                    if prompt.startswith(kind) and seen <= int(prompt.removeprefix(kind)):
                        status = code
                if prompt == "bad":
                    status = 400
                if prompt == "slow":
                    engine.released.wait(60)
                if status == 200:
                    answer: dict[str, Any] = {
                        "id": f"chatcmpl-{len(engine.requests)}", "object": "chat.completion",
                        "model": body["model"],
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": f"re: {prompt}"}}],
                        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}
                else:
                    answer = {"error": {"message": f"scripted {status}", "type": "scripted",
                                        "param": None, "code": status}}
                raw = json.dumps(answer).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(raw)))
                    self.end_headers()
                    self.wfile.write(raw)
                except OSError:
                    pass

        self.http = LocalServer(Handler)
        self.url = self.http.url

    def prompts(self) -> list[str]:
        with self.lock:
            return [_prompt(r["body"]) for r in self.requests]

    def close(self) -> None:
        self.released.set()
        self.http.close()


def _prompt(body: dict[str, Any]) -> str:
    return str(body["messages"][-1]["content"] if "messages" in body else body["prompt"])


@pytest.fixture
def engines() -> Iterator[dict[str, FakeEngine]]:
    eu, us = FakeEngine(), FakeEngine()
    yield {"eu": eu, "us": us}
    eu.close()
    us.close()


@pytest.fixture
def batch_settings(settings: Any) -> Any:
    settings.BATCH_BACKOFF_BASE_S = 0.01
    settings.BATCH_BACKOFF_MAX_S = 0.05
    settings.BATCH_MAX_ATTEMPTS = 3
    settings.BATCH_REQUEST_TIMEOUT_S = 2.0  # the fake engine answers at once, "slow" never
    settings.BATCH_CHUNK = 4
    return settings


@pytest.fixture
def fleet(catalog: Any, tenants: Any, engines: dict[str, FakeEngine], batch_settings: Any,
          sent_tasks: Any, signing_key_file: Any) -> dict[str, Any]:
    """A shared llama deployment allowed in the EU and the US with a ready replica in each;
    acme may use the EU only, so its lines must never reach the US engine. `sent_tasks`
    keeps the runner's Celery task off the broker; the tests run it themselves."""
    from controlplane.core.services import issue_api_key
    from controlplane.deployments.models import Deployment, Replica, ReplicaState

    deployment = Deployment.objects.create(name="llama", served_model_name="llama-3.1-8b",
                                           model=catalog["llama8b"])
    deployment.allowed_jurisdictions.set([catalog["eu"], catalog["us"]])
    Replica.objects.create(deployment=deployment, region=catalog["fra"], url=engines["eu"].url,
                           state=ReplicaState.READY)
    Replica.objects.create(deployment=deployment, region=catalog["iad"], url=engines["us"].url,
                           state=ReplicaState.READY)
    us_only = Deployment.objects.create(name="us-only", served_model_name="us-model",
                                        model=catalog["llama8b"])
    us_only.allowed_jurisdictions.set([catalog["us"]])
    _, acme_key = issue_api_key(tenants["acme"], "acme", "batch")
    _, globex_key = issue_api_key(tenants["globex"], "globex", "batch")
    _, narrow_key = issue_api_key(tenants["acme"], "narrow", "batch", ["other-model"])
    return {"acme": acme_key, "globex": globex_key, "narrow": narrow_key, "sent": sent_tasks,
            **engines}


def line(custom_id: str, prompt: str, model: str = "llama-3.1-8b",
         url: str = "/v1/chat/completions") -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "messages": [{"role": "user", "content": prompt}],
                     "max_tokens": 8}}


def jsonl(*rows: Any) -> bytes:
    return b"".join(json.dumps(row).encode() + b"\n" for row in rows)


def drive(batch_id: str, worker: str = "test-worker", rounds: int = 400) -> None:
    """Run the batch the way the Celery task does, until it is finished."""
    from controlplane.batches import runner

    for _ in range(rounds):
        wait = runner.process(batch_id, worker, budget_s=5.0)
        if wait is None:
            return
        time.sleep(min(wait, 0.05))
    raise AssertionError(f"batch {batch_id} did not finish")
