"""The edge in front of two real vLLM engines (vLLM's CPU build serving SmolLM2-135M-Instruct,
one core each): streams arrive byte for byte as the engine sent them; the prefix index sends
a conversation back to the engine whose real prefix cache holds it, as the engines' own hit
counters show; and a real engine killed under traffic costs no client an answer that had not
started streaming. (A stream whose engine is killed mid-answer goes on from the other engine
over mTLS, as the lab runs: tests/edge/test_real_engine_mtls.py.)

Two engines run for the whole module (never more); the last test kills one of them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.lab.waiting import wait_until_async
from edge.local import build_table
from tests.edge.conftest import API_KEY, replica, signing_key, tenant
from tests.edge.helpers import running_edge
from tests.edge.test_enginesim import RecordingRelay, response_body
from tests.real_engine import RealEngine, start_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.real_engine]
__all__ = ["signing_key"]  # the edge tests' fixture, used here too

MODEL = "smollm2-135m-instruct"
HEADERS = {"authorization": f"Bearer {API_KEY}"}
# A system prompt that spans several of vLLM's 128-token cache blocks.
SYSTEM = ("You are the support desk of Meridian, a control plane that serves language models "
          "from many regions. Answer briefly and precisely, in one sentence. ") * 12


@pytest.fixture(scope="module")
def engines() -> Iterator[list[RealEngine]]:
    cores = sorted(os.sched_getaffinity(0))
    with ExitStack() as stack:
        yield [stack.enter_context(start_vllm(cores=str(cores[i % len(cores)])))
               for i in range(2)]


def table_for(engines: list[RealEngine], urls: list[str] | None = None,
              **policy: object) -> dict[str, object]:
    urls = urls or [e.url for e in engines]
    return build_table(1, "edge-test", {MODEL: [
        replica(f"r{i}", url, region="local:lab-1", jurisdiction="EU")
        for i, url in enumerate(urls)]},
        tenants={API_KEY: tenant()},
        policy={"scorers": {"latency": 1.0, "load": 2.0, "prefix": 3.0, "cost": 0.5},
                "retry_before_first_byte": 2, "eject_after_failures": 1,
                "eject_base_s": 5.0, **policy})


def counters(engine: RealEngine) -> tuple[float, float]:
    """(prefix-cache hits, queries) from the engine's own /metrics."""
    with urllib.request.urlopen(engine.url + "/metrics", timeout=5) as response:
        text = response.read().decode()

    def total(name: str) -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name + "{"))

    return total("vllm:prefix_cache_hits_total"), total("vllm:prefix_cache_queries_total")


@pytest.mark.parametrize("chat", [True, False])
def test_a_real_engines_stream_arrives_byte_for_byte(
        engines: list[RealEngine], signing_key: Ed25519PrivateKey, tmp_path: Path,
        chat: bool) -> None:
    port = int(engines[0].url.rsplit(":", 1)[1])

    async def scenario() -> None:
        relay = RecordingRelay(port)
        await relay.start()
        try:
            table = table_for(engines, [f"http://127.0.0.1:{relay.port}"])
            async with running_edge(signing_key, tmp_path / "state") as edge:
                assert (await edge.push(table, signing_key))[0] == 200
                body: dict[str, object] = (
                    {"messages": [{"role": "user", "content": "Name three rivers."}]} if chat
                    else {"prompt": "The three longest rivers are"})
                body.update(model=MODEL, stream=True, max_tokens=24, temperature=0,
                            stream_options={"include_usage": True})
                path = "/v1/chat/completions" if chat else "/v1/completions"
                async with edge.session.post(edge.url + path, json=body,
                                             headers=HEADERS) as response:
                    assert response.status == 200
                    chunks = [chunk async for chunk in response.content.iter_any()]
                received = b"".join(chunks)
                assert received.endswith(b"data: [DONE]\n\n")
                assert received == response_body(bytes(relay.downstream))
                usage = json.loads(received.split(b"data: ")[-2])["usage"]
                assert usage["completion_tokens"] > 0
                await wait_until_async(lambda: edge.edge.metrics.tokens.get(
                    (MODEL, "local:lab-1", "acme", "completion")) == usage["completion_tokens"],
                    30, "the completion tokens counted")
        finally:
            await relay.stop()

    asyncio.run(scenario())


def test_a_repeated_conversation_goes_back_to_the_engine_whose_cache_holds_it(
        engines: list[RealEngine], signing_key: Ed25519PrivateKey, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with running_edge(signing_key, tmp_path / "state") as edge:
            assert (await edge.push(table_for(engines), signing_key))[0] == 200
            before = [counters(e) for e in engines]
            served: dict[str, list[str]] = {}
            cached: dict[str, list[int]] = {}
            # Four conversations, each a fresh system prompt, each asked three turns.
            for conversation in range(4):
                system = f"Session {uuid.uuid4().hex}. {SYSTEM}"
                messages = [{"role": "system", "content": system}]
                for turn in range(3):
                    messages.append({"role": "user", "content": f"Question {turn}?"})
                    async with edge.session.post(edge.url + "/v1/chat/completions", json={
                            "model": MODEL, "messages": messages, "max_tokens": 8,
                            "temperature": 0}, headers=HEADERS) as response:
                        assert response.status == 200
                        answer = await response.json()
                        served.setdefault(str(conversation), []).append(
                            response.headers["x-meridian-replica"])
                    cached.setdefault(str(conversation), []).append(
                        answer["usage"]["prompt_tokens_details"]["cached_tokens"])
                    messages.append(answer["choices"][0]["message"])
            after = [counters(e) for e in engines]
            # Every turn of a conversation went to the engine that served its first turn...
            assert all(len(set(replicas)) == 1 for replicas in served.values()), served
            # ...whose real cache held the conversation so far: the system prompt's blocks
            # at least, on every later turn.
            assert all(c[0] == 0 and min(c[1:]) >= 3 * 128 for c in cached.values()), cached
            hits = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
            assert sum(hits) >= sum(sum(c) for c in cached.values()), (hits, cached)

    asyncio.run(scenario())


def test_a_real_engine_killed_under_traffic_loses_no_request(
        engines: list[RealEngine], signing_key: Ed25519PrivateKey, tmp_path: Path) -> None:
    victim = engines[0]

    async def scenario() -> None:
        async with running_edge(signing_key, tmp_path / "state") as edge:
            table = table_for(engines, scorers={"load": 1.0})
            assert (await edge.push(table, signing_key))[0] == 200
            # Not streamed: nothing reaches a client before its answer is complete.
            tasks = [asyncio.ensure_future(edge.chat(MODEL, f"Tell me a fact about {i}.",
                                                     max_tokens=48))
                     for i in range(8)]
            await wait_until_async(lambda: edge.edge.stats["r0"].inflight >= 2, 30,
                                   "two requests in flight on the engine to kill")
            os.killpg(victim.pid, signal.SIGKILL)  # the API server and its engine core
            responses = [await task for task in tasks]
            assert [r.status for r in responses] == [200] * 8
            bodies = [json.loads(await r.read()) for r in responses]
            assert all(b["choices"][0]["message"]["content"] for b in bodies)
            assert {r.headers["x-meridian-replica"] for r in responses} == {"r1"}
            assert edge.edge.metrics.retries.get((MODEL,)) >= 2

    asyncio.run(scenario())
