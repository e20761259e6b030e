"""OpenAI's Files and Batches endpoints at the edge's public address, forwarded to the
control plane.

The edge keeps no batch state: `/v1/files…` and `/v1/batches…`, every method, go to the
control plane it pulls its tables from (`EdgeConfig.control_plane`) with the caller's
Authorization header, which the control plane checks. Bodies stream through both ways: an
upload is handed on as it arrives (`edge.httpserver.BodyStream`, with the client's reads
paused while the control plane's socket is full), and a file's content is relayed read by
read. The control plane's answers, its errors included, pass through unchanged. A control
plane that cannot be reached is a 503, one that fails before answering a 502, both in
OpenAI's error shape and naming it; one that fails mid-answer cuts the client's connection.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from edge.errors import ClientError
from edge.httpserver import HttpConnection, Request
from edge.table import Origin, parse_origin
from edge.upstream import HOP_BY_HOP, Listener, UpstreamConnection, UpstreamError

if TYPE_CHECKING:
    from edge.server import Edge

log = logging.getLogger("meridian.edge.batch_forward")

PREFIXES = ("/v1/files", "/v1/batches")
PREFIXES_DIR = ("/v1/files/", "/v1/batches/")
FORWARDED_HEADERS = (b"authorization", b"content-type", b"accept", b"x-request-id",
                     b"idempotency-key", b"user-agent")


def forwarded(path: str) -> bool:
    """Whether a path belongs to the Files and Batches API (and goes to the control plane)."""
    # Asked of every request's path (the server's streamed check): no string is built.
    return path.startswith(PREFIXES_DIR) or path in PREFIXES


def control_plane_error(status: int, code: str, message: str) -> ClientError:
    return ClientError(status, message, code=code, type_="server_error",
                       retry_after_s=1 if status == 503 else None)


class ControlPlaneForward(Listener):
    """One request on its way to the control plane, and its answer on the way back."""

    def __init__(self, edge: Edge, origin: Origin, base_url: str, request: Request,
                 client: HttpConnection) -> None:
        self.edge = edge
        self.origin = origin
        self.base_url = base_url
        self.request = request
        self.client = client
        self.upstream: UpstreamConnection | None = None
        self.chunked_body = False
        self.body_sent = request.stream is None
        self.done = False

    def head(self) -> bytes:
        request = self.request
        target = self.origin.base_path + request.path.encode()
        if request.query:
            target += b"?" + request.query.encode()
        lines = [b"%s %s HTTP/1.1\r\nhost: %s\r\n" % (request.method.encode(), target,
                                                        self.origin.host_header)]
        for name in FORWARDED_HEADERS:
            value = request.headers.get(name)
            if value is not None:
                lines.append(b"%s: %s\r\n" % (name, value))
        peer = request.peer.rpartition(":")[0]
        if peer:
            lines.append(b"x-forwarded-for: %s\r\n" % peer.encode())
        if request.stream is None:
            lines.append(b"content-length: %d\r\n" % len(request.body))
        else:
            length = request.headers.get(b"content-length")
            if length is not None and length.isdigit():
                lines.append(b"content-length: %s\r\n" % length)
            elif b"chunked" in request.headers.get(b"transfer-encoding", b"").lower():
                self.chunked_body = True
                lines.append(b"transfer-encoding: chunked\r\n")
            else:  # neither: HTTP/1.1 says there is no body
                lines.append(b"content-length: 0\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    async def run(self) -> None:
        self.client.on_close = self.cancel
        try:
            upstream = await self.edge.pool.connect(self.origin)
        except UpstreamError as exc:
            self.fail(control_plane_error(
                503, "control_plane_unreachable",
                f"The control plane at {self.base_url} cannot be reached: {exc}"))
            return
        if self.done:  # the client went away meanwhile
            upstream.close()
            return
        self.upstream = upstream
        stream = self.request.stream
        if stream is None:
            upstream.begin(self, self.head() + self.request.body)
            return
        upstream.begin(self, self.head())
        upstream.body_source = stream
        stream.consume(self.body_data, self.body_end)

    # --- the request body, as it arrives ------------------------------------------------

    def body_data(self, data: bytes) -> None:
        upstream = self.upstream
        if upstream is None or not data:
            return
        upstream.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked_body else data)

    def body_end(self) -> None:
        self.body_sent = True
        if self.upstream is not None and self.chunked_body:
            self.upstream.write(b"0\r\n\r\n")

    # --- the control plane's answer -----------------------------------------------------

    def on_upstream_head(self, conn: UpstreamConnection) -> bool:
        headers = b"".join([b"%s: %s\r\n" % (name, value) for name, value in conn.headers
                            if name not in HOP_BY_HOP])
        length = None if conn.chunked else conn.content_length
        self.client.start(conn.status, headers, length=length)
        self.client.set_producer(conn)
        return True

    def on_upstream_data(self, data: bytes, end: bool) -> None:
        if self.done:
            return
        self.client.send(data)
        if end:
            self.done = True
            self.client.set_producer(None)
            upstream, self.upstream = self.upstream, None
            if upstream is not None:
                upstream.body_source = None
                if self.body_sent:
                    self.edge.pool.release(upstream)
                else:  # answered before the whole body was sent: the rest cannot follow
                    upstream.close()
            self.client.end()

    def on_upstream_error(self, error: UpstreamError) -> None:
        if self.done:
            return
        log.warning("control plane %s failed %s %s: %s", self.base_url, self.request.method,
                    self.request.path, error)
        if self.client.response_started:
            self.done = True
            self.drop_upstream()
            self.client.abort()
            return
        self.fail(control_plane_error(
            502, "control_plane_failed",
            f"The control plane at {self.base_url} did not answer {self.request.method} "
            f"{self.request.path}: {error}"))

    # --- endings ------------------------------------------------------------------------

    def fail(self, error: ClientError) -> None:
        self.done = True
        self.drop_upstream()
        self.client.respond(error.status, error.body(), error.headers())

    def cancel(self) -> None:
        """The client went away: drop the forwarded request."""
        self.done = True
        self.drop_upstream()

    def drop_upstream(self) -> None:
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            upstream.body_source = None
            upstream.abort()


class BatchApi:
    """Answers the Files and Batches paths for one edge."""

    def __init__(self, edge: Edge) -> None:
        self.edge = edge
        base = edge.config.control_plane
        self.base_url = base.rstrip("/") if base else ""
        self.origin = parse_origin(base, "--control-plane") if base else None

    def handle(self, request: Request, conn: HttpConnection) -> ControlPlaneForward | None:
        """The forward to run (as a task), or None when it has already been answered."""
        if self.origin is None:
            error = control_plane_error(
                503, "control_plane_not_configured",
                "This edge forwards the Files and Batches API to its control plane, and none "
                "is configured (--control-plane).")
            conn.respond(error.status, error.body(), error.headers())
            return None
        return ControlPlaneForward(self.edge, self.origin, self.base_url, request, conn)
