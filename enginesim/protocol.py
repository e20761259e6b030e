"""vLLM's OpenAI server wire format: request validation, response bodies, SSE frames, errors.

Shapes follow vLLM 0.32's entrypoints (the version enginesim reports at /version), checked
against the real server by tests/contract:

- JSON bodies are written compactly (Starlette's JSONResponse: `separators=(",", ":")`,
  non-ASCII kept), non-streamed responses with every field of vLLM's models, nulls included,
  and a `system_fingerprint` naming the version.
- Chat streams: a first chunk whose delta carries `{"role": ..., "content": ""}`, sent with
  the first token; then one chunk per token; the last carries finish_reason and stop_reason;
  with `stream_options.include_usage` a chunk with `"choices": []` and the usage; then
  `data: [DONE]`. The stream's last JSON chunk carries the system fingerprint. Chunks are
  dumped with exclude_unset, so fields vLLM passes explicitly (token_ids) appear as null and
  the others are absent.
- Completion streams: the same, without a role chunk.
- `usage.prompt_tokens_details` is null unless the server was started with
  --enable-prompt-tokens-details; then it carries `cached_tokens` (the prompt's tokens found
  in the prefix cache), in the stream's usage chunk too.
- `cache_salt` (a non-empty string, or null) salts the prompt's prefix-cache blocks: prompts
  with different salts share none, as in vLLM.
- `max_tokens` above max_model_len is refused; otherwise it is cut to the room the prompt
  leaves, so a request stops at the context limit ("length"); unset, chat gets all that
  room and completions 16 tokens of it.
- Errors: `{"error": {"message", "type", "param", "code"}}`; 404 NotFoundError for an
  unknown model; 400 BadRequestError for a request vLLM refuses after validation (its
  wording, with " (parameter=..., value=...)" where vLLM adds it); 400 "Bad Request" with
  `param` "body.<field>" for a body that does not validate (pydantic's error, as vLLM's
  RequestValidationError handler reports it).

Frames for a streamed request are assembled from byte strings prepared once per request and
per vocabulary entry, so emitting a token is a few concatenations.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from enginesim.tokenizer import (
    VOCABULARY,
    VOCABULARY_JSON,
    ChatFormatError,
    count_tokens,
    decode,
    generation_offset,
    natural_length,
    render_chat,
    token_index,
)

# The vLLM release whose HTTP surface enginesim reproduces (and reports at /version).
VLLM_VERSION = "0.32.0"
DONE = b"data: [DONE]\n\n"
_EMPTY_TEXT = b'""'
_MISSING = object()
COMPLETION_DEFAULT_MAX_TOKENS = 16  # CompletionRequest.max_tokens
EMPTY_CONVERSATION = ("Cannot apply chat template to an empty conversation. Provide at least "
                      "one message.")
CACHE_SALT_REFUSED = "Parameter 'cache_salt' must be a non-empty string if provided."
CONTINUE_WITH_GENERATION_PROMPT = (
    "continue_final_message and add_generation_prompt are not compatible. Use "
    "continue_final_message when you want the model to continue the final message, and "
    "add_generation_prompt when you want to add a header that will prompt it to start a new "
    "assistant message instead.")
SCALE_OUT_DISABLED = ("Scale-out endpoints are disabled. Restart vllm serve with "
                      "--enable-scale-out to enable them.")


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def random_uuid() -> str:
    return uuid.uuid4().hex


def system_fingerprint(model: str) -> str:
    """`vllm-<version>-<8 hex digits>`, as vLLM names its build and model."""
    return f"vllm-{VLLM_VERSION}-" + hashlib.blake2b(model.encode(), digest_size=4).hexdigest()


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


def _input_repr(value: Any) -> str:
    if isinstance(value, dict):
        return f"<dict of {len(value)} items>"
    if isinstance(value, list):
        return f"<list of {len(value)} items>"
    return str(value)


def invalid(loc: str, kind: str, msg: str, value: Any,
            ctx: dict[str, Any] | None = None) -> ApiError:
    """A body that fails validation, as vLLM's RequestValidationError handler reports it:
    pydantic's error with its location under `body`, which is also the `param`."""
    where = "body." + loc if loc else "body"
    detail: dict[str, Any] = {"type": kind, "loc": where, "msg": msg,
                              "input": _input_repr(value)}
    if ctx is not None:
        detail["ctx"] = ctx
    return ApiError(400, f"1 validation error:\n  {detail!r}", "Bad Request", where)


