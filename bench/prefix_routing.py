"""Prefix-aware routing against round-robin and least-load, on a shared-prefix chat workload.

Four enginesim replicas (the llama-8b-h100 timing profile, each with a KV cache of 24k
tokens, so that not every replica can keep every conversation) sit behind a real Meridian
edge. The workload is chat: a few long system prompts, many users, each user holding a
multi-turn conversation that grows by its own messages and the answers it gets back. The
same workload runs three times, with fresh engines each time, under three edge policies:

- round_robin: `policy.picker = "round_robin"`;
- least_load: only the load scorer (in-flight, engine queue, KV use);
- meridian: the default weights (latency, load, prefix affinity with bounded-load
  consistent hashing, cost).

Measured per policy, at the client: time to first token (first content token of the stream)
p50/p95, output tokens per second and requests per second over the run; at the engines: the
prefix-cache hit rate (vllm:prefix_cache_hits_total over vllm:prefix_cache_queries_total).

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
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    processes = [subprocess.Popen(
        [sys.executable, "-m", "enginesim", "--port", str(port), "--model", MODEL,
         "--profile", "llama-8b-h100", "--kv-cache-tokens", str(kv_cache_tokens),
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


async def workload(url: str, systems: list[str], args: argparse.Namespace) -> RunResult:
    result = RunResult()
    rng = random.Random(args.seed)
    timeout = aiohttp.ClientTimeout(total=120)
    connector = aiohttp.TCPConnector(limit=args.users)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        started = time.perf_counter()
        stop_at = started + args.duration
        await asyncio.gather(*(
            conversation_slot(slot, session, url, systems, args, random.Random(rng.random()),
                              result, stop_at)
            for slot in range(args.users)))
        result.seconds = time.perf_counter() - started
    return result


def run_policy(name: str, systems: list[str], args: argparse.Namespace) -> dict[str, Any]:
    ports = [free_port() for _ in range(4)]
    engines = start_engines(ports, args.kv_cache_tokens)
    edge = LocalEdge(name="edge-bench", extra_args=["--probe-interval", "1"])
    try:
        edge.start()
        replicas = [replica_entry(f"{name}-r{i}", f"http://127.0.0.1:{port}",
                                  region=f"local:lab-{i % 2 + 1}", rtt_ms=2.0,
                                  max_inflight=64) for i, port in enumerate(ports)]
        edge.push(build_table(1, edge.name, {MODEL: replicas}, {API_KEY: {
            "tenant": "bench", "jurisdictions": ["EU"], "rpm": 0, "tpm": 0, "models": ["*"],
            "tier": "interactive"}}, policy=POLICIES[name]))
        result = asyncio.run(workload(edge.url + "/v1/chat/completions", systems, args))
        result.hits, result.queries = cache_counts(ports)
    finally:
        edge.close()
        stop(engines)
    summary = result.summary()
    log(f"{name}: {summary}")
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a run of well under a minute")
    parser.add_argument("--users", type=int, default=24, help="conversations at a time")
    parser.add_argument("--turns", type=int, default=4, help="turns per conversation")
    parser.add_argument("--duration", type=float, help="seconds of new turns per policy")
    parser.add_argument("--system-prompts", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1500)
    parser.add_argument("--user-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--kv-cache-tokens", type=int, default=KV_CACHE_TOKENS,
                        help="each replica's KV cache")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    args.duration = args.duration or (7.0 if args.quick else 30.0)
    started = time.monotonic()
    rng = random.Random(args.seed)
    systems = [system_prompt(TOPICS[i % len(TOPICS)], args.system_tokens, rng)
               for i in range(args.system_prompts)]
    log(f"{args.users} conversations at a time for {args.duration}s, {args.turns} turns each "
        f"({args.user_tokens}-token user messages, {args.max_tokens}-token answers), "
        f"{args.system_prompts} system prompts of ~{args.system_tokens} tokens; 4 enginesim "
        f"replicas (llama-8b-h100 profile, {args.kv_cache_tokens} KV tokens each)")
    results = {name: run_policy(name, systems, args) for name in POLICIES}
    rr, ours = results["round_robin"], results["meridian"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    out = {
        "ttft_p50_ratio_vs_round_robin": ratio(ours["ttft_p50_ms"], rr["ttft_p50_ms"]),
        "ttft_p95_ratio_vs_round_robin": ratio(ours["ttft_p95_ms"], rr["ttft_p95_ms"]),
        "throughput_ratio_vs_round_robin": ratio(ours["output_tokens_per_s"],
                                                 rr["output_tokens_per_s"]),
        "ttft_p50_ratio_vs_least_load": ratio(ours["ttft_p50_ms"],
                                              results["least_load"]["ttft_p50_ms"]),
        "throughput_ratio_vs_least_load": ratio(ours["output_tokens_per_s"],
                                                results["least_load"]["output_tokens_per_s"]),
        "prefix_hit_rate": ours["prefix_hit_rate"],
        "errors": sum(r["errors"] for r in results.values()),
        "policies": results,
        "seconds": round(time.monotonic() - started, 1),
    }
    log(f"done in {out['seconds']}s")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
