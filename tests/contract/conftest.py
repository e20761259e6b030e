"""The engines under contract: every test runs once against enginesim and once against a
real vLLM (its CPU build serving SmolLM2-135M-Instruct, started with `tools/vllm-cpu`).

The real engine is the judge: where the two differ, enginesim changes. MERIDIAN_CONTRACT_ENGINES
(comma-separated, default "enginesim,vllm") picks which run. With VLLM_BASE_URL set (e.g.
http://gpu-box:8000) the real-engine run goes to that server instead; VLLM_MODEL picks the
served model (default: the first /v1/models lists) and VLLM_API_KEY is sent as a bearer token
when the server wants one. The tests import nothing of Meridian: the contract is vLLM's HTTP
surface and nothing else (the fixture borrows only the test helpers that start engines).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from email.message import Message
from typing import Any

import pytest

from controlplane.lab.processes import die_with_parent
from tests.real_engine import start_vllm, wait_healthy

SIM_MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SIM_SERVED = "llama-3.1-8b"
SIM_MAX_MODEL_LEN = 4096
# What tools/vllm-cpu gives vllm serve beyond the model: enginesim gets the same.
SERVE_FLAGS = ("--enable-prompt-tokens-details", "--enable-scale-out")


@dataclass(frozen=True)
class Engine:
    base_url: str
    model: str
    max_model_len: int
    simulated: bool
    headers: dict[str, str] = field(default_factory=dict)

    def request(self, method: str, path: str,
                body: dict[str, Any] | bytes | None = None) -> urllib.request.Request:
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        headers = {**self.headers, **({"Content-Type": "application/json"} if data else {})}
        return urllib.request.Request(self.base_url + path, data=data, method=method,
                                      headers=headers)

    def call(self, method: str, path: str, body: dict[str, Any] | bytes | None = None,
             timeout: float = 120) -> tuple[int, Message, bytes]:
        """Status, headers (looked up case-insensitively: vLLM writes them in lower case) and
        body; an HTTP error status is returned, not raised."""
        try:
            with urllib.request.urlopen(self.request(method, path, body),
                                        timeout=timeout) as response:
                return response.status, response.headers, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers, exc.read()

    def post_json(self, path: str, body: dict[str, Any] | bytes) -> tuple[int, Any]:
        status, _, raw = self.call("POST", path, body)
        return status, json.loads(raw)

    def metrics(self) -> str:
        status, _, raw = self.call("GET", "/metrics")
        assert status == 200
        return raw.decode()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


ENGINES = [name.strip() for name in
           os.environ.get("MERIDIAN_CONTRACT_ENGINES", "enginesim,vllm").split(",")
           if name.strip()]


@pytest.fixture(scope="package", params=ENGINES)
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    if request.param == "enginesim":
        yield from enginesim_engine()
    elif request.param == "vllm":
        yield from vllm_engine()
    else:
        raise ValueError(f"MERIDIAN_CONTRACT_ENGINES: unknown engine {request.param!r} "
                         "(enginesim, vllm)")


def vllm_engine() -> Iterator[Engine]:
    base = os.environ.get("VLLM_BASE_URL", "").rstrip("/")
    if not base:
        with start_vllm() as real:
            yield Engine(real.url, real.model, real.max_model_len, False)
        return
    key = os.environ.get("VLLM_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    probe = Engine(base, "", 0, False, headers)
    status, _, raw = probe.call("GET", "/v1/models", timeout=30)
    assert status == 200, f"{base}/v1/models answered {status}"
    listed = json.loads(raw)["data"]
    model = os.environ.get("VLLM_MODEL") or listed[0]["id"]
    card = next(m for m in listed if m["id"] == model)
    yield Engine(base, model, int(card["max_model_len"]), False, headers)


def enginesim_engine() -> Iterator[Engine]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "enginesim", "--port", str(port),
                             "--model", SIM_MODEL, "--served-model-name", SIM_SERVED,
                             "--max-model-len", str(SIM_MAX_MODEL_LEN), *SERVE_FLAGS],
                            stderr=subprocess.DEVNULL, preexec_fn=die_with_parent())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s=30, every_s=0.05)
        yield Engine(url, SIM_SERVED, SIM_MAX_MODEL_LEN, True)
    finally:
        proc.terminate()
        proc.wait(10)
