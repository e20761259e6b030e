"""The delaying relay adds the configured latency in each direction, changes no byte, and does
not turn the delay into a throughput limit."""

from __future__ import annotations

import hashlib
import socket
import statistics
import time

import pytest

from controlplane.provisioning.local import free_port
from controlplane.provisioning.netem import parse_listen

from .helpers import start_relay, stop


def round_trip(port: int, payload: bytes) -> tuple[float, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        started = time.perf_counter()
        conn.sendall(payload)
        got = b""
        while len(got) < len(payload):
            chunk = conn.recv(65536)
            if not chunk:
                break
            got += chunk
        return time.perf_counter() - started, got


def median_rtt(port: int, payload: bytes, samples: int = 5) -> float:
    times = []
    for _ in range(samples):
        elapsed, got = round_trip(port, payload)
        assert got == payload
        times.append(elapsed)
    return statistics.median(times)


def test_relay_delays_both_ways_and_keeps_bytes(echo_server) -> None:  # type: ignore[no-untyped-def]
    near, far = free_port(), free_port()
    relay = start_relay(echo_server.port, {near: 0, far: 40})
    try:
        payload = bytes(range(256)) * 4  # every byte value, small enough to echo at once
        assert median_rtt(echo_server.port, payload) >= 0
        assert median_rtt(near, payload) >= 0  # bytes unchanged through the undelayed port
        slow = median_rtt(far, payload)
        # 40 ms each way: the round trip takes 80 ms at least (less up to a millisecond of
        # timer resolution per hop). Only the floor is asserted: a loaded machine adds time,
        # never removes it. (That the near port adds nothing is the relay's configuration,
        # checked without a clock in the providers' delay tests.)
        assert slow >= 0.078, slow
        _, got = round_trip(far, bytes(range(256)) * 400)
        assert got == bytes(range(256)) * 400
    finally:
        stop(relay)


def test_delay_does_not_limit_throughput(digest_server) -> None:  # type: ignore[no-untyped-def]
    """8 MiB through a 500 ms link: a relay that slept per chunk (64 KiB at most) would need
    128 × 500 ms = 64 s one way; one that pipelines needs a round trip and a bit. The bound
    is the generous one, 30 s: it only tells the two designs apart."""
    port = free_port()
    relay = start_relay(digest_server.port, {port: 500})
    try:
        payload = hashlib.sha256(b"seed").digest() * (8 * 1024 * 1024 // 32)
        with socket.create_connection(("127.0.0.1", port), timeout=60) as conn:
            started = time.perf_counter()
            conn.sendall(payload)
            conn.shutdown(socket.SHUT_WR)  # the half-close must travel through the relay too
            answer = b""
            while chunk := conn.recv(1024):
                answer += chunk
            elapsed = time.perf_counter() - started
        assert answer.decode() == hashlib.sha256(payload).hexdigest()
        assert 1.0 <= elapsed < 30, elapsed
    finally:
        stop(relay)


def test_listen_argument_parses_host_port_and_delay() -> None:
    assert parse_listen("127.0.0.1:7001=12.5") == ("127.0.0.1", 7001, 12.5)
    assert parse_listen(":7002") == ("127.0.0.1", 7002, 0.0)
    with pytest.raises(Exception, match="negative delay"):
        parse_listen("127.0.0.1:7003=-1")