def rejected(message: str, param: str, value: Any = _MISSING) -> ApiError:
    """A request vLLM refuses after validation (its VLLMValidationError)."""
    where = f"parameter={param}" + ("" if value is _MISSING else f", value={value}")
    return ApiError(400, f"{message} ({where})", param=param)


def not_found(model: str, served: list[str]) -> ApiError:
    return ApiError(404, f"The model `{model}` does not exist. Valid aliases: "
                    f"{', '.join(served)}.", "NotFoundError", "model")


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as an object, or the validation error vLLM answers."""
    try:
        body = json.loads(raw)
    except UnicodeDecodeError:
        raise invalid("0", "json_invalid", "JSON decode error", {},
                      {"error": "Invalid UTF-8"}) from None
    except json.JSONDecodeError as exc:
        raise invalid(str(exc.pos), "json_invalid", "JSON decode error", {},
                      {"error": exc.msg}) from None
    if not isinstance(body, dict):
        raise invalid("", "model_attributes_type", "Input should be a valid dictionary or "
                      "object to extract fields from", body)
    return body


@dataclass(frozen=True)
class GenerationRequest:
    """A validated /v1/completions or /v1/chat/completions request."""

    chat: bool
    prompt: str
    prompt_tokens: int
    # As asked (None: unset), and the field it came from (max_tokens or max_completion_tokens).
    max_tokens: int | None
    max_tokens_param: str
    stream: bool
    include_usage: bool
    continuous_usage: bool
    seed: int | None
    ignore_eos: bool
    min_tokens: int
    # Whether the prompt came as token ids (a text prompt is cut at max_model_len + 1 tokens
    # before its length is checked, so its count is reported as "at least" that).
    from_ids: bool = False
    # The role of the answer: the assistant's, or the final message's when it is continued.
    role: str = "assistant"
    # A chat that continues the simulator's own answer (continue_final_message, the final
    # assistant message holding its first tokens): where that answer's text starts, how many
    # of its tokens the message holds, and how many tokens it has left before its end.
    text_offset: int | None = None
    continued_tokens: int = 0
    natural_left: int = 0
    # vLLM's per-request prefix-cache salt (enginesim.tokenizer.block_hashes).
    cache_salt: str | None = None


def continuation(body: dict[str, Any], server_seed: int) -> tuple[int, int, int, int] | None:
    """(text offset, tokens held, tokens left, prompt tokens) when a chat's final assistant
    message, continued, is the first k tokens this server would have answered the
    conversation before it with: then the answer goes on from token k, as a model at
    temperature 0 continues its own text, and the prompt counts the original prompt's tokens
    plus those k (a tokenizer splits a model's own text into the tokens it produced)."""
    messages = body.get("messages")
    if not (body.get("continue_final_message") is True and isinstance(messages, list)
            and len(messages) > 1 and isinstance(messages[-1], dict)
            and messages[-1].get("role") == "assistant"):
        return None
    content = messages[-1].get("content")
    if not isinstance(content, str) or not content:
        return None
    try:
        prompt = render_chat(messages[:-1], True, False)
    except ChatFormatError:
        return None
    seed = body.get("seed")
    offset = generation_offset(server_seed, seed if isinstance(seed, int) else None, prompt)
    natural = natural_length(offset)
    text, k = "", 0
    while len(text) < len(content) and k < natural - 1:
        text += VOCABULARY[token_index(offset, k)]
        k += 1
    if text != content:
        return None
    return offset + k, k, natural - k, count_tokens(prompt) + k


def _opt_int(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise invalid(key, "int_parsing", "Input should be a valid integer, unable to "
                          "parse string as an integer", value) from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(key, "int_type", "Input should be a valid integer", value)
    return value


def _opt_bool(body: dict[str, Any], key: str, default: bool = False) -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise invalid(key, "bool_type", "Input should be a valid boolean", value)
    return value


def _max_tokens(body: dict[str, Any], keys: tuple[str, ...]) -> tuple[int | None, str]:
    for key in keys:
        value = _opt_int(body, key)
        if value is not None:
            if value < 1:
                raise rejected(f"max_tokens must be at least 1, got {value}.", "max_tokens",
                               value)
            return value, key
    return None, "max_tokens"


def parse_messages(body: dict[str, Any]) -> tuple[str, str]:
    """The chat prompt and the answer's role, from messages, add_generation_prompt and
    continue_final_message, refused as vLLM refuses them."""
    messages = body.get("messages", _MISSING)
    if messages is _MISSING:
        raise invalid("messages", "missing", "Field required", body)
    if not isinstance(messages, list):
        raise invalid("messages", "list_type", "Input should be a valid list", messages)
    add_generation_prompt = _opt_bool(body, "add_generation_prompt", True)
    continue_final = _opt_bool(body, "continue_final_message")
    if continue_final and add_generation_prompt:
        raise ApiError(400, CONTINUE_WITH_GENERATION_PROMPT)
    if not messages:
        raise ApiError(400, EMPTY_CONVERSATION)
    try:
        prompt = render_chat(messages, add_generation_prompt, continue_final)
    except ChatFormatError as exc:
        raise invalid(exc.loc, "value_error", str(exc), messages) from None
    role = "assistant" if add_generation_prompt else str(messages[-1]["role"])
    return prompt, role


def parse_prompt(body: dict[str, Any]) -> tuple[str, int, bool]:
    """A completion's prompt: its text, its token count and whether it came as token ids."""
    raw = body.get("prompt")
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]
    if raw is None or raw == "" or raw == []:
        raise rejected("Either prompt or prompt_embeds must be provided and non-empty.",
                       "prompt")
    if isinstance(raw, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                     for t in raw):
        # Every id the simulator's tokenizer reads as four characters decodes to four,
        # a real tokenizer's ids included, so the count is the ids'.
        return decode(raw), len(raw), True
    if not isinstance(raw, str):
        raise ApiError(400, "enginesim accepts a prompt as a string, a list of one string, "
                       "or a list of token ids.", param="prompt")
    return raw, count_tokens(raw), False


def parse_generation(body: dict[str, Any], chat: bool,
                     server_seed: int | None = None) -> GenerationRequest:
    stream = _opt_bool(body, "stream")
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not isinstance(stream_options, dict):
            raise invalid("stream_options", "model_type", "Input should be a valid "
                          "dictionary or instance of StreamOptions", stream_options)
        if not stream:
            raise rejected("Stream options can only be defined when `stream=True`.",
                           "stream_options")
    options = stream_options or {}
    # vLLM's StreamOptions defaults include_usage to True once stream_options is given.
    include_usage = stream_options is not None and options.get("include_usage", True) is True
    continuous = include_usage and options.get("continuous_usage_stats") is True
    n = _opt_int(body, "n")
    if n is not None and n < 1:
        raise ApiError(400, f"n must be at least 1, got {n}.")
    if n is not None and n > 1:
        raise ApiError(400, "enginesim serves one choice per request (n=1).", param="n")
    role = "assistant"
    from_ids = False
    text_offset, held, left = None, 0, 0
    if chat:
        max_tokens, param = _max_tokens(body, ("max_completion_tokens", "max_tokens"))
        prompt, role = parse_messages(body)
        prompt_tokens = count_tokens(prompt)
        continued = None if server_seed is None else continuation(body, server_seed)
        if continued is not None:
            text_offset, held, left, prompt_tokens = continued
    else:
        max_tokens, param = _max_tokens(body, ("max_tokens",))
        prompt, prompt_tokens, from_ids = parse_prompt(body)
    seed = _opt_int(body, "seed")
    min_tokens = _opt_int(body, "min_tokens") or 0
    return GenerationRequest(chat, prompt, prompt_tokens, max_tokens, param, stream,
                             include_usage, continuous, seed, _opt_bool(body, "ignore_eos"),
                             max(min_tokens, 0), from_ids, role, text_offset, held, left,
                             parse_cache_salt(body))


def parse_cache_salt(body: dict[str, Any]) -> str | None:
    """`cache_salt`: unset, null or a non-empty string (vLLM's check_cache_salt_support)."""
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise invalid("", "value_error", "Value error, " + CACHE_SALT_REFUSED, body)
    return salt


def check_context(request: GenerationRequest, max_model_len: int) -> int:
    """vLLM's length checks, with its wording; the number of tokens the request may generate:
    what it asked for, cut to the room its prompt leaves in the context."""
    asked = request.max_tokens
    if asked is not None and asked > max_model_len:
        raise rejected(f"{request.max_tokens_param}={asked} cannot be greater than "
                       f"max_model_len={max_model_len}. Please request fewer output tokens.",
                       request.max_tokens_param, asked)
    prompt_tokens = request.prompt_tokens
    if prompt_tokens > max_model_len:
        # A text prompt is tokenized with truncation at max_model_len + 1.
        count = prompt_tokens if request.from_ids else max_model_len + 1
        qualifier = "at least " if count == max_model_len + 1 else ""
        raise rejected(f"This model's maximum context length is {max_model_len} tokens. "
                       f"However, your prompt contains {qualifier}{count} input tokens, which "
                       "exceeds this limit even without any output tokens. Please reduce the "
                       "length of the input prompt.", "input_tokens", count)
    room = max_model_len - prompt_tokens
    if asked is None:
        asked = room if request.chat else COMPLETION_DEFAULT_MAX_TOKENS
    allowed = min(asked, room)
    if allowed < 1:
        raise rejected(f"max_tokens must be at least 1, got {allowed}.", "max_tokens", allowed)
    return allowed


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


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens}


