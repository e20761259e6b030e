"""The engine contract (DESIGN §4) that Meridian relies on, as vLLM's OpenAI server keeps it.

Runs against an enginesim started by the fixture and, unchanged, against a real vLLM server
when VLLM_BASE_URL is set (VLLM_MODEL and VLLM_API_KEY optional).
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from typing import Any

import pytest

from .conftest import Engine

REQUIRED_METRICS = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
)


def stream(engine: Engine, path: str, body: dict[str, Any]) -> tuple[dict[str, str], list[str],
                                                                      float]:
    """Headers, the SSE data payloads, and seconds until the first payload arrived."""
    started = time.perf_counter()
    first = None
    events = []
    with urllib.request.urlopen(engine.request("POST", path, {**body, "stream": True}),
                                timeout=120) as response:
        headers = dict(response.headers)
        buffered = b""
        for line in response:
            if first is None and line.startswith(b"data: "):
                first = time.perf_counter() - started
            buffered += line
    for block in buffered.decode().split("\n\n"):
        if block.strip():
            assert block.startswith("data: "), block
            events.append(block[len("data: "):])
    assert first is not None, "no event arrived"
    return headers, events, first


def chunks_of(events: list[str]) -> list[dict[str, Any]]:
    assert events[-1] == "[DONE]", events[-3:]
    assert "[DONE]" not in events[:-1]
    return [json.loads(e) for e in events[:-1]]


def counter(text: str, name: str, model: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and f'model_name="{model}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def error_of(raw: Any, status: int) -> dict[str, Any]:
    error = raw["error"]
    assert set(error) >= {"message", "type", "param", "code"}
    assert error["code"] == status
    return dict(error)


def test_health_answers_200(engine: Engine) -> None:
    status, _, _ = engine.call("GET", "/health")
    assert status == 200


def test_models_list_the_served_model_with_its_context_length(engine: Engine) -> None:
    status, _, raw = engine.call("GET", "/v1/models")
    listed = json.loads(raw)
    assert status == 200 and listed["object"] == "list"
    card = next(m for m in listed["data"] if m["id"] == engine.model)
    assert card["object"] == "model" and card["owned_by"] == "vllm"
    assert card["max_model_len"] == engine.max_model_len


def test_a_completion_has_openais_shape(engine: Engine) -> None:
    status, body = engine.post_json("/v1/completions", {
        "model": engine.model, "prompt": "The capital of France is", "max_tokens": 5})
    assert status == 200
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["model"] == engine.model
    choice = body["choices"][0]
    assert isinstance(choice["text"], str) and choice["finish_reason"] in ("length", "stop")
    usage = body["usage"]
    assert 0 < usage["completion_tokens"] <= 5 and usage["prompt_tokens"] > 0
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_chat_completion_has_openais_shape(engine: Engine) -> None:
    status, body = engine.post_json("/v1/chat/completions", {
        "model": engine.model, "max_tokens": 8,
        "messages": [{"role": "user", "content": "Say hello."}]})
    assert status == 200
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_a_chat_stream_opens_with_the_role_and_closes_with_usage_then_done(
        engine: Engine) -> None:
    headers, events, _ = stream(engine, "/v1/chat/completions", {
        "model": engine.model, "max_tokens": 6, "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Count to three."}]})
    assert headers["Content-Type"].startswith("text/event-stream")
    chunks = chunks_of(events)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert 0 < usage_chunk["usage"]["completion_tokens"] <= 6
    finishes = [c["choices"][0]["finish_reason"] for c in chunks[:-1]]
    assert finishes[-1] in ("length", "stop") and set(finishes[:-1]) == {None}


def test_a_completion_stream_without_usage_sends_no_usage_chunk(engine: Engine) -> None:
    _, events, _ = stream(engine, "/v1/completions", {
        "model": engine.model, "prompt": "One, two,", "max_tokens": 4})
    chunks = chunks_of(events)
    assert all(c["choices"] and c["object"] == "text_completion" for c in chunks)
    assert all(c.get("usage") is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_completion_stream_with_usage_ends_with_a_usage_chunk(engine: Engine) -> None:
    _, events, _ = stream(engine, "/v1/completions", {
        "model": engine.model, "prompt": "One, two,", "max_tokens": 4,
        "stream_options": {"include_usage": True}})
    chunks = chunks_of(events)
    assert chunks[-1]["choices"] == []
    usage = chunks[-1]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


def test_an_unknown_model_is_404_with_vllms_error_body(engine: Engine) -> None:
    for path, body in (("/v1/completions", {"prompt": "x"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        status, raw = engine.post_json(path, {"model": "no-such-model", **body})
        assert status == 404
        error = error_of(raw, 404)
        assert error["type"] == "NotFoundError"
        assert "no-such-model" in error["message"]


def test_a_prompt_longer_than_the_context_is_400(engine: Engine) -> None:
    prompt = "word " * (engine.max_model_len * 2)
    status, raw = engine.post_json("/v1/completions", {
        "model": engine.model, "prompt": prompt, "max_tokens": 4})
    assert status == 400
    error = error_of(raw, 400)
    assert error["type"] == "BadRequestError"
    assert "maximum context length" in error["message"]


def test_a_prompt_that_leaves_no_room_for_max_tokens_is_400(engine: Engine) -> None:
    status, raw = engine.post_json("/v1/chat/completions", {
        "model": engine.model, "max_tokens": engine.max_model_len,
        "messages": [{"role": "user", "content": "Hello there."}]})
    assert status == 400
    assert "maximum context length" in error_of(raw, 400)["message"]


def test_stream_options_without_streaming_are_refused(engine: Engine) -> None:
    status, raw = engine.post_json("/v1/completions", {
        "model": engine.model, "prompt": "x", "max_tokens": 1,
        "stream_options": {"include_usage": True}})
    assert status == 400
    assert "stream" in error_of(raw, 400)["message"]


def test_metrics_carry_vllms_names_labelled_by_model(engine: Engine) -> None:
    before = engine.metrics()
    for name in REQUIRED_METRICS:
        assert any(line.startswith(name + "{") and f'model_name="{engine.model}"' in line
                   for line in before.splitlines()), name
    status, body = engine.post_json("/v1/completions", {
        "model": engine.model, "prompt": "Tokens, please.", "max_tokens": 3})
    assert status == 200
    generated = body["usage"]["completion_tokens"]
    deadline = time.monotonic() + 5
    while True:
        after = engine.metrics()
        grew = (counter(after, "vllm:generation_tokens_total", engine.model)
                - counter(before, "vllm:generation_tokens_total", engine.model))
        if grew >= generated or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert grew >= generated
    parser = pytest.importorskip("prometheus_client.parser")
    families = {f.name for f in parser.text_string_to_metric_families(after)}
    assert {"vllm:time_to_first_token_seconds", "vllm:prompt_tokens"} <= families


def test_a_repeated_long_prompt_is_faster_and_the_prefix_cache_says_why(engine: Engine) -> None:
    # A fresh prefix each run, so the first request is really uncached; about 2,400 tokens
    # by any tokenizer (a real one counts a word or so per token here).
    sentence = "Meridian places each replica where it is cheapest and routes requests near. "
    target_tokens = min(int(engine.max_model_len * 0.6), 2400)
    prompt = f"Run {uuid.uuid4().hex}. " + sentence * (target_tokens // len(sentence.split()))
    if engine.simulated:
        prompt = prompt[: 4 * target_tokens]
    body = {"model": engine.model, "prompt": prompt, "max_tokens": 1,
            "stream_options": {"include_usage": True}}
    hits_before = counter(engine.metrics(), "vllm:prefix_cache_hits_total", engine.model)
    _, cold_events, cold = stream(engine, "/v1/completions", body)
    _, warm_events, warm = stream(engine, "/v1/completions", body)
    assert warm < cold * 0.6, (cold, warm)
    prompt_tokens = chunks_of(warm_events)[-1]["usage"]["prompt_tokens"]
    deadline = time.monotonic() + 5
    while True:
        hits = counter(engine.metrics(), "vllm:prefix_cache_hits_total", engine.model)
        if hits - hits_before >= 0.8 * prompt_tokens or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert hits - hits_before >= 0.8 * prompt_tokens
    assert chunks_of(cold_events)[-1]["usage"]["prompt_tokens"] == prompt_tokens
