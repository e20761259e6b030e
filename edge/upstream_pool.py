"""The pool of keep-alive connections to replicas (`edge.upstream.UpstreamConnection`).

Idle connections are kept per origin and reused most-recent first, up to
`max_idle_per_origin` and for `idle_ttl_s`; a sweeper closes stale ones and times out busy
ones that sent nothing for `read_timeout_s`. `fetch` makes a whole request and response, for
the health probes and the table pull.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable

from edge.batch import WriteBatch
from edge.metrics import Counter
from edge.table import Origin
from edge.upstream import Listener, UpstreamConnection, UpstreamError
from edge.upstream_tls import UpstreamTLS, peer_serial


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
