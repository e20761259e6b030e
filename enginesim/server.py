"""HTTP handlers: vLLM's OpenAI server surface (health, models, completions, chat, metrics).

Response shapes, SSE framing and error bodies follow vLLM's OpenAI-compatible server:
`data: {json}\\n\\n` chunks, the first chat chunk carrying the role, a usage chunk with
`choices: []` when `stream_options.include_usage` is set, then `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from aiohttp import web

from enginesim.engine import Engine, SimRequest
from enginesim.faults import Faults
from enginesim.metrics import EngineMetrics
from enginesim.profiles import Profile
from enginesim.tokens import generation_seed, natural_length, tokenize

ENGINE_KEY = web.AppKey("engine", Engine)
CONFIG_KEY = web.AppKey("config", dict)
FAULTS_KEY = web.AppKey("faults", Faults)


def error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": status}},
        status=status,
    )


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


def render_chat(messages: list[dict[str, Any]]) -> str:
    """A chat template: role-tagged turns, then the assistant's turn."""
    parts = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|{message.get('role', 'user')}|>\n{content or ''}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


class Handlers:
    def __init__(self, app: web.Application) -> None:
        self.app = app

    @property
    def engine(self) -> Engine:
        return self.app[ENGINE_KEY]

    @property
    def config(self) -> dict[str, Any]:
        return self.app[CONFIG_KEY]

    async def health(self, request: web.Request) -> web.Response:
        if self.app[FAULTS_KEY].mode == "hang":
            await asyncio.Event().wait()
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        cfg = self.config
        return web.json_response({"object": "list", "data": [{
            "id": cfg["served_model_name"], "object": "model", "created": cfg["created"],
            "owned_by": "vllm", "root": cfg["model"], "parent": None,
            "max_model_len": cfg["max_model_len"], "permission": [],
        }]})

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.engine.metrics.exposition(),
                            content_type="text/plain", charset="utf-8")

    async def faults(self, request: web.Request) -> web.Response:
        faults = self.app[FAULTS_KEY]
        if request.method == "POST":
            try:
                faults.set(await request.json())
            except (ValueError, TypeError) as exc:
                return error(400, str(exc), "BadRequestError")
            self.engine.slow_factor = faults.factor if faults.mode == "slow" else 1.0
            self.engine.paused = faults.mode == "hang"
        return web.json_response(faults.as_dict())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        faults = self.app[FAULTS_KEY]
        if faults.mode == "fail":
            return error(faults.status, "injected failure", "InternalServerError")
        if faults.mode == "hang":
            await asyncio.Event().wait()
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            return error(400, "The request body is not valid JSON.", "BadRequestError")
        if not isinstance(body, dict):
            return error(400, "The request body must be a JSON object.", "BadRequestError")
        cfg = self.config
        model = body.get("model")
        if model != cfg["served_model_name"]:
            return error(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return error(400, "messages must be a non-empty list", "BadRequestError",
                             "messages")
            prompt = render_chat(messages)
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list):
                prompt = "".join(str(p) for p in prompt)
            if not isinstance(prompt, str):
                return error(400, "prompt must be a string", "BadRequestError", "prompt")
        tokens = tokenize(prompt)
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
            return error(400, "max_tokens must be a positive integer", "BadRequestError",
                         "max_tokens")
        limit = cfg["max_model_len"]
        if len(tokens) + (max_tokens or 0) > limit or len(tokens) >= limit:
            return error(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {len(tokens) + (max_tokens or 0)} tokens ({len(tokens)} in the "
                f"messages, {max_tokens or 0} in the completion). Please reduce the length of "
                "the messages or completion.", "BadRequestError", "messages" if chat else "prompt")
        seed = generation_seed(prompt, body.get("seed"), cfg["seed"])
        if max_tokens is None:
            # vLLM: completions default to 16 tokens; chat runs to the end of the answer.
            length, on_length = (16, True) if not chat else (
                min(natural_length(seed), limit - len(tokens)), False)
        else:
            natural = natural_length(seed)
            length, on_length = (max_tokens, True) if max_tokens <= natural else (natural, False)
        sim = SimRequest(tokens, length, on_length, seed)
        self.engine.submit(sim)
        stream = bool(body.get("stream"))
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        try:
            if stream:
                return await self._stream(request, sim, rid, created, chat, include_usage)
            return await self._whole(sim, rid, created, chat)
        finally:
            if sim.finished is None:
                self.engine.abort(sim)

    async def _next_tokens(self, sim: SimRequest) -> list[str]:
        while not sim.out and sim.finished is None:
            sim.event.clear()
            await sim.event.wait()
        out, sim.out = sim.out, []
        return out

    async def _whole(self, sim: SimRequest, rid: str, created: int, chat: bool) -> web.Response:
        text = []
        while sim.finished is None or sim.out:
            text.extend(await self._next_tokens(sim))
        usage = {"prompt_tokens": sim.n_prompt, "total_tokens": sim.n_prompt + sim.generated,
                 "completion_tokens": sim.generated, "prompt_tokens_details": None}
        model = self.config["served_model_name"]
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": "".join(text),
                                              "tool_calls": [], "reasoning_content": None},
                      "logprobs": None, "finish_reason": sim.finished, "stop_reason": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": "".join(text), "logprobs": None,
                      "finish_reason": sim.finished, "stop_reason": None,
                      "prompt_logprobs": None}
            obj = "text_completion"
        return web.json_response({"id": rid, "object": obj, "created": created, "model": model,
                                  "choices": [choice], "usage": usage})

    async def _stream(self, request: web.Request, sim: SimRequest, rid: str, created: int,
                      chat: bool, include_usage: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8",
                                               "Cache-Control": "no-cache"})
        await response.prepare(request)
        model = _dumps(self.config["served_model_name"])
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = f'data: {{"id":"{rid}","object":"{obj}","created":{created},"model":{model},"choices":['
        if chat:
            await response.write((head + '{"index":0,"delta":{"role":"assistant","content":""},'
                                  '"logprobs":null,"finish_reason":null}]}\n\n').encode())
        while True:
            tokens = await self._next_tokens(sim)
            done = sim.finished is not None and not sim.out
            frames = []
            for i, token in enumerate(tokens):
                last = done and i == len(tokens) - 1
                reason = _dumps(sim.finished) if last else "null"
                if chat:
                    frames.append(f'{head}{{"index":0,"delta":{{"content":{_dumps(token)}}},'
                                  f'"logprobs":null,"finish_reason":{reason}}}]}}\n\n')
                else:
                    frames.append(f'{head}{{"index":0,"text":{_dumps(token)},"logprobs":null,'
                                  f'"finish_reason":{reason},"stop_reason":null}}]}}\n\n')
            if frames:
                await response.write("".join(frames).encode())
            if done:
                break
        if include_usage:
            usage = {"prompt_tokens": sim.n_prompt, "total_tokens": sim.n_prompt + sim.generated,
                     "completion_tokens": sim.generated}
            await response.write(f'{head}],"usage":{_dumps(usage)}}}\n\n'.encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def build_app(profile: Profile, model: str, served_model_name: str, max_model_len: int,
              max_num_seqs: int | None, kv_cache_tokens: int | None, seed: int) -> web.Application:
    app = web.Application(client_max_size=64 * 1024 * 1024)
    engine = Engine(profile, EngineMetrics(served_model_name), max_num_seqs, kv_cache_tokens)
    app[ENGINE_KEY] = engine
    app[FAULTS_KEY] = Faults()
    app[CONFIG_KEY] = {"model": model, "served_model_name": served_model_name,
                       "max_model_len": max_model_len, "seed": seed, "created": int(time.time())}
    handlers = Handlers(app)
    app.router.add_get("/health", handlers.health)
    app.router.add_get("/v1/models", handlers.models)
    app.router.add_post("/v1/completions", handlers.completions)
    app.router.add_post("/v1/chat/completions", handlers.chat)
    app.router.add_get("/metrics", handlers.metrics)
    app.router.add_route("*", "/sim/faults", handlers.faults)

    async def start_engine(app: web.Application) -> Any:
        task = asyncio.create_task(engine.run())
        yield
        task.cancel()

    app.cleanup_ctx.append(start_engine)
    return app
