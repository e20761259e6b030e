"""A hung engine (enginesim's `hang` fault: its kernel still accepts and acknowledges, nothing
answers) costs no client its answer: a stream with no first token within the policy's
`first_byte_timeout_s` goes to another replica and ejects the hung one, and requests still
waiting on it follow; streams already under way are resumed by the stall timeout; a slow
but healthy engine's long answer is never given up; a bad limit is refused naming it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.lab import netns
from controlplane.lab.processes import die_with_parent
from controlplane.lab.waiting import wait_until_async
from edge.table import TableError, parse_table

from .conftest import TableFactory, replica
from .helpers import (
    REPO,
    enginesim_command,
    enginesim_env,
    enginesims,
    free_port,
    health_answers,
    post_json,
    running_edge,
)

# A hung engine overruns any limit; these leave the healthy engine (first token in some
# 30 ms, then one every 10 ms) a hundred times its need on a loaded machine.
LIMIT = {"first_byte_timeout_s": 3.0, "eject_after_failures": 1, "eject_base_s": 30.0,
         "stream_stall_s": 2.0}


def _fault(port: int, **fault: Any) -> None:
    post_json(port, "/sim/faults", fault)


@pytest.fixture(scope="module")
def engines() -> Iterator[list[int]]:
    """Two enginesim processes: [the one that will hang, a healthy one]."""
    with enginesims(2) as ports:
        yield ports


@pytest.fixture
def hung(engines: list[int]) -> Iterator[list[int]]:
    """The first engine hung for the test, and healthy again after it."""
    _fault(engines[0], mode="hang")
    try:
        yield engines
    finally:
        _fault(engines[0], mode="none")


def _pair(make_table: TableFactory, ports: list[int], **policy: Any) -> dict[str, Any]:
    # The hung replica is the nearer one, so every first attempt goes to it.
    return make_table(models={"sim": [
        replica("hung", f"http://127.0.0.1:{ports[0]}", rtt_ms=1),
        replica("healthy", f"http://127.0.0.1:{ports[1]}", rtt_ms=90)]},
        policy={"scorers": {"latency": 1.0}, **policy})


def _stream_text(raw: str) -> str:
    assert raw.endswith("data: [DONE]\n\n"), raw[-300:]
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n")[:-2]]
    assert not any("error" in c for c in chunks), raw[-300:]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                   if c["choices"])


def test_a_hung_engine_costs_no_request_its_answer_and_is_ejected(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory,
        hung: list[int]) -> None:
    healthy = hung[1]
    messages = [{"role": "user", "content": "a question for a hung engine"}]
    whole = post_json(healthy, "/v1/chat/completions",
                  {"model": "sim", "messages": messages, "max_tokens": 30})

    async def scenario() -> None:
        async with running_edge(signing_key, state_dir) as edge:
            assert (await edge.push(_pair(make_table, hung, **LIMIT), signing_key))[0] == 200
            # Both go to the hung replica; the stream's first-token limit ejects it, and the
            # non-streamed request waiting there follows at the watch's next pass.
            streamed = asyncio.ensure_future(edge.chat(
                "sim", messages[0]["content"], stream=True, max_tokens=30))
            await wait_until_async(lambda: edge.edge.stats["hung"].inflight == 1, 30,
                                   "the stream on the hung replica")
            plain = asyncio.ensure_future(edge.chat("sim", "another question", max_tokens=30))
            stream_response, plain_response = await streamed, await plain
            assert stream_response.status == 200
            text = _stream_text((await stream_response.read()).decode())
            assert text == whole["choices"][0]["message"]["content"]
            assert plain_response.status == 200, await plain_response.text()
            assert (await plain_response.json())["choices"][0]["message"]["content"]
            stats = edge.edge.stats["hung"]
            assert stats.ejected(time.monotonic()) and stats.inflight == 0
            assert edge.edge.metrics.retries.get(("sim",)) == 2
            # Ejected, it takes nothing new.
            again = await edge.chat("sim", "a third question", max_tokens=5)
            assert again.status == 200 and edge.edge.stats["hung"].inflight == 0

    asyncio.run(scenario())


def test_with_no_other_replica_a_hung_stream_answers_502_naming_the_limit(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory,
        hung: list[int]) -> None:
    async def scenario() -> None:
        table = make_table(models={"sim": [replica("hung", f"http://127.0.0.1:{hung[0]}")]},
                           policy={"scorers": {"latency": 1.0}, **LIMIT})
        async with running_edge(signing_key, state_dir) as edge:
            assert (await edge.push(table, signing_key))[0] == 200
            response = await edge.chat("sim", "anyone there?", stream=True, max_tokens=5)
            assert response.status == 502
            error = (await response.json())["error"]
            assert error["code"] == "upstream_unavailable"
            assert "no first token within 3s" in error["message"], error

    asyncio.run(scenario())


def test_streams_under_way_when_the_engine_hangs_are_resumed_elsewhere_whole(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory,
        engines: list[int]) -> None:
    """After bytes reached the client, the stall timeout and resumption take over."""
    faulty, healthy = engines
    messages = [{"role": "user", "content": "a long answer, please"}]
    whole = post_json(healthy, "/v1/chat/completions",
                  {"model": "sim", "messages": messages, "max_tokens": 300})

    async def scenario() -> None:
        async with running_edge(signing_key, state_dir) as edge:
            assert (await edge.push(_pair(make_table, engines, **LIMIT), signing_key))[0] == 200
            response = await edge.chat("sim", messages[0]["content"], stream=True,
                                       max_tokens=300)
            assert response.status == 200
            first = await response.content.readany()
            assert b"data: " in first
            await asyncio.to_thread(_fault, faulty, mode="hang")
            raw = (first + await response.read()).decode()
            assert _stream_text(raw) == whole["choices"][0]["message"]["content"]
            assert edge.edge.metrics.resumptions.get(("resumed",)) == 1

    try:
        asyncio.run(scenario())
    finally:
        _fault(faulty, mode="none")


def test_a_slow_healthy_engines_long_answer_is_never_given_up(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory,
        engines: list[int]) -> None:
    """A non-streamed answer's first byte is the whole answer: its length is no fault."""
    slow = engines[0]
    _fault(slow, mode="slow", factor=20.0)
    try:
        async def scenario() -> None:
            table = make_table(models={"sim": [
                replica("slow", f"http://127.0.0.1:{slow}")]},
                policy={"scorers": {"latency": 1.0}, "first_byte_timeout_s": 0.2})
            async with running_edge(signing_key, state_dir) as edge:
                assert (await edge.push(table, signing_key))[0] == 200
                # 20 × (30 ms + 10 × 12 ms): about 3 s, many of the watch's passes past
                # the limit.
                response = await edge.chat("sim", "take your time", max_tokens=10)
                assert response.status == 200, await response.text()
                assert edge.edge.metrics.retries.get(("sim",)) == 0

        asyncio.run(scenario())
    finally:
        _fault(slow, mode="none")


