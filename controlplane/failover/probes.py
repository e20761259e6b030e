"""Active /health probes of replicas, all at once, with a short timeout."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Mapping

import aiohttp

from controlplane.failover.health import Probe

PROBE_TIMEOUT_S = 0.5


async def _probe(session: aiohttp.ClientSession, url: str, timeout_s: float) -> Probe:
    try:
        async with session.get(url.rstrip("/") + "/health",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status == 200:
                return Probe(True)
            return Probe(False, detail=f"/health answered {response.status}")
    except TimeoutError:
        return Probe(False, timed_out=True, detail=f"/health did not answer in {timeout_s} s")
    except (aiohttp.ClientError, OSError) as exc:
        return Probe(False, detail=f"/health failed: {type(exc).__name__}: {exc}"[:300])


async def _probe_all(targets: Mapping[int, str], timeout_s: float,
                     context: ssl.SSLContext | None) -> dict[int, Probe]:
    connector = aiohttp.TCPConnector(limit=256, force_close=True,
                                     ssl=context if context is not None else True)
    async with aiohttp.ClientSession(connector=connector) as session:
        ids = list(targets)
        results = await asyncio.gather(*(_probe(session, targets[i], timeout_s) for i in ids))
    return dict(zip(ids, results, strict=True))


def probe_all(targets: Mapping[int, str], timeout_s: float = PROBE_TIMEOUT_S,
              context: ssl.SSLContext | None = None) -> dict[int, Probe]:
    """Probe every replica id → base URL; one answer each. `context`: the control plane's
    client certificate, for engines that demand one."""
    if not targets:
        return {}
    return asyncio.run(_probe_all(targets, timeout_s, context))
