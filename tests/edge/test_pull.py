"""Pulling tables from the control plane with If-None-Match, under the push's rules."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.lab.waiting import wait_until_async
from edge.table import canonical_bytes, sign_table

from .conftest import TableFactory
from .helpers import running_edge


class FakeControlPlane:
    """Serves one edge's newest table the way the control plane's API does."""

    def __init__(self) -> None:
        self.table: dict[str, Any] | None = None
        self.seen: list[dict[str, str]] = []

    async def handle(self, request: web.Request) -> web.Response:
        self.seen.append({"if-none-match": request.headers.get("If-None-Match", ""),
                          "authorization": request.headers.get("Authorization", ""),
                          "name": request.match_info["name"]})
        if self.table is None:
            return web.json_response({"detail": "no table"}, status=404)
        etag = f'"{hashlib.sha256(canonical_bytes(self.table)).hexdigest()}"'
        if request.headers.get("If-None-Match") == etag:
            return web.Response(status=304, headers={"ETag": etag})
        # Not canonical on the wire, as a JSON renderer would send it.
        return web.Response(body=json.dumps(self.table, indent=1).encode(),
                            content_type="application/json", headers={"ETag": etag})


def test_pull_takes_new_tables_and_sends_if_none_match(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    async def scenario() -> None:
        plane = FakeControlPlane()
        app = web.Application()
        app.router.add_get("/api/v1/edges/{name}/table", plane.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            plane.table = sign_table(make_table(version=3), signing_key)
            async with running_edge(signing_key, state_dir,
                                    control_plane=f"http://127.0.0.1:{port}",
                                    control_plane_token="edge-token",
                                    pull_interval_s=0.05) as edge:
                await wait_until_async(lambda: edge.edge.table is not None, 30, "a pulled table")
                served = edge.edge.table
                assert served is not None and served.version == 3
                assert edge.edge.table_source == "pull"
                await wait_until_async(lambda: len(plane.seen) >= 3, 30, "three pulls")
                assert plane.seen[0] == {"if-none-match": "", "authorization":
                                         "Bearer edge-token", "name": "edge-test"}
                assert plane.seen[-1]["if-none-match"] == f'"{served.hash}"'

                tampered = sign_table(make_table(version=4), signing_key)
                tampered["tenants"] = {}
                plane.table = tampered
                seen = len(plane.seen)
                await wait_until_async(lambda: len(plane.seen) >= seen + 3, 30,
                                       "three pulls of the tampered table")
                assert edge.edge.table is served  # refused: still serving version 3

                plane.table = sign_table(make_table(version=5), signing_key)
                await wait_until_async(lambda: edge.edge.table is not None
                                       and edge.edge.table.version == 5, 30,
                                       "version 5 pulled")
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
