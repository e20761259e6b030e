"""Request bodies have deadlines at the edge: a body trickling in is answered 408 naming the
limit, and an upload streamed to the control plane that falls below the minimum rate after
the grace is cut at both ends (408 to the client, the control plane's request dropped), while
a steady upload that outlasts the grace goes through. Spoken over real sockets."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from aiohttp import web
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.lab.waiting import wait_until_async

from .conftest import API_KEY
from .helpers import EdgeUnderTest, running_edge

GRACE_S = 0.5
MIN_RATE = 256 * 1024


class CountingControlPlane:
    """Reads uploads to the end, and says how each ended: read whole, or cut."""

    def __init__(self) -> None:
        self.started = 0
        self.whole: list[int] = []
        self.cut: list[int] = []

    async def upload(self, request: web.Request) -> web.Response:
        self.started += 1
        size = 0
        try:
            async for piece in request.content.iter_any():
                size += len(piece)
        except (ConnectionError, asyncio.CancelledError):
            self.cut.append(size)
            raise
        if request.content_length is not None and size < request.content_length:
            self.cut.append(size)  # the body ended early: its sender gave up on it
            return web.json_response({}, status=400)
        self.whole.append(size)
        return web.json_response({"id": "file-1", "object": "file", "bytes": size})


@asynccontextmanager
async def edge_before_plane(signing_key: Ed25519PrivateKey, state_dir: Path
                            ) -> AsyncIterator[tuple[EdgeUnderTest, CountingControlPlane]]:
    plane = CountingControlPlane()
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/files", plane.upload)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        async with running_edge(signing_key, state_dir, control_plane=f"http://127.0.0.1:{port}",
                                client_request_timeout_s=GRACE_S,
                                upload_min_bytes_per_s=MIN_RATE) as edge:
            yield edge, plane
    finally:
        await runner.cleanup()


def head(path: bytes, length: int) -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nhost: edge\r\nauthorization: Bearer " +
            API_KEY.encode() + b"\r\ncontent-type: application/octet-stream\r\n"
            b"content-length: %d\r\n\r\n" % length)


async def trickle(port: int, path: bytes, length: int) -> tuple[bytes, int]:
    """Send a head, then one byte every 20 ms until the edge answers or closes: what it
    answered, and how many body bytes went out."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head(path, length))
    sent = 0

    async def drip() -> None:
        nonlocal sent
        while sent < length:
            writer.write(b"x")
            await writer.drain()
            sent += 1
            await asyncio.sleep(0.02)

    dripping = asyncio.create_task(drip())
    try:
        # Evidence, not a timer: the answer and the end of the connection. The limit is a
        # backstop far beyond the grace.
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        dripping.cancel()
        writer.close()
    return answer, sent


def error_of(answer: bytes) -> dict[str, str]:
    return dict(json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"])


def test_a_trickled_upload_gets_408_and_the_control_plane_is_let_go(
        signing_key: Ed25519PrivateKey, state_dir: Path) -> None:
    async def scenario() -> None:
        async with edge_before_plane(signing_key, state_dir) as (edge, plane):
            port = int(edge.url.rsplit(":", 1)[1])
            answer, sent = await trickle(port, b"/v1/files", 1_000_000)
            assert answer.startswith(b"HTTP/1.1 408 "), answer
            assert b"connection: close" in answer.lower()
            error = error_of(answer)
            assert error["code"] == "request_timeout"
            assert f"{MIN_RATE} bytes/s" in error["message"]
            assert f"first {GRACE_S:g} s" in error["message"]
            assert sent < 1_000_000
            # The forwarded request is dropped, so the control plane's worker is free again.
            await wait_until_async(lambda: plane.cut, 5, "the control plane's upload to end")
            assert plane.whole == []
            await wait_until_async(lambda: not edge.edge.pool.busy, 5,
                                   "the edge to hold no upstream connection")
            server = edge.edge.client_server
            assert server is not None
            await wait_until_async(lambda: not server.connections, 5,
                                   "the client's connection to be closed")

    asyncio.run(scenario())


def test_a_steady_upload_longer_than_the_grace_goes_through(
        signing_key: Ed25519PrivateKey, state_dir: Path) -> None:
    payload = b"y" * (2 * 1024 * 1024)

    async def pieces() -> AsyncIterator[bytes]:
        # About 2 MB/s, eight times the minimum, for about twice the grace.
        for start in range(0, len(payload), 64 * 1024):
            yield payload[start:start + 64 * 1024]
            await asyncio.sleep(0.03)

    async def scenario() -> None:
        async with edge_before_plane(signing_key, state_dir) as (edge, plane):
            response = await edge.session.post(
                edge.url + "/v1/files", data=pieces(),
                headers={"Authorization": f"Bearer {API_KEY}",
                         "Content-Length": str(len(payload))})
            assert response.status == 200, await response.text()
            assert plane.whole == [len(payload)] and plane.cut == []

    asyncio.run(scenario())


def test_a_completion_body_trickling_in_gets_408_naming_the_limit(
        signing_key: Ed25519PrivateKey, state_dir: Path) -> None:
    async def scenario() -> None:
        async with edge_before_plane(signing_key, state_dir) as (edge, _):
            port = int(edge.url.rsplit(":", 1)[1])
            answer, sent = await trickle(port, b"/v1/chat/completions", 4096)
            assert answer.startswith(b"HTTP/1.1 408 "), answer
            error = error_of(answer)
            assert error["code"] == "request_timeout"
            assert f"within {GRACE_S:g} s" in error["message"]
            assert sent < 4096

    asyncio.run(scenario())
