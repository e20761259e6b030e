"""HTTP handlers: vLLM's OpenAI server surface, plus the simulator's admin endpoints.

Served: GET /health, GET /version, GET /v1/models, POST /v1/completions,
POST /v1/chat/completions, POST /tokenize, POST /detokenize, GET /metrics; with
--enable-scale-out also POST /v1/chat/completions/render and /v1/completions/render (without
it they answer 403, as vLLM's do); and GET/POST /sim/faults (fault injection) and
GET /sim/state (the scheduler's queues and KV cache, for tests and the curious). Other paths answer like
Starlette does in vLLM (`{"detail": "Not Found"}`). With API keys configured, /v1 paths
want `Authorization: Bearer <key>` and answer 401 `{"error": "Unauthorized"}` otherwise,
as vLLM's AuthenticationMiddleware does; /health and /metrics stay open.

A streamed answer's headers go out at once; from then on the engine loop writes each token's
SSE frame straight to the connection (HTTP/1.1 chunked framing, as aiohttp set it up), and
the handler only waits for the end to close the body. A client that goes away aborts its
request in the engine, freeing its batch slot and KV blocks.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from enginesim.engine import Engine
from enginesim.faults import FaultError, Faults, parse_faults
from enginesim.metrics import EngineMetrics
from enginesim.profiles import Profile
from enginesim.protocol import (
    DONE,
    SCALE_OUT_DISABLED,
    VLLM_VERSION,
    ApiError,
    CacheDetails,
    GenerationRequest,
    StreamFrames,
    check_context,
    dumps,
    models_body,
    not_found,
    parse_detokenize,
    parse_generation,
    parse_json,
    parse_tokenize,
    random_uuid,
    render_body,
    sampling_params,
    system_fingerprint,
    whole_body,
)
from enginesim.scheduler import Scheduler, Sequence
from enginesim.tokenizer import (
    block_hashes,
    decode,
    encode,
    generated_text,
    generation_offset,
    natural_length,
    pieces,
    token_index,
)

JSON = "application/json"
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Paths served above; another method on them is 405, as Starlette answers.
ROUTED_PATHS = frozenset({"/health", "/version", "/v1/models", "/v1/completions",
                          "/v1/chat/completions", "/tokenize", "/detokenize",
                          "/v1/chat/completions/render", "/v1/completions/render", "/metrics",
                          "/sim/state"})


@dataclass
class ServerConfig:
    model: str
    served_model_names: list[str]
    max_model_len: int
    seed: int = 0
    faults: Faults = field(default_factory=Faults)
    # SHA-256 digests of the accepted API keys; empty: no authentication, as vllm serve
    # without --api-key.
    api_key_digests: tuple[bytes, ...] = ()
    # vllm serve's flags of the same names: usage.prompt_tokens_details (cached_tokens) and
    # the render endpoints are off unless asked for.
    enable_prompt_tokens_details: bool = False
    enable_scale_out: bool = False
    # The prefix cache's block, in tokens (the profile's: 16 as on a GPU, 128 on vLLM's CPU).
    block_tokens: int = 16

    @property
    def fingerprint(self) -> str:
        return system_fingerprint(self.model)

    def cache_details(self, seq: Sequence) -> CacheDetails | None:
        if not self.enable_prompt_tokens_details:
            return None
        block = self.block_tokens
        full_blocks = seq.prompt_len // block * block
        return CacheDetails(seq.num_cached, max(full_blocks - seq.num_cached, 0))

    def authorized(self, header: str | None) -> bool:
        if not self.api_key_digests:
            return True
        scheme, _, token = (header or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.encode()).digest()
        return any(hmac.compare_digest(digest, key) for key in self.api_key_digests)


class WholeOutput:
    """A non-streamed request: nothing per token, one wake-up when it finishes."""

    __slots__ = ("done", "max_tokens_param")

    def __init__(self, done: asyncio.Future[None], max_tokens_param: int | None) -> None:
        self.done = done
        self.max_tokens_param = max_tokens_param

    def deliver(self, seq: Sequence) -> None:
        if seq.finish_reason is not None and not self.done.done():
            self.done.set_result(None)


class StreamOutput:
    """A streamed request: each token's frame is written to the socket as it is sampled."""

    __slots__ = ("done", "max_tokens_param", "frames", "offset", "include_usage", "transport",
                 "chunked", "engine", "config")

    def __init__(self, done: asyncio.Future[None], max_tokens_param: int | None,
                 frames: StreamFrames, offset: int, include_usage: bool,
                 transport: asyncio.Transport, chunked: bool, engine: Engine,
                 config: ServerConfig) -> None:
        self.done = done
        self.max_tokens_param = max_tokens_param
        self.frames = frames
        self.offset = offset
        self.include_usage = include_usage
        self.transport = transport
        self.chunked = chunked
        self.engine = engine
        self.config = config

    def deliver(self, seq: Sequence) -> None:
        transport = self.transport
        if transport.is_closing():
            self.engine.abort(seq)
            if not self.done.done():
                self.done.set_result(None)
            return
        frames = self.frames
        position = seq.num_output - 1
        faults = self.config.faults
        if faults.cuts_streams and position >= faults.after_tokens:
            self.cut(seq, faults.mode)
            return
        reason = seq.finish_reason
        vocab = None if reason == "stop" else token_index(self.offset, position)
        if reason is None:
            data = frames.token(vocab, None, seq.num_output)
        else:
            data = frames.token(vocab, reason, seq.num_output, not self.include_usage)
        if position == 0 and frames.chat:
            data = frames.role() + data
        if reason is not None:
            if self.include_usage:
                data += frames.usage(seq.prompt_len, seq.num_output,
                                     self.config.cache_details(seq))
            data += DONE
        if self.chunked:
            # Concatenation, not %-formatting with a tuple: nothing the cyclic GC tracks is
            # allocated per token, so its collections stay rare and short.
            data = b"%x\r\n" % len(data) + data + b"\r\n"
        transport.write(data)
        if reason is not None and not self.done.done():
            self.done.set_result(None)

    def wait_for_hang_up(self) -> None:
        """A stalled answer: nothing more is sent; it ends when its client hangs up."""
        if self.transport.is_closing():
            if not self.done.done():
                self.done.set_result(None)
            return
        asyncio.get_running_loop().call_later(0.1, self.wait_for_hang_up)

    def cut(self, seq: Sequence, mode: str) -> None:
        """A mid-stream fault: end this answer as a failing engine would."""
        transport = self.transport
        self.engine.abort(seq)
        if mode == "stall":
            self.wait_for_hang_up()
            return
        if mode == "reset":
            transport.abort()
        else:
            data = b""
            if mode == "error_event":
                data = b"data: " + dumps({"error": {
                    "message": "The engine failed while generating (fault injection mode "
                    "'error_event').", "type": "InternalServerError", "param": None,
                    "code": 500}}) + b"\n\n" + DONE
            if self.chunked:
                data = (b"%x\r\n" % len(data) + data + b"\r\n" if data else b"") + b"0\r\n\r\n"
            transport.write(data)
            transport.close()
        if not self.done.done():
            self.done.set_result(None)