@dataclass(frozen=True)
class CacheDetails:
    """What a finished request found in the prefix cache, and what it added to it."""

    cached_tokens: int
    created_cache_tokens: int

    def whole(self, chat: bool) -> dict[str, Any]:
        return {"cached_tokens": self.cached_tokens,
                "created_cache_tokens": self.created_cache_tokens if chat else None,
                "multimodal_tokens": None}

    def streamed(self, chat: bool) -> dict[str, Any]:
        if chat:
            return {"cached_tokens": self.cached_tokens,
                    "created_cache_tokens": self.created_cache_tokens}
        return {"cached_tokens": self.cached_tokens}


def whole_body(chat: bool, request_id: str, created: int, model: str, text: str,
               finish_reason: str, prompt_tokens: int, completion_tokens: int,
               details: CacheDetails | None = None, role: str = "assistant",
               fingerprint: str | None = None) -> bytes:
    use = {**usage(prompt_tokens, completion_tokens),
           "prompt_tokens_details": None if details is None else details.whole(chat),
           "completion_tokens_details": None}
    if chat:
        return dumps({
            "id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {
                "role": role, "content": text, "refusal": None, "annotations": None,
                "audio": None, "function_call": None, "reasoning": None},
                "logprobs": None, "finish_reason": finish_reason, "stop_reason": None,
                "token_ids": None, "routed_experts": None}],
            "service_tier": None, "system_fingerprint": fingerprint, "usage": use,
            "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None,
            "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None})
    return dumps({
        "id": request_id, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason,
                     "stop_reason": None, "token_ids": None, "prompt_logprobs": None,
                     "prompt_token_ids": None, "routed_experts": None}],
        "service_tier": None, "system_fingerprint": fingerprint, "usage": use,
        "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None})


