"""The lab relay's black hole (SIGUSR1): a partition without namespaces. Nothing is forwarded
and nothing is closed or refused; the next SIGUSR1 heals it and what was held arrives."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest

from controlplane.failover.probes import probe_all
from controlplane.lab.processes import die_with_parent
from controlplane.lab.waiting import wait_until
from controlplane.provisioning.local import free_port

from .helpers import port_open, stop


@pytest.fixture
def echo_port() -> Iterator[int]:
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen(16)

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


def toggle(relay: subprocess.Popen[bytes], expect: bytes) -> None:
    relay.send_signal(signal.SIGUSR1)
    assert relay.stderr is not None
    assert expect in relay.stderr.readline()


def test_sigusr1_black_holes_the_relay_and_heals_it(echo_port: int) -> None:
    port = free_port()
    relay = subprocess.Popen([sys.executable, "-m", "controlplane.provisioning.netem",
                              "--upstream", f"127.0.0.1:{echo_port}",
                              "--listen", f"127.0.0.1:{port}=1"],
                             stderr=subprocess.PIPE, preexec_fn=die_with_parent())
    try:
        wait_until(lambda: port_open(port), 60, "relay listening")
        held = socket.create_connection(("127.0.0.1", port), timeout=5)
        held.sendall(b"before")
        assert held.recv(6) == b"before"
        toggle(relay, b"black hole")
        held.settimeout(0.5)
        held.sendall(b"during")
        with pytest.raises(TimeoutError):  # silence: neither an answer nor a close
            held.recv(6)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as new:
            new.settimeout(0.5)
            new.sendall(b"new")
            with pytest.raises(TimeoutError):
                new.recv(3)
        # The control plane's probe times out (not refused) through the black hole.
        probe = probe_all({1: f"http://127.0.0.1:{port}"}, timeout_s=0.5)[1]
        assert not probe.ok and probe.timed_out, probe.detail
        toggle(relay, b"forwarding")
        held.settimeout(5)
        assert held.recv(6) == b"during"  # held, not lost
        held.close()
    finally:
        stop(relay)
