"""Reading a replica's answer: the head the client gets, and the tokens it used.

The usage the engine reports is kept on the request (`record_usage`); for a stream without
a usage chunk the tokens are estimated from its events.
"""

from __future__ import annotations

from edge.state import RequestState
from edge.upstream import HOP_BY_HOP, UpstreamConnection
from edge.usage import parsed_usage, reported_usage


def response_headers(ex: RequestState, conn: UpstreamConnection) -> bytes:
    """The replica's headers less the hop-by-hop ones, with the request id and replica."""
    # Pieces joined once: concatenating each header line would make two objects a line.
    parts: list[bytes] = []
    for name, value in conn.headers:
        if name not in HOP_BY_HOP and name != b"x-request-id":
            parts.append(name)
            parts.append(b": ")
            parts.append(value)
            parts.append(b"\r\n")
    assert ex.replica is not None
    parts.append(b"x-request-id: ")
    parts.append(ex.request_id)
    parts.append(b"\r\nx-meridian-replica: ")
    parts.append(ex.replica.id.encode())
    parts.append(b"\r\n")
    return b"".join(parts)


def record_usage(ex: RequestState, usage: tuple[int, int] | None) -> bool:
    """Keep the (prompt, completion) tokens the engine reported, when it did."""
    if usage is None:
        return False
    ex.prompt_tokens, ex.completion_tokens = usage
    ex.usage_reported = True
    return True


def usage_from_answer(ex: RequestState, answer: bytes) -> None:
    """Usage from a whole JSON answer received in one read."""
    record_usage(ex, reported_usage(answer) or parsed_usage(answer))


def usage_from_tail(ex: RequestState, tail: bytes) -> None:
    """Usage from the end of an answer (`reported_usage`), or for a stream without a usage
    chunk an estimate from its events."""
    if record_usage(ex, reported_usage(tail)):
        return
    if ex.events:
        # No usage chunk (the client did not ask for one): one event per token, less the
        # role, finish and [DONE] events, is vLLM's streaming shape.
        ex.prompt_tokens = ex.prompt_tokens_est
        ex.completion_tokens = max(0, ex.events - (3 if ex.chat else 2))