class StreamFrames:
    """The SSE frames of one streamed request, prepared once."""

    __slots__ = ("chat", "_head", "_usage_head", "_role", "_continuous", "_prompt_tokens",
                 "_fingerprint")

    def __init__(self, chat: bool, request_id: str, created: int, model: str,
                 continuous_usage: bool, prompt_tokens: int, role: str = "assistant",
                 fingerprint: str | None = None) -> None:
        self.chat = chat
        obj = "chat.completion.chunk" if chat else "text_completion"
        envelope = (b'data: {"id":' + dumps(request_id) + b',"object":"' + obj.encode()
                    + b'","created":' + str(created).encode() + b',"model":' + dumps(model))
        self._usage_head = envelope + b',"choices":[],"usage":'
        self._continuous = continuous_usage
        self._prompt_tokens = prompt_tokens
        self._fingerprint = b',"system_fingerprint":' + dumps(fingerprint)
        if chat:
            self._head = envelope + b',"choices":[{"index":0,"delta":{"content":'
            self._role = (envelope + b',"choices":[{"index":0,"delta":{"role":' + dumps(role)
                          + b',"content":""},"logprobs":null,"finish_reason":null}],'
                          b'"prompt_token_ids":null,"prompt_text":null')
        else:
            self._head = envelope + b',"choices":[{"index":0,"text":'
            self._role = b""

    def role(self) -> bytes:
        """Chat's first chunk (empty for completions)."""
        if not self.chat:
            return b""
        return self._role + self._usage_suffix(0) + b"}\n\n"

    def token(self, vocab_index: int | None, finish_reason: str | None,
              completion_tokens: int, last: bool = False) -> bytes:
        """One token's chunk; `vocab_index` None is the end-of-sequence token (no text);
        `last`: no usage chunk follows, so this one carries the system fingerprint."""
        text = _EMPTY_TEXT if vocab_index is None else VOCABULARY_JSON[vocab_index]
        if finish_reason is None:
            reason = b'"finish_reason":null'
        else:
            reason = b'"finish_reason":"' + finish_reason.encode() + b'","stop_reason":null'
        tail = self._usage_suffix(completion_tokens)
        if last:
            tail += self._fingerprint
        if self.chat:
            return (self._head + text + b'},"logprobs":null,' + reason + b',"token_ids":null}]'
                    + tail + b"}\n\n")
        if finish_reason is None:
            reason += b',"stop_reason":null'
        return (self._head + text + b',"logprobs":null,' + reason
                + b',"prompt_token_ids":null,"token_ids":null}]' + tail + b"}\n\n")

    def _usage_suffix(self, completion_tokens: int) -> bytes:
        if not self._continuous:
            return b""
        return b',"usage":' + dumps(usage(self._prompt_tokens, completion_tokens))

    def usage(self, prompt_tokens: int, completion_tokens: int,
              details: CacheDetails | None = None) -> bytes:
        use = usage(prompt_tokens, completion_tokens)
        if details is not None:
            use["prompt_tokens_details"] = details.streamed(self.chat)
        return self._usage_head + dumps(use) + self._fingerprint + b"}\n\n"


