"""What the edge knows about each replica's health and load, and how that changes.

Passive: `record_failure` / `record_success` after each forwarded request. After
`eject_after_failures` consecutive connect errors or 5xx the replica is ejected for
`eject_base_s × 2^k` seconds (k = ejections since its last success, capped at `eject_max_s`);
once the ejection ends it is on probation, and one more failure ejects it again for twice as
long. Active: `Prober` asks each replica's `/health` about once a second and reads its
`/metrics` (vLLM names) for the queue and KV-cache figures the load scorer uses.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from edge.background import stop_task
from edge.table import Policy, Replica

log = logging.getLogger("meridian.edge.health")

# Consecutive failed probes before a replica counts as down; one success brings it back.
PROBE_FAILURES_TO_DOWN = 2
# vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc in v0.10; read either.
_WAITING = b"vllm:num_requests_waiting"
_RUNNING = b"vllm:num_requests_running"
_KV = (b"vllm:kv_cache_usage_perc", b"vllm:gpu_cache_usage_perc")


@dataclass(slots=True)
class ReplicaStats:
    inflight: int = 0
    probe_ok: bool = True
    probe_failures: int = 0
    consecutive_failures: int = 0
    ejections: int = 0  # since the last success: the exponent of the next backoff
    ejected_until: float = 0.0
    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    metrics_at: float = 0.0

    def available(self, now: float) -> bool:
        return self.probe_ok and now >= self.ejected_until

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until


def record_failure(stats: ReplicaStats, policy: Policy, now: float) -> float | None:
    """Count a connect error or 5xx; returns the ejection length when this one ejects."""
    stats.consecutive_failures += 1
    on_probation = stats.ejections > 0
    if stats.consecutive_failures < policy.eject_after_failures and not on_probation:
        return None
    if stats.ejected(now):
        return None  # already out; failures of requests that were in flight add nothing
    seconds = min(policy.eject_max_s, policy.eject_base_s * (2 ** stats.ejections))
    stats.ejections += 1
    stats.consecutive_failures = 0
    stats.ejected_until = now + seconds
    return seconds


def record_success(stats: ReplicaStats) -> None:
    stats.consecutive_failures = 0
    stats.ejections = 0


def record_probe(stats: ReplicaStats, ok: bool) -> bool:
    """Fold one /health answer in; returns whether the replica's probe state changed."""
    before = stats.probe_ok
    if ok:
        stats.probe_failures = 0
        stats.probe_ok = True
    else:
        stats.probe_failures += 1
        if stats.probe_failures >= PROBE_FAILURES_TO_DOWN:
            stats.probe_ok = False
    return before != stats.probe_ok


def parse_engine_metrics(text: bytes) -> dict[str, float]:
    """Queue depth, running requests and KV-cache usage from a vLLM /metrics page.

    A replica serves one model, so samples of a count under different labels add up; KV usage
    is a fraction in [0, 1] and the fullest engine (data-parallel ranks) counts.
    """
    waiting = running = 0.0
    kv_new: float | None = None
    kv_old: float | None = None
    for line in text.splitlines():
        if not line.startswith(b"vllm:"):
            continue
        brace = line.find(b"{")
        space = line.find(b" ")
        if brace >= 0 and (space < 0 or brace < space):
            name, rest = line[:brace], line[line.rfind(b"}") + 1:]
        else:
            name, rest = line[:space], line[space:]
        if name != _WAITING and name != _RUNNING and name not in _KV:
            continue
        try:
            value = float(rest.split()[0])
        except (ValueError, IndexError):
            continue
        if name == _WAITING:
            waiting += value
        elif name == _RUNNING:
            running += value
        elif name == _KV[0]:
            kv_new = value if kv_new is None else max(kv_new, value)
        else:
            kv_old = value if kv_old is None else max(kv_old, value)
    kv = kv_new if kv_new is not None else (kv_old or 0.0)
    return {"waiting": waiting, "running": running, "kv_usage": min(1.0, max(0.0, kv))}


ProbeFetch = Callable[[Replica, str, float], Awaitable[tuple[int, bytes]]]


class Prober:
    """Probes every replica of the current table about once a second."""

    def __init__(self, replicas: Callable[[], Iterable[Replica]],
                 stats: Callable[[str], ReplicaStats | None],
                 fetch: ProbeFetch,
                 interval_s: float = 1.0, timeout_s: float = 2.0,
                 on_change: Callable[[Replica, bool], None] | None = None) -> None:
        self._replicas = replicas
        self._stats = stats
        self._fetch = fetch
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._on_change = on_change
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="edge-prober")

    async def stop(self) -> None:
        await stop_task(self._task)
        self._task = None

    async def probe_all(self) -> None:
        seen: dict[str, Replica] = {}
        for replica in self._replicas():
            seen.setdefault(replica.id, replica)
        if seen:
            await asyncio.gather(*[self.probe(r) for r in seen.values()])

    async def probe(self, replica: Replica) -> None:
        ok = False
        metrics: dict[str, float] | None = None
        try:
            status, _ = await self._fetch(replica, "/health", self.timeout_s)
            ok = 200 <= status < 300
            if ok:
                status, body = await self._fetch(replica, "/metrics", self.timeout_s)
                if status == 200:
                    metrics = parse_engine_metrics(body)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - any failure to answer is a failed probe
            log.debug("probe of %s failed: %s", replica.id, exc)
        stats = self._stats(replica.id)
        if stats is None:
            return
        if metrics is not None:
            stats.waiting = metrics["waiting"]
            stats.running = metrics["running"]
            stats.kv_usage = metrics["kv_usage"]
            stats.metrics_at = time.monotonic()
        else:
            # Unknown is not busy: stale figures would steer traffic by an old picture. The
            # edge's own in-flight count still stands for the load.
            stats.waiting = stats.running = stats.kv_usage = 0.0
        if record_probe(stats, ok):
            log.warning("replica %s is %s by its /health probe", replica.id,
                        "up" if stats.probe_ok else "down")
            if self._on_change is not None:
                self._on_change(replica, stats.probe_ok)

    async def _run(self) -> None:
        while True:
            started = time.monotonic()
            try:
                await self.probe_all()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the loop must outlive any one bad round
                log.exception("probe round failed")
            # Jitter keeps many edges from probing a replica in lockstep.
            pause = self.interval_s * random.uniform(0.8, 1.2) - (time.monotonic() - started)
            await asyncio.sleep(max(0.05, pause))
