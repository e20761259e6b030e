"""The engine under contract: an enginesim started here, or a real vLLM at VLLM_BASE_URL."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class EngineUnderTest:
    base_url: str
    model: str
    max_model_len: int
    simulated: bool


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_healthy(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{url} did not become healthy in {timeout_s} s")


@pytest.fixture(scope="session")
def engine() -> Iterator[EngineUnderTest]:
    base = os.environ.get("VLLM_BASE_URL")
    if base:
        import json

        with urllib.request.urlopen(base.rstrip("/") + "/v1/models", timeout=10) as response:
            model = json.loads(response.read())["data"][0]
        yield EngineUnderTest(base.rstrip("/"), os.environ.get("VLLM_MODEL", model["id"]),
                              int(model.get("max_model_len", 4096)), simulated=False)
        return
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "enginesim", "--port", str(port),
                             "--model", "meta-llama/Llama-3.1-8B-Instruct",
                             "--served-model-name", "llama-3.1-8b", "--max-model-len", "4096"])
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        yield EngineUnderTest(url, "llama-3.1-8b", 4096, simulated=True)
    finally:
        proc.terminate()
        proc.wait(10)
