"""Token usage read from engines' answers, without parsing a long answer whole."""

from __future__ import annotations

import re

import orjson

_PROMPT_TOKENS = re.compile(rb'"prompt_tokens"\s*:\s*(\d+)')
_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_USAGE_OBJECT = re.compile(rb'"usage"\s*:\s*\{')
USAGE_WINDOW_BYTES = 1024  # a usage object's counts come within its first bytes


def reported_usage(tail: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens from the end of an answer: the usage chunk of an SSE
    stream, or the `usage` object of a JSON answer.

    Found by search rather than by parsing the answer, which for a long completion would
    cost more than the rest of the response path: the last `"usage"` that is a key with an
    object value (inside a string it would be escaped, and as a value — a token's text in
    `prompt_logprobs` — it is not followed by a colon), then its counts within that object's
    first bytes."""
    end = len(tail)
    while True:
        at = tail.rfind(b'"usage"', 0, end)
        if at < 0:
            return None
        key = _USAGE_OBJECT.match(tail, at)
        if key is not None:
            break
        end = at
    window = key.end() + USAGE_WINDOW_BYTES
    prompt = _PROMPT_TOKENS.search(tail, key.end(), window)
    completion = _COMPLETION_TOKENS.search(tail, key.end(), window)
    if prompt is None or completion is None:
        return None
    return int(prompt.group(1)), int(completion.group(1))


def parsed_usage(answer: bytes) -> tuple[int, int] | None:
    """The same from a whole JSON answer by parsing it: the fallback when the search finds
    nothing, for answers shaped unlike vLLM's."""
    try:
        document = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    usage = document.get("usage") if isinstance(document, dict) else None
    if not isinstance(usage, dict):
        return None
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(prompt, int) and isinstance(completion, int) and not isinstance(
            prompt, bool) and not isinstance(completion, bool):
        return prompt, completion
    return None
