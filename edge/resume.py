"""Stream resumption: a stream whose replica fails after bytes reached the client goes on
from another replica, and the client sees one unbroken stream.

A streamed chat or completion (a 200 `text/event-stream` answer) is relayed whole event by
whole event: a read that ends mid-event keeps its tail back until the rest arrives, so a cut
never leaves half an event with the client. The events relayed are kept (as the bytes read)
while the stream is open. The stream counts as cut when its replica's connection fails, when
the answer ends before `data: [DONE]`, when the engine sends an error event (`{"error": …}`,
which vLLM sends mid-stream when generation fails), or when nothing arrives for the policy's
`stream_stall_s` (while the client reads; the timer also covers a resumed leg's connect and
first token).

Then the edge reads what the client already has — the text, the tokens, the chunk `id`,
`created` and `model`, whether the role chunk went out, whether a tool call started — and,
unless something rules it out, sends the request again to another replica the same filters
allow (residency, tenant, model; never one already tried):

- chat: the original messages plus an assistant message holding the text so far, with
  `continue_final_message: true` and `add_generation_prompt: false` (a request that was
  itself continuing its final message gets the text appended to it instead);
- completions: the prompt plus the text so far;
- either way `max_tokens` / `max_completion_tokens` (and `min_tokens`) less the tokens
  already sent (a completion without `max_tokens` had vLLM's default of 16), and
  `stream_options: {"include_usage": true, "continuous_usage_stats": true}`, so that each
  chunk of a resumed leg says how many tokens that leg has produced.

Tokens sent are counted as chunks arrive: on the first leg, each event with a choice, other
than the chat role chunk, is one token (vLLM sends one event per generated token, the
end-of-sequence token's included, without speculative decoding); on resumed legs the engine's
own running count is used. The usage chunk the client gets (only if it asked, with
`stream_options.include_usage`) adds the legs' completion tokens; its prompt tokens are the
last resumed leg's, less the tokens it was given as the text so far (the original prompt's,
where the tokenizer splits the text as the model produced it).

A resumed leg's chunks are rewritten: the first leg's `id`, `created` and `model`, no second
role chunk, no usage of its own. Refused (with `data: {"error": {...}}` ending the stream,
never a silent cut): `n` or `best_of` above 1 (`refused_n`), logprobs (`refused_logprobs`),
a completion prompt that is not one string or asks for `echo` (`refused_prompt`), a tool call
under way (`refused_tools`), a tenant whose rules say `resume_streams: false`
(`refused_tenant`), no replica left (`no_replica`), and more than the policy's
`resume_streams_max` resumptions or a cut later than `resume_deadline_s` after the first
(`exhausted`). Each outcome is counted in `meridian_edge_stream_resumptions_total{outcome}`,
`resumed` once per leg that answers.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import orjson

from edge.errors import ClientError
from edge.state import Resumption

if TYPE_CHECKING:
    from edge.exchange import Exchange
    from edge.upstream import UpstreamConnection, UpstreamError

DONE_EVENT = b"data: [DONE]\n\n"
# What vLLM generates for a completion that sets no max_tokens.
COMPLETION_DEFAULT_MAX_TOKENS = 16
OUTCOMES = ("resumed", "refused_n", "refused_logprobs", "refused_prompt", "refused_tools",
            "refused_tenant", "no_replica", "exhausted")


def split_events(data: bytes) -> tuple[bytes, bytes]:
    """(the whole events in `data`, the partial event after them)."""
    at = data.rfind(b"\n\n")
    if at < 0:
        return b"", data
    return data[:at + 2], data[at + 2:]


def event_data(event: bytes) -> bytes:
    """The data of one event (its `data:` lines joined), b"" for a comment or empty event."""
    lines = [line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines)


def error_of(document: Any) -> str | None:
    """The message of an error event (vLLM's `{"error": {...}}`, or the older flat
    `{"object": "error", ...}`), else None."""
    if not isinstance(document, dict):
        return None
    error = document.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or "error")
    if isinstance(error, str):
        return error
    if document.get("object") == "error":
        return str(document.get("message") or "error")
    return None


def first_error(whole: bytes) -> tuple[int, str]:
    """Where the first error event in `whole` starts and its message; (-1, "") if none."""
    if b'"error"' not in whole:  # outside a string a quote is never escaped
        return -1, ""
    at = 0
    for event in whole.split(b"\n\n"):
        if b'"error"' in event:
            try:
                message = error_of(orjson.loads(event_data(event)))
            except orjson.JSONDecodeError:
                message = None
            if message is not None:
                return at, message
        at += len(event) + 2
    return -1, ""


def absorb(r: Resumption, sent: bytes) -> None:
    """Read the events the first leg delivered."""
    for event in sent.split(b"\n\n"):
        data = event_data(event)
        if not data or data == b"[DONE]":
            continue
        try:
            document = orjson.loads(data)
        except orjson.JSONDecodeError:
            continue
        if isinstance(document, dict):
            read(r, document)


def read(r: Resumption, document: dict[str, Any]) -> bool:
    """Note what one chunk says; False for a role chunk the client already had."""
    if r.id is None:
        r.id, r.created = document.get("id"), document.get("created")
        r.model = document.get("model")
    usage = document.get("usage")
    if isinstance(usage, dict):
        completion, prompt = usage.get("completion_tokens"), usage.get("prompt_tokens")
        if isinstance(completion, int):
            r.leg_usage = completion
        if isinstance(prompt, int):
            r.prompt_tokens = max(0, prompt - r.tokens)
    choices = document.get("choices")
    if not isinstance(choices, list):
        return True
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("finish_reason") is not None:
            r.finished = True
        if r.chat:
            delta = choice.get("delta")
            if not isinstance(delta, dict):
                continue
            if "role" in delta:
                if r.role_sent:
                    del delta["role"]
                    if not delta.get("content") and not delta.get("tool_calls") \
                            and choice.get("finish_reason") is None:
                        return False
                else:
                    r.role_sent = True
                if not delta.get("content") and not delta.get("tool_calls"):
                    continue  # the role chunk is not a token
            if delta.get("tool_calls"):
                r.tools = True
            text = delta.get("content")
        else:
            text = choice.get("text")
        if isinstance(text, str) and text:
            r.text.append(text)
        r.leg_events += 1
    return True


def chunk(r: Resumption, body: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps({
        "id": r.id, "object": "chat.completion.chunk" if r.chat else "text_completion",
        "created": r.created, "model": r.model, **body}) + b"\n\n"


# --- what may be resumed, and how ---------------------------------------------------------

def refusal(ex: Exchange, r: Resumption) -> tuple[str, str, str | None] | None:
    """(outcome, why, param) when this stream may not be resumed now."""
    payload = ex.payload or {}
    for name in ("n", "best_of"):
        value = payload.get(name)
        if isinstance(value, int) and value > 1:
            return "refused_n", f"it asked for {name}={value}", name
    logprobs = payload.get("logprobs")
    if (logprobs is not None and logprobs is not False) or payload.get("top_logprobs") \
            or payload.get("prompt_logprobs") is not None:
        return "refused_logprobs", "it asked for logprobs", "logprobs"
    if not ex.chat:
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str) or payload.get("echo"):
            return ("refused_prompt", "only a completion of one text prompt without echo "
                    "can be continued", "prompt")
    if r.tools:
        return "refused_tools", "a tool call was under way", None
    if ex.tenant is not None and not ex.tenant.resume_streams:
        return "refused_tenant", "resumption is off for this tenant", None
    policy = ex.cset.policy if ex.cset is not None else None
    limit = policy.resume_streams_max if policy is not None else 0
    if r.resumes >= limit:
        return "exhausted", f"it was resumed {r.resumes} time(s) already (limit {limit})", None
    if policy is not None and time.monotonic() > r.first_cut_at + policy.resume_deadline_s:
        return "exhausted", f"{policy.resume_deadline_s:g}s passed since its first cut", None
    return None


def next_body(ex: Exchange, r: Resumption) -> bytes | None:
    """The request for the next leg; None when the token budget is already spent."""
    body = dict(ex.payload or {})
    body["model"] = ex.model
    text = "".join(r.text)
    sent = r.sent_tokens
    if ex.chat:
        messages = list(body.get("messages") or [])
        last = messages[-1] if messages else None
        if body.get("continue_final_message") is True and isinstance(last, dict) \
                and isinstance(last.get("content"), str):
            messages[-1] = {**last, "content": last["content"] + text}
        else:
            messages.append({"role": "assistant", "content": text})
        body["messages"] = messages
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
        limits: tuple[str, ...] = ("max_completion_tokens", "max_tokens")
    else:
        prompt = body.get("prompt")
        body["prompt"] = (prompt[0] if isinstance(prompt, list) else str(prompt)) + text
        if not isinstance(body.get("max_tokens"), int):
            body["max_tokens"] = COMPLETION_DEFAULT_MAX_TOKENS
        limits = ("max_tokens",)
    for name in limits:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            if value - sent < 1:
                return None
            body[name] = value - sent
    min_tokens = body.get("min_tokens")
    if isinstance(min_tokens, int) and min_tokens > 0:
        body["min_tokens"] = max(0, min_tokens - sent)
    body["stream"] = True
    body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return orjson.dumps(body)


# --- the exchange's side --------------------------------------------------------------------

def tracks(ex: Exchange, conn: UpstreamConnection) -> bool:
    """Whether this answer is a stream the edge can resume: a 200 SSE body of open length."""
    return (ex.stream and ex.status == 200 and conn.content_length is None
            and conn.content_type.startswith(b"text/event-stream"))


def first_leg(ex: Exchange, data: bytes, end: bool) -> None:
    """The first leg's bytes when the fast path cannot pass them on as they are: an event
    split across reads, a possible error event, or the end of the answer."""
    r = ex.resumption
    assert r is not None
    whole, r.held = split_events(r.held + data)
    if whole:
        at, message = first_error(whole)
        if at >= 0:
            if at:
                keep(ex, r, whole[:at])
            stream_cut(ex, f"sent an error event: {message}")
            return
        keep(ex, r, whole)
    if not end:
        return
    if r.held or not (ex.prev_chunk + ex.last_chunk).rstrip().endswith(b"data: [DONE]"):
        stream_cut(ex, "ended before [DONE]")
        return
    r.kept = []
    ex.end_relay(b"")


def keep(ex: Exchange, r: Resumption, whole: bytes) -> None:
    r.kept.append(whole)
    ex.pass_on(whole)


def leg_head(ex: Exchange, conn: UpstreamConnection) -> bool:
    """A resumed leg's replica answered; False (and the next cut) unless it streams."""
    ex.head_at = conn.head_at
    status = conn.status
    if status != 200 or not conn.content_type.startswith(b"text/event-stream"):
        stream_cut(ex, f"answered {status} to the resumed request", replica_fault=status >= 500)
        return False
    ex.replica_answered()
    ex.edge.metrics.resumptions.inc(("resumed",))
    assert ex.resumption is not None
    ex.resumption.outcome = "resumed"
    ex.client.set_producer(conn)
    return True


