"""What the edge's HTTP server hands a handler and writes first: `Request`, `BodyStream`,
status lines and the `Date:` header.

Requests whose path the server's `streamed` predicate accepts (file uploads forwarded to the
control plane) are handed to the handler as soon as their head is read, with a `BodyStream`
in place of the body: its bytes go to the handler as they arrive, up to `max_streamed_body`,
and the client's reads pause while the handler says it cannot take more.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from edge.httpserver import HttpConnection


def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b"Unknown"


_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        line = _STATUS_LINES[status] = b"HTTP/1.1 %d %s\r\n" % (status, _reason(status))
    return line


class _DateCache:
    """`Date:` header bytes, rebuilt once a second."""

    __slots__ = ("second", "header")

    def __init__(self) -> None:
        self.second = -1
        self.header = b""

    def get(self) -> bytes:
        now = time.time()
        second = int(now)
        if second != self.second:
            self.second = second
            self.header = b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
        return self.header


DATE = _DateCache()


class BodyStream:
    """A request body still arriving. The consumer gets each piece (`on_data`) and the end
    (`on_end`); pieces that arrive before there is one are kept for it. `pause`/`resume`
    stop and restart reading the client's socket (backpressure from a slower destination)."""

    __slots__ = ("_conn", "_held", "_ended", "_on_data", "_on_end", "received", "dropping",
                 "paused_at", "paused_s")

    def __init__(self, conn: HttpConnection) -> None:
        self._conn = conn
        self._held: list[bytes] = []
        self._ended = False
        self._on_data: Callable[[bytes], None] | None = None
        self._on_end: Callable[[], None] | None = None
        self.received = 0
        self.dropping = False  # answered already: the rest is read and thrown away
        # Time spent paused by the destination's backpressure is not the client's: it does
        # not count against the body's deadline (`late`).
        self.paused_at = 0.0
        self.paused_s = 0.0

    def consume(self, on_data: Callable[[bytes], None], on_end: Callable[[], None]) -> None:
        self._on_data = on_data
        self._on_end = on_end
        held, self._held = self._held, []
        for piece in held:
            on_data(piece)
        if self._ended:
            on_end()

    def drop_rest(self) -> None:
        self.dropping = True
        self._held = []
        self._on_data = self._on_end = None
        self.resume()

    def feed(self, data: bytes) -> None:
        self.received += len(data)
        if self.dropping:
            return
        if self._on_data is None:
            self._held.append(data)
        else:
            self._on_data(data)

    def end(self) -> None:
        self._ended = True
        if self._on_end is not None:
            self._on_end()

    @property
    def ended(self) -> bool:
        return self._ended

    def pause(self) -> None:
        transport = self._conn.transport
        if transport is not None and not self._ended:
            if not self.paused_at:
                self.paused_at = time.monotonic()
            transport.pause_reading()

    def resume(self) -> None:
        if self.paused_at:
            self.paused_s += time.monotonic() - self.paused_at
            self.paused_at = 0.0
        transport = self._conn.transport
        if transport is not None:
            transport.resume_reading()

    def late(self, now: float, begun_at: float, grace_s: float, min_rate: int) -> bool:
        """Whether the client is sending this body too slowly: after `grace_s`, it must have
        averaged at least `min_rate` bytes a second (time paused by backpressure excluded).
        A slow-loris trickle is cut after the grace; a steady upload of any size is not."""
        if self._ended or self.dropping or min_rate <= 0:
            return False
        paused = self.paused_s + (now - self.paused_at if self.paused_at else 0.0)
        return now - begun_at - paused > grace_s + self.received / min_rate


class Request:
    __slots__ = ("method", "path", "query", "headers", "body", "keep_alive", "received_at",
                 "peer", "stream")

    def __init__(self, method: str, path: str, query: str, headers: dict[bytes, bytes],
                 body: bytes, keep_alive: bool, received_at: float, peer: str,
                 stream: BodyStream | None = None) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers  # lower-cased names; a repeated header keeps its last value
        self.body = body
        self.keep_alive = keep_alive
        self.received_at = received_at  # perf_counter() when the last body byte arrived
        self.peer = peer
        self.stream = stream  # the body as it arrives, for a streamed path (body is b"")


class Producer(Protocol):
    """Something whose reading can be paused while the client's socket buffer is full."""

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...
