"""vLLM's OpenAI-server wire format: request validation, response bodies, SSE frames, errors.

Shapes follow vLLM's entrypoints (protocol.py, serving_chat.py, serving_completion.py,
serving_engine.py) as of the 0.11 series:

- JSON bodies are written compactly (Starlette's JSONResponse: `separators=(",", ":")`,
  non-ASCII kept), non-streamed responses with every field of vLLM's models, nulls included.
- Chat streams: a first chunk whose delta carries `{"role": "assistant", "content": ""}`,
  sent with the first token; then one chunk per token; the last carries finish_reason and
  stop_reason; with `stream_options.include_usage` a chunk with `"choices": []` and the
  usage; then `data: [DONE]`. Chunks are dumped with exclude_unset, so fields vLLM passes
  explicitly (token_ids on token chunks) appear as null and the others are absent.
- Completion streams: every chunk dumped whole (`"usage": null` and all choice fields).
- Errors: `{"error": {"message", "type", "param", "code"}}`; 404 NotFoundError for an
  unknown model, 400 BadRequestError for a prompt that does not fit the context (vLLM's own
  wording), 400 "Bad Request" for a body that does not validate.

Frames for a streamed request are assembled from byte strings prepared once per request and
per vocabulary entry, so emitting a token is a few concatenations.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from enginesim.tokenizer import VOCABULARY_JSON, ChatFormatError, render_chat

DONE = b"data: [DONE]\n\n"
_EMPTY_TEXT = b'""'


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def random_uuid() -> str:
    return uuid.uuid4().hex


class ApiError(Exception):
    """An error answer: status, vLLM's error type, a message naming what to fix."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param

    def body(self) -> bytes:
        return dumps({"error": {"message": self.message, "type": self.kind,
                                "param": self.param, "code": self.status}})


def invalid(message: str, param: str | None = None) -> ApiError:
    """A body that fails validation, as vLLM's RequestValidationError handler reports it."""
    return ApiError(400, message, "Bad Request", param)


@dataclass(frozen=True)
class GenerationRequest:
    """A validated /v1/completions or /v1/chat/completions request."""

    chat: bool
    prompt: str
    max_tokens: int | None
    stream: bool
    include_usage: bool
    continuous_usage: bool
    seed: int | None
    ignore_eos: bool
    min_tokens: int


def _opt_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(f"{key}: Input should be a valid integer, got {value!r}", key)
    if value < minimum:
        raise ApiError(400, f"{key} must be at least {minimum}, got {value}.", param=key)
    return value


def _opt_bool(body: dict[str, Any], key: str) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(f"{key}: Input should be a valid boolean, got {value!r}", key)
    return value


def parse_generation(body: Any, chat: bool) -> GenerationRequest:
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    stream = _opt_bool(body, "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise invalid("stream_options: Input should be an object", "stream_options")
        if not stream:
            raise invalid("Stream options can only be defined when `stream=True`.",
                          "stream_options")
    options = stream_options or {}
    # vLLM's StreamOptions defaults include_usage to True once stream_options is given.
    include_usage = stream_options is not None and options.get("include_usage", True) is True
    continuous = include_usage and options.get("continuous_usage_stats") is True
    n = body.get("n")
    if n is not None and n != 1:
        raise ApiError(400, "enginesim serves one choice per request (n=1).", param="n")
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise invalid("messages: Field required: a non-empty list of messages", "messages")
        add_generation_prompt = body.get("add_generation_prompt", True)
        try:
            prompt = render_chat(messages, add_generation_prompt is not False)
        except ChatFormatError as exc:
            raise invalid(str(exc), "messages") from None
        max_tokens = _opt_int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _opt_int(body, "max_tokens", 1)
    else:
        raw = body.get("prompt")
        if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], str):
            raw = raw[0]
        if isinstance(raw, list) and raw and all(
                isinstance(t, int) and not isinstance(t, bool) for t in raw):
            # Token ids: one four-character piece per id keeps the count exact.
            raw = "".join(f"{t % 10000:04d}" for t in raw)
        if raw is None:
            raise invalid("At least one of `prompt` or `prompt_embeds` must be set.", "prompt")
        if not isinstance(raw, str):
            raise ApiError(400, "enginesim accepts a prompt as a string, a list of one "
                           "string, or a list of token ids.", param="prompt")
        if not raw:
            raise ApiError(400, "The decoder prompt cannot be empty", param="prompt")
        prompt = raw
        max_tokens = _opt_int(body, "max_tokens", 1)
        if "max_tokens" not in body:
            max_tokens = 16  # CompletionRequest.max_tokens defaults to 16
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise invalid(f"seed: Input should be a valid integer, got {seed!r}", "seed")
    min_tokens = _opt_int(body, "min_tokens", 0) or 0
    return GenerationRequest(chat, prompt, max_tokens, stream, include_usage, continuous,
                             seed, _opt_bool(body, "ignore_eos"), min_tokens)


