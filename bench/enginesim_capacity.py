"""How many concurrent streams one enginesim process holds with ITL within 10% of its model.

The engine runs in its own process (one core); a separate load process opens N streaming
chat requests at once, each asking for a fixed number of tokens, and measures the gaps
between tokens as the client sees them. The reference is the profile's modelled ITL at
that batch size; a level passes when the measured median ITL is within 10% of it. The
target is at least 128 streams, so that the lab's benchmarks measure Meridian, not the
simulator.

    python bench/enginesim_capacity.py [--quick]

Progress on stderr; one JSON line last on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from enginesim.profiles import BUILTIN, DEFAULT  # noqa: E402


def log(message: str) -> None:
    print(f"[enginesim_capacity] {message}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def one_stream(session: aiohttp.ClientSession, url: str, tokens: int, gaps: list[float],
                     prompt: str) -> None:
    body = {"model": "sim", "stream": True, "max_tokens": tokens,
            "messages": [{"role": "user", "content": prompt}]}
    last = None
    async with session.post(url, json=body) as response:
        async for line in response.content:
            if not line.startswith(b"data: {") or b'"content":""' in line:
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now


async def level(url: str, streams: int, tokens: int) -> list[float]:
    gaps: list[float] = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(one_stream(session, url, tokens, gaps, f"user {i} asks something")
                               for i in range(streams)))
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    levels = [16, 64, 128, 256, 384, 512] if args.quick else [16, 32, 64, 128, 192, 256, 384, 512, 768]
    tokens = 60 if args.quick else 150
    profile = BUILTIN[DEFAULT]
    port = free_port()
    engine = subprocess.Popen([sys.executable, "-m", "enginesim", "--port", str(port),
                               "--model", "sim", "--max-num-seqs", "1024",
                               "--kv-cache-tokens", "4000000"], cwd=REPO)
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    results = []
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        for streams in levels:
            gaps = asyncio.run(level(url, streams, tokens))
            expected = profile.itl_at(streams)
            p50 = statistics.median(gaps)
            p95 = sorted(gaps)[int(len(gaps) * 0.95)]
            ok = abs(p50 - expected) <= 0.10 * expected
            results.append({"streams": streams, "itl_p50_ms": round(p50 * 1000, 2),
                            "itl_p95_ms": round(p95 * 1000, 2),
                            "model_itl_ms": round(expected * 1000, 2), "within_10pct": ok})
            log(f"{streams:4d} streams: ITL p50 {p50 * 1000:.2f} ms, p95 {p95 * 1000:.2f} ms, "
                f"model {expected * 1000:.2f} ms -> {'ok' if ok else 'over'}")
            if not ok:
                break
    finally:
        engine.terminate()
        engine.wait(10)
    passing = [r["streams"] for r in results if r["within_10pct"]]
    print(json.dumps({"benchmark": "enginesim_capacity", "quick": args.quick,
                      "profile": profile.name, "max_streams_within_10pct": max(passing, default=0),
                      "target": 128, "levels": results}))


if __name__ == "__main__":
    main()
