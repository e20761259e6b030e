"""Small waiting and process helpers shared by the provider tests."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Callable
from typing import TypeVar

from controlplane.lab.processes import die_with_parent

T = TypeVar("T")


def wait_until(probe: Callable[[], T], timeout_s: float = 20.0, every_s: float = 0.05,
               what: str = "condition") -> T:
    """Call `probe` until it returns something truthy; fail the test after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every_s)
    raise AssertionError(f"{what} not reached in {timeout_s} s (last: {last!r})")


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
        wait_until(lambda p=port: port_open(p), 15, what=f"relay listening on {port}")
    return relay


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)
