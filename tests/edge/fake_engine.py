"""A scriptable stand-in for a vLLM OpenAI server, for the edge's tests.

It answers `/health`, `/metrics`, `/v1/models`, `/v1/chat/completions` and `/v1/completions`
in vLLM's shapes (SSE: role chunk, one chunk per token, finish chunk, optional usage chunk,
`data: [DONE]`), and lets a test decide how it misbehaves: an error status, a delay before
answering, a stream cut after some events, a pause between events. It records what it was
sent and which requests its client abandoned. Run it in-process (`FakeEngine`) or as a
process a test can kill (`python tests/edge/fake_engine.py --port P`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


@dataclass
class Behaviour:
    status: int = 200  # answer this status (with an OpenAI-shaped error) instead
    delay_s: float = 0.0  # before the head of the answer
    event_gap_s: float = 0.0  # between SSE events
    tokens: int = 5
    cut_after_events: int | None = None  # stream this many events, then drop the connection
    health_status: int = 200
    waiting: int = 0  # reported as vllm:num_requests_waiting
    kv_usage: float = 0.0


def sse_events(model: str, tokens: int, chat: bool, usage: bool,
               prompt_tokens: int) -> list[bytes]:
    """The SSE events vLLM sends for a stream of `tokens` tokens."""
    created = 1767225600

    def event(body: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    kind = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": "cmpl-fake", "object": kind, "created": created, "model": model}
    out = []
    if chat:
        out.append(event({**base, "choices": [{"index": 0, "delta": {
            "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}))
    for i in range(tokens):
        choice: dict[str, Any] = (
            {"index": 0, "delta": {"content": f" t{i}"}, "logprobs": None, "finish_reason": None}
            if chat else {"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": None})
        out.append(event({**base, "choices": [choice]}))
    last: dict[str, Any] = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
                            if chat else {"index": 0, "text": "", "logprobs": None,
                                          "finish_reason": "stop"})
    out.append(event({**base, "choices": [last]}))
    if usage:
        out.append(event({**base, "choices": [], "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": tokens,
            "total_tokens": prompt_tokens + tokens}}))
    out.append(b"data: [DONE]\n\n")
    return out


@dataclass
class FakeEngine:
    model: str = "m"
    behaviour: Behaviour = field(default_factory=Behaviour)
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    abandoned: int = 0
    in_flight: int = 0
    url: str = ""
    _runner: web.AppRunner | None = None

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/chat/completions", self.complete)
        app.router.add_post("/v1/completions", self.complete)
        return app

    async def start(self, port: int = 0, tls: ssl.SSLContext | None = None) -> str:
        # Cancelling the handler when the client goes away is how it notices an abandoned
        # request, as vLLM does.
        self._runner = web.AppRunner(self.app(), access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, ssl_context=tls)
        await site.start()
        server = site._server
        assert server is not None
        bound = server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{bound}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.behaviour.health_status)

    async def metrics(self, request: web.Request) -> web.Response:
        labels = f'model_name="{self.model}",engine="0"'
        return web.Response(text=(
            f"# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{{{labels}}} {self.behaviour.waiting}.0\n"
            f"vllm:num_requests_running{{{labels}}} {self.in_flight}.0\n"
            f"vllm:kv_cache_usage_perc{{{labels}}} {self.behaviour.kv_usage}\n"))

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [
            {"id": self.model, "object": "model", "owned_by": "vllm"}]})

    async def complete(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        self.headers.append({k.lower(): v for k, v in request.headers.items()})
        behaviour = self.behaviour
        chat = request.path.endswith("/chat/completions")
        self.in_flight += 1
        try:
            if behaviour.delay_s:
                await asyncio.sleep(behaviour.delay_s)
            if behaviour.status != 200:
                return web.json_response({"error": {
                    "message": "injected failure", "type": "server_error", "param": None,
                    "code": behaviour.status}}, status=behaviour.status)
            prompt_tokens = len(json.dumps(body.get("messages") or body.get("prompt"))) // 4
            if body.get("stream"):
                return await self.stream(request, body, chat, prompt_tokens)
            text = "".join(f" t{i}" for i in range(behaviour.tokens))
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "logprobs": None, "finish_reason": "stop"} if chat else
                      {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"})
            return web.json_response({
                "id": "cmpl-fake", "object": "chat.completion" if chat else "text_completion",
                "created": 1767225600, "model": body.get("model"), "choices": [choice],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": behaviour.tokens,
                          "total_tokens": prompt_tokens + behaviour.tokens}})
        except (asyncio.CancelledError, ConnectionResetError):
            self.abandoned += 1
            raise
        finally:
            self.in_flight -= 1

    async def stream(self, request: web.Request, body: dict[str, Any], chat: bool,
                     prompt_tokens: int) -> web.StreamResponse:
        behaviour = self.behaviour
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events = sse_events(str(body.get("model")), behaviour.tokens, chat, usage,
                            prompt_tokens)
        response = web.StreamResponse(headers={"content-type": "text/event-stream; "
                                                              "charset=utf-8"})
        await response.prepare(request)
        for i, event in enumerate(events):
            if behaviour.cut_after_events is not None and i >= behaviour.cut_after_events:
                assert request.transport is not None
                request.transport.abort()
                return response
            if behaviour.event_gap_s and i:
                await asyncio.sleep(behaviour.event_gap_s)
            await response.write(event)
        await response.write_eof()
        return response


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", default="m")
    parser.add_argument("--delay", type=float, default=0.0)
    args = parser.parse_args()

    async def run() -> None:
        engine = FakeEngine(args.model, Behaviour(delay_s=args.delay))
        await engine.start(args.port)
        print("READY", flush=True)
        while True:
            await asyncio.sleep(3600)

    try:
        asyncio.run(run())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