class EngineServer:
    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.unhung = asyncio.Event()
        self.held = 0  # requests waiting at the gate while the engine hangs
        self.apply_faults(config.faults)

    # -- faults ------------------------------------------------------------------------------
    def apply_faults(self, faults: Faults) -> None:
        self.config.faults = faults
        self.engine.slow_factor = faults.slow_factor
        if faults.hangs:
            self.engine.pause()
            self.unhung.clear()
        else:
            self.engine.resume()
            self.unhung.set()

    async def _gate(self) -> None:
        """Hold the request while the engine hangs, as a wedged engine would."""
        if not self.unhung.is_set():
            self.held += 1
            try:
                await self.unhung.wait()
            finally:
                self.held -= 1

    # -- vLLM's endpoints --------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        await self._gate()
        faults = self.config.faults
        if faults.fails_health:
            return web.Response(status=faults.status)
        return web.Response(status=200)

    async def version(self, request: web.Request) -> web.Response:
        return web.Response(body=dumps({"version": VLLM_VERSION}), content_type=JSON)

    async def models(self, request: web.Request) -> web.Response:
        cfg = self.config
        return web.Response(body=models_body(cfg.served_model_names, cfg.model,
                                             cfg.max_model_len), content_type=JSON)

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.engine.metrics.render(self.engine.state())
        return web.Response(body=body, headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        await self._gate()
        cfg = self.config
        if cfg.faults.fails_requests:
            status = cfg.faults.status
            return _error(ApiError(status, "The engine is failing on purpose (fault injection "
                                   f"mode 'fail', status {status}).", _error_type(status)))
        arrival = time.monotonic()
        try:
            body = await self._body(request)
            parsed = parse_generation(body, chat, cfg.seed)
            max_tokens = check_context(parsed, cfg.max_model_len)
        except ApiError as exc:
            return _error(exc)
        prompt_tokens = parsed.prompt_tokens
        prefix = "chatcmpl-" if chat else "cmpl-"
        request_id = prefix + request.headers.get("X-Request-Id", random_uuid())
        created = int(time.time())
        served = cfg.served_model_names[0]
        offset = generation_offset(cfg.seed, parsed.seed, parsed.prompt) \
            if parsed.text_offset is None else parsed.text_offset
        seq = Sequence(prompt_tokens,
                       block_hashes(parsed.prompt, cfg.block_tokens, parsed.cache_salt),
                       max_tokens,
                       _eos_at(parsed, offset), arrival)
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if not parsed.stream:
            seq.payload = WholeOutput(done, parsed.max_tokens)
            return await self._answer_whole(seq, done, parsed, request_id, created, served,
                                            offset)
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8"})
        writer = await response.prepare(request)
        transport = request.transport
        if writer is None or transport is None:
            return response
        frames = StreamFrames(chat, request_id, created, served, parsed.continuous_usage,
                              prompt_tokens, parsed.role, cfg.fingerprint)
        seq.payload = StreamOutput(done, parsed.max_tokens, frames, offset,
                                   parsed.include_usage, transport,
                                   bool(getattr(writer, "chunked", False)), self.engine, cfg)
        self.engine.submit(seq)
        try:
            await done
        finally:
            if seq.finish_reason is None:
                self.engine.abort(seq)
        if not transport.is_closing():
            await response.write_eof()
        return response

    async def _answer_whole(self, seq: Sequence, done: asyncio.Future[None],
                            parsed: GenerationRequest, request_id: str, created: int,
                            served: str, offset: int) -> web.Response:
        self.engine.submit(seq)
        try:
            await done
        finally:
            if seq.finish_reason is None:
                self.engine.abort(seq)
        reason = seq.finish_reason or "abort"
        text = generated_text(offset, seq.num_output, reason == "stop")
        cfg = self.config
        return web.Response(body=whole_body(parsed.chat, request_id, created, served, text,
                                            reason, seq.prompt_len, seq.num_output,
                                            cfg.cache_details(seq), parsed.role,
                                            cfg.fingerprint), content_type=JSON)

    async def _body(self, request: web.Request) -> dict[str, Any]:
        """The JSON body, its model checked against the served names."""
        body = parse_json(await request.read())
        model = body.get("model")
        if model is not None and model not in self.config.served_model_names:
            raise not_found(str(model), self.config.served_model_names)
        return body

    # -- tokenizer and render endpoints ------------------------------------------------------
    async def tokenize(self, request: web.Request) -> web.Response:
        try:
            text, return_strs = parse_tokenize(await self._body(request))
        except ApiError as exc:
            return _error(exc)
        tokens = encode(text)
        return web.Response(body=dumps({
            "count": len(tokens), "max_model_len": self.config.max_model_len,
            "tokens": tokens, "token_strs": pieces(text) if return_strs else None}),
            content_type=JSON)

    async def detokenize(self, request: web.Request) -> web.Response:
        try:
            tokens = parse_detokenize(await self._body(request))
        except ApiError as exc:
            return _error(exc)
        return web.Response(body=dumps({"prompt": decode(tokens)}), content_type=JSON)

    async def chat_render(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=True)

    async def completion_render(self, request: web.Request) -> web.Response:
        return await self._render(request, chat=False)

    async def _render(self, request: web.Request, chat: bool) -> web.Response:
        """What the request would be given to the engine as: its token ids and sampling
        parameters (vLLM's scale-out render endpoints; nothing is generated)."""
        cfg = self.config
        if not cfg.enable_scale_out:
            return _error(ApiError(403, SCALE_OUT_DISABLED, "PermissionDeniedError"))
        try:
            body = await self._body(request)
            parsed = parse_generation(body, chat)
            max_tokens = check_context(parsed, cfg.max_model_len)
            params = sampling_params(body, max_tokens if chat or parsed.max_tokens is not None
                                     else None, parsed.stream)
        except ApiError as exc:
            return _error(exc)
        if parsed.from_ids:
            raw = body["prompt"]
            ids = list(raw[0] if isinstance(raw[0], list) else raw)
        else:
            ids = encode(parsed.prompt)
        prefix = "chatcmpl-" if chat else "cmpl-"
        rendered = render_body(prefix + request.headers.get("X-Request-Id", random_uuid()),
                               ids, params, cfg.served_model_names[0], body, parsed.stream)
        return web.Response(body=dumps(rendered if chat else [rendered]), content_type=JSON)

    # -- the simulator's admin endpoints ---------------------------------------------------
    async def faults(self, request: web.Request) -> web.Response:
        if request.method not in ("GET", "POST"):
            return web.Response(status=405, body=b'{"detail":"Method Not Allowed"}',
                                content_type=JSON)
        if request.method == "POST":
            try:
                faults = parse_faults(await request.json())
            except (FaultError, ValueError) as exc:
                return web.Response(status=400, body=dumps({"error": str(exc)}),
                                    content_type=JSON)
            if faults.mode == "die":
                # Answer first, then vanish without closing anything, as a crash would.
                asyncio.get_running_loop().call_later(0.05, os._exit, 1)
            else:
                self.apply_faults(faults)
            return web.Response(body=dumps(faults.as_dict()), content_type=JSON)
        return web.Response(body=dumps(self.config.faults.as_dict()), content_type=JSON)

    async def state(self, request: web.Request) -> web.Response:
        s = self.engine.scheduler
        pool = s.pool
        return web.Response(body=dumps({
            "profile": s.profile.name, "running": len(s.running), "waiting": len(s.waiting),
            "pending": len(s.pending), "steps": s.steps, "max_num_seqs": s.max_num_seqs,
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "kv_blocks": pool.num_blocks, "kv_free_blocks": pool.num_free,
            "kv_cached_blocks": pool.num_cached, "kv_cache_usage": pool.usage(),
            "paused": self.engine.paused, "faults": self.config.faults.as_dict(),
        }), content_type=JSON)

    async def not_found(self, request: web.Request) -> web.Response:
        if request.path in ROUTED_PATHS:
            return web.Response(status=405, body=b'{"detail":"Method Not Allowed"}',
                                content_type=JSON)
        return web.Response(status=404, body=b'{"detail":"Not Found"}', content_type=JSON)


def _error(exc: ApiError) -> web.Response:
    return web.Response(status=exc.status, body=exc.body(), content_type=JSON)


def _error_type(status: int) -> str:
    if status == 404:
        return "NotFoundError"
    if 400 <= status < 500:
        return "BadRequestError"
    return "InternalServerError" if status == 500 else "ServiceUnavailableError"


def _eos_at(parsed: GenerationRequest, offset: int) -> int | None:
    if parsed.ignore_eos:
        return None
    natural = natural_length(offset) if parsed.text_offset is None else parsed.natural_left
    return max(natural, parsed.min_tokens + 1)


ENGINE_KEY = web.AppKey("engine", Engine)
SERVER_KEY = web.AppKey("server", EngineServer)


def build_app(profile: Profile, model: str, served_model_name: str | list[str],
              max_model_len: int | None = None, max_num_seqs: int | None = None,
              kv_cache_tokens: int | None = None, seed: int = 0, *,
              max_num_batched_tokens: int | None = None,
              faults: Faults | None = None,
              api_keys: list[str] | None = None,
              enable_prompt_tokens_details: bool = False,
              enable_scale_out: bool = False) -> web.Application:
    """An aiohttp application serving one simulated engine (its loop starts with the app)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    max_model_len = max_model_len or profile.max_model_len
    kv_tokens = kv_cache_tokens or profile.kv_cache_tokens
    if max_model_len > kv_tokens:
        raise ValueError(f"max_model_len {max_model_len} exceeds the KV cache ({kv_tokens} "
                         "tokens): a full-length request could never be scheduled")
    # Built here, before anything listens, so that a bad combination fails at once.
    scheduler = Scheduler(profile, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          kv_cache_tokens=kv_tokens, max_model_len=max_model_len)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    config = ServerConfig(model, names, max_model_len, seed, faults or Faults(),
                          tuple(hashlib.sha256(k.encode()).digest() for k in api_keys or ()),
                          enable_prompt_tokens_details, enable_scale_out,
                          block_tokens=scheduler.block_tokens)

    async def lifecycle(app: web.Application) -> Any:
        engine = Engine(scheduler, EngineMetrics(names[0], max_model_len))
        server = EngineServer(engine, config)
        app[ENGINE_KEY] = engine
        app[SERVER_KEY] = server
        engine.start()
        yield
        await engine.stop()

    app.cleanup_ctx.append(lifecycle)

    def route(name: str) -> Any:
        async def handler(request: web.Request) -> web.StreamResponse:
            server = request.app[SERVER_KEY]
            if (request.path.startswith("/v1")
                    and not server.config.authorized(request.headers.get("Authorization"))):
                return web.Response(status=401, body=b'{"error":"Unauthorized"}',
                                    content_type=JSON)
            return await getattr(server, name)(request)
        return handler

    app.router.add_get("/health", route("health"))
    app.router.add_get("/version", route("version"))
    app.router.add_get("/v1/models", route("models"))
    app.router.add_post("/v1/completions", route("completions"))
    app.router.add_post("/v1/chat/completions", route("chat_completions"))
    app.router.add_post("/tokenize", route("tokenize"))
    app.router.add_post("/detokenize", route("detokenize"))
    app.router.add_post("/v1/chat/completions/render", route("chat_render"))
    app.router.add_post("/v1/completions/render", route("completion_render"))
    app.router.add_get("/metrics", route("metrics"))
    app.router.add_route("*", "/sim/faults", route("faults"))
    app.router.add_get("/sim/state", route("state"))
    app.router.add_route("*", "/{tail:.*}", route("not_found"))
    return app