# -- tokenizer and render endpoints ---------------------------------------------------------

def sampling_params(body: dict[str, Any], max_tokens: int | None,
                    stream: bool) -> dict[str, Any]:
    """The SamplingParams a request becomes, as /v1/*/render shows them (the fields vLLM
    writes for a plain request; a completion's unset max_tokens is left out, as vLLM's
    default)."""

    def number(key: str, default: float) -> float:
        value = body.get(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise invalid(key, "float_parsing", "Input should be a valid number, unable to "
                          "parse string as a number", value)
        return float(value)

    params: dict[str, Any] = {
        "presence_penalty": number("presence_penalty", 0.0),
        "frequency_penalty": number("frequency_penalty", 0.0),
        "repetition_penalty": number("repetition_penalty", 1.0),
        "temperature": number("temperature", 1.0),
        "top_p": number("top_p", 1.0), "min_p": number("min_p", 0.0)}
    seed = _opt_int(body, "seed")
    if seed is not None:
        params["seed"] = seed
    stop = body.get("stop")
    params["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
    params["stop_token_ids"] = list(body.get("stop_token_ids") or [])
    if max_tokens is not None:
        params["max_tokens"] = max_tokens
    params.update({"output_kind": 1 if stream else 2, "skip_clone": True, "bad_words": [],
                   "skip_reading_prefix_cache": False})
    return params


def render_body(request_id: str, token_ids: list[int], params: dict[str, Any], model: str,
                body: dict[str, Any], stream: bool) -> dict[str, Any]:
    """One rendered request (`--enable-scale-out`): what the engine would be given."""
    return {"request_id": request_id, "token_ids": token_ids, "token_offsets": None,
            "features": None, "content_parts": None, "sampling_params": params, "model": model,
            "reasoning_ended": None, "reasoning_parser_kwargs": None, "return_token_ids": None,
            "output_mode": "tokens", "stream": stream,
            "stream_options": body.get("stream_options"), "cache_salt": body.get("cache_salt"),
            "priority": body.get("priority") or 0, "kv_transfer_params": None,
            "ec_transfer_params": None}


def parse_tokenize(body: dict[str, Any]) -> tuple[str, bool]:
    """/tokenize's text (a prompt, or messages through the chat template) and whether to
    return the tokens' strings."""
    return_strs = _opt_bool(body, "return_token_strs")
    if "messages" in body:
        prompt, _ = parse_messages(body)
        return prompt, return_strs
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING:
        detail = [{"type": "missing", "loc": f"body.{key}", "msg": "Field required",
                   "input": _input_repr(body)} for key in ("prompt", "messages")]
        raise ApiError(400, "2 validation errors:\n" + "\n".join(f"  {d!r}" for d in detail),
                       "Bad Request", "body.prompt")
    if not isinstance(prompt, str):
        raise invalid("prompt", "string_type", "Input should be a valid string", prompt)
    return prompt, return_strs


def parse_detokenize(body: dict[str, Any]) -> list[int]:
    tokens = body.get("tokens", _MISSING)
    if tokens is _MISSING:
        raise invalid("tokens", "missing", "Field required", body)
    if not isinstance(tokens, list):
        raise invalid("tokens", "list_type", "Input should be a valid list", tokens)
    for i, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int):
            raise invalid(f"tokens.{i}", "int_type", "Input should be a valid integer", token)
        if token < 0:
            raise invalid(f"tokens.{i}", "greater_than_equal", "Input should be greater than "
                          "or equal to 0", token, {"ge": 0})
    return tokens
