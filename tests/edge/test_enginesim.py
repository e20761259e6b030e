"""The edge in front of enginesim, the project's vLLM stand-in: what the engine sent is what
the client gets, byte for byte; an engine that dies costs no client an error while nothing of
its answer had been sent."""

from __future__ import annotations

import asyncio
import functools
import json
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httptools
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.lab.waiting import wait_until, wait_until_async

from .conftest import API_KEY, TableFactory, replica
from .helpers import (
    enginesims,
    free_port,
    health_answers,
    post_json,
    running_edge,
    start_enginesim,
)

pytest.importorskip("enginesim")

@pytest.fixture(scope="module")
def enginesim_port() -> Iterator[int]:
    port = free_port()
    process = start_enginesim(port)
    try:
        wait_until(lambda: health_answers(f"http://127.0.0.1:{port}"), 60,
                   "enginesim answering /health")
        yield port
    finally:
        process.kill()
        process.wait()


class RecordingRelay:
    """A TCP relay that keeps every byte the upstream sent back, to compare with the client's."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.downstream = bytearray()
        self.port = 0
        self._server: asyncio.base_events.Server | None = None

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, keep: bool) -> None:
            while data := await src.read(65536):
                if keep:
                    self.downstream.extend(data)
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True),
                             return_exceptions=True)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()


def response_body(raw: bytes) -> bytes:
    """The body of the HTTP response in `raw`, de-chunked."""
    parts: list[bytes] = []

    class Collector:
        def on_body(self, body: bytes) -> None:
            parts.append(body)

    httptools.HttpResponseParser(Collector()).feed_data(raw)
    return b"".join(parts)


@pytest.mark.parametrize("chat", [True, False])
def test_streams_from_enginesim_arrive_byte_identical(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory,
        enginesim_port: int, chat: bool) -> None:
    async def scenario() -> None:
        relay = RecordingRelay(enginesim_port)
        await relay.start()
        try:
            table = make_table(models={"sim": [replica("r1", f"http://127.0.0.1:{relay.port}")]})
            async with running_edge(signing_key, state_dir) as edge:
                assert (await edge.push(table, signing_key))[0] == 200
                body: dict[str, Any] = (
                    {"model": "sim", "messages": [{"role": "user", "content": "tell me"}]}
                    if chat else {"model": "sim", "prompt": "once upon a time"})
                body.update(stream=True, max_tokens=20,
                            stream_options={"include_usage": True})
                path = "/v1/chat/completions" if chat else "/v1/completions"
                async with edge.session.post(edge.url + path, json=body, headers={
                        "authorization": f"Bearer {API_KEY}"}) as response:
                    assert response.status == 200
                    chunks = [chunk async for chunk in response.content.iter_any()]
                received = b"".join(chunks)
                assert received.endswith(b"data: [DONE]\n\n")
                assert received == response_body(bytes(relay.downstream))
                assert len(chunks) > 3
                await wait_until_async(lambda: edge.edge.metrics.tokens.get(
                    ("sim", "local:lab-1", "acme", "completion")) == 20, 30,
                    "20 completion tokens counted")
        finally:
            await relay.stop()

    asyncio.run(scenario())


def test_an_enginesim_that_dies_mid_request_costs_no_client_an_error(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory) -> None:
    ports = [free_port(), free_port()]
    processes = [start_enginesim(port) for port in ports]
    try:
        async def scenario() -> None:
            for port in ports:
                await wait_until_async(functools.partial(health_answers, f"http://127.0.0.1:{port}"),
                                       60, f"enginesim on port {port} answering /health")
            table = make_table(models={"sim": [
                replica("dies", f"http://127.0.0.1:{ports[0]}"),
                replica("lives", f"http://127.0.0.1:{ports[1]}")]},
                policy={"scorers": {"load": 1.0}, "retry_before_first_byte": 2,
                        "eject_after_failures": 1, "eject_base_s": 5.0})
            async with running_edge(signing_key, state_dir) as edge:
                assert (await edge.push(table, signing_key))[0] == 200
                # Not streamed: nothing reaches a client before its answer is complete.
                tasks = [asyncio.ensure_future(edge.chat("sim", f"question {i}", max_tokens=30))
                         for i in range(6)]
                await wait_until_async(lambda: edge.edge.stats["dies"].inflight >= 2, 30,
                                       "two requests in flight on the engine that dies")
                request = urllib.request.Request(
                    f"http://127.0.0.1:{ports[0]}/sim/faults", method="POST",
                    data=json.dumps({"mode": "die"}).encode(),
                    headers={"content-type": "application/json"})
                try:
                    await asyncio.to_thread(urllib.request.urlopen, request, timeout=5)
                except OSError:
                    pass  # it died before answering, as it should
                responses = [await task for task in tasks]
                assert [r.status for r in responses] == [200] * 6
                bodies = [json.loads(await r.read()) for r in responses]
                assert all(b["choices"][0]["message"]["content"] for b in bodies)
                assert edge.edge.metrics.retries.get(("sim",)) >= 2

        asyncio.run(scenario())
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()


@pytest.fixture(scope="module")
def enginesim_pair() -> Iterator[list[int]]:
    with enginesims(2) as ports:
        yield ports


@pytest.mark.parametrize("fault", ["reset", "eof", "error_event", "stall"])
def test_a_stream_cut_by_an_enginesim_fault_continues_on_the_other_as_the_same_answer(
        signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory,
        enginesim_pair: list[int], fault: str) -> None:
    """enginesim continues its own answer (continue_final_message), as a model at
    temperature 0 would: the resumed stream is the uninterrupted answer, token for token."""
    faulty, healthy = enginesim_pair
    messages = [{"role": "user", "content": f"the {fault} question"}]
    whole = post_json(healthy, "/v1/chat/completions",
                  {"model": "sim", "messages": messages, "max_tokens": 60})
    post_json(faulty, "/sim/faults", {"mode": fault, "after_tokens": 7})
    try:
        async def scenario() -> None:
            table = make_table(models={"sim": [
                replica("faulty", f"http://127.0.0.1:{faulty}", rtt_ms=1),
                replica("healthy", f"http://127.0.0.1:{healthy}", rtt_ms=90)]},
                policy={"scorers": {"latency": 1.0}, "stream_stall_s": 0.5})
            async with running_edge(signing_key, state_dir) as edge:
                assert (await edge.push(table, signing_key))[0] == 200
                response = await edge.chat("sim", messages[0]["content"], stream=True,
                                           max_tokens=60, stream_options={"include_usage": True})
                raw = (await response.read()).decode()
                assert raw.endswith("data: [DONE]\n\n")
                chunks = [json.loads(e[6:]) for e in raw.split("\n\n")[:-2]]
                text = "".join(c["choices"][0]["delta"].get("content") or ""
                               for c in chunks if c["choices"])
                assert text == whole["choices"][0]["message"]["content"]
                assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
                assert sum("role" in c["choices"][0]["delta"] for c in chunks
                           if c["choices"]) == 1
                usage = [c["usage"] for c in chunks if c.get("usage")]
                assert len(usage) == 1 and chunks[-1]["usage"] == usage[0]
                expected = whole["usage"]
                assert (usage[0]["prompt_tokens"], usage[0]["completion_tokens"]) == (
                    expected["prompt_tokens"], expected["completion_tokens"])
                assert edge.edge.metrics.resumptions.get(("resumed",)) == 1

        asyncio.run(scenario())
    finally:
        post_json(faulty, "/sim/faults", {"mode": "none"})
