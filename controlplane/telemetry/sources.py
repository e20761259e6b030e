"""Metrics sources: scrape replicas directly (the embedded default) or ask Prometheus.

Both answer the same question — each replica's current load and windowed latency and
throughput — as ReplicaStats, so health, autoscaling and the dashboard do not care which.
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from controlplane.telemetry.engine_metrics import parse_engine_metrics
from controlplane.telemetry.queries import QUERIES, render


@dataclass(frozen=True)
class ReplicaStats:
    up: bool
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0
    ttft_p95_s: float | None = None
    itl_p95_s: float | None = None
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    error: str = ""


class MetricsSource(Protocol):
    def replica_stats(self, targets: Mapping[str, str], window_s: int) -> dict[str, ReplicaStats]:
        """Stats per replica id, for targets given as replica id → base URL."""
        ...


@dataclass(frozen=True)
class Scrape:
    snapshot: Any  # EngineSnapshot for replicas, EdgeSnapshot for edges; None when down
    error: str = ""


Parser = Callable[[str], Any]
log = logging.getLogger(__name__)


async def _scrape_one(session: aiohttp.ClientSession, url: str, timeout_s: float,
                      parse: Parser) -> Scrape:
    try:
        async with session.get(url.rstrip("/") + "/metrics",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as response:
            if response.status != 200:
                return Scrape(None, f"/metrics answered {response.status}")
            return Scrape(parse(await response.text()))
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:
        return Scrape(None, f"{type(exc).__name__}: {exc}"[:300])


async def scrape_all_async(targets: Mapping[str, str], timeout_s: float = 2.0,
                           parse: Parser = parse_engine_metrics,
                           context: ssl.SSLContext | None = None) -> dict[str, Scrape]:
    connector = aiohttp.TCPConnector(ssl=context) if context is not None else None
    async with aiohttp.ClientSession(connector=connector) as session:
        ids = list(targets)
        results = await asyncio.gather(
            *(_scrape_one(session, targets[i], timeout_s, parse) for i in ids))
    return dict(zip(ids, results, strict=True))


def scrape_all(targets: Mapping[str, str], timeout_s: float = 2.0,
               parse: Parser = parse_engine_metrics,
               context: ssl.SSLContext | None = None) -> dict[str, Scrape]:
    """`context`: a client certificate, for engines that demand one (mTLS)."""
    if not targets:
        return {}
    return asyncio.run(scrape_all_async(targets, timeout_s, parse, context))


class PrometheusUnavailable(RuntimeError):
    """Prometheus did not answer a query, and no fallback source was given."""


class PrometheusSource:
    """Stats from a Prometheus server that scrapes the targets Meridian writes (file SD).

    Every query is one named in `queries.py`, grouped by the `replica` target label and
    summed (or maxed) over whatever labels the engine adds (vLLM's `engine`, `model_name`).
    A query that fails (Prometheus down, slow, or answering an error) falls back to
    `fallback` for the whole call when one is given; otherwise it raises
    PrometheusUnavailable. No query waits longer than `timeout_s`, and none is retried.
    """

    def __init__(self, url: str, timeout_s: float = 5.0,
                 fallback: MetricsSource | None = None) -> None:
        from prometheus_api_client import PrometheusConnect
        from urllib3.util.retry import Retry

        self.url = url
        self.timeout_s = timeout_s
        self.fallback = fallback
        # The client's default retries three times with backoff and has no timeout: a
        # Prometheus that is down would hold a periodic task for most of a minute.
        self.client = PrometheusConnect(url=url, disable_ssl=True, timeout=timeout_s,
                                        retry=Retry(total=0))

    def query(self, name: str, window_s: int, at: float | None = None) -> dict[str, float]:
        """The named query's value per replica, now or at the Unix time `at`. Series whose
        value is not a finite number (NaN from a window without observations) are left out."""
        params = {"timeout": f"{self.timeout_s:g}s"}
        if at is not None:
            params["time"] = f"{at:.3f}"
        out: dict[str, float] = {}
        for series in self.client.custom_query(render(name, window_s), params=params):
            replica = series["metric"].get("replica")
            value = float(series["value"][1])
            if replica and math.isfinite(value):
                out[replica] = value
        return out

    def replica_stats(self, targets: Mapping[str, str], window_s: int) -> dict[str, ReplicaStats]:
        from prometheus_api_client import PrometheusApiClientException
        from requests import RequestException

        try:
            values = {name: self.query(name, window_s) for name in QUERIES}
        except (RequestException, PrometheusApiClientException, KeyError, ValueError) as exc:
            reason = f"Prometheus at {self.url} did not answer: {type(exc).__name__}: {exc}"
            if self.fallback is None:
                raise PrometheusUnavailable(reason[:500]) from exc
            log.warning("%s; reading the direct scrape instead", reason[:500])
            return self.fallback.replica_stats(targets, window_s)
        stats = {}
        for replica in targets:
            up = values["up"].get(replica, 0.0) >= 1
            error = "" if up else ("Prometheus reports the target down" if replica in values["up"]
                                   else "not among Prometheus's targets yet")
            stats[replica] = ReplicaStats(
                up=up,
                running=values["running"].get(replica, 0.0),
                waiting=values["waiting"].get(replica, 0.0),
                kv_usage=values["kv_usage"].get(replica, 0.0),
                ttft_p95_s=values["ttft_p95_s"].get(replica),
                itl_p95_s=values["itl_p95_s"].get(replica),
                prompt_tps=values["prompt_tps"].get(replica, 0.0),
                generation_tps=values["generation_tps"].get(replica, 0.0),
                error=error,
            )
        return stats
