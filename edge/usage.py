"""Token usage read from engines' answers, without parsing a long answer whole."""

from __future__ import annotations

from typing import Final

import orjson

# Final: mypyc compiles these in as constants instead of looking each up per use.
USAGE_WINDOW_BYTES: Final = 1024  # a usage object's counts come within its first bytes
USAGE_KEY: Final = b'"usage"'
PROMPT_KEY: Final = b'"prompt_tokens"'
COMPLETION_KEY: Final = b'"completion_tokens"'


def is_space(c: int) -> bool:
    """Whitespace as a bytes regex reads it: space, tab, newline, vertical tab, form feed,
    carriage return (JSON's own four among them)."""
    return c == 32 or 9 <= c <= 13


def skip_space(data: bytes, at: int, end: int) -> int:
    while at < end and is_space(data[at]):
        at += 1
    return at


def after_colon(data: bytes, at: int, end: int) -> int:
    """Where a value starts after the key ending at `at` (past spaces, a colon, spaces), or -1."""
    at = skip_space(data, at, end)
    if at >= end or data[at] != 58:  # ':'
        return -1
    return skip_space(data, at + 1, end)


def count_after(data: bytes, key: bytes, start: int, end: int) -> int:
    """The first `key: <digits>` within data[start:end], as a number; -1 if none."""
    while True:
        at = data.find(key, start, end)
        if at < 0:
            return -1
        i = after_colon(data, at + len(key), end)
        if i >= 0 and i < end and 48 <= data[i] <= 57:
            value = 0
            while i < end and 48 <= data[i] <= 57:
                value = value * 10 + data[i] - 48
                i += 1
            return value
        start = at + 1


def reported_usage(tail: bytes) -> tuple[int, int] | None:
    """(prompt, completion) tokens from the end of an answer: the usage chunk of an SSE
    stream, or the `usage` object of a JSON answer.

    Found by search rather than by parsing the answer, which for a long completion would
    cost more than the rest of the response path: the last `"usage"` that is a key with an
    object value (inside a string it would be escaped, and as a value — a token's text in
    `prompt_logprobs` — it is not followed by a colon), then its counts within that object's
    first bytes. Plain `bytes.find` and a scan, no regular expressions: this runs on every
    answer, and three regex searches were 5% of the edge's time per request."""
    end = len(tail)
    while True:
        at = tail.rfind(USAGE_KEY, 0, end)
        if at < 0:
            return None
        value = after_colon(tail, at + len(USAGE_KEY), len(tail))
        if value >= 0 and value < len(tail) and tail[value] == 123:  # '{'
            break
        end = at
    start = value + 1
    window = min(len(tail), start + USAGE_WINDOW_BYTES)
    prompt = count_after(tail, PROMPT_KEY, start, window)
    completion = count_after(tail, COMPLETION_KEY, start, window)
    if prompt < 0 or completion < 0:
        return None
    return prompt, completion


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
