"""The Files and Batches API at the edge: forwarded to the control plane with the caller's key,
bodies streamed through both ways, the control plane's answers unchanged, and an
OpenAI-shaped error naming the control plane when it cannot be reached."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .helpers import free_port, running_edge

MB = 1024 * 1024


class FakeControlPlane:
    """Answers /v1/files and /v1/batches the way the control plane does, and keeps what it
    was sent."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    async def upload(self, request: web.Request) -> web.Response:
        digest = hashlib.sha256()
        size = 0
        async for piece in request.content.iter_any():
            digest.update(piece)
            size += len(piece)
        self.seen.append({"path": request.path, "method": request.method,
                          "authorization": request.headers.get("Authorization"),
                          "content_type": request.headers.get("Content-Type"),
                          "size": size, "sha256": digest.hexdigest()})
        return web.json_response({"id": "file-1", "object": "file", "bytes": size})

    async def refuse(self, request: web.Request) -> web.Response:
        """Answers before reading the body, as the control plane does a bad key."""
        return web.json_response({"error": {"message": "Incorrect API key provided.",
                                            "type": "invalid_request_error", "param": None,
                                            "code": "invalid_api_key"}}, status=401)

    async def batch(self, request: web.Request) -> web.Response:
        self.seen.append({"path": request.path, "method": request.method,
                          "query": request.query_string,
                          "authorization": request.headers.get("Authorization")})
        if request.match_info["batch_id"] == "batch_missing":
            return web.json_response(
                {"error": {"message": "No such Batch object: batch_missing",
                           "type": "invalid_request_error", "param": "id",
                           "code": "batch_not_found"}}, status=404)
        return web.json_response({"id": request.match_info["batch_id"], "object": "batch"})

    async def content(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/jsonl"})
        await response.prepare(request)
        for n in range(64):
            await response.write(b"%06d" % n + b"x" * (64 * 1024 - 7) + b"\n")
        await response.write_eof()
        return response


@asynccontextmanager
async def control_plane() -> AsyncIterator[tuple[FakeControlPlane, str]]:
    plane = FakeControlPlane()
    app = web.Application(client_max_size=64 * MB)
    app.router.add_post("/v1/files", plane.upload)
    app.router.add_post("/refused/v1/files", plane.refuse)   # a control plane under a path
    app.router.add_get("/v1/files/{file_id}/content", plane.content)
    app.router.add_route("*", "/v1/batches/{batch_id}", plane.batch)
    app.router.add_route("*", "/v1/batches/{batch_id}/cancel", plane.batch)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield plane, f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def test_an_upload_larger_than_the_edge_buffers_streams_to_the_control_plane(
        signing_key: Ed25519PrivateKey, state_dir: Path) -> None:
    payload = bytes(range(256)) * (24 * MB // 256)   # 24 MB against a 1 MB request limit

    async def scenario() -> None:
        async with control_plane() as (plane, url), running_edge(
                signing_key, state_dir, control_plane=url, max_body_bytes=1 * MB) as edge:
            response = await edge.session.post(
                edge.url + "/v1/files", data=payload,
                headers={"Authorization": "Bearer sk-mrd-tenant",
                         "Content-Type": "application/octet-stream"})
            assert response.status == 200, await response.text()
            assert await response.json() == {"id": "file-1", "object": "file",
                                             "bytes": len(payload)}
            assert plane.seen == [{
                "path": "/v1/files", "method": "POST", "authorization": "Bearer sk-mrd-tenant",
                "content_type": "application/octet-stream", "size": len(payload),
                "sha256": hashlib.sha256(payload).hexdigest()}]

            chunked = await edge.session.post(
                edge.url + "/v1/files", data=_pieces(payload[:3 * MB]),
                headers={"Authorization": "Bearer sk-mrd-tenant"})
            assert chunked.status == 200, await chunked.text()
            assert plane.seen[-1]["size"] == 3 * MB
            assert plane.seen[-1]["sha256"] == hashlib.sha256(payload[:3 * MB]).hexdigest()

            completion = await edge.chat("m", "x" * (2 * MB))
            assert completion.status == 413   # the completions keep the buffered limit

    asyncio.run(scenario())


async def _pieces(data: bytes) -> AsyncIterator[bytes]:
    for start in range(0, len(data), 256 * 1024):
        yield data[start:start + 256 * 1024]


def test_batch_calls_and_their_errors_pass_through_unchanged(
        signing_key: Ed25519PrivateKey, state_dir: Path) -> None:
    async def scenario() -> None:
        async with control_plane() as (plane, url), running_edge(
                signing_key, state_dir, control_plane=url) as edge:
            auth = {"Authorization": "Bearer sk-mrd-tenant"}
            found = await edge.session.get(edge.url + "/v1/batches/batch_1?x=1", headers=auth)
            assert found.status == 200 and (await found.json())["id"] == "batch_1"
            assert plane.seen[-1] == {"path": "/v1/batches/batch_1", "method": "GET",
                                      "query": "x=1", "authorization": "Bearer sk-mrd-tenant"}

            cancelled = await edge.session.post(edge.url + "/v1/batches/batch_2/cancel",
                                                headers=auth, json={})
            assert cancelled.status == 200
            assert plane.seen[-1]["path"] == "/v1/batches/batch_2/cancel"

            missing = await edge.session.get(edge.url + "/v1/batches/batch_missing",
                                             headers=auth)
            assert missing.status == 404
            assert await missing.json() == {"error": {
                "message": "No such Batch object: batch_missing",
                "type": "invalid_request_error", "param": "id", "code": "batch_not_found"}}

            content = await edge.session.get(edge.url + "/v1/files/file-1/content",
                                             headers=auth)
            body = await content.read()
            assert content.status == 200 and len(body) == 64 * 64 * 1024
            assert body.startswith(b"000000x") and body.endswith(b"x\n")

    asyncio.run(scenario())


def test_an_unreachable_control_plane_is_a_503_naming_it(
        signing_key: Ed25519PrivateKey, state_dir: Path) -> None:
    port = free_port()   # nothing listens there

    async def scenario() -> None:
        async with running_edge(signing_key, state_dir,
                                control_plane=f"http://127.0.0.1:{port}",
                                pull_interval_s=3600) as edge:
            response = await edge.session.post(
                edge.url + "/v1/files", data=b"{}\n",
                headers={"Authorization": "Bearer sk-mrd-tenant"})
            assert response.status == 503
            error = (await response.json())["error"]
            assert error["code"] == "control_plane_unreachable"
            assert error["type"] == "server_error"
            assert f"control plane at http://127.0.0.1:{port} cannot be reached" \
                in error["message"]
            assert response.headers["Retry-After"] == "1"

    asyncio.run(scenario())


def test_an_edge_without_a_control_plane_says_so(
        signing_key: Ed25519PrivateKey, state_dir: Path) -> None:
    async def scenario() -> None:
        async with running_edge(signing_key, state_dir) as edge:
            response = await edge.session.get(edge.url + "/v1/batches",
                                              headers={"Authorization": "Bearer sk-x"})
            assert response.status == 503
            error = json.loads(await response.text())["error"]
            assert error["code"] == "control_plane_not_configured"
            assert "--control-plane" in error["message"]

    asyncio.run(scenario())


def test_an_answer_before_the_upload_ends_reaches_the_client_and_ends_the_connection(
        signing_key: Ed25519PrivateKey, state_dir: Path) -> None:
    async def scenario() -> None:
        async with control_plane() as (plane, url), running_edge(
                signing_key, state_dir, control_plane=url + "/refused") as edge:
            response = await edge.session.post(
                edge.url + "/v1/files", data=b"x" * (8 * MB),
                headers={"Authorization": "Bearer sk-wrong"})
            assert response.status == 401
            assert response.headers["Connection"] == "close"   # the client knows not to reuse it
            assert (await response.json())["error"]["code"] == "invalid_api_key"
            # The edge is still serving, and has nothing of that request left open.
            again = await edge.session.post(edge.url + "/v1/files", data=b"{}",
                                            headers={"Authorization": "Bearer sk-wrong"})
            assert again.status == 401
            assert not edge.edge.pool.busy

    asyncio.run(scenario())
