"""The HTTP surface in process: streams, validation, ids, determinism, client aborts."""

from __future__ import annotations

import json
from typing import Any

import aiohttp

from controlplane.lab.waiting import wait_until_async

from .conftest import FAST, engine_of, run, serving


async def post(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[int, Any]:
    async with session.post(url, json=body, headers=headers) as response:
        raw = await response.read()
        return response.status, (json.loads(raw) if raw.startswith(b"{") else raw)


def sse_chunks(raw: bytes) -> list[dict[str, Any]]:
    events = [e[len(b"data: "):] for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]"
    return [json.loads(e) for e in events[:-1]]


CHAT = {"model": "test", "messages": [{"role": "user", "content": "Tell me about edges."}],
        "max_tokens": 12, "ignore_eos": True}


def test_a_chat_stream_carries_one_chunk_per_token_between_the_role_and_the_usage() -> None:
    async def scenario() -> None:
        async with serving() as (base, _), aiohttp.ClientSession() as session:
            body = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
            async with session.post(base + "/v1/chat/completions", json=body) as response:
                assert response.headers["Content-Type"] == "text/event-stream; charset=utf-8"
                chunks = sse_chunks(await response.read())
            status, whole = await post(session, base + "/v1/chat/completions", CHAT)
        assert status == 200
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        tokens = chunks[1:-1]
        assert len(tokens) == 12
        assert [c["choices"][0]["finish_reason"] for c in tokens] == [None] * 11 + ["length"]
        assert chunks[-1]["choices"] == []
        assert chunks[-1]["usage"]["completion_tokens"] == 12
        assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
        streamed = "".join(c["choices"][0]["delta"]["content"] for c in tokens)
        assert streamed == whole["choices"][0]["message"]["content"]
    run(scenario())


def test_a_completion_stream_ends_with_an_empty_eos_token_when_the_model_stops() -> None:
    async def scenario() -> None:
        async with serving() as (base, _), aiohttp.ClientSession() as session:
            body = {"model": "test", "prompt": "Once", "max_tokens": 4000, "stream": True}
            async with session.post(base + "/v1/completions", json=body) as response:
                chunks = sse_chunks(await response.read())
        last = chunks[-1]["choices"][0]
        assert last["finish_reason"] == "stop" and last["text"] == ""
        assert all(c.get("usage") is None for c in chunks)
        assert 32 <= len(chunks) <= 512
    run(scenario())


def test_the_same_request_gets_the_same_text_and_another_seed_another() -> None:
    async def text(seed: int, request_seed: int | None = None) -> str:
        async with serving(seed=seed) as (base, _), aiohttp.ClientSession() as session:
            body = {"model": "test", "prompt": "Same prompt", "max_tokens": 8,
                    **({"seed": request_seed} if request_seed is not None else {})}
            _, reply = await post(session, base + "/v1/completions", body)
            return str(reply["choices"][0]["text"])

    async def scenario() -> None:
        first = await text(1)
        assert await text(1) == first
        assert await text(2) != first
        assert await text(1, request_seed=5) != first
    run(scenario())


def test_the_request_id_header_names_the_completion() -> None:
    async def scenario() -> None:
        async with serving() as (base, _), aiohttp.ClientSession() as session:
            _, reply = await post(session, base + "/v1/completions",
                                  {"model": "test", "prompt": "x", "max_tokens": 1},
                                  headers={"X-Request-Id": "trace-42"})
        assert reply["id"] == "cmpl-trace-42"
    run(scenario())


def test_a_request_without_a_model_goes_to_the_served_one() -> None:
    async def scenario() -> None:
        async with serving(served="alias") as (base, _), aiohttp.ClientSession() as session:
            status, reply = await post(session, base + "/v1/completions",
                                       {"prompt": [1, 2, 3], "max_tokens": 2})
        assert status == 200 and reply["model"] == "alias"
        assert reply["usage"] == {"prompt_tokens": 3, "total_tokens": 5, "completion_tokens": 2,
                                  "prompt_tokens_details": None,
                                  "completion_tokens_details": None}
    run(scenario())


def test_bad_requests_are_refused_with_vllms_status_and_a_message_naming_the_problem() -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "BadRequestError",
         "Stream options can only be defined when `stream=True`. (parameter=stream_options)"),
        ({"prompt": "x", "max_tokens": 0}, "BadRequestError",
         "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)"),
        ({"prompt": "x", "max_tokens": "ten"}, "Bad Request", "body.max_tokens"),
        ({"prompt": "x", "max_tokens": 129}, "BadRequestError",
         "max_tokens=129 cannot be greater than max_model_len=128. Please request fewer "
         "output tokens. (parameter=max_tokens, value=129)"),
        ({"prompt": "x" * 600}, "BadRequestError",
         "This model's maximum context length is 128 tokens. However, your prompt contains "
         "at least 129 input tokens"),
        ({"prompt": [7] * 128}, "BadRequestError", "max_tokens must be at least 1, got 0."),
        ({"prompt": ""}, "BadRequestError",
         "Either prompt or prompt_embeds must be provided and non-empty."),
        ({"prompt": "x", "n": 0}, "BadRequestError", "n must be at least 1, got 0."),
        ({"prompt": "x", "n": 2}, "BadRequestError", "n=1"),
    ]

    async def scenario() -> None:
        async with serving(max_model_len=128) as (base, _), aiohttp.ClientSession() as session:
            for body, kind, message in cases:
                status, reply = await post(session, base + "/v1/completions",
                                           {"model": "test", **body})
                assert status == 400, body
                assert reply["error"]["type"] == kind and reply["error"]["code"] == 400
                assert message in reply["error"]["message"], reply
            async with session.post(base + "/v1/completions", data=b"{not json") as response:
                assert response.status == 400
                assert (await response.json())["error"]["param"] == "body.1"
    run(scenario())