def leg_data(ex: Exchange, data: bytes, end: bool) -> None:
    """A resumed leg's bytes: rewritten into the first leg's stream."""
    r = ex.resumption
    assert r is not None
    whole, r.held = split_events(r.held + data)
    out: list[bytes] = []
    error = ""
    for event in whole.split(b"\n\n"):
        payload = event_data(event)
        if not payload:
            continue
        if payload == b"[DONE]":
            r.leg_done = True
            continue
        try:
            document = orjson.loads(payload)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(document, dict):
            continue
        message = error_of(document)
        if message is not None:
            error = message
            break
        if not read(r, document) or not document.get("choices"):
            continue  # a repeated role chunk, or a usage chunk (the edge sends its own)
        document["id"], document["created"] = r.id, r.created
        document["model"] = r.model
        if "usage" in document:
            if r.continuous_usage:
                document["usage"] = r.usage(ex.prompt_tokens_est)
            else:
                del document["usage"]
        out.append(b"data: " + orjson.dumps(document) + b"\n\n")
    if out:
        ex.pass_on(b"".join(out))
    if error:
        stream_cut(ex, f"sent an error event: {error}")
    elif end:
        if r.leg_done and not r.held:
            finish(ex, r)
        else:
            stream_cut(ex, "ended before [DONE]")


