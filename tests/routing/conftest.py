"""Fixtures for routing: a signing key and edge admin key, and edge admin endpoints that
verify what they get (the admin HMAC, then the table's signature)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from aiohttp import web

from controlplane.routing import edge_secrets, signing
from edge import admin_auth
from edge.keys import load_public_key_file
from edge.table import verify_table


@pytest.fixture
def signing_key_file(tmp_path, monkeypatch):  # type: ignore[no-untyped-def]
    private, public = signing.generate_key_files(tmp_path / "signing-key.pem")
    monkeypatch.setenv("MERIDIAN_SIGNING_KEY_FILE", str(private))
    monkeypatch.delenv("MERIDIAN_SIGNING_KEY", raising=False)
    monkeypatch.setenv("MERIDIAN_EDGE_ADMIN_KEY", "routing-tests-edge-admin-key-0123456789abcdef")
    signing.signing_key.cache_clear()
    edge_secrets.admin_key.cache_clear()
    yield public
    signing.signing_key.cache_clear()
    edge_secrets.admin_key.cache_clear()


@dataclass
class AdminEndpoint:
    """An edge's admin API as the control plane sees it: verifies, refuses old versions."""

    public_key_path: Path
    version: int = 0
    received: list[dict] = field(default_factory=list)
    up: bool = True
    port: int = 0

    async def put_table(self, request: web.Request) -> web.Response:
        if not self.up:
            return web.Response(status=503, text="down for the test")
        body = await request.read()
        table = json.loads(body)
        headers = {k.lower().encode(): v.encode() for k, v in request.headers.items()}
        try:
            admin_auth.verify(edge_secrets.edge_secret(table["edge"]), "PUT", request.path,
                              headers, body)
        except admin_auth.AdminAuthError as refusal:
            return web.json_response({"error": refusal.message}, status=refusal.status)
        verify_table(table, load_public_key_file(self.public_key_path))
        if table["version"] <= self.version:
            return web.json_response({"error": "not newer"}, status=409)
        self.version = table["version"]
        self.received.append(table)
        return web.json_response({"version": self.version})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture
def admin_endpoints(signing_key_file) -> Iterator[list[AdminEndpoint]]:  # type: ignore[no-untyped-def]
    endpoints = [AdminEndpoint(signing_key_file) for _ in range(3)]
    loop = asyncio.new_event_loop()
    runners: list[web.AppRunner] = []
    ready = threading.Event()

    async def start() -> None:
        for endpoint in endpoints:
            app = web.Application()
            app.router.add_put("/admin/table", endpoint.put_table)
            runner = web.AppRunner(app)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            endpoint.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
            runners.append(runner)
        ready.set()

    thread = threading.Thread(target=lambda: (loop.run_until_complete(start()), loop.run_forever()))
    thread.start()
    ready.wait(10)
    yield endpoints

    async def stop() -> None:
        for runner in runners:
            await runner.cleanup()

    asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
