"""Fixtures for enginesim's tests: a virtual-clock driver for the scheduler, sequence
builders, and an in-process enginesim server on a free port with a fast profile."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Coroutine, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
from aiohttp import web

from enginesim.engine import Engine
from enginesim.profiles import Profile
from enginesim.scheduler import Scheduler, Sequence
from enginesim.server import ENGINE_KEY, build_app
from enginesim.tokenizer import block_hashes, count_tokens

# Round numbers so that expected times are easy to write down by hand.
PROFILE = Profile("test", overhead_s=0.030, prefill_s_per_token=0.001, itl_s=0.010,
                  itl_growth_per_seq=0.01, max_num_seqs=8, max_num_batched_tokens=256,
                  kv_cache_tokens=16 * 64, max_model_len=1024)
# For servers driven in real time: quick, but still many steps per request.
FAST = Profile("fast", overhead_s=0.0, prefill_s_per_token=1e-5, itl_s=0.002,
               itl_growth_per_seq=0.0, kv_cache_tokens=65_536, max_model_len=8192)


def seq_of(prompt: str | int, max_tokens: int = 4, eos_at: int | None = None,
           arrival: float = 0.0) -> Sequence:
    """A sequence for `prompt` (a text, or a length for a prompt no other prompt shares)."""
    if isinstance(prompt, int):
        return Sequence(prompt, [], max_tokens, eos_at, arrival)
    return Sequence(count_tokens(prompt), block_hashes(prompt), max_tokens, eos_at, arrival)


@dataclass
class Trace:
    """When each sequence got each of its tokens, and every step's length, on the clock."""

    tokens: dict[int, list[float]] = field(default_factory=dict)
    steps: list[float] = field(default_factory=list)

    def of(self, seq: Sequence) -> list[float]:
        return self.tokens[id(seq)]


def run_virtual(scheduler: Scheduler, seqs: Iterable[Sequence], max_steps: int = 100_000,
                ) -> Trace:
    """Run `scheduler` on a virtual clock until every sequence has finished."""
    trace = Trace()
    overhead = scheduler.profile.overhead_s
    for seq in seqs:
        trace.tokens[id(seq)] = []
        scheduler.add(seq, seq.arrival + overhead)
    now = 0.0
    for _ in range(max_steps):
        step = scheduler.schedule(now)
        if step is None:
            ready = scheduler.next_ready()
            if ready is None:
                return trace
            now = max(now, ready)
            continue
        now += step.duration
        trace.steps.append(step.duration)
        for seq in scheduler.complete(step, now):
            trace.tokens[id(seq)].append(now)
    raise AssertionError("the scheduler did not drain")


@pytest.fixture
def scheduler() -> Scheduler:
    return Scheduler(PROFILE)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@asynccontextmanager
async def serving(profile: Profile = FAST, *, served: str = "test",
                  max_model_len: int | None = None, seed: int = 0, api_keys: list[str] | None = None,
                  enable_prompt_tokens_details: bool = False, enable_scale_out: bool = False,
                  ) -> AsyncIterator[tuple[str, web.Application]]:
    """An enginesim app on a free port for the duration of the block: (base URL, app)."""
    app = build_app(profile, "org/test-model", served, max_model_len, seed=seed,
                    api_keys=api_keys, enable_prompt_tokens_details=enable_prompt_tokens_details,
                    enable_scale_out=enable_scale_out)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        await runner.cleanup()


def engine_of(app: web.Application) -> Engine:
    return app[ENGINE_KEY]


Result = TypeVar("Result")


def run(coro: Coroutine[Any, Any, Result]) -> Result:
    return asyncio.run(coro)
