"""The engine contract (DESIGN §4) that Meridian relies on, as vLLM 0.32's OpenAI server
keeps it.

Every test runs against an enginesim and against a real vLLM (see conftest.py); where they
differ, the real engine is right. Wording that is vLLM's own is checked by its keywords and
`param`, not whole; token ids are checked exactly only against the real tokenizer.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from email.message import Message
from typing import Any

import pytest

from controlplane.lab.waiting import wait_until

from .conftest import Engine

CONTRACT_VLLM_VERSION = "0.32.0"
# The real engine's model and what its tokenizer makes of a short text.
REAL_MODEL = "smollm2-135m-instruct"
HELLO = "Hello, Meridian"
HELLO_IDS = [19556, 28, 8700, 22812]

REQUIRED_METRICS = (
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
    "vllm:request_success_total", "vllm:time_to_first_token_seconds_bucket",
    "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
)


def stream(engine: Engine, path: str, body: dict[str, Any]) -> tuple[Message, list[str], float]:
    """Headers, the SSE data payloads, and seconds until the first payload arrived."""
    started = time.perf_counter()
    first = None
    events = []
    with urllib.request.urlopen(engine.request("POST", path, {**body, "stream": True}),
                                timeout=120) as response:
        headers = response.headers
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
    assert (headers.get("content-type") or "").startswith("text/event-stream")
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
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        status, raw = engine.post_json(path, {"model": "no-such-model", **body})
        assert status == 404, path
        error = error_of(raw, 404)
        assert error["type"] == "NotFoundError" and error["param"] == "model"
        assert "no-such-model" in error["message"]


def test_a_prompt_longer_than_the_context_is_400(engine: Engine) -> None:
    prompt = "word " * (engine.max_model_len * 2)
    status, raw = engine.post_json("/v1/completions", {
        "model": engine.model, "prompt": prompt, "max_tokens": 4})
    assert status == 400
    error = error_of(raw, 400)
    assert error["type"] == "BadRequestError" and error["param"] == "input_tokens"
    assert "maximum context length" in error["message"]
    # Given as token ids, the count is exact.
    status, raw = engine.post_json("/v1/completions", {
        "model": engine.model, "prompt": [HELLO_IDS[0]] * (engine.max_model_len + 5),
        "max_tokens": 4})
    assert status == 400
    error = error_of(raw, 400)
    assert error["param"] == "input_tokens"
    assert f"{engine.max_model_len + 5} input tokens" in error["message"]


def test_max_tokens_up_to_the_context_is_cut_to_the_room_the_prompt_leaves(
        engine: Engine) -> None:
    status, body = engine.post_json("/v1/chat/completions", {
        "model": engine.model, "max_tokens": engine.max_model_len, "temperature": 0,
        "messages": [{"role": "user", "content": "Hello there."}]})
    assert status == 200, body
    usage = body["usage"]
    assert body["choices"][0]["finish_reason"] in ("length", "stop")
    assert 0 < usage["completion_tokens"] <= engine.max_model_len - usage["prompt_tokens"]


def test_a_prompt_that_nearly_fills_the_context_stops_at_the_context_limit(
        engine: Engine) -> None:
    max_len = engine.max_model_len
    status, body = engine.post_json("/v1/completions", {
        "model": engine.model, "prompt": [HELLO_IDS[0]] * (max_len - 3), "max_tokens": max_len,
        "ignore_eos": True})
    assert status == 200, body
    usage = body["usage"]
    assert usage["prompt_tokens"] == max_len - 3 and usage["completion_tokens"] == 3
    assert usage["total_tokens"] == max_len
    assert body["choices"][0]["finish_reason"] == "length"
    # A prompt that fills it leaves no token to generate.
    status, raw = engine.post_json("/v1/completions", {
        "model": engine.model, "prompt": [HELLO_IDS[0]] * max_len, "max_tokens": 4})
    assert status == 400
    error = error_of(raw, 400)
    assert error["type"] == "BadRequestError" and error["param"] == "max_tokens"
    assert "max_tokens must be at least 1, got 0" in error["message"]


@pytest.mark.parametrize(("path", "field"), [("/v1/chat/completions", "max_tokens"),
                                             ("/v1/chat/completions", "max_completion_tokens"),
                                             ("/v1/completions", "max_tokens")])
def test_max_tokens_beyond_the_context_is_400(engine: Engine, path: str, field: str) -> None:
    asked = engine.max_model_len + 1
    prompt: dict[str, Any] = ({"prompt": "Hello"} if path == "/v1/completions" else
                              {"messages": [{"role": "user", "content": "Hello there."}]})
    status, raw = engine.post_json(path, {"model": engine.model, field: asked, **prompt})
    assert status == 400
    error = error_of(raw, 400)
    assert error["type"] == "BadRequestError" and error["param"] == field
    assert error["message"] == (
        f"{field}={asked} cannot be greater than max_model_len={engine.max_model_len}. Please "
        f"request fewer output tokens. (parameter={field}, value={asked})")


def test_stream_options_without_streaming_are_refused(engine: Engine) -> None:
    status, raw = engine.post_json("/v1/completions", {
        "model": engine.model, "prompt": "x", "max_tokens": 1,
        "stream_options": {"include_usage": True}})
    assert status == 400
    error = error_of(raw, 400)
    assert error["type"] == "BadRequestError" and error["param"] == "stream_options"
    assert "stream=True" in error["message"]


CHAT_ERRORS: list[tuple[str, dict[str, Any] | bytes, str, str | None, tuple[str, ...]]] = [
    # (case, body (the model added), type, param, keywords of the message)
    ("no messages", {}, "Bad Request", "body.messages", ("Field required",)),
    ("messages not a list", {"messages": "hi"}, "Bad Request", "body.messages",
     ("valid list",)),
    ("max_tokens not a number", {"max_tokens": "ten"}, "Bad Request", "body.max_tokens",
     ("valid integer",)),
    ("max_tokens negative", {"max_tokens": -1}, "BadRequestError", "max_tokens",
     ("max_tokens must be at least 1, got -1",)),
    ("n zero", {"n": 0}, "BadRequestError", None, ("n must be at least 1, got 0.",)),
    ("invalid JSON", b'{"model": ', "Bad Request", "body.", ("JSON",)),
    ("empty messages", {"messages": []}, "BadRequestError", None,
     ("Cannot apply chat template to an empty conversation",)),
    ("continue_final_message with add_generation_prompt",
     {"continue_final_message": True, "messages": [
         {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
     "BadRequestError", None,
     ("continue_final_message and add_generation_prompt are not compatible",)),
]


@pytest.mark.parametrize(("case", "body", "kind", "param", "keywords"), CHAT_ERRORS,
                         ids=[c[0] for c in CHAT_ERRORS])
def test_a_bad_chat_request_is_400_with_vllms_error_type_and_param(
        engine: Engine, case: str, body: dict[str, Any] | bytes, kind: str,
        param: str | None, keywords: tuple[str, ...]) -> None:
    if isinstance(body, dict):
        body = {"model": engine.model, "max_tokens": 2,
                "messages": [{"role": "user", "content": "Hi"}], **body}
        body = {k: v for k, v in body.items() if not (case == "no messages" and k == "messages")}
    status, raw = engine.post_json("/v1/chat/completions", body)
    assert status == 400, raw
    error = error_of(raw, 400)
    assert error["type"] == kind
    if param is not None and param.endswith("."):
        assert str(error["param"]).startswith(param), error
    else:
        assert error["param"] == param, error
    for keyword in keywords:
        assert keyword in error["message"], error


def test_whole_bodies_carry_vllms_fields(engine: Engine) -> None:
    _, chat = engine.post_json("/v1/chat/completions", {
        "model": engine.model, "max_tokens": 2,
        "messages": [{"role": "user", "content": "Hi"}]})
    assert set(chat) == {"id", "object", "created", "model", "choices", "service_tier",
                         "system_fingerprint", "usage", "prompt_logprobs", "prompt_token_ids",
                         "prompt_text", "kv_transfer_params", "ec_transfer_params", "metrics"}
    assert set(chat["choices"][0]) == {"index", "message", "logprobs", "finish_reason",
                                       "stop_reason", "token_ids", "routed_experts"}
    assert set(chat["choices"][0]["message"]) == {"role", "content", "refusal", "annotations",
                                                  "audio", "function_call", "reasoning"}
    assert set(chat["usage"]) == {"prompt_tokens", "total_tokens", "completion_tokens",
                                  "prompt_tokens_details", "completion_tokens_details"}
    assert chat["system_fingerprint"].startswith(f"vllm-{CONTRACT_VLLM_VERSION}-")
    _, completion = engine.post_json("/v1/completions", {
        "model": engine.model, "prompt": "Hi", "max_tokens": 2})
    assert set(completion) == {"id", "object", "created", "model", "choices", "service_tier",
                               "system_fingerprint", "usage", "kv_transfer_params",
                               "ec_transfer_params", "metrics"}
    assert set(completion["choices"][0]) == {
        "index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids",
        "prompt_logprobs", "prompt_token_ids", "routed_experts"}


def test_version_names_the_vllm_release_of_the_contract(engine: Engine) -> None:
    status, _, raw = engine.call("GET", "/version")
    assert status == 200
    assert json.loads(raw) == {"version": CONTRACT_VLLM_VERSION}


def test_tokenize_a_prompt_and_detokenize_it_back(engine: Engine) -> None:
    status, body = engine.post_json("/tokenize", {"model": engine.model, "prompt": HELLO})
    assert status == 200
    assert set(body) == {"count", "max_model_len", "tokens", "token_strs"}
    assert body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == engine.max_model_len and body["token_strs"] is None
    assert all(isinstance(t, int) and t >= 0 for t in body["tokens"])
    if not engine.simulated and engine.model == REAL_MODEL:
        assert body["tokens"] == HELLO_IDS
    status, back = engine.post_json("/detokenize", {"model": engine.model,
                                                    "tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": HELLO}
    # Without a model it goes to the served one; the tokens' strings on request.
    status, named = engine.post_json("/tokenize", {"prompt": HELLO, "return_token_strs": True})
    assert status == 200 and named["tokens"] == body["tokens"]
    assert len(named["token_strs"]) == named["count"]
    # The count is the one a completion reports.
    status, done = engine.post_json("/v1/completions", {
        "model": engine.model, "prompt": HELLO, "max_tokens": 1})
    assert status == 200 and done["usage"]["prompt_tokens"] == body["count"]


def test_detokenize_refuses_a_negative_id_as_a_validation_error(engine: Engine) -> None:
    status, raw = engine.post_json("/detokenize", {"model": engine.model, "tokens": [-1]})
    assert status == 400
    error = error_of(raw, 400)
    assert error["type"] == "Bad Request" and error["param"] == "body.tokens.0"


def test_tokenize_messages_counts_what_the_chat_completion_is_given(engine: Engine) -> None:
    messages = [{"role": "user", "content": HELLO}]
    status, body = engine.post_json("/tokenize", {"model": engine.model, "messages": messages})
    assert status == 200 and body["count"] == len(body["tokens"])
    status, done = engine.post_json("/v1/chat/completions", {
        "model": engine.model, "messages": messages, "max_tokens": 1})
    assert status == 200 and done["usage"]["prompt_tokens"] == body["count"]
    status, bare = engine.post_json("/tokenize", {"model": engine.model, "messages": messages,
                                                  "add_generation_prompt": False})
    assert status == 200 and bare["count"] < body["count"]
    status, text = engine.post_json("/detokenize", {"model": engine.model,
                                                    "tokens": body["tokens"]})
    assert status == 200 and HELLO in text["prompt"]
    status, raw = engine.post_json("/tokenize", {"model": engine.model, "messages": []})
    assert status == 400
    assert "empty conversation" in error_of(raw, 400)["message"]


def render(engine: Engine, path: str, body: dict[str, Any]) -> tuple[int, Any]:
    status, answer = engine.post_json(path, {"model": engine.model, **body})
    if status == 403 and not engine.simulated:
        pytest.skip("this vLLM was started without --enable-scale-out")
    return status, answer


def test_chat_render_gives_the_token_ids_and_sampling_params_the_engine_would_get(
        engine: Engine) -> None:
    messages = [{"role": "user", "content": HELLO}]
    status, rendered = render(engine, "/v1/chat/completions/render", {"messages": messages})
    assert status == 200, rendered
    assert {"request_id", "token_ids", "sampling_params", "model", "stream", "stream_options",
            "cache_salt", "priority"} <= set(rendered)
    assert rendered["request_id"].startswith("chatcmpl-")
    assert rendered["model"] == engine.model and rendered["stream"] is False
    _, tokens = engine.post_json("/tokenize", {"model": engine.model, "messages": messages})
    assert rendered["token_ids"] == tokens["tokens"]
    params = rendered["sampling_params"]
    assert params["max_tokens"] == engine.max_model_len - len(rendered["token_ids"])
    assert params["temperature"] == 1.0 and params["stop"] == []
    status, rendered = render(engine, "/v1/chat/completions/render", {
        "messages": messages, "max_tokens": 7, "temperature": 0, "stream": True, "seed": 5})
    assert status == 200
    params = rendered["sampling_params"]
    assert (params["max_tokens"], params["temperature"], params["seed"]) == (7, 0.0, 5)
    assert rendered["stream"] is True
    status, raw = render(engine, "/v1/chat/completions/render", {
        "messages": messages, "max_tokens": engine.max_model_len + 1})
    assert status == 400 and error_of(raw, 400)["param"] == "max_tokens"


def test_completion_render_answers_a_list_of_rendered_prompts(engine: Engine) -> None:
    status, rendered = render(engine, "/v1/completions/render", {"prompt": HELLO,
                                                                 "max_tokens": 5})
    assert status == 200 and isinstance(rendered, list) and len(rendered) == 1
    _, tokens = engine.post_json("/tokenize", {"model": engine.model, "prompt": HELLO})
    assert rendered[0]["token_ids"] == tokens["tokens"]
    assert rendered[0]["request_id"].startswith("cmpl-")
    assert rendered[0]["sampling_params"]["max_tokens"] == 5


CONTINUED = [{"role": "user", "content": "Name the capital of France."},
             {"role": "assistant", "content": "The capital of France is"}]


def test_continue_final_message_continues_the_assistants_text(engine: Engine) -> None:
    request = {"model": engine.model, "messages": CONTINUED, "max_tokens": 8, "temperature": 0,
               "continue_final_message": True, "add_generation_prompt": False}
    status, body = engine.post_json("/v1/chat/completions", request)
    assert status == 200, body
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant"
    text = message["content"]
    assert text and not text.lstrip().startswith("The capital")
    if not engine.simulated and engine.model == REAL_MODEL:
        assert "Paris" in text
    # The prompt is the conversation with the final message left open: fewer tokens than the
    # same conversation closed with a generation prompt after it.
    _, left_open = engine.post_json("/tokenize", {
        "model": engine.model, "messages": CONTINUED, "continue_final_message": True,
        "add_generation_prompt": False})
    _, closed = engine.post_json("/tokenize", {"model": engine.model, "messages": CONTINUED})
    assert body["usage"]["prompt_tokens"] == left_open["count"] < closed["count"]
    # Streamed, the first chunk carries the role and the text is the same.
    _, events, _ = stream(engine, "/v1/chat/completions", request)
    chunks = chunks_of(events)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in c["choices"][0]["delta"] for c in chunks[1:])
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == text


def test_without_a_generation_prompt_the_answer_takes_the_final_messages_role(
        engine: Engine) -> None:
    status, body = engine.post_json("/v1/chat/completions", {
        "model": engine.model, "max_tokens": 2, "temperature": 0,
        "add_generation_prompt": False, "continue_final_message": True,
        "messages": [{"role": "user", "content": "Name the capital of"}]})
    assert status == 200
    assert body["choices"][0]["message"]["role"] == "user"


def test_metrics_carry_vllms_names_labelled_by_model(engine: Engine) -> None:
    before = engine.metrics()
    for name in REQUIRED_METRICS:
        assert any(line.startswith(name + "{") and f'model_name="{engine.model}"' in line
                   for line in before.splitlines()), name
    status, body = engine.post_json("/v1/completions", {
        "model": engine.model, "prompt": "Tokens, please.", "max_tokens": 3})
    assert status == 200
    generated = body["usage"]["completion_tokens"]

    def grown() -> str | None:
        after = engine.metrics()
        grew = (counter(after, "vllm:generation_tokens_total", engine.model)
                - counter(before, "vllm:generation_tokens_total", engine.model))
        return after if grew >= generated else None

    after = wait_until(grown, 30, f"vllm:generation_tokens_total grown by {generated}",
                       every_s=0.1)
    parser = pytest.importorskip("prometheus_client.parser")
    families = {f.name for f in parser.text_string_to_metric_families(after)}
    assert {"vllm:time_to_first_token_seconds", "vllm:prompt_tokens"} <= families


def test_a_repeated_long_prompt_is_served_from_the_prefix_cache_and_says_so(
        engine: Engine) -> None:
    # A fresh prefix each run, so the first request is really uncached; some 600 tokens by
    # either tokenizer. The engine's own evidence, not timing: cached_tokens in the usage
    # (whole blocks of the prompt, never its last token) and the hit counters.
    sentence = "Meridian places each replica where it is cheapest and routes requests near. "
    prompt = f"Run {uuid.uuid4().hex}. " + sentence * 40
    body = {"model": engine.model, "prompt": prompt, "max_tokens": 1}
    hits_before = counter(engine.metrics(), "vllm:prefix_cache_hits_total", engine.model)
    status, cold = engine.post_json("/v1/completions", body)
    assert status == 200
    prompt_tokens = cold["usage"]["prompt_tokens"]
    assert prompt_tokens >= 400
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    status, warm = engine.post_json("/v1/completions", body)
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert prompt_tokens // 2 <= cached < prompt_tokens, (cached, prompt_tokens)
    wait_until(lambda: counter(engine.metrics(), "vllm:prefix_cache_hits_total", engine.model)
               - hits_before >= cached, 30, f"{cached} prefix cache hits counted", every_s=0.1)
    # Streamed, the usage chunk says the same.
    _, events, _ = stream(engine, "/v1/completions", {
        **body, "stream_options": {"include_usage": True}})
    usage = chunks_of(events)[-1]["usage"]
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["prompt_tokens_details"]["cached_tokens"] == cached


def test_a_cache_salt_keeps_the_same_prompt_apart_in_the_prefix_cache(engine: Engine) -> None:
    # The same fresh prompt salted "tenant-A", "tenant-B", then "tenant-A" again: only the
    # last finds anything cached (the first request's blocks), as a salt is mixed into the
    # first block's hash and every later block chains on it. An empty salt is refused.
    sentence = "Meridian keeps each tenant's prompts to itself in a shared prefix cache. "
    body = {"model": engine.model, "max_tokens": 1,
            "prompt": f"Run {uuid.uuid4().hex}. " + sentence * 40}
    usages = []
    for salt in ("tenant-A", "tenant-B", "tenant-A"):
        status, answer = engine.post_json("/v1/completions", {**body, "cache_salt": salt})
        assert status == 200, answer
        usages.append(answer["usage"])
    prompt_tokens = usages[0]["prompt_tokens"]
    cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usages]
    assert cached[:2] == [0, 0]
    assert prompt_tokens // 2 <= cached[2] < prompt_tokens, (cached, prompt_tokens)
    status, raw = engine.post_json("/v1/completions", {**body, "cache_salt": ""})
    assert status == 400
    assert "cache_salt" in error_of(raw, 400)["message"]
