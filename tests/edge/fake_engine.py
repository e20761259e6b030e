"""A scriptable stand-in for a vLLM OpenAI server, for the edge's tests.

It answers `/health`, `/metrics`, `/v1/models`, `/v1/chat/completions` and `/v1/completions`
in vLLM's shapes (SSE: role chunk, one chunk per token, finish chunk, optional usage chunk,
`data: [DONE]`), and lets a test decide how it misbehaves: an error status, a delay before
answering, a stream cut after some events (reset, ended early, an error event, or a stall),
a pause between events. Its text is ` t0 t1 t2 …`, and a request that continues it (a chat
whose final assistant message, with `continue_final_message`, or a completion whose prompt,
ends with the first k tokens) gets the rest from ` t{k}` on, as a model at temperature 0
would. It records what it was sent and which requests its client abandoned. Run it in-process (`FakeEngine`) or as a
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
    held: asyncio.Event | None = None  # answer only once the test sets it (after delay_s)
    event_gap_s: float = 0.0  # between SSE events
    tokens: int = 5
    tool_call: bool = False  # stream the tokens as a tool call's arguments
    error_body: dict[str, Any] | None = None  # the body of an error `status` (vLLM's shape)
    cut_after_events: int | None = None  # stream this many events, then fail as `cut_how`:
    cut_how: str = "reset"  # reset the connection, "eof" (end without [DONE]), "error" (an
    # error event, then [DONE], as vLLM does when generation fails), "stall" (send nothing)
    health_status: int = 200
    waiting: int = 0  # reported as vllm:num_requests_waiting
    kv_usage: float = 0.0


def continued_tokens(body: dict[str, Any], chat: bool) -> int:
    """How many of this engine's tokens the request already holds (0 unless it continues)."""
    if chat:
        messages = body.get("messages") or []
        if not (body.get("continue_final_message") and messages
                and messages[-1].get("role") == "assistant"):
            return 0
        text = str(messages[-1].get("content") or "")
    else:
        text = str(body.get("prompt") or "")
    k, seq = 0, ""
    for n in range(len(text)):
        seq += f" t{n}"
        if len(seq) > len(text):
            break
        if text.endswith(seq):
            k = n + 1
    return k


def sse_events(model: str, tokens: int, chat: bool, usage: bool,
               prompt_tokens: int, start: int = 0, continuous: bool = False,
               tool_call: bool = False) -> list[bytes]:
    """The SSE events vLLM sends for a stream of tokens `start` … `tokens - 1`."""
    created = 1767225600 + start  # a resumed answer is another request, made later

    def event(body: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

    kind = "chat.completion.chunk" if chat else "text_completion"
    base = {"id": "cmpl-fake", "object": kind, "created": created, "model": model}
    out = []
    if start:
        base["id"] = f"cmpl-fake-{start}"

    def counts(n: int) -> dict[str, Any]:
        return {"usage": {"prompt_tokens": prompt_tokens, "completion_tokens": n,
                          "total_tokens": prompt_tokens + n}} if continuous else {}

    if chat:
        out.append(event({**base, "choices": [{"index": 0, "delta": {
            "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
            **counts(0)}))
    for n, i in enumerate(range(start, tokens), 1):
        delta: dict[str, Any] = {"tool_calls": [{"index": 0, "function": {
            "arguments": f" t{i}"}}]} if tool_call else {"content": f" t{i}"}
        choice: dict[str, Any] = (
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
            if chat else {"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": None})
        out.append(event({**base, "choices": [choice], **counts(n)}))
    generated = max(tokens - start, 0)
    last: dict[str, Any] = ({"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
                            if chat else {"index": 0, "text": "", "logprobs": None,
                                          "finish_reason": "stop"})
    out.append(event({**base, "choices": [last], **counts(generated)}))
    if usage:
        out.append(event({**base, "choices": [], "usage": {
            "prompt_tokens": prompt_tokens, "completion_tokens": generated,
            "total_tokens": prompt_tokens + generated}}))
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
        bound = self._runner.addresses[0][1]
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
            if behaviour.held is not None:
                await behaviour.held.wait()
            if behaviour.status != 200 and behaviour.error_body is not None:
                return web.json_response(behaviour.error_body, status=behaviour.status)
            if behaviour.status != 200:
                return web.json_response({"error": {
                    "message": "injected failure", "type": "server_error", "param": None,
                    "code": behaviour.status}}, status=behaviour.status)
            # A continued request's prompt counts as the original's plus the tokens it holds.
            start = continued_tokens(body, chat)
            prompt = body.get("messages") or body.get("prompt")
            if start:
                prompt = prompt[:-1] if chat else str(prompt)[:-len(
                    "".join(f" t{i}" for i in range(start)))]
            prompt_tokens = len(json.dumps(prompt)) // 4
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
        options = body.get("stream_options") or {}
        usage = bool(options.get("include_usage"))
        start = continued_tokens(body, chat)
        events = sse_events(str(body.get("model")), behaviour.tokens, chat, usage,
                            prompt_tokens + start, start,
                            usage and bool(options.get("continuous_usage_stats")),
                            behaviour.tool_call)
        response = web.StreamResponse(headers={"content-type": "text/event-stream; "
                                                              "charset=utf-8"})
        await response.prepare(request)
        for i, event in enumerate(events):
            if behaviour.cut_after_events is not None and i >= behaviour.cut_after_events:
                if behaviour.cut_how == "eof":
                    await response.write_eof()
                elif behaviour.cut_how == "error":
                    await response.write(b'data: {"error":{"message":"engine step failed",'
                                         b'"type":"InternalServerError","param":null,'
                                         b'"code":500}}\n\ndata: [DONE]\n\n')
                    await response.write_eof()
                elif behaviour.cut_how == "half":  # half an event, then a reset
                    await response.write(event[:len(event) // 2])
                    await asyncio.sleep(0.05)
                    assert request.transport is not None
                    request.transport.abort()
                elif behaviour.cut_how == "stall":
                    await asyncio.sleep(3600)
                else:
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
