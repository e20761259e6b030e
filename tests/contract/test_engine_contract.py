"""The engine contract (DESIGN §4) that Meridian relies on, as vLLM's OpenAI server keeps it.

Runs against enginesim by default and, unchanged, against a real vLLM server when
VLLM_BASE_URL is set (VLLM_MODEL optional).
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from typing import Any

import pytest

from controlplane.provisioning.readiness import engine_readiness
from controlplane.telemetry.engine_metrics import parse_engine_metrics


def post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def sse_events(raw: bytes) -> list[str]:
    text = raw.decode()
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    return [block[len("data: "):] for block in text.split("\n\n") if block]


def test_health_and_models_list_the_served_model(engine):  # type: ignore[no-untyped-def]
    assert engine_readiness(engine.base_url, engine.model).ready
    with urllib.request.urlopen(engine.base_url + "/v1/models") as response:
        listed = json.loads(response.read())
    assert listed["object"] == "list"
    entry = next(m for m in listed["data"] if m["id"] == engine.model)
    assert entry["max_model_len"] == engine.max_model_len


def test_completion_shape(engine):  # type: ignore[no-untyped-def]
    status, raw = post(engine.base_url + "/v1/completions",
                       {"model": engine.model, "prompt": "The capital of France is", "max_tokens": 5})
    body = json.loads(raw)
    assert status == 200 and body["object"] == "text_completion"
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    assert body["usage"]["completion_tokens"] <= 5 and body["usage"]["prompt_tokens"] > 0


def test_chat_shape(engine):  # type: ignore[no-untyped-def]
    status, raw = post(engine.base_url + "/v1/chat/completions", {
        "model": engine.model, "max_tokens": 8,
        "messages": [{"role": "user", "content": "Say hello."}]})
    body = json.loads(raw)
    assert status == 200 and body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["usage"]["total_tokens"] == (body["usage"]["prompt_tokens"]
                                             + body["usage"]["completion_tokens"])


def test_chat_stream_role_first_usage_last_then_done(engine):  # type: ignore[no-untyped-def]
    status, raw = post(engine.base_url + "/v1/chat/completions", {
        "model": engine.model, "max_tokens": 6, "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": "Count to three."}]})
    assert status == 200
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] <= 6
    finishes = [c["choices"][0]["finish_reason"] for c in chunks[:-1] if c["choices"]]
    assert finishes[-1] in ("length", "stop") and set(finishes[:-1]) <= {None}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)


def test_completion_stream_without_usage(engine):  # type: ignore[no-untyped-def]
    status, raw = post(engine.base_url + "/v1/completions",
                       {"model": engine.model, "prompt": "One two", "max_tokens": 4, "stream": True})
    chunks = [json.loads(e) for e in sse_events(raw)[:-1]]
    assert status == 200 and all(c["choices"] for c in chunks)
    assert all("usage" not in c or c["usage"] is None for c in chunks)


def test_unknown_model_is_404_with_error_body(engine):  # type: ignore[no-untyped-def]
    status, raw = post(engine.base_url + "/v1/completions", {"model": "no-such-model", "prompt": "x"})
    assert status == 404
    assert json.loads(raw)["error"]["code"] == 404


def test_prompt_over_context_is_400(engine):  # type: ignore[no-untyped-def]
    prompt = "word " * (engine.max_model_len * 2)
    status, raw = post(engine.base_url + "/v1/completions",
                       {"model": engine.model, "prompt": prompt, "max_tokens": 4})
    assert status == 400
    error = json.loads(raw)["error"]
    assert "maximum context length" in error["message"]


def test_metrics_have_vllm_names(engine):  # type: ignore[no-untyped-def]
    post(engine.base_url + "/v1/completions", {"model": engine.model, "prompt": "hi", "max_tokens": 2})
    with urllib.request.urlopen(engine.base_url + "/metrics") as response:
        text = response.read().decode()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket"):
        assert name in text, name
    assert 'model_name="' in text
    snapshot = parse_engine_metrics(text)
    assert snapshot.counters["generation_tokens"] >= 2


def test_repeated_long_prompt_is_faster_and_metrics_say_why(engine):  # type: ignore[no-untyped-def]
    if not engine.simulated:
        pytest.skip("timing depends on the GPU; the cache counters are checked below anyway")
    prompt = "Meridian places replicas where they are cheapest. " * 60  # ~750 tokens

    def ttft() -> float:
        started = time.perf_counter()
        post(engine.base_url + "/v1/completions", {"model": engine.model, "prompt": prompt,
                                                   "max_tokens": 1})
        return time.perf_counter() - started

    def hits() -> float:
        with urllib.request.urlopen(engine.base_url + "/metrics") as response:
            return parse_engine_metrics(response.read().decode()).counters.get("prefix_hits", 0)

    before = hits()
    cold = ttft()
    warm = ttft()
    assert warm < cold * 0.6, (cold, warm)
    assert hits() - before >= 700
