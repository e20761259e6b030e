"""How long from the start of a sustained overload until the autoscaler decides to scale up.

A deployment with one replica, a real enginesim engine (llama-8b-h100 timing, at most 4
sequences at once), and the control loops as beat runs them: `telemetry.collect` scrapes
/metrics into Postgres every 2 s and `telemetry.autoscale` decides every 2 s, at a random
phase to the scrapes. Each trial starts, at a random moment, more concurrent requests than
the engine admits (a queue builds at once and stays), and measures seconds from the first
request to the stored ScalingDecision. Placement runs the real solver; the replicas it
requests are recorded at the Celery boundary instead of launched.

    python bench/autoscale.py [--quick | --smoke] [--trials N]

(`--smoke`: one trial after one quiet scrape, 40-token answers, to check that every step
runs, not the figures)

Prints progress on stderr and one JSON line last on stdout. Target: ≤ 10 s (SkyServe waits
300 s by default before scaling up; Knative's panic window is 6 s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from decimal import Decimal
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from controlplane.lab.engines import free_port, start_enginesims, stop_all  # noqa: E402
from controlplane.lab.waiting import WaitTimeout, wait_until  # noqa: E402

MODEL = "llama-3.1-8b"
MAX_NUM_SEQS = 4
CONCURRENCY = 16
TARGET_S = 10.0
INTERVAL_S = 2.0
# What every run's JSON line holds (tests/bench/test_benchmarks.py checks it at --smoke).
RESULT_KEYS = ("benchmark", "quick", "smoke", "trials", "decision_s_p50", "decision_s_max",
               "target_s", "met", "cadence_s", "results")


def log(message: str) -> None:
    print(f"[autoscale] {message}", file=sys.stderr, flush=True)


def start_engine(port: int) -> subprocess.Popen[bytes]:
    """One enginesim admitting MAX_NUM_SEQS sequences at once, answering /health."""
    return start_enginesims([port], model=MODEL,
                            extra=("--max-num-seqs", str(MAX_NUM_SEQS)))[0]


def setup(url: str) -> Any:
    from table_push import setup_django

    # Its engine is an enginesim of its own on plain HTTP, scraped directly by the control
    # loops: no engine mTLS (the lab's engines have it; this is no lab).
    os.environ["MERIDIAN_ENGINE_TLS"] = "0"
    setup_django("meridian_bench_autoscale")
    from celery.app.task import Task

    from controlplane.deployments.models import Deployment, Model, Replica
    from controlplane.deployments.models import ReplicaState as S
    from controlplane.scaling.models import ScalingDecision
    from regions.models import Cloud, GpuType, Jurisdiction, Offer, Quota, Region

    # Celery is the boundary: the replicas a scale-up requests are not launched here.
    Task.apply_async = lambda self, *a, **k: None  # type: ignore[method-assign]

    ScalingDecision.objects.all().delete()
    Replica.objects.all().delete()
    Deployment.objects.all().delete()
    eu, _ = Jurisdiction.objects.get_or_create(code="EU", defaults={"name": "European Union"})
    cloud, _ = Cloud.objects.get_or_create(name="local", defaults={"display_name": "Local"})
    region, _ = Region.objects.get_or_create(
        cloud=cloud, code="eu-frankfurt", defaults={
            "display_name": "Frankfurt", "latitude": 50.1, "longitude": 8.7, "country": "DE",
            "jurisdiction": eu})
    gpu, _ = GpuType.objects.get_or_create(name="H100", defaults={
        "memory_gib": 80, "memory_bandwidth_gbps": 3350, "bf16_tflops": 989,
        "fp16_tflops": 989})
    offer, _ = Offer.objects.get_or_create(
        region=region, gpu_type=gpu, gpus_per_node=1, instance_type="enginesim",
        defaults={"on_demand_usd_h": Decimal("4.00"), "observed_at": "2026-01-01T00:00:00Z"})
    Quota.objects.get_or_create(region=region, gpu_type=gpu, defaults={
        "limit_gpus": 8, "observed_at": "2026-01-01T00:00:00Z"})
    model, _ = Model.objects.get_or_create(name="llama-3.1-8b-instruct", defaults={
        "hf_id": "meta-llama/Llama-3.1-8B-Instruct", "parameters_b": 8.03, "layers": 32,
        "attention_heads": 32, "kv_heads": 8, "head_dim": 128, "max_context": 131072})
    deployment = Deployment.objects.create(
        name="bench-chat", served_model_name=MODEL, model=model, min_replicas=1,
        max_replicas=4, target_inflight_per_replica=8, slo_ttft_p95_ms=1000,
        scale_up_cooldown_s=30)
    deployment.allowed_jurisdictions.set([eu])
    deployment.user_regions.set([region])
    Replica.objects.create(deployment=deployment, region=region, offer=offer, state=S.READY,
                           url=url, provider="local")
    return deployment


class ControlLoops(threading.Thread):
    """telemetry.collect and telemetry.autoscale, each every 2 s, `phase` s apart."""

    def __init__(self, phase: float) -> None:
        super().__init__(daemon=True)
        self.phase, self.stop = phase, threading.Event()
        self.errors: list[str] = []

    def run(self) -> None:
        from django.db import connection

        from controlplane.scaling import autoscaler
        from controlplane.telemetry import services

        next_collect = time.monotonic()
        next_scale = next_collect + self.phase
        try:
            while not self.stop.is_set():
                now = time.monotonic()
                try:
                    if now >= next_collect:
                        services.collect()
                        next_collect += INTERVAL_S
                    if now >= next_scale:
                        autoscaler.run()
                        next_scale += INTERVAL_S
                except Exception as exc:  # reported, not hidden
                    self.errors.append(repr(exc))
                self.stop.wait(max(0.0, min(next_collect, next_scale) - time.monotonic()))
        finally:
            connection.close()


class Load(threading.Thread):
    """CONCURRENCY clients sending chat completions of `max_tokens` back to back until
    stopped (the queue stays as long as they send; shorter answers only end it sooner)."""

    def __init__(self, url: str, max_tokens: int = 150) -> None:
        super().__init__(daemon=True)
        self.url, self.stop = url, threading.Event()
        self.max_tokens = max_tokens
        self.started_at = 0.0
        self.begun = threading.Event()

    def run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        import aiohttp

        body = {"model": MODEL, "max_tokens": self.max_tokens,
                "messages": [{"role": "user", "content": "Tell me about autoscaling."}]}
        async with aiohttp.ClientSession() as session:
            async def client() -> None:
                while not self.stop.is_set():
                    async with session.post(f"{self.url}/v1/chat/completions", json=body) as r:
                        await r.read()

            self.started_at = time.time()
            self.begun.set()
            tasks = [asyncio.create_task(client()) for _ in range(CONCURRENCY)]
            while not self.stop.is_set():
                await asyncio.sleep(0.05)
            await asyncio.gather(*tasks, return_exceptions=True)


def engine_idle(url: str) -> bool:
    from controlplane.telemetry.engine_metrics import parse_engine_metrics

    text = urllib.request.urlopen(f"{url}/metrics", timeout=2).read().decode()
    snap = parse_engine_metrics(text)
    return snap.running + snap.waiting == 0


def trial(url: str, deployment: Any, rng: random.Random, quiet_scrapes: int = 2,
          drain: bool = True, max_tokens: int = 150) -> dict[str, Any]:
    """One overload from a quiet engine until the scale-up decision; `drain`: then wait until
    the engine has finished the overload's requests (the next trial starts from quiet)."""
    from controlplane.deployments.models import Replica
    from controlplane.deployments.models import ReplicaState as S
    from controlplane.scaling.models import ScalingDecision
    from controlplane.telemetry.models import ReplicaSample

    ScalingDecision.objects.all().delete()
    Replica.objects.filter(deployment=deployment).exclude(state=S.READY).delete()
    ReplicaSample.objects.all().delete()
    phase = rng.uniform(0, INTERVAL_S)
    loops = ControlLoops(phase)
    loops.start()
    time.sleep(INTERVAL_S * quiet_scrapes + rng.uniform(0, INTERVAL_S))  # quiet scrapes first
    load = Load(url, max_tokens)
    load.start()
    load.begun.wait(10)
    decision = None
    try:
        decision = wait_until(
            lambda: ScalingDecision.objects.filter(deployment=deployment, direction="up").first(),
            30.0, "a scale-up decision after the overload began", every_s=0.1)
    except WaitTimeout:
        pass  # the control loops' errors, if any, say more than the timeout
    finally:
        load.stop.set()
        load.join(30)
        loops.stop.set()
        loops.join(30)
    if loops.errors:
        raise RuntimeError(f"control loop failed: {loops.errors[:3]}")
    if decision is None:
        raise RuntimeError("no scale-up decision within 30 s of the overload")
    if drain:
        wait_until(lambda: engine_idle(url), 60.0,
                   "the engine to finish the overload's requests", every_s=0.2)
    seconds = decision.at.timestamp() - load.started_at
    held = decision.signals.get("sustained_s", {})
    return {"decision_s": round(seconds, 2), "phase_s": round(phase, 2),
            "replicas": [decision.replicas_before, decision.replicas_after],
            "placed": decision.placed, "reason": decision.reason,
            "held_s": {k: v for k, v in held.items() if v}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three trials")
    parser.add_argument("--smoke", action="store_true",
                        help="one trial after one quiet scrape: every step, not the figures")
    parser.add_argument("--trials", type=int, default=None)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    trials = args.trials or (1 if args.smoke else 3 if args.quick else 10)
    port = free_port()
    engine = start_engine(port)
    url = f"http://127.0.0.1:{port}"
    try:
        deployment = setup(url)
        rng = random.Random(args.seed)
        results = []
        for i in range(trials):
            result = trial(url, deployment, rng, quiet_scrapes=1 if args.smoke else 2,
                           drain=i < trials - 1, max_tokens=40 if args.smoke else 150)
            log(f"trial {i + 1}/{trials}: decision {result['decision_s']} s after the overload "
                f"began (autoscale phase {result['phase_s']} s): {result['reason']}")
            results.append(result)
    finally:
        stop_all([engine])
    seconds = sorted(r["decision_s"] for r in results)
    print(json.dumps({
        "benchmark": "autoscale", "quick": args.quick, "smoke": args.smoke,
        "trials": len(results),
        "decision_s_p50": round(statistics.median(seconds), 2),
        "decision_s_max": seconds[-1], "target_s": TARGET_S, "met": seconds[-1] <= TARGET_S,
        "cadence_s": INTERVAL_S, "results": results,
    }))


if __name__ == "__main__":
    main()
