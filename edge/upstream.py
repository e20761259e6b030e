"""Connections to replicas: pooled keep-alive HTTP/1.1 over httptools' response parser.

An exchange on a connection reports to a `Listener` by plain callbacks, from inside
`data_received`: `on_upstream_head` once the status line and headers are parsed, then
`on_upstream_data` once per read with the body bytes of that read (`end` on the last), or
`on_upstream_error` if the replica goes away, times out or sends garbage. Nothing is held
back between reads, which is what lets SSE pass through with no added delay, and no task or
future is involved, which is what keeps a proxied request cheap. A connection goes back to
the pool (`edge.upstream_pool`) only after a complete response; a failed or abandoned one is closed, which is also
how an engine learns to stop generating. While other exchanges are in flight, requests are
queued and sent once per loop pass (`edge.batch`), like the client side's responses.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from typing import TYPE_CHECKING, Protocol

import httptools

from edge.table import Origin

if TYPE_CHECKING:
    from edge.upstream_pool import UpstreamPool

HOP_BY_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te",
    b"trailer", b"transfer-encoding", b"upgrade", b"content-length", b"date", b"server",
})


class UpstreamError(Exception):
    """A replica that did not answer (connect error, reset, timeout, garbage)."""

    def __init__(self, message: str, *, received_any: bool = False, reused: bool = False,
                 timeout: bool = False) -> None:
        super().__init__(message)
        self.received_any = received_any  # some response byte arrived before the failure
        self.reused = reused  # it happened on a pooled keep-alive connection
        self.timeout = timeout


class Listener:
    """What an exchange on an upstream connection reports to."""

    def on_upstream_head(self, conn: UpstreamConnection) -> bool:
        """Status and headers are on `conn`; return False to drop the exchange (the
        listener then closes or aborts the connection itself)."""
        return True

    def on_upstream_data(self, data: bytes, end: bool) -> None: ...

    def on_upstream_error(self, error: UpstreamError) -> None: ...


class BodySource(Protocol):
    def pause(self) -> None: ...

    def resume(self) -> None: ...


class UpstreamConnection(asyncio.Protocol):
    def __init__(self, pool: UpstreamPool, origin: Origin) -> None:
        self.pool = pool
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self._out = b""  # a request queued for the end of the loop pass
        self.parser = httptools.HttpResponseParser(self)
        self.closed = False
        self.exchanges = 0
        self.idle_since = 0.0
        self.last_read = 0.0
        self.listener: Listener | None = None
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.content_type = b""
        self.content_length: int | None = None
        self.chunked = False
        self.body: list[bytes] = []
        self.headers_complete = False
        self.complete = False
        self.received_any = False
        self.keep_alive = True
        self.head_at = 0.0
        # What writes a streamed request body into this connection: paused while the
        # socket's send buffer is full (`pause_writing`), resumed once it drains.
        self.body_source: BodySource | None = None

    # --- driving an exchange ------------------------------------------------------------

    def begin(self, listener: Listener, request: bytes) -> None:
        """Write one request; `listener` hears about the response."""
        self.listener = listener
        self.status = 0
        self.headers = []
        self.content_type = b""
        self.content_length = None
        self.chunked = False
        self.body = []
        self.headers_complete = False
        self.complete = False
        self.received_any = False
        self.keep_alive = True
        self.exchanges += 1
        self.last_read = time.monotonic()
        self.pool.busy.add(self)
        if self.transport is None or self.closed:
            self._fail(UpstreamError("connection closed before the request was sent",
                                     reused=self.exchanges > 1))
            return
        if self._out:
            self._out += request
        elif len(self.pool.busy) < 2:
            self.transport.write(request)  # the only exchange in flight: nothing to wait for
        else:
            self._out = request
            self.pool.batch.add(self)

    def write(self, data: bytes) -> None:
        """More of the request `begin` started (a streamed body), after anything it queued."""
        if self.transport is None or self.closed:
            return
        if self._out:
            self._out += data
        else:
            self.transport.write(data)

    def flush(self) -> None:
        """Send the queued request (the end of the loop pass)."""
        out = self._out
        if out:
            self._out = b""
            if self.transport is not None and not self.closed:
                self.transport.write(out)

    @property
    def reusable(self) -> bool:
        return self.complete and self.keep_alive and not self.closed

    def pause_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        self.closed = True
        self.listener = None
        self._out = b""
        self.pool.busy.discard(self)
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closed = True
        self.listener = None
        self._out = b""
        self.pool.busy.discard(self)
        if self.transport is not None:
            self.transport.abort()

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = transport  # type: ignore[assignment]
        watch_peer(transport, self.pool.dead_peer_s)

    def pause_writing(self) -> None:
        if self.body_source is not None:
            self.body_source.pause()

    def resume_writing(self) -> None:
        if self.body_source is not None:
            self.body_source.resume()

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        self.last_read = time.monotonic()
        if self.listener is None:
            # Bytes with no exchange outstanding: the peer is confused; do not reuse.
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"malformed response from {self.origin.host_header!r}: "
                                     f"{exc}", received_any=True))
            self.abort()
            return
        listener = self.listener
        if listener is not None and self.headers_complete and (self.body or self.complete):
            body = self.body
            self.body = []
            if self.complete:
                self.listener = None
                self.pool.busy.discard(self)
            listener.on_upstream_data(body[0] if len(body) == 1 else b"".join(body),
                                      self.complete)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.transport = None
        self.pool.forget(self)
        if self.listener is None or self.complete:
            return
        if self.headers_complete and self.content_length is None and not self.chunked:
            # A body delimited by the end of the connection ends here, complete.
            self.keep_alive = False
            self.complete = True
            listener, self.listener = self.listener, None
            body = b"".join(self.body)
            self.body = []
            listener.on_upstream_data(body, True)
            return
        reason = f"{type(exc).__name__}: {exc}" if exc else "connection closed"
        if isinstance(exc, ssl.SSLError) and self.pool.tls is not None:
            # TLS 1.3: an engine refusing the edge's certificate says so after the
            # handshake, on the first read.
            self.pool._refuse("handshake", f"TLS with {self.origin.host_header.decode()} "
                              f"failed: {exc}")
        self._fail(UpstreamError(f"{self.origin.host_header.decode()} went away: {reason}",
                                 received_any=self.received_any, reused=self.exchanges > 1,
                                 timeout=isinstance(exc, TimeoutError)))

    def _fail(self, error: UpstreamError) -> None:
        self.pool.busy.discard(self)
        listener, self.listener = self.listener, None
        if listener is not None:
            listener.on_upstream_error(error)

    # --- httptools callbacks ------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        lname = name.lower()
        if lname == b"content-type":
            self.content_type = value
        elif lname == b"content-length":
            self.content_length = int(value) if value.isdigit() else None
        elif lname == b"transfer-encoding":
            self.chunked = b"chunked" in value.lower()
        self.headers.append((lname, value))

    def on_headers_complete(self) -> None:
        self.headers_complete = True
        self.head_at = time.perf_counter()
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        listener = self.listener
        if listener is not None and not listener.on_upstream_head(self):
            self.listener = None

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


def watch_peer(transport: asyncio.BaseTransport, dead_peer_s: float) -> None:
    """Have the kernel give up on a replica that went silent — a partition drops packets and
    sends no reset, so nothing else would end the connection before the read timeout.

    TCP keepalive probes start after dead_peer_s / 2 without a packet and TCP_USER_TIMEOUT
    closes the connection (ETIMEDOUT) once probes or sent bytes stay unacknowledged for
    dead_peer_s. A live engine's kernel acknowledges both however long it computes, so a slow
    answer is never taken for a dead peer. 0 turns this off; where the options do not exist
    (not Linux), nothing is set.
    """
    if dead_peer_s <= 0:
        return
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    idle = max(1, int(dead_peer_s / 2))
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", 1),
                        ("TCP_KEEPCNT", max(1, int(dead_peer_s) - idle)),
                        ("TCP_USER_TIMEOUT", int(dead_peer_s * 1000))):
        option = getattr(socket, name, None)
        if option is not None:
            options.append((socket.IPPROTO_TCP, option, value))
    try:
        for level, option, value in options:
            sock.setsockopt(level, option, value)
    except OSError:
        pass
