"""The delaying relay adds the configured latency in each direction and changes no byte."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from controlplane.provisioning.local import free_port


@pytest.fixture
def echo_server():  # type: ignore[no-untyped-def]
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                while data := conn.recv(65536):
                    conn.sendall(data)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    server.close()


def round_trip(port: int, payload: bytes) -> tuple[float, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        started = time.perf_counter()
        conn.sendall(payload)
        got = b""
        while len(got) < len(payload):
            got += conn.recv(65536)
        return time.perf_counter() - started, got


def test_relay_delays_both_ways_and_keeps_bytes(echo_server):  # type: ignore[no-untyped-def]
    near, far = free_port(), free_port()
    relay = subprocess.Popen([sys.executable, "-m", "controlplane.provisioning.netem",
                              "--upstream", f"127.0.0.1:{echo_server}",
                              "--listen", f"127.0.0.1:{near}=0", "--listen", f"127.0.0.1:{far}=40"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", far), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        payload = bytes(range(256)) * 400
        direct, _ = round_trip(echo_server, payload)
        fast, got_fast = round_trip(near, payload)
        slow, got_slow = round_trip(far, payload)
        assert got_fast == payload and got_slow == payload
        assert 0.080 <= slow < 0.080 + 0.150, slow  # 40 ms each way
        assert fast < 0.05 + direct, fast
    finally:
        relay.terminate()
        relay.wait(10)
