"""Metrics sources: scrape replicas directly (the embedded default) or ask Prometheus.

Both answer the same question — each replica's current load and windowed latency and
throughput — as ReplicaStats, so health, autoscaling and the dashboard do not care which.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp

from controlplane.telemetry.engine_metrics import parse_engine_metrics


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
                           parse: Parser = parse_engine_metrics) -> dict[str, Scrape]:
    async with aiohttp.ClientSession() as session:
        ids = list(targets)
        results = await asyncio.gather(
            *(_scrape_one(session, targets[i], timeout_s, parse) for i in ids))
    return dict(zip(ids, results, strict=True))


def scrape_all(targets: Mapping[str, str], timeout_s: float = 2.0,
               parse: Parser = parse_engine_metrics) -> dict[str, Scrape]:
    if not targets:
        return {}
    return asyncio.run(scrape_all_async(targets, timeout_s, parse))


class PrometheusSource:
    """Stats from a Prometheus server that scrapes the targets Meridian writes (file SD)."""

    def __init__(self, url: str) -> None:
        from prometheus_api_client import PrometheusConnect

        self.client = PrometheusConnect(url=url, disable_ssl=True)

    def _by_replica(self, name: str, window_s: int) -> dict[str, float]:
        from controlplane.telemetry.queries import render

        out: dict[str, float] = {}
        for series in self.client.custom_query(render(name, window_s)):
            replica = series["metric"].get("replica")
            value = float(series["value"][1])
            if replica and value == value:  # NaN when a window saw no observations
                out[replica] = value
        return out

    def replica_stats(self, targets: Mapping[str, str], window_s: int) -> dict[str, ReplicaStats]:
        values = {name: self._by_replica(name, window_s) for name in (
            "up", "running", "waiting", "kv_usage", "ttft_p95_s", "itl_p95_s", "prompt_tps",
            "generation_tps")}
        stats = {}
        for replica in targets:
            up = values["up"].get(replica, 0.0) >= 1
            stats[replica] = ReplicaStats(
                up=up,
                running=values["running"].get(replica, 0.0),
                waiting=values["waiting"].get(replica, 0.0),
                kv_usage=values["kv_usage"].get(replica, 0.0),
                ttft_p95_s=values["ttft_p95_s"].get(replica),
                itl_p95_s=values["itl_p95_s"].get(replica),
                prompt_tps=values["prompt_tps"].get(replica, 0.0),
                generation_tps=values["generation_tps"].get(replica, 0.0),
                error="" if up else "Prometheus reports the target down",
            )
        return stats
