"""Prefix-aware routing against round-robin and least-load, on a shared-prefix chat workload.

Each policy gets its own four enginesim replicas (the llama-8b-h100 timing profile: 250 µs
per uncached prompt token, 12 ms per output token, 30 ms fixed; a KV cache of 24k tokens
each) behind its own Meridian edge; the three run side by side, at the same time, so that
whatever else the machine does weighs on them alike:

- round_robin: `policy.picker = "round_robin"`;
- least_load: only the load scorer (in-flight, engine queue, KV use);
- meridian: the default weights (latency, load, prefix affinity with bounded-load
  consistent hashing, cost).

The workload is chat: eight long system prompts (~3,000 tokens each: together more than one
replica's cache holds, a quarter of them fits), conversations of six turns by one user each,
every turn a ~100-token message sent with the whole history and answered with 32 tokens.

1. Saturation (the headline figures): 24 conversations at a time, each replaced by a new
   one when it ends, no think time, for `--duration` seconds: TTFT (first content token at
   the client) p50/p95 and output tokens per second.
2. Steady load: new conversations arrive as a Poisson process at 70% (`--load`) of the rate
   round-robin carried in phase 1, the same for every policy: TTFT p50/p95 at equal load.

Prefix-cache hit rate per phase from the engines' vllm:prefix_cache_hits_total and
vllm:prefix_cache_queries_total.

    python bench/prefix_routing.py --quick
    python bench/prefix_routing.py --smoke [--engine vllm]

(`--smoke`: a few requests per policy, to check that every step runs, not the figures)

prints progress to stderr and one JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402

from controlplane.lab import engines  # noqa: E402
from controlplane.lab.waiting import wait_until  # noqa: E402
from edge.health import parse_engine_metrics  # noqa: E402
from edge.local import LocalEdge, build_table, free_port, replica_entry  # noqa: E402

MODEL = "llama-3.1-8b-instruct"
KV_CACHE_TOKENS = 24_576
VLLM_MODEL = "smollm2-135m-instruct"
VLLM_BLOCK_TOKENS = 128
# The profile calibrated against the real engine: with it (or with --engine vllm) the run
# takes the CPU workload below, on two replicas, one policy at a time.
CPU_PROFILE = "smollm2-135m-cpu"
CPU_WORKLOAD = {"replicas": 2, "users": 6, "turns": 4, "system_prompts": 16,
                "system_tokens": 700, "user_tokens": 40, "max_tokens": 8,
                "kv_cache_tokens": 64 * VLLM_BLOCK_TOKENS, "max_model_len": 4096}
DEFAULT_WORKLOAD = {"replicas": 4, "users": 24, "turns": 6, "system_prompts": 8,
                    "system_tokens": 3000, "user_tokens": 100, "max_tokens": 32,
                    "kv_cache_tokens": KV_CACHE_TOKENS, "max_model_len": 16_384}
# A smoke run's workload: every step, a few requests (with --engine vllm, the engines' start
# is most of it).
SMOKE_WORKLOAD = {"replicas": 2, "users": 3, "turns": 2, "system_prompts": 4,
                  "system_tokens": 300, "user_tokens": 20, "max_tokens": 4}
# What every run's JSON line holds (tests/bench/test_benchmarks.py checks it at --smoke).
RESULT_KEYS = ("ttft_p50_ratio_vs_round_robin", "ttft_p95_ratio_vs_round_robin",
               "throughput_ratio_vs_round_robin", "ttft_p50_ratio_vs_least_load",
               "saturation_prefix_hit_rate", "prefix_hit_rate", "round_robin_prefix_hit_rate",
               "errors", "engine", "engine_timing", "profile", "workload", "policies",
               "smoke", "seconds")
SMOKE_ENGINES = ("enginesim", "vllm")
API_KEY = "sk-bench-prefix-routing"
POLICIES: dict[str, dict[str, Any]] = {
    "round_robin": {"scorers": {"load": 1.0}, "picker": "round_robin"},
    "least_load": {"scorers": {"load": 1.0}},
    "meridian": {"scorers": {"latency": 1.0, "load": 2.0, "prefix": 3.0, "cost": 0.5}},
}
TOPICS = ["shipping and customs", "retail banking", "telecom billing", "travel insurance",
          "home energy tariffs", "car leasing"]
WORDS = ("policy customer account request refund invoice delivery contract schedule payment "
         "claim warranty balance transfer address identity document limit renewal notice "
         "service channel escalation priority agent record summary").split()


def log(message: str) -> None:
    print(f"[prefix_routing] {message}", file=sys.stderr, flush=True)


def system_prompt(topic: str, tokens: int, rng: random.Random, chars_per_token: float = 4.0
                  ) -> str:
    """A long, distinct support-desk system prompt of about `tokens` tokens (4 chars each
    for enginesim; the real engine's tokenizer is measured on the first prompt)."""
    sentences = [f"You are the {topic} assistant of Meridian Bench Corp."]
    while sum(len(s) + 1 for s in sentences) < tokens * chars_per_token:
        sentences.append(f"Rule {len(sentences)}: when a {rng.choice(WORDS)} about "
                         f"{rng.choice(WORDS)} comes up, check the {rng.choice(WORDS)} and "
                         f"answer about {topic} plainly.")
    return " ".join(sentences)


def user_message(user: int, turn: int, tokens: int, rng: random.Random,
                 chars_per_token: float = 4.0) -> str:
    words = [rng.choice(WORDS) for _ in range(int(tokens * chars_per_token) // 7)]
    return f"User {user}, turn {turn}: " + " ".join(words)


@dataclass
class Sample:
    ttft_s: float
    output_tokens: int
    ok: bool
    turn: int = 0
    replica: str = ""
    started: float = 0.0


@dataclass
class RunResult:
    samples: list[Sample] = field(default_factory=list)
    seconds: float = 0.0
    hits: float = 0.0
    queries: float = 0.0

    def add(self, other: RunResult) -> None:
        """Another round of the same policy: samples, time and cache counts pooled."""
        self.samples += other.samples
        self.seconds += other.seconds
        self.hits += other.hits
        self.queries += other.queries

    def summary(self) -> dict[str, Any]:
        ok = [s for s in self.samples if s.ok]
        ttfts = sorted(s.ttft_s for s in ok)

        def pct(q: float) -> float:
            return round(ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] * 1000, 1)

        tokens = sum(s.output_tokens for s in ok)
        by_turn: dict[int, list[float]] = {}
        for sample in ok:
            by_turn.setdefault(sample.turn, []).append(sample.ttft_s)
        return {
            "ttft_p50_ms_by_turn": [round(sorted(v)[len(v) // 2] * 1000, 1)
                                    for _, v in sorted(by_turn.items())],
            "requests": len(self.samples), "errors": len(self.samples) - len(ok),
            "ttft_p50_ms": pct(0.50) if ttfts else None,
            "ttft_p95_ms": pct(0.95) if ttfts else None,
            "output_tokens_per_s": round(tokens / self.seconds, 1) if self.seconds else 0.0,
            "requests_per_s": round(len(ok) / self.seconds, 2) if self.seconds else 0.0,
            "prefix_hit_rate": round(self.hits / self.queries, 3) if self.queries else 0.0,
            "seconds": round(self.seconds, 2),
        }


async def converse(session: aiohttp.ClientSession, url: str, system: str, user: int,
                   turns: int, args: argparse.Namespace, rng: random.Random,
                   result: RunResult, stop_at: float) -> None:
    """One user's conversation: each turn sends the whole history, as chat clients do."""
    messages: list[dict[str, str]] = [{"role": "system", "content": system}]
    for turn in range(turns):
        if time.perf_counter() >= stop_at:
            return
        messages.append({"role": "user", "content": user_message(
            user, turn, args.user_tokens, rng, args.chars_per_token)})
        body: dict[str, Any] = {"model": args.model, "messages": messages, "stream": True,
                                "max_tokens": args.max_tokens,
                                "stream_options": {"include_usage": True}}
        if args.sequential:
            # Every answer as long as asked: a real model may stop early, enginesim not.
            body["ignore_eos"] = True
        started = time.perf_counter()
        ttft = 0.0
        text: list[str] = []
        tokens = 0
        ok = False
        replica = ""
        try:
            async with session.post(url, json=body,
                                    headers={"authorization": f"Bearer {API_KEY}"}) as response:
                replica = response.headers.get("x-meridian-replica", "")
                buffer = b""
                async for chunk in response.content.iter_any():
                    buffer += chunk
                    *events, buffer = buffer.split(b"\n\n")
                    for event in events:
                        if not event.startswith(b"data: ") or event == b"data: [DONE]":
                            continue
                        data = json.loads(event[6:])
                        if data.get("usage"):
                            tokens = data["usage"]["completion_tokens"]
                        for choice in data.get("choices", []):
                            content = choice.get("delta", {}).get("content")
                            if content:
                                if not ttft:
                                    ttft = time.perf_counter() - started
                                text.append(content)
                ok = response.status == 200 and ttft > 0
        except (TimeoutError, aiohttp.ClientError):
            ok = False
        result.samples.append(Sample(ttft, tokens, ok, turn, replica, started))
        messages.append({"role": "assistant", "content": "".join(text)})


async def conversation_slot(slot: int, session: aiohttp.ClientSession, url: str,
                            systems: list[str], args: argparse.Namespace, rng: random.Random,
                            result: RunResult, stop_at: float) -> None:
    """Conversations back to back, each by a new user, until the run's time is up."""
    user = slot
    # Users arrive spread over the first second rather than all in the same instant.
    await asyncio.sleep(rng.random())
    while time.perf_counter() < stop_at:
        await converse(session, url, systems[rng.randrange(len(systems))], user, args.turns,
                       args, random.Random(rng.random()), result, stop_at)
        user += args.users


def start_engines(ports: list[int], kv_cache_tokens: int, profile: str = "llama-8b-h100",
                  max_model_len: int = 16_384, extra: tuple[str, ...] = ()
                  ) -> list[subprocess.Popen[bytes]]:
    """enginesim processes, one per port; returns once all answer /health."""
    return engines.start_enginesims(
        ports, model=MODEL, profile=profile, seeded=True,
        extra=("--kv-cache-tokens", str(kv_cache_tokens),
               "--max-model-len", str(min(max_model_len, kv_cache_tokens)), *extra))


stop = engines.stop_all


def cache_counts(ports: list[int]) -> tuple[float, float]:
    hits = queries = 0.0
    for port in ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read()
        for line in text.splitlines():
            if line.startswith(b"vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(b" ", 1)[1])
            elif line.startswith(b"vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(b" ", 1)[1])
    # Used only to check the replicas answer /metrics the way the edge reads them.
    parse_engine_metrics(text)
    return hits, queries


async def saturation(session: aiohttp.ClientSession, url: str, systems: list[str],
                     args: argparse.Namespace, rng: random.Random,
                     ports: list[int] | None = None) -> RunResult:
    """Closed loop: `users` conversations at a time, back to back, for `duration` seconds,
    after `warmup` seconds of the same whose requests are not counted (cache counts are then
    read from `ports` when the warm-up ends)."""
    result = RunResult()
    started = time.perf_counter()
    measure_from = started + args.warmup
    stop_at = measure_from + args.duration
    before = (0.0, 0.0)

    async def mark() -> None:
        nonlocal before
        await asyncio.sleep(args.warmup)
        if ports is not None:
            before = await asyncio.to_thread(cache_counts, ports)

    await asyncio.gather(mark(), *(
        conversation_slot(slot, session, url, systems, args, random.Random(rng.random()),
                          result, stop_at)
        for slot in range(args.users)))
    result.seconds = time.perf_counter() - measure_from
    if args.warmup:
        result.samples = [s for s in result.samples if s.started >= measure_from]
    if ports is not None:
        hits, queries = cache_counts(ports)
        result.hits, result.queries = hits - before[0], queries - before[1]
    return result


async def steady_load(session: aiohttp.ClientSession, url: str, systems: list[str],
                      args: argparse.Namespace, rng: random.Random, rate: float) -> RunResult:
    """Open loop: new conversations arrive as a Poisson process at `rate` a second, the same
    for every policy, for `duration` seconds; each runs its turns to the end."""
    result = RunResult()
    started = time.perf_counter()
    stop_at = started + args.duration
    conversations = []
    user = 1_000_000
    while (now := time.perf_counter()) < stop_at:
        conversations.append(asyncio.ensure_future(converse(
            session, url, systems[rng.randrange(len(systems))], user, args.turns, args,
            random.Random(rng.random()), result, float("inf"))))
        user += 1
        await asyncio.sleep(min(rng.expovariate(rate), stop_at - now))
    await asyncio.gather(*conversations)
    result.seconds = time.perf_counter() - started
    return result


async def phase(kind: str, urls: list[str], systems: list[str], args: argparse.Namespace,
                ports: list[list[int]], rate: float = 0.0) -> list[RunResult]:
    """Run one phase for every policy at once; cache hits are counted per phase."""
    timeout = aiohttp.ClientTimeout(total=120)
    before = [cache_counts(p) for p in ports]
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        if kind == "saturation":
            runs = [saturation(session, url, systems, args, random.Random(args.seed))
                    for url in urls]
        else:
            runs = [steady_load(session, url, systems, args, random.Random(args.seed + 1), rate)
                    for url in urls]
        results = list(await asyncio.gather(*runs))
    for result, p, (hits, queries) in zip(results, ports, before, strict=True):
        after_hits, after_queries = cache_counts(p)
        result.hits, result.queries = after_hits - hits, after_queries - queries
    return results


def start_edge(name: str, ports: list[int], model: str) -> tuple[LocalEdge, str]:
    """A Meridian edge applying policy `name` to the engines on `ports`; returns its URL."""
    edge = LocalEdge(name="edge-bench", extra_args=["--probe-interval", "1"])
    edge.start()
    return edge, point_edge(edge, name, ports, model)


def point_edge(edge: LocalEdge, name: str, ports: list[int], model: str) -> str:
    """Push `edge` a table routing `model` to the engines on `ports` under policy `name`."""
    replicas = [replica_entry(f"{name}-r{i}-{port}", f"http://127.0.0.1:{port}",
                              region=f"local:lab-{i % 2 + 1}", rtt_ms=2.0,
                              max_inflight=64) for i, port in enumerate(ports)]
    edge.push(build_table(edge.version + 1, edge.name, {model: replicas}, {API_KEY: {
        "tenant": "bench", "jurisdictions": ["EU"], "rpm": 0, "tpm": 0, "models": ["*"],
        "tier": "interactive"}}, policy=POLICIES[name]))
    return edge.url + "/v1/chat/completions"


class PolicyUnderTest:
    """Fresh engines and an edge applying one policy."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name = name
        self.model = args.model
        self.ports = [free_port() for _ in range(args.replicas)]
        self.engines = start_engines(self.ports, args.kv_cache_tokens, args.profile,
                                     args.max_model_len)
        self.edge: LocalEdge | None = None

    def start(self) -> str:
        self.edge, url = start_edge(self.name, self.ports, self.model)
        return url

    def stop(self) -> None:
        if self.edge is not None:
            self.edge.close()
        stop(self.engines)


def run_policies(systems: list[str], args: argparse.Namespace) -> tuple[dict[str, Any], float]:
    """All three at once, each on its own engines and edge: the same load, at the same time,
    so that whatever else the machine is doing weighs on them alike.

    First the saturation phase; then the steady phase, at `load` × the rate of new
    conversations round-robin managed at saturation, so every policy gets the same offered
    load, one round-robin can carry."""
    setups: list[PolicyUnderTest] = []
    try:
        for name in POLICIES:
            setups.append(PolicyUnderTest(name, args))
        urls = [setup.start() for setup in setups]
        ports = [setup.ports for setup in setups]
        busy = asyncio.run(phase("saturation", urls, systems, args, ports))
        round_robin = busy[list(POLICIES).index("round_robin")]
        rate = max(0.2, args.load * len(round_robin.samples) / args.turns / round_robin.seconds)
        log(f"steady phase at {rate:.2f} new conversations/s ({args.load:.0%} of round-robin's "
            "saturated rate)")
        steady = asyncio.run(phase("steady", urls, systems, args, ports, rate))
    finally:
        for setup in setups:
            setup.stop()
    results = {}
    for setup, b, s in zip(setups, busy, steady, strict=True):
        results[setup.name] = {"saturation": b.summary(), "steady": s.summary()}
        log(f"{setup.name}: {results[setup.name]}")
    return results, rate


class SimPair:
    """enginesim replicas for the one-policy-at-a-time runs: fresh processes (empty caches)
    for every run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.processes: list[subprocess.Popen[bytes]] = []
        self.ports: list[int] = []

    def fresh(self) -> list[int]:
        stop(self.processes)
        self.ports = [free_port() for _ in range(self.args.replicas)]
        self.processes = start_engines(self.ports, self.args.kv_cache_tokens,
                                       self.args.profile, self.args.max_model_len,
                                       ("--enable-prompt-tokens-details",))
        return self.ports

    def close(self) -> None:
        stop(self.processes)


class VllmPair:
    """Real vLLM engines (the CPU build from `make engine`), one core each; the prefix caches
    are emptied between runs through vLLM's /reset_prefix_cache (served with
    VLLM_SERVER_DEV_MODE=1). Each engine dies with this process (a parent-death signal)."""

    def __init__(self, args: argparse.Namespace) -> None:
        missing = engines.engine_unavailable() or engines.engine_missing()
        if missing is not None:
            raise SystemExit(f"no real engine here: {missing}")
        self.ports = [free_port() for _ in range(args.replicas)]
        self.logs: list[Path] = []
        self.processes: list[subprocess.Popen[bytes]] = []
        cores = sorted(os.sched_getaffinity(0))
        blocks = args.kv_cache_tokens // VLLM_BLOCK_TOKENS
        try:
            for i, port in enumerate(self.ports):
                log_path = Path(f"/tmp/prefix-routing-vllm-{port}.log")
                self.logs.append(log_path)
                self.processes.append(engines.start_vllm(
                    port, log_path, "--num-gpu-blocks-override", str(blocks),
                    cores=str(cores[i % len(cores)]), max_model_len=args.max_model_len,
                    env={"VLLM_SERVER_DEV_MODE": "1"}))
            for port, process, log_path in zip(self.ports, self.processes, self.logs,
                                               strict=True):
                engines.wait_healthy(f"http://127.0.0.1:{port}", process, log=log_path)
        except BaseException:
            self.close()
            raise

    def fresh(self) -> list[int]:
        for port in self.ports:
            # A busy engine may not answer a reset within its 10 s: that is asked again too.
            wait_until(functools.partial(reset_prefix_cache, port), 60.0,
                       f"vLLM on port {port} to empty its prefix cache (blocks still held by "
                       "requests finishing)", every_s=0.2, ignore=(OSError,))
        return self.ports

    def close(self) -> None:
        engines.stop_all(self.processes)
        for log_path in self.logs:
            log_path.unlink(missing_ok=True)


def reset_prefix_cache(port: int) -> bool:
    """True once vLLM on `port` emptied its prefix cache (POST /reset_prefix_cache)."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/reset_prefix_cache",
                                     data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        return bool(json.loads(response.read()).get("success"))


def chars_per_token(port: int, model: str) -> float:
    """Characters per token of the engine's own tokenizer on the bench's text."""
    sample = system_prompt(TOPICS[0], 1000, random.Random(0))
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/tokenize", method="POST",
        data=json.dumps({"model": model, "prompt": sample}).encode(),
        headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return len(sample) / json.loads(response.read())["count"]


async def stream_timing(session: aiohttp.ClientSession, port: int, model: str, prompt: str,
                        max_tokens: int) -> tuple[float, float, int]:
    """(TTFT, total seconds, cached prompt tokens) of one streamed completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first, cached = 0.0, 0
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as response:
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            data = json.loads(line[6:])
            if data.get("choices") and not first:
                first = time.perf_counter() - started
            if data.get("usage"):
                cached = (data["usage"].get("prompt_tokens_details") or {}).get(
                    "cached_tokens") or 0
    return first, time.perf_counter() - started, cached


async def engine_timing(port: int, args: argparse.Namespace) -> dict[str, float]:
    """How fast the engine is now, alone: a fresh prompt of ~system_tokens tokens prefilled
    cold and then from the cache, and a lone 32-token decode; the enginesim profile's terms."""
    prompt = system_prompt("calibration", args.system_tokens, random.Random(time.time()),
                           args.chars_per_token)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        cold, _, _ = await stream_timing(session, port, args.model, prompt, 1)
        warm, _, cached = await stream_timing(session, port, args.model, prompt, 1)
        first, total, _ = await stream_timing(session, port, args.model, "Once upon a time",
                                              32)
    return {"ttft_cold_ms": round(cold * 1000, 1), "ttft_cached_ms": round(warm * 1000, 1),
            "prefill_ms_per_token": round((cold - warm) * 1000 / cached, 3) if cached else 0.0,
            "itl_ms": round((total - first) * 1000 / 31, 1)}


def run_one_at_a_time(args: argparse.Namespace) -> dict[str, Any]:
    """The policies one after another on the same engines (with a real engine there is room
    for two, not one pair per policy), each run starting from empty prefix caches, the order
    reversed every other round so that the machine's other load weighs on them alike."""
    engines: SimPair | VllmPair = VllmPair(args) if args.engine == "vllm" else SimPair(args)
    totals = {name: RunResult() for name in POLICIES}
    try:
        if args.engine == "vllm":
            args.chars_per_token = round(chars_per_token(engines.ports[0], args.model), 2)
            log(f"engines up; their tokenizer: {args.chars_per_token} characters a token")
        engines.fresh()
        args.engine_timing = asyncio.run(engine_timing(engines.ports[0], args))
        log(f"one engine alone, before the runs: {args.engine_timing}")
        systems = make_systems(args)
        # One edge per policy for the whole run; each run pushes it a table naming the
        # engines (the same ones each time for vLLM, fresh processes for enginesim).
        edges = {name: LocalEdge(name="edge-bench", extra_args=["--probe-interval", "1"])
                 for name in POLICIES}
        for edge in edges.values():
            edge.start()
        try:
            for round_ in range(args.rounds):
                order = list(POLICIES) if round_ % 2 == 0 else list(reversed(POLICIES))
                for name in order:
                    url = point_edge(edges[name], name, engines.fresh(), args.model)
                    result = asyncio.run(one_saturation(url, systems, args, engines.ports))
                    totals[name].add(result)
                    log(f"round {round_ + 1} {name}: {result.summary()}")
        finally:
            for edge in edges.values():
                edge.close()
    finally:
        engines.close()
    return {name: {"saturation": totals[name].summary()} for name in POLICIES}


async def one_saturation(url: str, systems: list[str], args: argparse.Namespace,
                         ports: list[int]) -> RunResult:
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        return await saturation(session, url, systems, args, random.Random(args.seed), ports)


def make_systems(args: argparse.Namespace) -> list[str]:
    rng = random.Random(args.seed)
    return [system_prompt(TOPICS[i % len(TOPICS)], args.system_tokens, rng,
                          args.chars_per_token) for i in range(args.system_prompts)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run of well under a minute")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run that goes through every step: a few requests "
                             "per policy (with --engine vllm, the engines' start is most of "
                             "it)")
    parser.add_argument("--engine", choices=("enginesim", "vllm"), default="enginesim",
                        help="enginesim (default) or two real vLLM CPU engines (`make engine`)")
    parser.add_argument("--profile", default=None,
                        help=f"enginesim's timing profile (default llama-8b-h100; {CPU_PROFILE} "
                             "is calibrated against --engine vllm and takes its workload)")
    parser.add_argument("--replicas", type=int, help="engines per policy")
    parser.add_argument("--users", type=int, help="conversations at a time")
    parser.add_argument("--turns", type=int, help="turns per conversation")
    parser.add_argument("--duration", type=float,
                        help="seconds of new work in each phase, per policy")
    parser.add_argument("--warmup", type=float,
                        help="seconds of the same load before each measured run (not counted)")
    parser.add_argument("--rounds", type=int,
                        help="one-at-a-time runs: rounds of the three policies")
    parser.add_argument("--load", type=float, default=0.7,
                        help="steady phase's offered load, as a share of round-robin's "
                             "saturated rate of conversations")
    parser.add_argument("--system-prompts", type=int)
    parser.add_argument("--system-tokens", type=int)
    parser.add_argument("--user-tokens", type=int)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--kv-cache-tokens", type=int, help="each replica's KV cache")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    if args.engine == "vllm" and args.profile not in (None, CPU_PROFILE):
        parser.error("--profile is enginesim's; a real engine has its own timing")
    args.profile = args.profile or (CPU_PROFILE if args.engine == "vllm" else "llama-8b-h100")
    # With a real engine (and with the profile calibrated against it), the policies run one
    # at a time on the same two engines, on a workload scaled to a 135M model on a CPU core.
    args.sequential = args.profile == CPU_PROFILE
    workload = CPU_WORKLOAD if args.sequential else DEFAULT_WORKLOAD
    if args.smoke:
        workload = {**workload, **SMOKE_WORKLOAD}
    for key, value in workload.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.smoke:
        args.duration = args.duration or 1.5
        args.warmup = args.warmup or 0.0
        args.rounds = args.rounds or 1
    elif args.sequential:
        args.duration = args.duration or (6.0 if args.quick else 30.0)
        args.warmup = 2.0 if args.warmup is None and args.quick else (
            10.0 if args.warmup is None else args.warmup)
        args.rounds = args.rounds or (2 if args.quick else 3)
    else:
        args.duration = args.duration or (6.0 if args.quick else 30.0)
        args.warmup = args.warmup or 0.0
        args.rounds = 1
    args.model = VLLM_MODEL if args.engine == "vllm" else MODEL
    args.chars_per_token = 4.0  # enginesim's; a real engine's is measured once it is up
    args.engine_timing = None
    started = time.monotonic()
    engines = (f"{args.replicas} real vLLM engines (SmolLM2-135M, one core each, "
               f"{args.kv_cache_tokens} KV tokens each)" if args.engine == "vllm" else
               f"{args.replicas} enginesim replicas ({args.profile} profile, "
               f"{args.kv_cache_tokens} KV tokens each)")
    if args.sequential:
        log(f"saturation: {args.users} conversations at a time, {args.warmup}s warm-up + "
            f"{args.duration}s measured per policy, {args.rounds} rounds of the three "
            f"policies one at a time on the same engines (prefix caches emptied between); "
            f"{args.turns} turns each ({args.user_tokens}-token user messages, "
            f"{args.max_tokens}-token answers), {args.system_prompts} system prompts of "
            f"~{args.system_tokens} tokens; {engines}")
        results = run_one_at_a_time(args)
        rate = 0.0
    else:
        log(f"saturation: {args.users} conversations at a time for {args.duration}s; steady "
            f"load: {args.load:.0%} of that for {args.duration}s; {args.turns} turns each "
            f"({args.user_tokens}-token user messages, {args.max_tokens}-token answers), "
            f"{args.system_prompts} system prompts of ~{args.system_tokens} tokens; {engines}")
        results, rate = run_policies(make_systems(args), args)

    def ratio(policy: str, phase: str, key: str) -> float | None:
        if phase not in results["meridian"]:
            return None
        ours, theirs = results["meridian"][phase][key], results[policy][phase][key]
        return round(ours / theirs, 3) if ours and theirs else None

    out = {
        # The headline figures come from one condition: the same 24 conversations at a time
        # for every policy, as many requests as each can serve.
        "ttft_p50_ratio_vs_round_robin": ratio("round_robin", "saturation", "ttft_p50_ms"),
        "ttft_p95_ratio_vs_round_robin": ratio("round_robin", "saturation", "ttft_p95_ms"),
        "throughput_ratio_vs_round_robin": ratio("round_robin", "saturation",
                                                 "output_tokens_per_s"),
        "ttft_p50_ratio_vs_least_load": ratio("least_load", "saturation", "ttft_p50_ms"),
        "throughput_ratio_vs_least_load": ratio("least_load", "saturation",
                                                "output_tokens_per_s"),
        # The same offered load for every policy (70% of what round-robin carried).
        "steady_ttft_p50_ratio_vs_round_robin": ratio("round_robin", "steady", "ttft_p50_ms"),
        "steady_ttft_p95_ratio_vs_round_robin": ratio("round_robin", "steady", "ttft_p95_ms"),
        "saturation_prefix_hit_rate": results["meridian"]["saturation"]["prefix_hit_rate"],
        "prefix_hit_rate": results["meridian"].get("steady", results["meridian"]["saturation"])[
            "prefix_hit_rate"],
        "round_robin_prefix_hit_rate": results["round_robin"]["saturation"]["prefix_hit_rate"],
        "least_load_prefix_hit_rate": results["least_load"]["saturation"]["prefix_hit_rate"],
        "steady_conversations_per_s": round(rate, 3) if rate else None,
        "errors": sum(r[phase]["errors"] for r in results.values() for phase in r),
        "engine": args.engine,
        # The first engine alone before the runs (one-at-a-time runs only): what the machine's
        # other load made of it this time, in the profile's terms.
        "engine_timing": args.engine_timing,
        "profile": None if args.engine == "vllm" else args.profile,
        "workload": {key: getattr(args, key) for key in (
            "replicas", "users", "turns", "system_prompts", "system_tokens", "user_tokens",
            "max_tokens", "kv_cache_tokens", "duration", "warmup", "rounds")},
        "policies": results,
        "smoke": args.smoke,
        "seconds": round(time.monotonic() - started, 1),
    }
    log(f"done in {out['seconds']}s")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