@pytest.mark.parametrize("value, message", [
    (0, "must be > 0"), (-3, "must be > 0"), ("30s", "must be a number"),
    (True, "must be a number")])
def test_a_bad_first_byte_timeout_is_refused_naming_it(make_table: TableFactory, value: Any,
                                                       message: str) -> None:
    table = make_table(policy={"scorers": {"load": 1.0}, "first_byte_timeout_s": value})
    with pytest.raises(TableError) as refused:
        parse_table(table)
    assert refused.value.field == "policy.first_byte_timeout_s"
    assert message in str(refused.value)


def test_the_first_byte_timeout_defaults_to_30s_and_takes_the_tables_value(
        make_table: TableFactory) -> None:
    assert parse_table(make_table()).policy.first_byte_timeout_s == 30.0
    table = make_table(policy={"scorers": {"load": 1.0}, "first_byte_timeout_s": 45})
    assert parse_table(table).policy.first_byte_timeout_s == 45.0


def test_a_pooled_connection_that_times_out_sends_the_request_elsewhere_at_once(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory,
        netns_lab: netns.Lab, engines: list[int]) -> None:
    """A kept-alive connection to a replica cut off by a partition fails by the dead-peer
    timeout; that is the replica's fault, not a stale connection's, so the request goes to
    another replica rather than to the same one on a new connection (which would hang for
    the whole connect timeout, here longer than the client waits)."""
    region = netns_lab.region()
    port = free_port()
    far_url = f"http://{region.address}:{port}"
    far = region.popen(enginesim_command(port, host=region.address), cwd=REPO,
                       stderr=subprocess.DEVNULL, env=enginesim_env(),
                       preexec_fn=die_with_parent())
    try:
        async def scenario() -> None:
            await wait_until_async(lambda: health_answers(far_url), 60,
                                   "the far engine answering /health")
            table = make_table(models={"sim": [
                replica("far", far_url, rtt_ms=1),
                replica("near", f"http://127.0.0.1:{engines[1]}", rtt_ms=90)]},
                policy={"scorers": {"latency": 1.0}, "eject_after_failures": 1})
            async with running_edge(signing_key, state_dir, connect_timeout_s=60.0,
                                    dead_peer_timeout_s=3.0) as edge:
                assert (await edge.push(table, signing_key))[0] == 200
                warm = await edge.chat("sim", "warm the pool", max_tokens=2)
                assert warm.status == 200 and edge.edge.metrics.retries.get(("sim",)) == 0
                await warm.read()
                region.partition()
                response = await edge.chat("sim", "after the cut", max_tokens=5)
                assert response.status == 200, await response.text()
                assert edge.edge.metrics.retries.get(("sim",)) == 1
                assert edge.edge.stats["far"].ejected(time.monotonic())

        asyncio.run(scenario())
    finally:
        far.kill()
        far.wait()
