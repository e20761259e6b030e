"""A replica behind a black hole — packets dropped, no reset, a connect that hangs — is found
by probe timeouts, not only by refused connections: its /health probe times out within its
bound, and two such probes in a row fail it, so a black-holed region goes down and is
replaced on the watch loop's second pass (a crash takes the first)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.failover import services
from controlplane.failover.health import TIMEOUTS_TO_FAIL, Probe, replica_verdict
from controlplane.failover.models import Health, RegionHealth
from controlplane.failover.probes import probe_all
from controlplane.lab import netns


@contextlib.contextmanager
def black_hole() -> Iterator[str]:
    """A listening socket that never accepts, its accept queue full: the kernel drops further
    SYNs, so a connect neither completes nor is refused."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(0)
    port = server.getsockname()[1]
    held = []
    try:
        while True:
            client = socket.socket()
            client.settimeout(0.3)
            try:
                client.connect(("127.0.0.1", port))
            except TimeoutError:
                client.close()
                break
            held.append(client)
            assert len(held) < 64, "the accept queue never filled"
        yield f"http://127.0.0.1:{port}"
    finally:
        for client in held:
            client.close()
        server.close()


def probe_within(targets: dict[int, str], timeout_s: float, bound_s: float) -> dict[int, Probe]:
    """probe_all, which must answer before bound_s (a deadline, not a timing)."""
    answer: dict[int, Probe] = {}
    thread = threading.Thread(target=lambda: answer.update(probe_all(targets, timeout_s)),
                              daemon=True)
    thread.start()
    thread.join(bound_s)
    assert not thread.is_alive(), "the probe outlived its bound"
    return answer


def test_a_black_holed_health_check_times_out_and_fails_on_the_second_timeout() -> None:
    with black_hole() as url:
        probe = probe_within({1: url}, timeout_s=0.5, bound_s=20)[1]
    assert not probe.ok and probe.timed_out, probe.detail
    failed, timeouts = replica_verdict(probe, 0)
    assert not failed and timeouts == 1
    for _ in range(TIMEOUTS_TO_FAIL - 1):
        failed, timeouts = replica_verdict(probe, timeouts)
    assert failed


def test_a_partitioned_namespace_times_out_the_probe_too() -> None:
    reason = netns.why_unavailable()
    if reason:
        pytest.skip(reason)
    with netns.lab() as lab:
        region = lab.region()
        code = ("import http.server as h\n"
                "class H(h.BaseHTTPRequestHandler):\n"
                "    def do_GET(self):\n"
                "        self.send_response(200); self.end_headers()\n"
                "    def log_message(self, *a): pass\n"
                f"s = h.HTTPServer(({region.address!r}, 9200), H)\n"
                "print('READY', flush=True); s.serve_forever()\n")
        server = region.popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        try:
            assert server.stdout is not None and b"READY" in server.stdout.readline()
            url = f"http://{region.address}:9200"
            assert probe_within({1: url}, timeout_s=2.0, bound_s=20)[1].ok
            region.partition()
            probe = probe_within({1: url}, timeout_s=0.5, bound_s=20)[1]
            assert not probe.ok and probe.timed_out, probe.detail
        finally:
            server.kill()
            server.wait()


@pytest.mark.django_db
def test_a_black_holed_region_goes_down_and_is_replaced_on_the_second_pass(  # type: ignore[no-untyped-def]
        catalog, deployment, ready_replica, sent_tasks):
    deployment.spread_regions = 2
    deployment.save()
    with black_hole() as first, black_hole() as second:
        lost = [ready_replica(deployment, catalog["fra"], url) for url in (first, second)]
        report = services.watch()
        assert report.failed == []  # one timeout may be a stall under load
        report = services.watch()
    assert sorted(report.failed) == sorted(r.public_id for r in lost)
    assert report.regions_down == ["aws:eu-central-1"]
    assert RegionHealth.objects.get(region=catalog["fra"]).state == Health.DOWN
    new = list(Replica.objects.filter(state=S.PENDING))
    assert len(new) == 2 and {r.region for r in new} == {catalog["ams"]}