def check_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """vLLM's length validation (serving_engine._validate_input), with its wording."""
    if prompt_tokens >= max_model_len:
        raise ApiError(400, f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, your request has {prompt_tokens} input tokens. Please reduce "
                       "the length of the input messages.")
    if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        raise ApiError(400, f"'max_tokens' or 'max_completion_tokens' is too large: "
                       f"{max_tokens}. This model's maximum context length is {max_model_len} "
                       f"tokens and your request has {prompt_tokens} input tokens ({max_tokens} "
                       f"> {max_model_len} - {prompt_tokens}).")


def models_body(served_names: list[str], root: str, max_model_len: int) -> bytes:
    now = int(time.time())
    return dumps({"object": "list", "data": [{
        "id": name, "object": "model", "created": now, "owned_by": "vllm", "root": root,
        "parent": None, "max_model_len": max_model_len,
        "permission": [{
            "id": f"modelperm-{random_uuid()}", "object": "model_permission", "created": now,
            "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
            "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
            "organization": "*", "group": None, "is_blocking": False,
        }],
    } for name in served_names]})


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}


def whole_body(chat: bool, request_id: str, created: int, model: str, text: str,
               finish_reason: str, prompt_tokens: int, completion_tokens: int) -> bytes:
    use = {**usage(prompt_tokens, completion_tokens), "prompt_tokens_details": None}
    if chat:
        return dumps({
            "id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {
                "role": "assistant", "content": text, "refusal": None, "annotations": None,
                "audio": None, "function_call": None, "tool_calls": [],
                "reasoning_content": None},
                "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
                "token_ids": None}],
            "service_tier": None, "system_fingerprint": None, "usage": use,
            "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None})
    return dumps({
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                     "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                     "prompt_token_ids": None}],
        "service_tier": None, "system_fingerprint": None, "usage": use,
        "kv_transfer_params": None})


class StreamFrames:
    """The SSE frames of one streamed request, prepared once."""

    __slots__ = ("chat", "_head", "_usage_head", "_tok_tail", "_role", "_continuous",
                 "_prompt_tokens")

    def __init__(self, chat: bool, request_id: str, created: int, model: str,
                 continuous_usage: bool, prompt_tokens: int) -> None:
        self.chat = chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        envelope = (b'data: {"id":' + dumps(request_id) + b',"object":"' + obj.encode()
                    + b'","created":' + str(created).encode() + b',"model":' + dumps(model))
        self._usage_head = envelope + b',"choices":[],"usage":'
        self._continuous = continuous_usage
        self._prompt_tokens = prompt_tokens
        if chat:
            self._head = envelope + b',"choices":[{"index":0,"delta":{"content":'
            self._role = (envelope + b',"choices":[{"index":0,"delta":{"role":"assistant",'
                          b'"content":""},"logprobs":null,"finish_reason":null}]')
        else:
            self._head = envelope + b',"choices":[{"index":0,"text":'
            self._role = b""

    def role(self) -> bytes:
        """Chat's first chunk (empty for completions)."""
        if not self.chat:
            return b""
        return self._role + self._usage_suffix(0) + b"}\n\n"

    def token(self, vocab_index: int | None, finish_reason: str | None,
              completion_tokens: int) -> bytes:
        """One token's chunk; `vocab_index` None is the end-of-sequence token (no text)."""
        text = _EMPTY_TEXT if vocab_index is None else VOCABULARY_JSON[vocab_index]
        if finish_reason is None:
            reason = b'"finish_reason":null'
        else:
            reason = b'"finish_reason":"' + finish_reason.encode() + b'","stop_reason":null'
        if self.chat:
            return (self._head + text + b'},"logprobs":null,' + reason + b',"token_ids":null}]'
                    + self._usage_suffix(completion_tokens) + b"}\n\n")
        if finish_reason is None:
            reason += b',"stop_reason":null'
        tail = self._usage_suffix(completion_tokens) or b',"usage":null'
        return (self._head + text + b',"logprobs":null,' + reason
                + b',"prompt_token_ids":null,"token_ids":null}]' + tail + b"}\n\n")

    def _usage_suffix(self, completion_tokens: int) -> bytes:
        if not self._continuous:
            return b""
        return b',"usage":' + dumps(usage(self._prompt_tokens, completion_tokens))

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        return self._usage_head + dumps(usage(prompt_tokens, completion_tokens)) + b"}\n\n"
