"""How many concurrent streams one enginesim process holds with ITL within 10% of its model.

One enginesim process (the default llama-8b-h100 profile, its own event loop and core) is
loaded by a separate load process at rising concurrency: 16, 32, 64, 128, 192, 256, 384,
512, 768, 1024 streams (the profile's max_num_seqs), each level a fresh batch of streaming
completions started together, each asking for a fixed number of tokens (ignore_eos). The
load process is a bare asyncio protocol per connection that only timestamps the frames it
receives, so it stays cheap next to the server it measures.

Per level: the gaps between consecutive tokens of each stream as the client sees them,
taken in the steady window (after every stream has its first token, so no step carries a
prefill, and before any stream has finished, so the batch is whole), their p50, p95 and
mean, and the ITL the profile models for that batch size (it grows with the batch). A level passes when both p50 and mean are within 10% of the
model; the ramp stops at the first level that fails. Also reported: the server's CPU use
during the level, which says how much headroom one core has left.

    python bench/enginesim_capacity.py [--quick | --smoke]

(`--smoke`: the first level only, to check that every step runs, not the figures)

Progress goes to stderr; one JSON line last on stdout, with max_streams_within_10pct.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from controlplane.lab.engines import (  # noqa: E402
    free_port,
    start_enginesim,
    stop_group,
    wait_healthy,
)
from enginesim.profiles import BUILTIN, DEFAULT  # noqa: E402

LEVELS = (16, 32, 64, 128, 192, 256, 384, 512, 768, 1024)
TOLERANCE = 0.10
# What every run's JSON line holds (tests/bench/test_benchmarks.py checks it at --smoke).
RESULT_KEYS = ("benchmark", "quick", "smoke", "profile", "max_streams_within_10pct", "target",
               "levels", "seconds")


def log(message: str) -> None:
    print(f"[enginesim_capacity] {message}", file=sys.stderr, flush=True)


# --- the load process ----------------------------------------------------------------------

class StreamProbe(asyncio.Protocol):
    """One streaming request over a raw connection; records when each token frame arrives."""

    def __init__(self, request: bytes, done: asyncio.Future[None]) -> None:
        self.request = request
        self.done = done
        self.arrivals: list[float] = []
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def factory(self) -> StreamProbe:
        return self

    def send(self) -> None:
        assert self.transport is not None
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self.arrivals.extend([now] * data.count(b'"text":'))
        if b"data: [DONE]" in data:
            if self.transport is not None:
                self.transport.close()
            if not self.done.done():
                self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)


async def run_level(port: int, streams: int, tokens: int) -> list[list[float]]:
    loop = asyncio.get_running_loop()
    probes = []
    for i in range(streams):
        body = json.dumps({"model": "sim", "prompt": f"s{i}",
                           "max_tokens": tokens, "ignore_eos": True, "stream": True}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                   b"Content-Type: application/json\r\nContent-Length: "
                   + str(len(body)).encode() + b"\r\n\r\n" + body)
        probes.append(StreamProbe(request, loop.create_future()))
    # Connect everyone first, then send every request at once, so the batch fills together.
    await asyncio.gather(*(loop.create_connection(p.factory, "127.0.0.1", port) for p in probes))
    for probe in probes:
        probe.send()
    await asyncio.wait_for(asyncio.gather(*(p.done for p in probes)), timeout=120)
    return [p.arrivals for p in probes]


def load_main(port: int, streams: int, tokens: int) -> None:
    import uvloop

    arrivals = uvloop.run(run_level(port, streams, tokens))
    print(json.dumps(arrivals))


# --- the orchestrator ----------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(port: int, server_pid: int, streams: int, tokens: int) -> dict[str, object]:
    cpu_before, wall_before = cpu_seconds(server_pid), time.monotonic()
    out = subprocess.run(
        [sys.executable, __file__, "--load", str(port), str(streams), str(tokens)],
        capture_output=True, text=True, check=True, timeout=180)
    wall = time.monotonic() - wall_before
    cpu = cpu_seconds(server_pid) - cpu_before
    per_stream = json.loads(out.stdout)
    incomplete = sum(1 for arrivals in per_stream if len(arrivals) < tokens)
    # The steady window: every stream has its first token (no prefill left in any step)
    # and none has finished yet (the batch is whole).
    full = max(arrivals[0] for arrivals in per_stream)
    last = min(arrivals[-1] for arrivals in per_stream)
    gaps = [b - a for arrivals in per_stream for a, b in itertools.pairwise(arrivals)
            if a >= full and b <= last]
    gaps.sort()
    model = BUILTIN[DEFAULT].itl_at(streams)
    p50 = statistics.median(gaps)
    mean = statistics.fmean(gaps)
    p95 = gaps[int(len(gaps) * 0.95)]
    ok = (incomplete == 0 and len(gaps) >= 5 * streams and abs(p50 - model) <= TOLERANCE * model
          and abs(mean - model) <= TOLERANCE * model)
    return {"streams": streams, "tokens_per_stream": tokens, "itl_p50_ms": round(p50 * 1e3, 2),
            "itl_p95_ms": round(p95 * 1e3, 2), "itl_mean_ms": round(mean * 1e3, 2),
            "model_itl_ms": round(model * 1e3, 2), "server_cpu_pct": round(100 * cpu / wall),
            "gaps_sampled": len(gaps), "incomplete_streams": incomplete, "within_10pct": ok}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="40 tokens per stream (plus one per 8 streams), not 150")
    parser.add_argument("--smoke", action="store_true",
                        help="the first level only, 20 tokens per stream: every step, not "
                             "the figures")
    parser.add_argument("--load", nargs=3, type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.load:
        load_main(*args.load)
        return
    profile = BUILTIN[DEFAULT]
    base_tokens = 20 if args.smoke else 40 if args.quick else 150
    levels = LEVELS[:1] if args.smoke else LEVELS
    port = free_port()
    server = start_enginesim(port)
    results: list[dict[str, object]] = []
    started = time.monotonic()
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server, 30.0, every_s=0.1)
        log(f"profile {profile.name}: {profile.itl_s * 1e3:.0f} ms ITL alone, +"
            f"{profile.itl_growth_per_seq:.1%} per extra sequence")
        for streams in levels:
            if streams > profile.max_num_seqs:
                break
            # Admitting and prefilling a large batch takes longer: give its streams more
            # tokens so that the steady window stays long.
            tokens = base_tokens + streams // 8
            result = measure(port, server.pid, streams, tokens)
            results.append(result)
            log(f"{streams:5d} streams: ITL p50 {result['itl_p50_ms']} ms, p95 "
                f"{result['itl_p95_ms']} ms, mean {result['itl_mean_ms']} ms, model "
                f"{result['model_itl_ms']} ms, server CPU {result['server_cpu_pct']}% -> "
                f"{'ok' if result['within_10pct'] else 'over'}")
            if not result["within_10pct"]:
                break
    finally:
        stop_group(server)
    passing = [int(r["streams"]) for r in results if r["within_10pct"]]  # type: ignore[call-overload]
    print(json.dumps({"benchmark": "enginesim_capacity", "quick": args.quick,
                      "smoke": args.smoke,
                      "profile": profile.name,
                      "max_streams_within_10pct": max(passing, default=0), "target": 128,
                      "levels": results, "seconds": round(time.monotonic() - started, 1)}))


if __name__ == "__main__":
    main()
