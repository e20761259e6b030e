"""Fixtures for alerts: a clean environment, a deployment with replicas, edges, and a real
local HTTP server standing for the webhook receiver."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from django.utils import timezone

from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S


@pytest.fixture(autouse=True)
def alert_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No webhook and the embedded metrics source unless a test sets them."""
    from django.conf import settings

    monkeypatch.setitem(settings.MERIDIAN, "ALERT_WEBHOOK_URL", None)
    monkeypatch.setitem(settings.MERIDIAN, "ALERT_WEBHOOK_TIMEOUT_S", 5.0)
    monkeypatch.delenv("PROMETHEUS_URL", raising=False)


@pytest.fixture
def deployment(catalog: dict[str, Any], tenants: dict[str, Any]) -> Deployment:
    d = Deployment.objects.create(
        name="chat", served_model_name="llama", model=catalog["llama8b"], tenant=tenants["acme"],
        min_replicas=1, max_replicas=4, max_model_len=4096, slo_ttft_p95_ms=1000,
        slo_itl_p95_ms=50)
    d.allowed_jurisdictions.set([catalog["eu"]])
    return d


@pytest.fixture
def make_replica(catalog: dict[str, Any]) -> Callable[..., Replica]:
    from regions.models import Offer

    def make(deployment: Deployment, region: Any, state: str = S.READY) -> Replica:
        offer = Offer.objects.get(region=region, gpu_type=catalog["h100"])
        return Replica.objects.create(
            deployment=deployment, region=region, offer=offer, state=state, provider="local",
            url=f"http://127.0.0.1:9/{region.code}", ready_at=timezone.now())

    return make


@pytest.fixture
def make_edge(catalog: dict[str, Any]) -> Callable[..., Any]:
    from controlplane.routing.models import Edge

    def make(name: str, acked: int | None = None) -> Edge:
        return Edge.objects.create(name=name, region=catalog["fra"],
                                   admin_url=f"http://127.0.0.1:9/{name}",
                                   last_acked_version=acked)

    return make


@dataclass
class Receiver:
    """A webhook receiver on a real port: answers each POST with the next scripted status
    (the last one repeats), or with `hold` not until the test ends, and keeps what it was
    sent."""

    statuses: list[int] = field(default_factory=lambda: [200])
    hold: bool = False
    released: threading.Event = field(default_factory=threading.Event)
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    url: str = ""

    def next_status(self) -> int:
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    state = Receiver()
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if state.hold:
                state.released.wait(60)
            with lock:
                state.received.append(json.loads(body))
                state.headers.append(dict(self.headers))
                status = state.next_status()
            self.send_response(status)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.url = f"http://127.0.0.1:{server.server_address[1]}/hooks/meridian"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    state.released.set()
    server.shutdown()
    server.server_close()
