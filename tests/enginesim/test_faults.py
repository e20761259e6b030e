"""Fault injection at run time: fail, hang, slow, die, and back to healthy."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from typing import Any

import aiohttp
import pytest

from controlplane.lab.waiting import wait_until, wait_until_async
from enginesim.faults import FaultError, parse_faults
from enginesim.profiles import Profile
from enginesim.server import SERVER_KEY
from tests.edge.helpers import health_answers

from .conftest import engine_of, free_port, run, serving

TICKING = Profile("ticking", overhead_s=0.0, prefill_s_per_token=1e-5, itl_s=0.010,
                  itl_growth_per_seq=0.0, kv_cache_tokens=65_536, max_model_len=8192)


async def set_faults(session: aiohttp.ClientSession, base: str, **fault: Any) -> None:
    async with session.post(base + "/sim/faults", json=fault) as response:
        assert response.status == 200, await response.text()


@pytest.mark.parametrize(("body", "field"), [
    ({"mode": "explode"}, "mode"), ({"mode": "fail", "status": 200}, "status"),
    ({"mode": "slow", "factor": 0}, "factor"), ({"mode": "fail", "health": "no"}, "health"),
    ({"mode": "fail", "sttaus": 500}, "unknown field"), ([], "object"),
])
def test_a_bad_fault_request_names_the_field(body: Any, field: str) -> None:
    with pytest.raises(FaultError, match=field):
        parse_faults(body)


def test_a_failing_engine_refuses_work_and_health_until_it_recovers() -> None:
    async def scenario() -> None:
        async with serving() as (base, _), aiohttp.ClientSession() as session:
            completion = {"model": "test", "prompt": "x", "max_tokens": 1}
            await set_faults(session, base, mode="fail", status=503)
            async with session.post(base + "/v1/completions", json=completion) as response:
                assert response.status == 503
                assert (await response.json())["error"]["code"] == 503
            async with session.get(base + "/health") as response:
                assert response.status == 503
            await set_faults(session, base, mode="fail", status=500, health=False)
            async with session.get(base + "/health") as response:
                assert response.status == 200
            async with session.get(base + "/sim/faults") as response:
                assert (await response.json())["status"] == 500
            await set_faults(session, base, mode="none")
            async with session.post(base + "/v1/completions", json=completion) as response:
                assert response.status == 200
    run(scenario())


def test_a_hung_engine_stalls_streams_and_requests_until_it_is_released() -> None:
    async def scenario() -> None:
        async with serving(TICKING) as (base, app), aiohttp.ClientSession() as session:
            engine, server = engine_of(app), app[SERVER_KEY]
            body = {"model": "test", "prompt": "x", "max_tokens": 30, "ignore_eos": True,
                    "stream": True}
            stream = await session.post(base + "/v1/completions", json=body)
            await stream.content.readuntil(b"\n\n")
            await set_faults(session, base, mode="hang")
            produced = engine.state().generation_tokens
            health = asyncio.ensure_future(session.get(base + "/health"))
            # The server's own evidence that the request is held, rather than a pause.
            await wait_until_async(lambda: server.held == 1, 30,
                                   "the request held at the hung engine's gate")
            assert not health.done()
            assert engine.state().generation_tokens == produced  # no step completes
            await set_faults(session, base, mode="none")
            assert (await asyncio.wait_for(health, 30)).status == 200
            rest = await asyncio.wait_for(stream.read(), 30)
            assert rest.endswith(b"data: [DONE]\n\n")
            assert engine.state().generation_tokens > produced
            stream.close()
    run(scenario())


def test_a_slowed_engine_stretches_every_step_by_the_factor() -> None:
    """12 tokens take a step each of at least the profile's 10 ms, times the factor. Only
    floors are asserted (a loaded machine adds time, never removes it), with two steps to
    spare for the first token's: slowed by 3, the answer cannot come back before 10 × 30 ms,
    where an unslowed one needs about 12 × 10 ms."""
    async def answer_s(session: aiohttp.ClientSession, base: str) -> float:
        body = {"model": "test", "prompt": "x", "max_tokens": 12, "ignore_eos": True,
                "stream": True}
        started = time.monotonic()
        async with session.post(base + "/v1/completions", json=body) as response:
            chunks = [line async for line in response.content if line.startswith(b"data: {")]
        assert len(chunks) >= 12
        return time.monotonic() - started

    async def scenario() -> None:
        async with serving(TICKING) as (base, app), aiohttp.ClientSession() as session:
            normal = await answer_s(session, base)
            await set_faults(session, base, mode="slow", factor=3)
            assert engine_of(app).slow_factor == 3
            slowed = await answer_s(session, base)
        assert normal >= 10 * 0.010
        assert slowed >= 10 * 0.030
    run(scenario())


def test_a_dying_engine_answers_the_admin_request_then_vanishes() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "enginesim", "--port", str(port),
                             "--model", "m", "--profile", "instant"],
                            stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: health_answers(f"http://127.0.0.1:{port}"), 60,
                   "enginesim answering /health")
        request = urllib.request.Request(f"http://127.0.0.1:{port}/sim/faults",
                                         data=b'{"mode": "die"}', method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200
        assert proc.wait(5) != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
