"""Connections to replicas: pooled keep-alive HTTP/1.1 over httptools' response parser.

An exchange on a connection reports to a `Listener` by plain callbacks, from inside
`data_received`: `on_upstream_head` once the status line and headers are parsed, then
`on_upstream_data` once per read with the body bytes of that read (`end` on the last), or
`on_upstream_error` if the replica goes away, times out or sends garbage. Nothing is held
back between reads, which is what lets SSE pass through with no added delay, and no task or
future is involved, which is what keeps a proxied request cheap. A connection goes back to
the pool only after a complete response; a failed or abandoned one is closed, which is also
how an engine learns to stop generating. While other exchanges are in flight, requests are
queued and sent once per loop pass (`edge.batch`), like the client side's responses.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Callable
from typing import Protocol

import httptools

from edge.batch import WriteBatch
from edge.metrics import Counter
from edge.table import Origin
from edge.upstream_tls import UpstreamTLS, peer_serial

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


class UpstreamPool:
    """Keep-alive connections per origin; idle ones are reused most-recent first."""

    def __init__(self, connect_timeout_s: float = 3.0, read_timeout_s: float = 600.0,
                 max_idle_per_origin: int = 256, idle_ttl_s: float = 30.0,
                 dead_peer_s: float = 5.0, tls: UpstreamTLS | None = None,
                 tls_failures: Counter | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        # mTLS to replicas (edge.upstream_tls): every origin must be https and the edge's
        # client certificate must be usable; None (tests and a lab without a CA only):
        # http:// origins are plain and https:// ones verified against the system's store.
        self.tls = tls
        self.tls_failures = tls_failures
        # Serials of revoked certificates, from the routing table.
        self.revoked: frozenset[str] = frozenset()
        # Origins that are not replicas (the control plane the edge pulls from and forwards
        # batches to): the mTLS rule is for engines; these keep their own scheme.
        self.exempt: frozenset[tuple[str, str, int]] = frozenset()
        self.dead_peer_s = dead_peer_s
        self.read_timeout_s = read_timeout_s
        self.max_idle_per_origin = max_idle_per_origin
        self.idle_ttl_s = idle_ttl_s
        self._idle: dict[tuple[str, str, int], list[UpstreamConnection]] = {}
        self.busy: set[UpstreamConnection] = set()
        self.batch = WriteBatch()
        self._ssl: ssl.SSLContext | None = None
        self._sweeper: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    def take(self, origin: Origin) -> UpstreamConnection | None:
        idle = self._idle.get(origin.key)
        if not idle:
            return None
        cutoff = time.monotonic() - self.idle_ttl_s
        while idle:
            conn = idle.pop()
            if not conn.closed and conn.idle_since >= cutoff:
                return conn
            conn.close()
        return None

    def _refuse(self, reason: str, message: str) -> UpstreamError:
        """A TLS refusal: counted, logged (edge.upstream_tls), never a plain-HTTP retry."""
        if self.tls_failures is not None:
            self.tls_failures.inc((reason,))
        if self.tls is not None:
            self.tls.note(reason, message)
        return UpstreamError(message)

    def _ssl_for(self, origin: Origin) -> ssl.SSLContext | None:
        tls = self.tls
        if tls is not None and origin.key not in self.exempt:
            if origin.scheme != "https":
                raise self._refuse("plain_http", f"refusing plain HTTP to "
                                   f"{origin.host_header.decode()}: this edge speaks only "
                                   "mTLS to replicas")
            problem = tls.own_problem(self.revoked)
            if problem is not None:
                raise self._refuse(problem[0], problem[1])
            return tls.context()
        if origin.scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            return self._ssl
        return None

    async def connect(self, origin: Origin) -> UpstreamConnection:
        ssl_context = self._ssl_for(origin)
        loop = asyncio.get_running_loop()
        try:
            transport, protocol = await asyncio.wait_for(
                loop.create_connection(
                    lambda: UpstreamConnection(self, origin), origin.host, origin.port,
                    ssl=ssl_context,
                    server_hostname=origin.server_name if ssl_context else None,
                ),
                self.connect_timeout_s,
            )
        except ssl.SSLError as tls_error:
            # SSLCertVerificationError is an OSError too: caught here first.
            if self.tls is None or origin.key in self.exempt:
                raise UpstreamError(f"cannot connect to {origin.host_header.decode()}: "
                                    f"{tls_error}") from None
            raise self._refuse("handshake", f"TLS handshake with "
                               f"{origin.host_header.decode()} failed: {tls_error}") from None
        except OSError as exc:
            if (ssl_context is not None and self.tls is not None
                    and not isinstance(exc, (TimeoutError, ConnectionRefusedError))):
                # The TCP connection was made; the replica dropped it in the handshake,
                # which is how an engine refuses a client certificate it does not trust.
                raise self._refuse("handshake", f"TLS handshake with "
                                   f"{origin.host_header.decode()} failed: the replica closed "
                                   f"the connection ({type(exc).__name__} {exc}): it refused "
                                   "this edge's certificate, or it is going away") from None
            # TimeoutError is an OSError too.
            kind = "timed out" if isinstance(exc, TimeoutError) else str(exc)
            raise UpstreamError(f"cannot connect to {origin.host_header.decode()}: {kind}",
                                timeout=isinstance(exc, TimeoutError)) from None
        if self.tls is not None and self.revoked and origin.key not in self.exempt:
            serial = peer_serial(transport.get_extra_info("ssl_object"))
            if serial in self.revoked:
                protocol.abort()
                raise self._refuse("replica_revoked", f"{origin.host_header.decode()} "
                                   f"presented a revoked certificate (serial {serial})")
        return protocol

    def release(self, conn: UpstreamConnection) -> None:
        """Return a connection after a complete response, or close it."""
        self.busy.discard(conn)
        conn.listener = None
        if not conn.reusable:
            conn.close()
            return
        idle = self._idle.get(conn.origin.key)
        if idle is None:
            idle = self._idle[conn.origin.key] = []
        if len(idle) >= self.max_idle_per_origin:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def forget(self, conn: UpstreamConnection) -> None:
        self.busy.discard(conn)
        idle = self._idle.get(conn.origin.key)
        if idle and conn in idle:
            idle.remove(conn)

    def close_origins(self, keep: Callable[[tuple[str, str, int]], bool]) -> None:
        """Close idle connections to origins that `keep` rejects (they left the table)."""
        for key in [k for k in self._idle if not keep(k)]:
            for conn in self._idle.pop(key):
                conn.close()

    async def _sweep(self) -> None:
        # One periodic check instead of a timer per request: a replica that stops sending
        # bytes for read_timeout_s fails the request.
        while True:
            await asyncio.sleep(1.0)
            cutoff = time.monotonic() - self.read_timeout_s
            for conn in [c for c in self.busy if c.last_read < cutoff]:
                conn._fail(UpstreamError(
                    f"{conn.origin.host_header.decode()} sent nothing for "
                    f"{self.read_timeout_s:.0f}s", received_any=conn.received_any, timeout=True))
                conn.abort()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
        for conn in list(self.busy):
            conn.abort()

    async def fetch(self, origin: Origin, method: str, path: str, timeout_s: float,
                    headers: bytes = b"", body: bytes = b""
                    ) -> tuple[int, dict[bytes, bytes], bytes]:
        """A whole request and response, for probes and the table pull (not the hot path)."""
        request = b"%s %s%s HTTP/1.1\r\nhost: %s\r\n%scontent-length: %d\r\n\r\n%s" % (
            method.encode(), origin.base_path, path.encode(), origin.host_header, headers,
            len(body), body)

        async def exchange() -> tuple[int, dict[bytes, bytes], bytes]:
            for attempt in range(2):
                conn = self.take(origin) or await self.connect(origin)
                collector = _Collector()
                conn.begin(collector, request)
                try:
                    response = await collector.done
                except UpstreamError as exc:
                    conn.abort()
                    # A pooled connection the peer had already closed: try a fresh one.
                    if exc.reused and not exc.received_any and attempt == 0:
                        continue
                    raise
                except BaseException:
                    conn.abort()
                    raise
                self.release(conn)
                return conn.status, dict(conn.headers), response
            raise AssertionError("unreachable")

        try:
            return await asyncio.wait_for(exchange(), timeout_s)
        except TimeoutError:
            raise UpstreamError(f"{origin.host_header.decode()} did not answer {path} within "
                                f"{timeout_s}s", timeout=True) from None


class _Collector(Listener):
    """Gathers a whole response into a future (for `UpstreamPool.fetch`)."""

    def __init__(self) -> None:
        self.done: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        self.parts: list[bytes] = []

    def on_upstream_data(self, data: bytes, end: bool) -> None:
        self.parts.append(data)
        if end and not self.done.done():
            self.done.set_result(b"".join(self.parts))

    def on_upstream_error(self, error: UpstreamError) -> None:
        if not self.done.done():
            self.done.set_exception(error)