def leg_failed(ex: Exchange, error: UpstreamError) -> None:
    """A stream's connection failed: a resumed leg's stale pooled connection is tried again
    on a fresh one (`Exchange.resend_if_stale`); anything else cuts the stream."""
    r = ex.resumption
    if r is not None and r.cut and ex.resend_if_stale(error):
        return
    stream_cut(ex, f"failed mid-response: {error}")


def stream_cut(ex: Exchange, reason: str, replica_fault: bool = True) -> None:
    """The stream's current leg is over without its end: resume it, or end it with an
    error event."""
    ex.drop_upstream()
    ex.client.set_producer(None)
    if replica_fault:
        ex.replica_failed(reason)
    ex.last_failure = reason
    r = ex.resumption
    assert r is not None
    if not r.cut:
        r.mark_cut()
        absorb(r, b"".join(r.kept))
        r.kept = []
    r.end_leg()
    if r.finished:
        finish(ex, r)  # the answer was whole; only its end was lost
        return
    refused = refusal(ex, r)
    if refused is not None:
        outcome, why, param = refused
        end_with_error(ex, outcome, f"The replica serving this stream failed ({reason}) and "
                       f"the stream cannot be resumed: {why}.", param)
        return
    body = next_body(ex, r)
    if body is None:
        finish(ex, r, "length")
        return
    r.resumes += 1
    policy = ex.cset.policy if ex.cset is not None else None
    ex.deadline = r.first_cut_at + (policy.resume_deadline_s if policy is not None else 0.0)
    r.leg_sent_at = time.perf_counter()
    ex.send_again(body, reason)
    if not ex.finished:
        arm_stall(ex)


