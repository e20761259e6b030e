"""Stream resumption: a stream whose replica fails after bytes reached the client goes on
from another replica as one unbroken stream (same id, created and model, one role chunk, no
text duplicated or missing, usage over both legs, [DONE]); where it may not, the stream ends
with an OpenAI-shaped error event rather than a silent cut. Engine errors come back in the
edge's error shape."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from controlplane.lab.waiting import wait_until_async

from .conftest import API_KEY, replica, tenant
from .fake_engine import Behaviour
from .test_proxy import edge_with, engines, run

__all__ = ["edge_with"]  # test_proxy's fixture, used here too

FULL = "".join(f" t{i}" for i in range(20))
STALL = {"stream_stall_s": 0.3}


def events(body: bytes) -> list[Any]:
    """The data of each SSE event: parsed JSON, or the string "[DONE]"."""
    text = body.decode()
    assert text.endswith("\n\n"), "the stream must end on a whole event"
    out: list[Any] = []
    for event in text.split("\n\n")[:-1]:
        assert event.startswith("data: "), event
        data = event[6:]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


def text_of(chunks: list[Any], chat: bool = True) -> str:
    parts = []
    for chunk in chunks:
        if isinstance(chunk, dict):
            for choice in chunk.get("choices", []):
                piece = choice.get("delta", {}).get("content") if chat else choice.get("text")
                parts.append(piece or "")
    return "".join(parts)


def two_replicas(flaky: Any, other: Any, **extra: Any) -> dict[str, Any]:
    # The nearer replica takes the request first.
    return {"models": {"m": [replica("flaky", flaky.url, rtt_ms=1),
                             replica("other", other.url, rtt_ms=90)]}, **extra}


def policy(**fields: Any) -> dict[str, Any]:
    return {"scorers": {"latency": 1.0, "load": 2.0, "prefix": 3.0, "cost": 0.5}, **fields}


@pytest.mark.parametrize("how", ["reset", "eof", "error", "stall"])
@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_cut_stream_goes_on_from_another_replica_as_one_stream(
        edge_with: Callable[..., Any], how: str, chat: bool) -> None:
    async def scenario() -> None:
        async with engines("m", "m") as (flaky, other), edge_with(
                **two_replicas(flaky, other, policy=policy(**STALL))) as edge:
            flaky.behaviour = Behaviour(tokens=20, cut_after_events=4 if chat else 3,
                                        cut_how=how)
            other.behaviour = Behaviour(tokens=20)
            body: dict[str, Any] = {"model": "m", "stream": True, "max_tokens": 50,
                                    "stream_options": {"include_usage": True}}
            if chat:
                body["messages"] = [{"role": "user", "content": "hello"}]
            else:
                body["prompt"] = "Say:"
            response = await edge.session.post(
                edge.url + ("/v1/chat/completions" if chat else "/v1/completions"), json=body,
                headers={"authorization": f"Bearer {API_KEY}"})
            assert response.status == 200
            chunks = events(await response.read())
            assert chunks[-1] == "[DONE]"
            assert not any("error" in c for c in chunks if isinstance(c, dict))
            assert text_of(chunks, chat) == FULL  # nothing repeated, nothing missing
            dicts = [c for c in chunks if isinstance(c, dict)]
            assert {(c["id"], c["created"], c["model"]) for c in dicts} == {
                ("cmpl-fake", 1767225600, "m")}
            if chat:
                roles = [c for c in dicts if c["choices"] and "role" in c["choices"][0]["delta"]]
                assert len(roles) == 1
            # One usage chunk, over both legs: the original prompt, all 20 tokens.
            usage = [c["usage"] for c in dicts if c.get("usage")]
            original = json.dumps(body["messages"] if chat else body["prompt"])
            assert usage == [{"prompt_tokens": len(original) // 4, "completion_tokens": 20,
                              "total_tokens": len(original) // 4 + 20}]
            assert chunks[-2]["choices"] == [] and chunks[-2]["usage"] == usage[0]
            # What the other replica was asked: the text so far, continued, 3 tokens fewer.
            (resumed,) = other.requests
            assert resumed["max_tokens"] == 47
            assert resumed["stream_options"] == {"include_usage": True,
                                                 "continuous_usage_stats": True}
            if chat:
                assert resumed["messages"] == [{"role": "user", "content": "hello"},
                                               {"role": "assistant", "content": " t0 t1 t2"}]
                assert resumed["continue_final_message"] is True
                assert resumed["add_generation_prompt"] is False
            else:
                assert resumed["prompt"] == "Say: t0 t1 t2"
            metrics = edge.edge.metrics
            assert metrics.resumptions.get(("resumed",)) == 1
            await wait_until_async(lambda: edge.edge.stats["flaky"].inflight == 0
                                   and edge.edge.stats["other"].inflight == 0, 30,
                                   "both replicas idle")
            assert edge.edge.stats["flaky"].consecutive_failures == 1

    run(scenario())


def test_a_stream_without_usage_asked_gets_none_and_is_resumed_twice(
        edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m", "m", "m") as (a, b, c), edge_with(models={"m": [
                replica("a", a.url, rtt_ms=1), replica("b", b.url, rtt_ms=50),
                replica("c", c.url, rtt_ms=90)]}) as edge:
            a.behaviour = Behaviour(tokens=20, cut_after_events=4)
            b.behaviour = Behaviour(tokens=20, cut_after_events=6)  # role + 5 more tokens
            c.behaviour = Behaviour(tokens=20)
            response = await edge.chat("m", stream=True)
            chunks = events(await response.read())
            assert chunks[-1] == "[DONE]" and text_of(chunks) == FULL
            assert not any(isinstance(ch, dict) and ch.get("usage") for ch in chunks)
            assert b.requests[0]["messages"][-1]["content"] == " t0 t1 t2"
            assert c.requests[0]["messages"][-1]["content"] == " t0 t1 t2 t3 t4 t5 t6 t7"
            assert edge.edge.metrics.resumptions.get(("resumed",)) == 2

    run(scenario())


def error_event(chunks: list[Any]) -> dict[str, Any]:
    """A refused stream: its last event is an OpenAI-shaped error, with no [DONE]."""
    assert "[DONE]" not in chunks
    last = chunks[-1]
    assert set(last) == {"error"} and set(last["error"]) == {"message", "type", "param", "code"}
    assert last["error"]["code"] == "stream_interrupted"
    return dict(last["error"])


@pytest.mark.parametrize(("extra", "outcome", "param"), [
    ({"n": 2}, "refused_n", "n"),
    ({"logprobs": True, "top_logprobs": 2}, "refused_logprobs", "logprobs"),
])
def test_a_stream_that_cannot_be_continued_ends_with_an_error_event(
        edge_with: Callable[..., Any], extra: dict[str, Any], outcome: str,
        param: str) -> None:
    async def scenario() -> None:
        async with engines("m", "m") as (flaky, other), edge_with(
                **two_replicas(flaky, other)) as edge:
            flaky.behaviour = Behaviour(tokens=20, cut_after_events=4)
            response = await edge.chat("m", stream=True, **extra)
            chunks = events(await response.read())
            assert text_of(chunks) == " t0 t1 t2"
            error = error_event(chunks)
            assert error["param"] == param
            assert other.requests == []
            assert edge.edge.metrics.resumptions.get((outcome,)) == 1

    run(scenario())


def test_a_tool_call_under_way_is_not_resumed(edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m", "m") as (flaky, other), edge_with(
                **two_replicas(flaky, other)) as edge:
            flaky.behaviour = Behaviour(tokens=20, cut_after_events=4, tool_call=True)
            chunks = events(await (await edge.chat("m", stream=True)).read())
            assert "tool call" in error_event(chunks)["message"]
            assert other.requests == []
            assert edge.edge.metrics.resumptions.get(("refused_tools",)) == 1

    run(scenario())


def test_a_tenant_may_turn_resumption_off(edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m", "m") as (flaky, other), edge_with(**two_replicas(
                flaky, other, tenants={API_KEY: tenant(resume_streams=False)})) as edge:
            flaky.behaviour = Behaviour(tokens=20, cut_after_events=4, cut_how="eof")
            chunks = events(await (await edge.chat("m", stream=True)).read())
            assert "off for this tenant" in error_event(chunks)["message"]
            assert other.requests == []
            assert edge.edge.metrics.resumptions.get(("refused_tenant",)) == 1

    run(scenario())


def test_no_other_replica_ends_the_stream_with_an_error_event(
        edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m") as (flaky,), edge_with(
                models={"m": [replica("flaky", flaky.url)]}) as edge:
            flaky.behaviour = Behaviour(tokens=20, cut_after_events=4, cut_how="error")
            chunks = events(await (await edge.chat("m", stream=True)).read())
            error = error_event(chunks)
            assert "engine step failed" in error["message"]
            assert text_of(chunks) == " t0 t1 t2"
            assert edge.edge.metrics.resumptions.get(("no_replica",)) == 1

    run(scenario())


def test_resumptions_stop_at_the_policy_limit(edge_with: Callable[..., Any]) -> None:
    async def scenario() -> None:
        async with engines("m", "m", "m") as (a, b, c), edge_with(models={"m": [
                replica("a", a.url, rtt_ms=1), replica("b", b.url, rtt_ms=50),
                replica("c", c.url, rtt_ms=90)]}, policy=policy(resume_streams_max=1)) as edge:
            a.behaviour = Behaviour(tokens=20, cut_after_events=4)
            b.behaviour = Behaviour(tokens=20, cut_after_events=3)
            chunks = events(await (await edge.chat("m", stream=True)).read())
            assert "limit 1" in error_event(chunks)["message"]
            assert text_of(chunks) == " t0 t1 t2 t3 t4"
            assert c.requests == []
            metrics = edge.edge.metrics
            assert metrics.resumptions.get(("resumed",)) == 1
            assert metrics.resumptions.get(("exhausted",)) == 1

    run(scenario())


def test_a_stream_split_mid_event_reaches_the_client_in_whole_events(
        edge_with: Callable[..., Any]) -> None:
    """A replica that dies halfway through an event: the half never reaches the client."""
    async def scenario() -> None:
        async with engines("m", "m") as (flaky, other), edge_with(
                **two_replicas(flaky, other)) as edge:
            flaky.behaviour = Behaviour(tokens=20, cut_after_events=4, cut_how="half")
            other.behaviour = Behaviour(tokens=20)
            chunks = events(await (await edge.chat("m", stream=True)).read())
            assert chunks[-1] == "[DONE]" and text_of(chunks) == FULL

    run(scenario())


@pytest.mark.parametrize(("error_body", "param"), [
    # vLLM before 0.9: flat, param null; the field is read from the message.
    ({"object": "error", "message": "max_tokens=1000000 cannot be greater than "
      "max_model_len=8192. Please request fewer output tokens.", "type": "BadRequestError",
      "param": None, "code": 400}, "max_tokens"),
    # vLLM 0.32: nested, param named.
    ({"error": {"message": "This model's maximum context length is 8192 tokens.",
                "type": "BadRequestError", "param": "input_tokens", "code": 400}},
     "input_tokens"),
    ({"error": {"message": "Field required", "type": "BadRequestError",
                "param": "body.messages", "code": 400}}, "messages"),
])
def test_an_engines_refusal_comes_back_in_the_edges_error_shape(
        edge_with: Callable[..., Any], error_body: dict[str, Any], param: str) -> None:
    async def scenario() -> None:
        async with engines("m") as (engine,), edge_with(
                models={"m": [replica("r1", engine.url)]}) as edge:
            engine.behaviour = Behaviour(status=400, error_body=error_body)
            response = await edge.chat("m", max_tokens=1_000_000)
            body = await response.json()
            assert response.status == 400
            message = error_body.get("error", error_body)["message"]
            assert body == {"error": {"message": message, "type": "invalid_request_error",
                                      "param": param, "code": "invalid_value"}}
            assert response.headers["x-request-id"]

    run(scenario())
