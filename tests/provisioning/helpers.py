"""Small process helpers shared by the provider tests."""

from __future__ import annotations

import functools
import socket
import subprocess
import sys

from controlplane.lab.processes import die_with_parent
from controlplane.lab.waiting import wait_until


def port_open(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


def start_relay(upstream: int, listens: dict[int, float]) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "controlplane.provisioning.netem",
            "--upstream", f"127.0.0.1:{upstream}"]
    for port, delay_ms in listens.items():
        argv += ["--listen", f"127.0.0.1:{port}={delay_ms}"]
    relay = subprocess.Popen(argv, preexec_fn=die_with_parent())
    for port in listens:
        wait_until(functools.partial(port_open, port), 60, f"relay listening on {port}")
    return relay


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)
