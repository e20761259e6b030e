"""Fixtures for failover: replicas whose /health answers as a test wants, a deployment."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from django.utils import timezone

from controlplane.deployments.lifecycle import transition
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.failover import services
from controlplane.provisioning.local import free_port
from tests.local_http import LocalServer, QuietHandler
from tests.provisioning.conftest import (  # noqa: F401 (the local provider's fixtures)
    enginesim,
    lab_regions,
    local_provider,
    state_dir,
)


class Engine:
    """A /health endpoint on a real port whose answer a test switches: ok, slow or gone. A
    slow one answers only once closed, so no probe timeout can be long enough to see it
    answer, however loaded the machine."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.released = threading.Event()
        engine = self

        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802
                if engine.mode == "slow":
                    engine.released.wait(60)
                self.send_response(200 if engine.mode != "error" else 500)
                self.end_headers()

        self.http = LocalServer(Handler)
        self.url = self.http.url

    def close(self) -> None:
        self.released.set()
        self.http.close()


@pytest.fixture
def engines() -> Iterator[Callable[[], Engine]]:
    made: list[Engine] = []

    def make() -> Engine:
        made.append(Engine())
        return made[-1]

    yield make
    for engine in made:
        engine.close()


def dead_url() -> str:
    """A URL on a port nothing listens on: connections are refused."""
    port = free_port()
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    return f"http://127.0.0.1:{port}"


@pytest.fixture
def deployment(catalog: dict[str, Any]) -> Deployment:
    d = Deployment.objects.create(name="chat", served_model_name="llama", model=catalog["llama8b"],
                                  min_replicas=2, max_replicas=6, max_model_len=4096)
    d.allowed_jurisdictions.set([catalog["eu"]])
    d.user_regions.set([catalog["fra"]])
    return d


@pytest.fixture
def ready_replica(catalog: dict[str, Any]) -> Callable[..., Replica]:
    from regions.models import Offer

    def make(deployment: Deployment, region: Any, url: str) -> Replica:
        offer = Offer.objects.get(region=region, gpu_type=catalog["h100"])
        return Replica.objects.create(deployment=deployment, region=region, offer=offer,
                                      url=url, state=S.READY, provider="skypilot",
                                      ready_at=timezone.now())
    return make


def fail_one_and_ready_its_replacement(deployment: Deployment, region: Any,
                                       ready_replica: Callable[..., Replica],
                                       engines: Callable[[], Engine]) -> Replica:
    """One replica serving and one whose engine is gone; the watch loop fails the second and
    places a replacement, taken here through its launch to ready (on a serving engine)."""
    ready_replica(deployment, region, engines().url)
    ready_replica(deployment, region, dead_url())
    services.watch()
    (new,) = Replica.objects.filter(state=S.PENDING)
    for state in (S.PROVISIONING, S.STARTING):
        transition(new, state, actor="test", reason="launching")
    return transition(new, S.READY, actor="test", reason="ready", url=engines().url)


@pytest.fixture(autouse=True)
def fresh_probe_counts() -> Iterator[None]:
    """Timeout counts live in Redis by replica id; ids restart with each test database."""
    from controlplane.core.redis_clients import redis_client

    def clear() -> None:
        client = redis_client()
        for key in client.scan_iter("meridian:failover:*"):
            client.delete(key)

    clear()
    yield
    clear()
