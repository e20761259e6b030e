"""The edge's HTTP/1.1 connections: an asyncio.Protocol over httptools' C parser.

Written for the hot path rather than taken from a framework: one parse per read, a response
head built from pre-encoded parts and sent with its body in a single write, and handlers
that may answer without a task. A handler is called as soon as a request is complete; it
either answers (now or later, from callbacks) and returns None, or returns a coroutine,
which runs as a task. Either way the connection moves on once the response is complete.

While more than one request is being answered, writes are queued per connection and sent
once per loop pass (`edge.batch`), so the responses produced by one pass of reads leave
together; a lone request's are written at once.

Keep-alive and pipelining (answered in order), chunked request bodies,
`Expect: 100-continue`, limits on head and body size (431, 413), write backpressure handed
to whatever produces the body (`set_producer`), and a close hook (`on_close`) through which a
handler learns that the client went away. A streamed body (`edge.http_messages.BodyStream`)
and the deadlines are described with the listener that enforces them (`edge.http_listener`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import httptools

from edge.http_messages import DATE, BodyStream, Producer, Request, status_line

if TYPE_CHECKING:
    from edge.http_listener import HttpServer

log = logging.getLogger("meridian.edge.http")

MAX_HEADER_BYTES = 64 * 1024
MAX_PIPELINED = 16
# After a 408 to a client still sending its body, how long the rest is read and dropped
# before the connection is closed (closing with unread bytes resets it, and the client could
# lose the answer).
LINGER_S = 2.0
# The methods clients send, as the strings a Request carries, so that a request's method is
# not decoded anew each time.
METHODS = {m.encode(): m for m in ("GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH")}
INTERNAL_ERROR = (b'{"error":{"message":"internal error","type":"server_error","param":null,'
                  b'"code":"internal_error"}}')


class HttpConnection(asyncio.Protocol):
    """One client connection. A handler answers through `respond` or `start`/`send`/`end`."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.handler = server.handler
        self.max_body = server.max_body
        self.batch = server.batch
        self.transport: asyncio.Transport | None = None
        self._out: list[bytes] = []  # queued writes, sent by `flush` at the end of the pass
        self.peer = ""
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._path = ""  # the URL's path and query, read once its head is in
        self._query = ""
        self._headers: dict[bytes, bytes] = {}
        self._header_bytes = 0  # bytes read of the current request's head
        self._in_body = False
        self._body: list[bytes] = []
        self._body_size = 0
        self._rejected = False
        self._linger = False  # closing after a 408 to a client still sending (`close`)
        self._stream: BodyStream | None = None  # the body of a streamed request, arriving
        self._pending: deque[Request] = deque()
        self._busy = False  # a request is being answered
        self._task: asyncio.Task[None] | None = None
        self._reading_paused = False
        self._writing_paused = False
        self._producer: Producer | None = None
        self.on_close: Callable[[], None] | None = None
        self.last_active = time.monotonic()
        self.request_begun_at = 0.0  # while a request is still arriving
        # State of the response being written.
        self._chunked = False
        self._close_after = False
        self.response_started = False
        self.response_done = False
        self.bytes_sent = 0

    # --- asyncio.Protocol ---------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = transport  # type: ignore[assignment]
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer or "")
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.server.busy.discard(self)
        self.transport = None
        self._out.clear()
        self._pending.clear()
        self._producer = None
        if self._task is not None and not self._task.done():
            self._task.cancel()
        on_close, self.on_close = self.on_close, None
        if on_close is not None and not self.response_done:
            on_close()

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if not self._in_body:
            self._header_bytes += len(data)
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, "protocol upgrades are not supported")
            return
        except httptools.HttpParserError as exc:
            if not self._rejected:
                self._reject(400, f"malformed HTTP request: {exc}")
            return
        # Checked per read rather than per header: a head still incomplete after this many
        # bytes is refused.
        if not self._in_body and self._header_bytes > MAX_HEADER_BYTES and not self._rejected:
            self._reject(431, "request head too large")

    def pause_writing(self) -> None:
        self._writing_paused = True
        if self._producer is not None:
            self._producer.pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._producer is not None:
            self._producer.resume_reading()

    # --- httptools callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        self.request_begun_at = time.monotonic()
        self._url = b""
        self._headers = {}
        self._body = []
        self._body_size = 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self._in_body = True
        if self._rejected:
            return
        # The path is read once here, for the streamed check and for the request itself.
        url = self._url
        qmark = url.find(b"?")
        if qmark < 0:
            self._path, self._query = url.decode("utf-8", "replace"), ""
        else:
            self._path = url[:qmark].decode("utf-8", "replace")
            self._query = url[qmark + 1:].decode("utf-8", "replace")
        streamed = self.server.streamed
        limit = self.max_body
        if streamed is not None and not self._busy and not self._pending \
                and streamed(self._path):
            limit = self.server.max_streamed_body
            self._stream = BodyStream(self)
        length = self._headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            self._stream = None
            self._reject(413, f"request body over {limit} bytes")
            return
        admit = self.server.admit_head
        if admit is not None:
            method = self._parser.get_method()
            refusal = admit(METHODS.get(method) or method.decode(), self._path, self._headers)
            if refusal is not None:
                self._stream = None
                self._reject(refusal[0], refusal[2], refusal[1])
                return
        expect = self._headers.get(b"expect")
        if expect is not None and expect.lower() == b"100-continue" and self.transport:
            self._write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if self._stream is not None:
            self._start(self._request(b"", self._stream))

    def on_body(self, body: bytes) -> None:
        if self._rejected:
            return
        stream = self._stream
        if stream is not None:
            if stream.received + len(body) > self.server.max_streamed_body:
                # The handler is already answering: the connection ends instead (its close
                # hook tells the handler, which drops what it forwarded).
                self._stream = None
                self._rejected = True
                log.warning("streamed request body over %d bytes; closing",
                            self.server.max_streamed_body)
                if self.transport is not None:
                    self.transport.abort()
                return
            stream.feed(body)
            return
        self._body_size += len(body)
        if self._body_size > self.max_body:
            self._reject(413, f"request body over {self.max_body} bytes")
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self.request_begun_at = 0.0
        self._in_body = False
        self._header_bytes = 0
        if self._rejected:
            return
        stream = self._stream
        if stream is not None:
            self._stream = None
            stream.end()
            if stream.dropping:  # its answer has been sent: now the connection can end
                self.close()
            return
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        request = self._request(body, None)
        if not self._busy:
            self._start(request)
        else:
            self._pending.append(request)
            if len(self._pending) >= MAX_PIPELINED and self.transport and not self._reading_paused:
                self._reading_paused = True
                self.transport.pause_reading()

    def _request(self, body: bytes, stream: BodyStream | None) -> Request:
        parser = self._parser
        method = parser.get_method()
        return Request(
            METHODS.get(method) or method.decode(), self._path, self._query, self._headers,
            body, parser.should_keep_alive(), time.perf_counter(), self.peer, stream,
        )

    # --- request dispatch ---------------------------------------------------------------

    def _reset_response(self, close_after: bool) -> None:
        self._chunked = False
        self._close_after = close_after
        self.response_started = False
        self.response_done = False
        self.bytes_sent = 0
        self.on_close = None

    def _start(self, request: Request) -> None:
        self._busy = True
        self.server.busy.add(self)
        self._reset_response(not request.keep_alive)
        try:
            pending = self.handler(request, self)
        except Exception:  # noqa: BLE001 - one bad request must not take the connection down
            log.exception("unhandled error answering %s %s", request.method, request.path)
            self._internal_error()
            return
        if pending is not None:
            self._task = asyncio.get_running_loop().create_task(self._run(pending, request))

    async def _run(self, pending: Coroutine[Any, Any, None], request: Request) -> None:
        try:
            await pending
        except asyncio.CancelledError:
            return
        except Exception:  # noqa: BLE001 - one bad request must not take the connection down
            log.exception("unhandled error answering %s %s", request.method, request.path)
            self._internal_error()
            return
        finally:
            self._task = None
        if not self.response_done and self.on_close is None:
            # The handler returned without answering and without a pending answer.
            self._internal_error()

    def _internal_error(self) -> None:
        if not self.response_started:
            self.respond(500, INTERNAL_ERROR)
        else:
            self.abort()

    def _finished(self) -> None:
        """The response is complete: close, or go on to the next pipelined request."""
        self.response_done = True
        self.on_close = None
        self._busy = False
        self.server.busy.discard(self)
        stream = self._stream
        if stream is not None and not self.server.closing:
            # Answered before its streamed body was read to the end (a refusal): the rest
            # is read and thrown away, and the connection ends once it is in (closing with
            # unread bytes would reset it, and the client could lose the answer). The
            # idle sweep ends it sooner if the rest does not come within the request
            # timeout.
            stream.drop_rest()
            self._close_after = True
            return
        self._stream = None
        if self._close_after or self.server.closing:
            self.close()
            return
        if self._pending:
            # Later, not from inside whatever callback finished this response.
            asyncio.get_running_loop().call_soon(self._next)

    def _next(self) -> None:
        if self._busy or not self._pending or self.transport is None:
            return
        self._start(self._pending.popleft())
        if self._reading_paused and len(self._pending) < MAX_PIPELINED // 2 and self.transport:
            self._reading_paused = False
            self.transport.resume_reading()

    def _reject(self, status: int, message: str, code: str = "") -> None:
        """Answer a request we will not read to the end, then close."""
        self._rejected = True
        if self.transport is None:
            return
        code = code or {413: "request_too_large", 431: "headers_too_large"}.get(
            status, "bad_request")
        body = (b'{"error":{"message":"%s","type":"invalid_request_error","param":null,'
                b'"code":"%s"}}' % (message.encode().replace(b'"', b"'"), code.encode()))
        if not self._busy:
            self._reset_response(close_after=True)
            self.respond(status, body)
        else:
            # A response is already being written on this connection; it cannot be
            # interleaved, so the connection ends after it.
            self._close_after = True
            self._pending.clear()

    def request_late(self, timeout_s: float) -> None:
        """A request (not streamed) still arriving after `timeout_s`: one whose body is
        arriving gets a 408 naming the limit; one whose head is not in yet is closed, as is
        a connection throwing away the rest of a body it has already answered."""
        if self._in_body and self._stream is None and not self._rejected:
            self._linger = True
            self._reject(408, f"request body not received within {timeout_s:g} s",
                         "request_timeout")
        else:
            self.close()

    def streamed_body_late(self, now: float, grace_s: float, min_rate: int) -> bool:
        """Whether a streamed body is still being answered and arriving too slowly."""
        stream = self._stream
        return (stream is not None and self._busy and 0 < self.request_begun_at
                and stream.late(now, self.request_begun_at, grace_s, min_rate))

    def end_late_body(self, grace_s: float, min_rate: int) -> None:
        """A streamed body arriving too slowly: its handler is told (as if the client had
        gone: it drops what it was forwarding), the client gets a 408 naming the limit where
        no answer has begun, and the connection ends."""
        stream, self._stream = self._stream, None
        received = stream.received if stream is not None else 0
        self._rejected = True  # whatever still arrives of it is ignored
        log.warning("streamed request body from %s too slow (%d bytes); closing", self.peer,
                    received)
        on_close, self.on_close = self.on_close, None
        if on_close is not None:
            on_close()
        if self.response_started or self.transport is None:
            self.abort()
            return
        self._close_after = True
        self._linger = True
        self._pending.clear()
        message = (f"request body arrived slower than {min_rate} bytes/s after its first "
                   f"{grace_s:g} s ({received} bytes received)")
        self.respond(408, b'{"error":{"message":"%s","type":"invalid_request_error",'
                          b'"param":null,"code":"request_timeout"}}' % message.encode())

    # --- writing a response -------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        out = self._out
        if not out:
            if len(self.server.busy) < 2 and self.transport is not None:
                # Nothing else is being answered: no other write to wait for.
                self.transport.write(data)
                return
            self.batch.add(self)
        out.append(data)

    def flush(self) -> None:
        """Send what this pass queued, in one write."""
        out = self._out
        if not out:
            return
        self._out = []
        if self.transport is not None:
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def _head(self, status: int, headers: bytes, length: int | None) -> bytes:
        if self._stream is not None:
            # The request's body is still arriving: after this answer the rest is thrown
            # away and the connection ends, which the client is told.
            self._close_after = True
        if length is not None:
            framing = b"content-length: %d\r\n" % length
        elif self._close_after:
            framing = b""
        else:
            self._chunked = True
            framing = b"transfer-encoding: chunked\r\n"
        if self._close_after:
            framing += b"connection: close\r\n"
        return b"".join((status_line(status), DATE.get(), headers, framing, b"\r\n"))

    def respond(self, status: int, body: bytes, headers: bytes = b"",
                content_type: bytes | None = b"application/json") -> None:
        """A whole response in one write. `headers`: pre-encoded `name: value\\r\\n` lines,
        which carry the content type themselves when `content_type` is None."""
        if self.response_started:
            return
        self.response_started = True
        if self.transport is not None:
            if content_type is not None:
                headers = b"content-type: " + content_type + b"\r\n" + headers
            self._write(self._head(status, headers, len(body)) + body)
            self.bytes_sent += len(body)
        self._finished()

    def start(self, status: int, headers: bytes, first: bytes = b"",
              length: int | None = None) -> None:
        """Send the head (and optionally the first body bytes) of a streamed response."""
        self.response_started = True
        if self.transport is None:
            return
        head = self._head(status, headers, length)
        if first:
            head += self._frame(first)
            self.bytes_sent += len(first)
        self._write(head)

    def _frame(self, data: bytes) -> bytes:
        if self._chunked:
            return b"%x\r\n%b\r\n" % (len(data), data)
        return data

    def send(self, data: bytes) -> None:
        if data and self.transport is not None:
            self._write(self._frame(data))
            self.bytes_sent += len(data)

    def end(self, last: bytes = b"") -> None:
        """Finish a streamed response (with optional last body bytes) in one write."""
        if self.transport is not None:
            out = self._frame(last) if last else b""
            if self._chunked:
                out += b"0\r\n\r\n"
            if out:
                self._write(out)
            self.bytes_sent += len(last)
        self._finished()

    def set_producer(self, producer: Producer | None) -> None:
        self._producer = producer
        if producer is not None and self._writing_paused:
            producer.pause_reading()

    def close(self) -> None:
        transport = self.transport
        if transport is not None:
            self.flush()
            if self._linger and transport.can_write_eof():
                # The answer ends with our half of the connection; what the client still
                # sends is dropped (`_rejected`) until it closes, or for LINGER_S at most.
                transport.write_eof()
                transport.resume_reading()
                asyncio.get_running_loop().call_later(LINGER_S, transport.close)
            else:
                transport.close()

    def abort(self) -> None:
        """Cut the connection: the way to tell a client its response is incomplete."""
        self.response_done = True
        self.on_close = None
        self._busy = False
        self.server.busy.discard(self)
        if self.transport is not None:
            self.flush()  # what was written before the cut goes out, as it would have
            self.transport.abort()

    @property
    def writing_paused(self) -> bool:
        """The client's socket buffer is full (its reader is behind)."""
        return self._writing_paused

    @property
    def idle(self) -> bool:
        return not self._busy
