"""The client API end to end against fake engines: pass-through, streaming, errors in
OpenAI's shape, rate limits, retries before the first byte, ejection, cut streams, client
disconnects, aliases, the wait queue, and the access log."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.lab.waiting import wait_until_async

from .conftest import API_KEY, TableFactory, replica, tenant
from .fake_engine import Behaviour, FakeEngine
from .helpers import EdgeUnderTest, running_edge

Scenario = Callable[..., Coroutine[Any, Any, None]]


@asynccontextmanager
async def engines(*models: str) -> AsyncIterator[list[FakeEngine]]:
    started = [FakeEngine(model) for model in models]
    for engine in started:
        await engine.start()
    try:
        yield started
    finally:
        for engine in started:
            await engine.stop()


def expect_error(status: int, code: str, param: str | None = None) -> Callable[..., Any]:
    async def check(response: aiohttp.ClientResponse) -> dict[str, Any]:
        body = await response.json()
        assert response.status == status, body
        assert set(body["error"]) == {"message", "type", "param", "code"}
        assert body["error"]["code"] == code
        assert body["error"]["param"] == param
        return dict(body["error"])
    return check


def run(scenario: Coroutine[Any, Any, None]) -> None:
    asyncio.run(scenario)


@pytest.fixture
def edge_with(signing_key: Ed25519PrivateKey, state_dir: Path, make_table: TableFactory
              ) -> Callable[..., Any]:
    """`async with edge_with(models=..., tenants=...) as edge:` an edge serving that table."""

    @asynccontextmanager
    async def start(config: dict[str, Any] | None = None,
                    **table: Any) -> AsyncIterator[EdgeUnderTest]:
        async with running_edge(signing_key, state_dir, **(config or {})) as edge:
            status, body = await edge.push(make_table(**table), signing_key)
            assert status == 200, body
            yield edge

    return start


def test_json_completion_passes_through(edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m") as (engine,), edge_with(
                models={"m": [replica("r1", engine.url)]}) as edge:
            direct = await edge.session.post(engine.url + "/v1/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "hello"}]})
            expected = await direct.read()
            response = await edge.chat("m", "hello", headers={"x-request-id": "req-42"})
            assert response.status == 200
            assert await response.read() == expected
            assert response.headers["x-meridian-replica"] == "r1"
            assert response.headers["x-request-id"] == "req-42"
            forwarded = engine.headers[-1]
            assert forwarded["x-request-id"] == "req-42"
            assert "authorization" not in forwarded
            # /v1/completions too
            completion = await edge.session.post(edge.url + "/v1/completions", json={
                "model": "m", "prompt": "Once upon a time"},
                headers={"authorization": f"Bearer {API_KEY}"})
            assert completion.status == 200
            assert (await completion.json())["choices"][0]["text"].startswith(" t0")

    run(scenario())


@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_is_byte_identical_to_the_engines(edge_with: Callable[..., Any],
                                                 include_usage: bool) -> None:
    async def scenario() -> None:
        async with engines("m") as (engine,), edge_with(
                models={"m": [replica("r1", engine.url)]}) as edge:
            engine.behaviour = Behaviour(tokens=12, event_gap_s=0.01)
            body = {"model": "m", "stream": True,
                    "messages": [{"role": "user", "content": "count"}]}
            if include_usage:
                body["stream_options"] = {"include_usage": True}
            direct = await edge.session.post(engine.url + "/v1/chat/completions", json=body)
            expected = await direct.read()
            response = await edge.session.post(edge.url + "/v1/chat/completions", json=body,
                                               headers={"authorization": f"Bearer {API_KEY}"})
            assert response.headers["content-type"].startswith("text/event-stream")
            chunks = [chunk async for chunk in response.content.iter_any()]
            assert b"".join(chunks) == expected
            assert len(chunks) > 5  # relayed as it came, not gathered into one piece
            await wait_until_async(lambda: edge.edge.metrics.tokens.get(
                ("m", "local:lab-1", "acme", "completion")) >= 12, 30, "12 completion tokens counted")
            assert edge.edge.metrics.itl.count(("m",)) >= 5

    run(scenario())


def test_client_errors_have_openai_shape_and_name_the_field(edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m") as (engine,), edge_with(
                models={"m": [replica("r1", engine.url)]},
                config={"max_body_bytes": 4096}) as edge:
            post = edge.session.post
            url = edge.url + "/v1/chat/completions"
            auth = {"authorization": f"Bearer {API_KEY}"}
            await expect_error(401, "invalid_api_key")(await edge.chat("m", key=""))
            await expect_error(401, "invalid_api_key")(await edge.chat("m", key="sk-wrong"))
            await expect_error(404, "model_not_found", "model")(await edge.chat("nope"))
            await expect_error(400, "invalid_json")(await post(url, data=b"{", headers=auth))
            await expect_error(400, "missing_required_parameter", "model")(
                await post(url, json={"messages": []}, headers=auth))
            await expect_error(400, "missing_required_parameter", "messages")(
                await post(url, json={"model": "m"}, headers=auth))
            await expect_error(400, "invalid_value", "messages[1]")(
                await post(url, json={"model": "m", "messages": [
                    {"role": "user", "content": "a"}, "oops"]}, headers=auth))
            await expect_error(400, "invalid_type", "stream")(
                await edge.chat("m", stream="yes"))
            await expect_error(400, "invalid_value", "max_tokens")(
                await edge.chat("m", max_tokens=0))
            await expect_error(413, "request_too_large")(
                await post(url, data=b"x" * 5000, headers=auth))
            await expect_error(404, "not_found")(await edge.session.get(edge.url + "/v2/x"))
            await expect_error(405, "method_not_allowed")(await edge.session.get(url))
            assert engine.requests == []  # none of these reached the engine

    run(scenario())


def test_a_key_left_out_of_a_new_table_is_refused_at_once(
        edge_with: Callable[..., Any], make_table: TableFactory,
        signing_key: Ed25519PrivateKey) -> None:
    async def scenario() -> None:
        async with engines("m") as (engine,), edge_with(
                models={"m": [replica("r1", engine.url)]},
                tenants={API_KEY: tenant(), "sk-other": tenant("other")}) as edge:
            for _ in range(2):  # known keys are remembered for the table they were found in
                assert (await edge.chat("m")).status == 200
                assert (await edge.chat("m", key="sk-other")).status == 200
            status, body = await edge.push(make_table(
                models={"m": [replica("r1", engine.url)]}, tenants={"sk-other": tenant("other")},
                version=2), signing_key)
            assert status == 200, body
            await expect_error(401, "invalid_api_key")(await edge.chat("m"))
            assert (await edge.chat("m", key="sk-other")).status == 200

    run(scenario())


def test_requests_over_the_rpm_limit_get_429_with_retry_after(
        edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m") as (engine,), edge_with(
                models={"m": [replica("r1", engine.url)]},
                tenants={API_KEY: tenant(rpm=2), "sk-other": tenant("globex", rpm=2)}) as edge:
            assert (await edge.chat("m")).status == 200
            assert (await edge.chat("m")).status == 200
            refused = await edge.chat("m")
            error = await expect_error(429, "rate_limit_exceeded")(refused)
            assert error["type"] == "requests"
            assert int(refused.headers["retry-after"]) == 30
            assert (await edge.chat("m", key="sk-other")).status == 200  # another tenant
            assert len(engine.requests) == 3

    run(scenario())


def test_tpm_counts_the_prompt_and_the_usage_the_engine_reports(
        edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m") as (engine,), edge_with(
                models={"m": [replica("r1", engine.url)]},
                tenants={API_KEY: tenant(tpm=600)}) as edge:
            engine.behaviour = Behaviour(tokens=300)
            assert (await edge.chat("m", "x" * 400)).status == 200  # ~100 prompt tokens
            level = edge.edge.limiter.level("acme", "tokens", asyncio.get_running_loop().time())
            # The engine reported its own prompt count plus 300 completion tokens.
            assert level is not None and level < 600 - 300
            refused = await edge.chat("m", "x" * 1600)  # ~400 more: over what is left
            await expect_error(429, "rate_limit_exceeded")(refused)
            assert int(refused.headers["retry-after"]) >= 1

    run(scenario())


def test_residency_fails_closed_with_503(edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m") as (us,), edge_with(
                models={"m": [replica("us-1", us.url, jurisdiction="US")]}) as edge:
            response = await edge.chat("m")
            error = await expect_error(503, "residency_unavailable")(response)
            assert "acme" in error["message"]
            assert response.headers["retry-after"] == "1"
            assert us.requests == []

    run(scenario())


def test_another_tenants_dedicated_model_is_not_found_not_unavailable(
        edge_with: Callable[..., Any]) -> None:
    """A model that only another tenant's own replicas serve answers exactly as an unknown
    name does, directly or through an alias: no 503 confirms that it exists."""
    async def scenario() -> None:
        async with engines("theirs") as (engine,), edge_with(
                models={"theirs": [replica("t1", engine.url, tenant="globex")]},
                tenants={API_KEY: tenant(), "sk-globex": tenant("globex")},
                aliases={"smart": "theirs"}) as edge:
            unknown = await (await edge.chat("no-such-model")).json()
            for name in ("theirs", "smart"):
                response = await edge.chat(name)
                error = await expect_error(404, "model_not_found", "model")(response)
                assert error["message"] == unknown["error"]["message"].replace(
                    "no-such-model", name)
            assert engine.requests == []
            assert (await edge.chat("theirs", key="sk-globex")).status == 200

    run(scenario())


def test_a_failing_replica_is_retried_elsewhere_and_ejected(edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m", "m") as (bad, good), edge_with(
                models={"m": [replica("bad", bad.url, rtt_ms=1),
                              replica("good", good.url, rtt_ms=80)]}) as edge:
            bad.behaviour = Behaviour(status=500)
            for _ in range(2):
                response = await edge.chat("m")
                assert response.status == 200
                assert response.headers["x-meridian-replica"] == "good"
            assert len(bad.requests) == 2  # two failures: ejected now
            assert edge.edge.metrics.ejections.get(("bad",)) == 1
            assert edge.edge.metrics.retries.get(("m",)) == 2
            assert (await edge.chat("m")).headers["x-meridian-replica"] == "good"
            assert len(bad.requests) == 2  # not tried while ejected

    run(scenario())


def test_a_refused_connection_is_retried_without_the_client_noticing(
        edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m") as (good,), edge_with(
                models={"m": [replica("gone", "http://127.0.0.1:9", rtt_ms=1),
                              replica("good", good.url, rtt_ms=80)]}) as edge:
            response = await edge.chat("m")
            assert response.status == 200
            assert response.headers["x-meridian-replica"] == "good"

    run(scenario())


def test_a_5xx_is_passed_on_when_no_other_replica_may_take_it(
        edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m") as (bad,), edge_with(
                models={"m": [replica("bad", bad.url)]}) as edge:
            bad.behaviour = Behaviour(status=503)
            response = await edge.chat("m")
            assert response.status == 503  # the engine's own answer
            assert (await response.json())["error"]["message"] == "injected failure"

    run(scenario())


def test_a_stream_cut_by_the_engine_with_resumption_off_ends_with_an_error_event(
        edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m", "m") as (flaky, other), edge_with(
                models={"m": [replica("flaky", flaky.url, rtt_ms=1),
                              replica("other", other.url, rtt_ms=90)]},
                policy={"resume_streams_max": 0}) as edge:
            flaky.behaviour = Behaviour(tokens=20, cut_after_events=4, event_gap_s=0.01)
            response = await edge.chat("m", stream=True)
            assert response.status == 200
            last = (await response.read()).decode().split("\n\n")[-2]
            assert json.loads(last.removeprefix("data: "))["error"]["code"] == (
                "stream_interrupted")
            assert other.requests == []  # bytes had reached the client: no retry
            await wait_until_async(lambda: edge.edge.stats["flaky"].consecutive_failures == 1,
                                   30, "the cut stream counted as a failure")

    run(scenario())


def test_a_client_that_leaves_cancels_the_engines_work(edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m") as (engine,), edge_with(
                models={"m": [replica("r1", engine.url)]}) as edge:
            engine.behaviour = Behaviour(tokens=200, event_gap_s=0.02)
            response = await edge.chat("m", stream=True)
            await response.content.readline()
            response.close()  # the client hangs up mid-stream
            await wait_until_async(lambda: engine.abandoned == 1, 30, "the stream abandoned")
            await wait_until_async(lambda: edge.edge.stats["r1"].inflight == 0, 30,
                                   "nothing in flight")
            # A non-streaming request abandoned while the engine is still working, too.
            engine.behaviour = Behaviour(delay_s=5)
            task = asyncio.ensure_future(edge.chat("m"))
            await wait_until_async(lambda: engine.in_flight == 1, 30, "the request at the engine")
            task.cancel()
            await wait_until_async(lambda: engine.abandoned == 2, 30, "the request abandoned")

    run(scenario())


def test_an_alias_picks_the_model_by_prompt_length(edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("small", "large") as (small, large), edge_with(
                models={"small": [replica("s1", small.url)], "large": [replica("l1", large.url)]},
                aliases={"auto": {"rules": [{"max_prompt_tokens": 50, "model": "small"}],
                                  "default": "large"}}) as edge:
            short = await edge.chat("auto", "hi")
            assert short.headers["x-meridian-replica"] == "s1"
            long = await edge.chat("auto", "word " * 400)
            assert long.headers["x-meridian-replica"] == "l1"
            assert [r["model"] for r in small.requests + large.requests] == ["small", "large"]
            listed = await edge.session.get(edge.url + "/v1/models",
                                            headers={"authorization": f"Bearer {API_KEY}"})
            assert [m["id"] for m in (await listed.json())["data"]] == ["large", "small", "auto"]

    run(scenario())


def test_a_full_replica_makes_requests_wait_then_refuses_past_the_deadline(
        edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m") as (engine,), edge_with(
                models={"m": [replica("r1", engine.url, max_inflight=1)]},
                policy={"queue_timeout_s": 30.0}) as edge:
            held = asyncio.Event()
            engine.behaviour = Behaviour(held=held)
            first = asyncio.ensure_future(edge.chat("m"))
            await wait_until_async(lambda: engine.in_flight == 1, 30, "the first at the engine")
            second = asyncio.ensure_future(edge.chat("m"))  # waits for the first to finish
            await wait_until_async(lambda: edge.edge.queue.waiting == 1, 30, "the second queued")
            held.set()
            assert (await second).status == 200 and (await first).status == 200
            assert edge.edge.metrics.queue_waits.get(("interactive", "woken")) >= 1

        async with engines("m") as (engine,), edge_with(
                models={"m": [replica("r1", engine.url, max_inflight=1)]},
                policy={"queue_timeout_s": 0.1}, version=2) as edge:
            held = asyncio.Event()
            engine.behaviour = Behaviour(held=held)  # busy until the refusal
            first = asyncio.ensure_future(edge.chat("m"))
            await wait_until_async(lambda: engine.in_flight == 1, 30, "the first at the engine")
            refused = await edge.chat("m")
            await expect_error(503, "no_capacity")(refused)
            assert "retry-after" in refused.headers
            held.set()
            assert (await first).status == 200

    run(scenario())


def test_a_full_wait_queue_answers_429(edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m") as (engine,), edge_with(
                models={"m": [replica("r1", engine.url, max_inflight=1)]},
                config={"max_queue": 1}, policy={"queue_timeout_s": 30.0}) as edge:
            held = asyncio.Event()
            engine.behaviour = Behaviour(held=held)  # busy until the 429
            first = asyncio.ensure_future(edge.chat("m"))
            await wait_until_async(lambda: engine.in_flight == 1, 30, "the first at the engine")
            waiting = asyncio.ensure_future(edge.chat("m"))
            await wait_until_async(lambda: edge.edge.queue.waiting == 1, 30, "one queued")
            await expect_error(429, "queue_full")(await edge.chat("m"))
            held.set()
            assert (await first).status == 200 and (await waiting).status == 200

    run(scenario())


def test_batch_yields_to_interactive_when_both_wait(edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m") as (engine,), edge_with(
                models={"m": [replica("r1", engine.url, max_inflight=2)]},
                policy={"queue_timeout_s": 30.0, "batch_queue_timeout_s": 30.0,
                        "batch_max_share": 0.5}) as edge:
            held = asyncio.Event()
            engine.behaviour = Behaviour(held=held)  # busy until both wait
            first = asyncio.ensure_future(edge.chat("m", "first"))
            second = asyncio.ensure_future(edge.chat("m", "second"))
            await wait_until_async(lambda: engine.in_flight == 2, 30, "two at the engine")
            batch = asyncio.ensure_future(edge.chat("m", "batch",
                                                    headers={"x-meridian-tier": "batch"}))
            await wait_until_async(lambda: edge.edge.queue.waiting == 1, 30, "the batch queued")
            interactive = asyncio.ensure_future(edge.chat("m", "interactive"))
            await wait_until_async(lambda: edge.edge.queue.waiting == 2, 30,
                                   "the interactive queued too")
            held.set()
            for task in (first, second, batch, interactive):
                assert (await task).status == 200
            order = [r["messages"][0]["content"] for r in engine.requests]
            assert order.index("interactive") < order.index("batch")

    run(scenario())


def test_models_lists_what_the_tenant_may_use(edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with edge_with(models={"eu-model": [replica("a")],
                                     "us-model": [replica("b", jurisdiction="US")]}) as edge:
            response = await edge.session.get(edge.url + "/v1/models",
                                              headers={"authorization": f"Bearer {API_KEY}"})
            assert [m["id"] for m in (await response.json())["data"]] == ["eu-model"]
            await expect_error(401, "invalid_api_key")(
                await edge.session.get(edge.url + "/v1/models"))

    run(scenario())


def test_one_access_log_line_per_request(edge_with: Callable[..., Any],
                                         caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> None:
        async with engines("m") as (engine,), edge_with(
                models={"m": [replica("r1", engine.url)]}) as edge:
            caplog.set_level(logging.INFO, logger="meridian.edge.access")
            await edge.chat("m", headers={"x-request-id": "log-me"})
            await edge.chat("nope")
            edge.edge.access_log.flush()
        lines = [json.loads(line) for record in caplog.records
                 if record.name == "meridian.edge.access"
                 for line in record.getMessage().splitlines()]
        assert [(line["status"], line["model"], line["code"]) for line in lines] == [
            (200, "m", None), (404, "nope", "model_not_found")]
        first = lines[0]
        assert (first["request_id"], first["tenant"], first["replica"], first["region"]) == (
            "log-me", "acme", "r1", "local:lab-1")
        assert first["completion_tokens"] == 5 and first["usage_reported"] is True
        assert first["ttft_s"] > 0 and first["overhead_s"] > 0

    run(scenario())
