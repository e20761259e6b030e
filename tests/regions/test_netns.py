"""controlplane/lab/netns.py: namespaces joined by veth pairs, real kernel delay, partitions that drop
packets without a reset, and a cleanup that happens even when the test process is killed."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from controlplane.lab import netns
from controlplane.lab.waiting import wait_until
from regions.geo import one_way_ms


def _listener_in(region: netns.Region, port: int) -> subprocess.Popen[bytes]:
    code = ("import socket, sys, time\n"
            f"s = socket.socket(); s.bind(({region.address!r}, {port})); s.listen(16)\n"
            "print('READY', flush=True)\n"
            "while True:\n"
            "    c, _ = s.accept(); c.sendall(b'hi')\n")
    process = region.popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert process.stdout is not None and b"READY" in process.stdout.readline()
    return process


def _names() -> str:
    return (subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
            + subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout)


def test_a_partition_drops_packets_and_refuses_nothing(netns_lab: netns.Lab) -> None:
    region = netns_lab.region()
    server = _listener_in(region, 9100)
    try:
        held = socket.create_connection((region.address, 9100), timeout=5)
        assert held.recv(2) == b"hi"
        region.partition()
        # No refusal, no reset: a connect hangs until its own timeout.
        with pytest.raises(TimeoutError):
            socket.create_connection((region.address, 9100), timeout=0.5)
        held.settimeout(0.5)
        held.sendall(b"anyone there?")
        with pytest.raises(TimeoutError):
            held.recv(1)
        region.heal()
        with socket.create_connection((region.address, 9100), timeout=5) as again:
            assert again.recv(2) == b"hi"
        held.close()
    finally:
        server.kill()
        server.wait()


def test_netem_delays_each_direction_by_the_fibre_distance(netns_lab: netns.Lab) -> None:
    reason = netns.netem_missing()
    if reason:
        pytest.skip(reason)
    km = 2000.0  # about Frankfurt to Madrid
    region = netns_lab.region(one_way_ms(km))
    server = _listener_in(region, 9101)
    try:
        # A connect is one round trip; netem holds every packet at least its delay.
        start = time.monotonic()
        with socket.create_connection((region.address, 9101), timeout=5) as conn:
            connected = time.monotonic() - start
            assert conn.recv(2) == b"hi"
        assert connected >= 2 * one_way_ms(km) / 1000.0
    finally:
        server.kill()
        server.wait()


def test_what_a_killed_test_process_made_is_removed_by_its_watchdog() -> None:
    reason = netns.why_unavailable()
    if reason:
        pytest.skip(reason)
    code = ("import sys, time\n"
            "from controlplane.lab import netns\n"
            "lab = netns.Lab(); lab.start(); region = lab.region()\n"
            "print(region.name, region.outer, flush=True)\n"
            "time.sleep(600)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE,
                             cwd=netns.ROOT, env={**os.environ, "PYTHONPATH": str(netns.ROOT)})
    assert child.stdout is not None
    name, outer = child.stdout.readline().decode().split()
    assert name in _names() and outer in _names()
    child.send_signal(signal.SIGKILL)
    child.wait()
    wait_until(lambda: name not in _names() and outer not in _names(), 60,
               "the watchdog removing the namespaces", every_s=0.1)


def test_stale_namespaces_of_dead_processes_are_swept() -> None:
    reason = netns.why_unavailable()
    if reason:
        pytest.skip(reason)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    name = f"{netns.NS_PREFIX}{dead}-0"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        assert name in netns.sweep_stale()
        assert name not in _names()
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
