"""The admin port's authentication: an HMAC of each request with the edge's admin secret,
checked (shape and time) before the body is read and (the HMAC) before any JSON is parsed;
every refusal names the problem and changes nothing."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge import admin_auth

from .conftest import TableFactory
from .helpers import ADMIN_SECRET, running_edge, signed_body


def test_table_pushes_without_a_valid_hmac_are_refused_with_the_reason(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    async def scenario() -> None:
        async with running_edge(signing_key, state_dir) as edge:
            assert (await edge.push(make_table(version=1), signing_key))[0] == 200
            body = signed_body(make_table(version=2), signing_key)
            now = time.time()
            attempts = [
                ({}, "admin_auth_required"),
                ({admin_auth.HEADER: "t=abc,sig=00"}, "admin_auth_malformed"),
                ({admin_auth.HEADER: admin_auth.sign(ADMIN_SECRET, "PUT", "/admin/table", body,
                                                      now - 3600)}, "admin_auth_expired"),
                ({admin_auth.HEADER: admin_auth.sign(b"another-edge-secret-0123456789",
                                                      "PUT", "/admin/table", body)},
                 "admin_auth_invalid"),
                # A signed GET is no PUT, and a signature covers the body it was made for.
                ({admin_auth.HEADER: admin_auth.sign(ADMIN_SECRET, "GET", "/admin/table",
                                                      body)}, "admin_auth_invalid"),
                ({admin_auth.HEADER: admin_auth.sign(ADMIN_SECRET, "PUT", "/admin/table",
                                                      body + b" ")}, "admin_auth_invalid"),
            ]
            for headers, code in attempts:
                async with edge.session.put(edge.admin_url + "/admin/table", data=body,
                                            headers=headers) as response:
                    answer = await response.json()
                    assert (response.status, answer["error"]["code"]) == (401, code), answer
                    assert admin_auth.HEADER in answer["error"]["message"]
            assert edge.edge.table is not None and edge.edge.table.version == 1
            async with edge.session.get(edge.admin_url + "/admin/replicas") as response:
                assert response.status == 401
            async with edge.session.get(edge.admin_url + "/metrics") as response:
                text = await response.text()  # metrics and health need no secret
            assert 'meridian_edge_admin_refusals_total{reason="admin_auth_invalid"} 3' in text
            assert 'meridian_edge_admin_refusals_total{reason="admin_auth_required"} 2' in text
            assert (await edge.admin("PUT", "/admin/table", body))[0] == 200

    asyncio.run(scenario())


def test_the_hmac_is_checked_before_the_json_is_parsed(
        signing_key: Ed25519PrivateKey, state_dir: Path) -> None:
    async def scenario() -> None:
        async with running_edge(signing_key, state_dir) as edge:
            garbage = b"{" * 1000
            forged = admin_auth.sign(b"not-the-edge-secret-0123456789", "PUT", "/admin/table",
                                     garbage)
            async with edge.session.put(edge.admin_url + "/admin/table", data=garbage,
                                        headers={admin_auth.HEADER: forged}) as response:
                assert response.status == 401  # not 400 invalid_table: never parsed
            assert edge.edge.metrics.table_rejections.get(("invalid",)) == 0
            status, answer = await edge.admin("PUT", "/admin/table", garbage)
            assert (status, answer["error"]["code"]) == (400, "invalid_table")

    asyncio.run(scenario())


async def _raw_head(port: int, head: bytes) -> bytes:
    """Send a request head alone and read the answer: the body is never sent."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        return await asyncio.wait_for(reader.read(65536), 5)
    finally:
        writer.close()


def test_a_large_body_is_refused_before_it_is_read(
        signing_key: Ed25519PrivateKey, state_dir: Path) -> None:
    async def scenario() -> None:
        async with running_edge(signing_key, state_dir,
                                admin_max_body_bytes=1024 * 1024) as edge:
            port = int(edge.admin_url.rsplit(":", 1)[1])
            # Unauthenticated, 60 MiB announced: answered from the head alone.
            answer = await _raw_head(port, b"PUT /admin/table HTTP/1.1\r\nhost: x\r\n"
                                           b"content-length: 62914560\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 413") and b"1048576 bytes" in answer
            answer = await _raw_head(port, b"PUT /admin/table HTTP/1.1\r\nhost: x\r\n"
                                           b"content-length: 1000\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 401") and b"admin_auth_required" in answer
            answer = await _raw_head(port, b"PUT /admin/table HTTP/1.1\r\nhost: x\r\n"
                                           b"x-meridian-admin-auth: t=1,sig=" + b"0" * 64 +
                                           b"\r\ncontent-length: 1000\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 401") and b"admin_auth_expired" in answer

    asyncio.run(scenario())


def test_an_edge_without_a_secret_keeps_its_admin_api_closed(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    async def scenario() -> None:
        async with running_edge(signing_key, state_dir, admin_secret=None) as edge:
            status, answer = await edge.push(make_table(version=1), signing_key)
            assert (status, answer["error"]["code"]) == (503, "admin_auth_unconfigured")
            async with edge.session.get(edge.admin_url + "/healthz") as response:
                assert response.status == 503  # no table: open, and says so

    asyncio.run(scenario())