def test_max_tokens_is_cut_to_the_room_the_prompt_leaves() -> None:
    async def scenario() -> None:
        async with serving(max_model_len=128) as (base, _), aiohttp.ClientSession() as session:
            status, reply = await post(session, base + "/v1/completions", {
                "prompt": "x" * 400, "max_tokens": 30, "ignore_eos": True})
        assert status == 200
        assert reply["usage"]["completion_tokens"] == 28
        assert reply["choices"][0]["finish_reason"] == "length"
    run(scenario())


def test_cached_tokens_are_reported_with_the_flag_only() -> None:
    prompt = {"prompt": "A shared beginning for both requests. " * 20, "max_tokens": 1}

    async def cached(enable_prompt_tokens_details: bool = False) -> list[Any]:
        async with serving(enable_prompt_tokens_details=enable_prompt_tokens_details) as (
                base, _), aiohttp.ClientSession() as session:
            return [(await post(session, base + "/v1/completions", prompt))[1]["usage"]
                    ["prompt_tokens_details"] for _ in range(2)]

    async def scenario() -> None:
        assert await cached() == [None, None]
        cold, warm = await cached(enable_prompt_tokens_details=True)
        assert cold == {"cached_tokens": 0, "created_cache_tokens": None,
                        "multimodal_tokens": None}
        assert warm["cached_tokens"] == 176  # 190 tokens: 11 whole blocks of 16
    run(scenario())