def finish(ex: Exchange, r: Resumption, finish_reason: str = "") -> None:
    """End a resumed stream as the engine would have: (a finish chunk,) the usage chunk if
    the client asked for one, `[DONE]`."""
    out = b""
    if finish_reason:
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish_reason}
        if r.chat:
            choice["delta"] = {}
        else:
            choice["text"] = ""
        out += chunk(r, {"choices": [choice]})
    if r.include_usage:
        out += chunk(r, {"choices": [], "usage": r.usage(ex.prompt_tokens_est)})
    settle(ex, r)
    ex.end_relay(out + DONE_EVENT)


def end_with_error(ex: Exchange, outcome: str, message: str, param: str | None) -> None:
    """End the stream with an OpenAI-shaped error event (then the end of the body)."""
    ex.edge.metrics.resumptions.inc((outcome,))
    ex.code = "stream_interrupted"
    r = ex.resumption
    if r is not None:
        r.outcome = outcome
        if r.cut:
            settle(ex, r)
    error = ClientError(502, message, code="stream_interrupted", type_="server_error",
                        param=param)
    ex.client.end(b"data: " + error.body() + b"\n\n")
    ex.last_byte_at = time.perf_counter()
    ex.complete()


def settle(ex: Exchange, r: Resumption) -> None:
    usage = r.usage(ex.prompt_tokens_est)
    ex.prompt_tokens, ex.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
    ex.usage_reported = r.prompt_tokens >= 0 and r.leg_usage >= 0


# --- the stall timer: one per stream, rescheduled from the last byte ----------------------

def arm_stall(ex: Exchange) -> None:
    r = ex.resumption
    if r is not None and r.stall_timer is None and ex.cset is not None:
        r.stall_timer = asyncio.get_running_loop().call_later(
            ex.cset.policy.stream_stall_s, check_stall, ex)


def check_stall(ex: Exchange) -> None:
    r = ex.resumption
    if ex.finished or ex.cset is None or r is None:
        return
    r.stall_timer = None
    stall = ex.cset.policy.stream_stall_s
    idle = time.perf_counter() - max(ex.last_byte_at, r.leg_sent_at)
    if idle >= stall and ex.upstream is not None and not ex.client.writing_paused:
        ex.guarded(stream_cut, ex, f"stalled: nothing for {idle:.1f}s")
        return
    r.stall_timer = asyncio.get_running_loop().call_later(
        stall - idle if idle < stall else stall, check_stall, ex)
