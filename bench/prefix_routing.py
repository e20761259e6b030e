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

prints progress to stderr and one JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
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

from edge.health import parse_engine_metrics  # noqa: E402
from edge.local import LocalEdge, build_table, free_port, replica_entry  # noqa: E402

MODEL = "llama-3.1-8b-instruct"
API_KEY = "sk-bench-prefix-routing"
KV_CACHE_TOKENS = 24_576
POLICIES = {
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


def system_prompt(topic: str, tokens: int, rng: random.Random) -> str:
    """A long, distinct support-desk system prompt of about `tokens` tokens (4 chars each)."""
    sentences = [f"You are the {topic} assistant of Meridian Bench Corp."]
    while sum(len(s) + 1 for s in sentences) < tokens * 4:
        sentences.append(f"Rule {len(sentences)}: when a {rng.choice(WORDS)} about "
                         f"{rng.choice(WORDS)} comes up, check the {rng.choice(WORDS)} and "
                         f"answer about {topic} plainly.")
    return " ".join(sentences)


def user_message(user: int, turn: int, tokens: int, rng: random.Random) -> str:
    words = [rng.choice(WORDS) for _ in range(tokens * 4 // 7)]
    return f"User {user}, turn {turn}: " + " ".join(words)


@dataclass
class Sample:
    ttft_s: float
    output_tokens: int
    ok: bool
    turn: int = 0
    replica: str = ""


@dataclass
class RunResult:
    samples: list[Sample] = field(default_factory=list)
    seconds: float = 0.0
    hits: float = 0.0
    queries: float = 0.0

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
        messages.append({"role": "user", "content": user_message(user, turn, args.user_tokens,
                                                                 rng)})
        body = {"model": MODEL, "messages": messages, "stream": True,
                "max_tokens": args.max_tokens, "stream_options": {"include_usage": True}}
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
        result.samples.append(Sample(ttft, tokens, ok, turn, replica))
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


def start_engines(ports: list[int], kv_cache_tokens: int) -> list[subprocess.Popen[bytes]]:
    """Four enginesim processes; returns once all answer /health."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    processes = [subprocess.Popen(
        [sys.executable, "-m", "enginesim", "--port", str(port), "--model", MODEL,
         "--profile", "llama-8b-h100", "--kv-cache-tokens", str(kv_cache_tokens),
         "--max-model-len", str(min(16_384, kv_cache_tokens)),
         "--seed", str(i)], cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
        for i, port in enumerate(ports)]
    deadline = time.monotonic() + 30
    for port in ports:
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"enginesim on port {port} did not start") from None
                time.sleep(0.1)
    return processes


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


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
                     args: argparse.Namespace, rng: random.Random) -> RunResult:
    """Closed loop: `users` conversations at a time, back to back, for `duration` seconds."""
    result = RunResult()
    started = time.perf_counter()
    stop_at = started + args.duration
    await asyncio.gather(*(
        conversation_slot(slot, session, url, systems, args, random.Random(rng.random()),
                          result, stop_at)
        for slot in range(args.users)))
    result.seconds = time.perf_counter() - started
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


class PolicyUnderTest:
    """Four fresh engines and an edge applying one policy."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name = name
        self.ports = [free_port() for _ in range(4)]
        self.engines = start_engines(self.ports, args.kv_cache_tokens)
        self.edge = LocalEdge(name="edge-bench", extra_args=["--probe-interval", "1"])

    def start(self) -> str:
        self.edge.start()
        replicas = [replica_entry(f"{self.name}-r{i}", f"http://127.0.0.1:{port}",
                                  region=f"local:lab-{i % 2 + 1}", rtt_ms=2.0,
                                  max_inflight=64) for i, port in enumerate(self.ports)]
        self.edge.push(build_table(1, self.edge.name, {MODEL: replicas}, {API_KEY: {
            "tenant": "bench", "jurisdictions": ["EU"], "rpm": 0, "tpm": 0, "models": ["*"],
            "tier": "interactive"}}, policy=POLICIES[self.name]))
        return self.edge.url + "/v1/chat/completions"

    def stop(self) -> None:
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run of well under a minute")
    parser.add_argument("--users", type=int, default=24, help="conversations at a time")
    parser.add_argument("--turns", type=int, default=6, help="turns per conversation")
    parser.add_argument("--duration", type=float,
                        help="seconds of new work in each phase, per policy")
    parser.add_argument("--load", type=float, default=0.7,
                        help="steady phase's offered load, as a share of round-robin's "
                             "saturated rate of conversations")
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=3000)
    parser.add_argument("--user-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-tokens", type=int, default=KV_CACHE_TOKENS,
                        help="each replica's KV cache")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    args.duration = args.duration or (6.0 if args.quick else 30.0)
    started = time.monotonic()
    rng = random.Random(args.seed)
    systems = [system_prompt(TOPICS[i % len(TOPICS)], args.system_tokens, rng)
               for i in range(args.system_prompts)]
    log(f"saturation: {args.users} conversations at a time for {args.duration}s; steady load: "
        f"{args.load:.0%} of that for {args.duration}s; {args.turns} turns each "
        f"({args.user_tokens}-token user messages, {args.max_tokens}-token answers), "
        f"{args.system_prompts} system prompts of ~{args.system_tokens} tokens; 4 enginesim "
        f"replicas (llama-8b-h100 profile, {args.kv_cache_tokens} KV tokens each)")
    results, rate = run_policies(systems, args)

    def ratio(policy: str, phase: str, key: str) -> float | None:
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
        "prefix_hit_rate": results["meridian"]["steady"]["prefix_hit_rate"],
        "steady_conversations_per_s": round(rate, 3),
        "errors": sum(r[phase]["errors"] for r in results.values()
                      for phase in ("saturation", "steady")),
        "policies": results,
        "seconds": round(time.monotonic() - started, 1),
    }
    log(f"done in {out['seconds']}s")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