def test_a_cache_salt_keeps_prompts_apart_as_in_vllm() -> None:
    """The same prompt salted "tenant-A", "tenant-B", "tenant-A": the second finds nothing
    (another salt), the third finds the first's blocks; a bad salt is refused as vLLM does."""
    prompt: dict[str, Any] = {"prompt": "A system prompt only one tenant should see. " * 20,
                              "max_tokens": 1}

    async def scenario() -> None:
        async with serving(enable_prompt_tokens_details=True) as (base, _), \
                aiohttp.ClientSession() as session:
            cached = []
            for salt in ("tenant-A", "tenant-B", "tenant-A", None):
                status, reply = await post(session, base + "/v1/completions",
                                           {**prompt, "cache_salt": salt})
                assert status == 200, reply
                cached.append(reply["usage"]["prompt_tokens_details"]["cached_tokens"])
            refused = [await post(session, base + "/v1/chat/completions",
                                  {**CHAT, "cache_salt": bad}) for bad in ("", 7)]
        blocks = (len(prompt["prompt"]) // 4 - 1) // 16 * 16
        assert cached == [0, 0, blocks, 0]  # unsalted is a salt of its own
        for status, reply in refused:
            assert status == 400
            assert "Parameter 'cache_salt' must be a non-empty string" in \
                reply["error"]["message"]
    run(scenario())


def test_tokenize_detokenize_version_and_render() -> None:
    async def scenario() -> None:
        async with serving(enable_scale_out=True) as (base, _), \
                aiohttp.ClientSession() as session:
            status, tokens = await post(session, base + "/tokenize",
                                        {"prompt": "Grüße, edge!", "return_token_strs": True})
            assert status == 200
            assert tokens["token_strs"] == ["Grüß", "e, e", "dge!"]
            _, text = await post(session, base + "/detokenize", {"tokens": tokens["tokens"]})
            assert text == {"prompt": "Grüße, edge!"}
            async with session.get(base + "/version") as response:
                assert await response.json() == {"version": "0.32.0"}
            status, rendered = await post(session, base + "/v1/chat/completions/render", {
                "messages": [{"role": "user", "content": "Hi"}]})
            assert status == 200 and rendered["model"] == "test"
            assert rendered["sampling_params"]["max_tokens"] == 8192 - len(rendered["token_ids"])
        async with serving() as (base, _), aiohttp.ClientSession() as session:
            status, refused = await post(session, base + "/v1/chat/completions/render", {
                "messages": [{"role": "user", "content": "Hi"}]})
            assert status == 403 and refused["error"]["type"] == "PermissionDeniedError"
    run(scenario())


def test_unknown_paths_and_methods_answer_as_vllms_router_does() -> None:
    async def scenario() -> None:
        async with serving() as (base, _), aiohttp.ClientSession() as session:
            async with session.get(base + "/v2/nothing") as response:
                assert (response.status, await response.json()) == (404, {"detail": "Not Found"})
            async with session.post(base + "/health") as response:
                assert response.status == 405
    run(scenario())


def test_a_client_that_hangs_up_frees_its_place_in_the_batch() -> None:
    async def scenario() -> None:
        async with serving() as (base, app), aiohttp.ClientSession() as session:
            engine = engine_of(app)
            body = {"model": "test", "prompt": "long answer", "max_tokens": 5000,
                    "ignore_eos": True, "stream": True}
            response = await session.post(base + "/v1/completions", json=body)
            await response.content.readuntil(b"\n\n")
            assert len(engine.scheduler.running) == 1
            response.close()
            await wait_until_async(lambda: not engine.scheduler.running, 30,
                                   "the abandoned request out of the batch")
            assert engine.scheduler.pool.usage() == 0.0
            assert engine.metrics.success["abort"] == 1
    run(scenario())


def test_metrics_and_state_report_the_engine_as_it_runs() -> None:
    async def scenario() -> None:
        async with serving() as (base, _), aiohttp.ClientSession() as session:
            await post(session, base + "/v1/completions",
                       {"model": "test", "prompt": "count me", "max_tokens": 3})
            async with session.get(base + "/metrics") as response:
                assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
                text = await response.text()
            async with session.get(base + "/sim/state") as response:
                state = await response.json()
        assert 'vllm:generation_tokens_total{engine="0",model_name="test"} 3.0' in text
        assert 'vllm:prompt_tokens_total{engine="0",model_name="test"} 2.0' in text
        assert state["profile"] == FAST.name and state["running"] == 0
    run(scenario())


def test_with_an_api_key_only_v1_paths_want_the_bearer_token() -> None:
    async def scenario() -> None:
        async with serving(api_keys=["sk-lab"]) as (base, _), aiohttp.ClientSession() as s:
            async with s.get(base + "/v1/models") as response:
                assert response.status == 401
                assert await response.json() == {"error": "Unauthorized"}
            async with s.get(base + "/v1/models",
                             headers={"Authorization": "Bearer sk-wrong"}) as response:
                assert response.status == 401
            async with s.get(base + "/v1/models",
                             headers={"Authorization": "Bearer sk-lab"}) as response:
                assert response.status == 200
            for open_path in ("/health", "/metrics"):
                async with s.get(base + open_path) as response:
                    assert response.status == 200
    run(scenario())
