"""Pushes signed tables to many edges at once and collects their answers. No Django here.

One aiohttp session with a bounded connection pool sends every PUT concurrently, each with
its own timeout, so one slow edge never holds the others back. Each PUT carries the HMAC of
its body with that edge's admin secret (`edge.admin_auth`), without which an edge answers 401.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

import aiohttp

from edge import admin_auth


@dataclass(frozen=True)
class PushTarget:
    edge: str
    admin_url: str
    body: bytes
    version: int
    # The edge's admin secret (routing/edge_secrets.py): the PUT carries its HMAC.
    secret: bytes = b""


@dataclass(frozen=True)
class PushResult:
    edge: str
    version: int
    acked: bool
    status: int | None
    detail: str
    seconds: float


async def _push_one(session: aiohttp.ClientSession, target: PushTarget, timeout_s: float) -> PushResult:
    started = time.perf_counter()
    url = target.admin_url.rstrip("/") + "/admin/table"
    headers = {"Content-Type": "application/json",
               admin_auth.HEADER: admin_auth.sign(target.secret, "PUT", urlsplit(url).path,
                                                  target.body)}
    try:
        async with session.put(
            url, data=target.body, headers=headers,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as response:
            text = (await response.text())[:500]
            # 409: the edge already holds this version or a newer one, which is an ack too.
            acked = response.status in (200, 409)
            return PushResult(target.edge, target.version, acked, response.status, text,
                              time.perf_counter() - started)
    except (TimeoutError, aiohttp.ClientError, OSError) as exc:
        return PushResult(target.edge, target.version, False, None,
                          f"{type(exc).__name__}: {exc}", time.perf_counter() - started)


async def push_all_async(
    targets: list[PushTarget], timeout_s: float = 2.0, concurrency: int = 256
) -> list[PushResult]:
    connector = aiohttp.TCPConnector(limit=concurrency, limit_per_host=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        return await asyncio.gather(*(_push_one(session, t, timeout_s) for t in targets))


def push_all(targets: list[PushTarget], timeout_s: float = 2.0) -> list[PushResult]:
    """Blocking wrapper for Celery tasks and commands."""
    if not targets:
        return []
    return asyncio.run(push_all_async(targets, timeout_s))
