"""Async helpers for the edge's tests: an in-process edge, signed pushes, and a client."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import ssl
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Any

import aiohttp
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.lab import engines
from controlplane.lab.engines import free_port, health_answers
from controlplane.lab.processes import die_with_parent
from controlplane.lab.waiting import wait_until
from edge import admin_auth
from edge.keys import public_key_id
from edge.server import Edge, EdgeConfig
from edge.table import canonical_bytes, sign_table

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ADMIN_SECRET = b"edge-test-admin-secret-0123456789"


def signed_body(table: Mapping[str, Any], key: Ed25519PrivateKey) -> bytes:
    document = dict(table, key_id=public_key_id(key.public_key()))
    return canonical_bytes(sign_table(document, key))


class EdgeUnderTest:
    """An edge in this event loop, with its two base URLs and a client session."""

    def __init__(self, edge: Edge, port: int, admin_port: int,
                 session: aiohttp.ClientSession, scheme: str = "http",
                 admin_secret: bytes = ADMIN_SECRET) -> None:
        self.edge = edge
        self.admin_secret = admin_secret
        self.url = f"{scheme}://127.0.0.1:{port}"
        self.admin_url = f"http://127.0.0.1:{admin_port}"
        self.session = session

    async def push(self, table: Mapping[str, Any], key: Ed25519PrivateKey) -> tuple[int, Any]:
        return await self.put_table(signed_body(table, key))

    async def put_table(self, body: bytes) -> tuple[int, Any]:
        return await self.admin("PUT", "/admin/table", body)

    async def admin(self, method: str, path: str, body: bytes = b"") -> tuple[int, Any]:
        """An admin API call signed with the edge's admin secret: (status, JSON answer)."""
        headers = {admin_auth.HEADER: admin_auth.sign(self.admin_secret, method, path, body)}
        async with self.session.request(method, self.admin_url + path, data=body,
                                        headers=headers) as response:
            return response.status, await response.json()

    async def chat(self, model: str, content: str = "hello", key: str = "sk-test",
                   **extra: Any) -> aiohttp.ClientResponse:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        headers.update(extra.pop("headers", {}))
        body = {"model": model, "messages": [{"role": "user", "content": content}], **extra}
        return await self.session.post(self.url + "/v1/chat/completions", json=body,
                                       headers=headers)


@contextlib.asynccontextmanager
async def running_edge(key: Ed25519PrivateKey, state_dir: Path, name: str = "edge-test",
                       tls: ssl.SSLContext | None = None, client_tls: ssl.SSLContext | None = None,
                       **config: Any) -> AsyncIterator[EdgeUnderTest]:
    config.setdefault("probes", False)
    config.setdefault("admin_secret", ADMIN_SECRET)
    edge = Edge(EdgeConfig(name=name, region="local:test-1", state_dir=state_dir,
                           public_keys=[key.public_key()], **config))
    port, admin_port = await edge.start(("127.0.0.1", 0), ("127.0.0.1", 0), tls)
    session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20),
                                    connector=aiohttp.TCPConnector(ssl=client_tls or True))
    try:
        yield EdgeUnderTest(edge, port, admin_port, session, "https" if tls else "http",
                            config["admin_secret"] or ADMIN_SECRET)
    finally:
        await session.close()
        await edge.stop(drain_s=0.5)


def start_engine_process(port: int, delay_s: float = 0.0,
                         model: str = "m") -> subprocess.Popen[bytes]:
    """A fake engine in its own process, so that a test can kill it for real."""
    process = subprocess.Popen(
        [sys.executable, str(HERE / "fake_engine.py"), "--port", str(port), "--model", model,
         "--delay", str(delay_s)], stdout=subprocess.PIPE, preexec_fn=die_with_parent())
    assert process.stdout is not None
    line = process.stdout.readline()
    if b"READY" not in line:
        process.kill()
        raise RuntimeError("fake engine did not start")
    return process


def enginesim_command(port: int, host: str = "127.0.0.1",
                      profile: str = "llama-8b-h100") -> list[str]:
    """enginesim through its command line, the contract it shares with `vllm serve`."""
    return engines.enginesim_command(port, host=host, profile=profile)


def enginesim_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO)}


def start_enginesim(port: int, profile: str = "llama-8b-h100") -> subprocess.Popen[bytes]:
    return engines.start_enginesim(port, profile=profile)


@contextlib.contextmanager
def enginesims(count: int) -> Iterator[list[int]]:
    """`count` enginesim processes on loopback, each answering /health; killed at the end."""
    ports = [free_port() for _ in range(count)]
    processes = [start_enginesim(port) for port in ports]
    try:
        for port in ports:
            wait_until(functools.partial(health_answers, f"http://127.0.0.1:{port}"), 60,
                       f"enginesim on port {port} answering /health")
        yield ports
    finally:
        for process in processes:
            process.kill()
            process.wait()


def post_json(port: int, path: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method="POST",
                                     data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())

