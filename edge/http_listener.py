"""The edge's HTTP listener: `HttpServer` accepts connections (`edge.httpserver`) and
calls its handler for each request.

Deadlines: a request must arrive whole within `request_timeout_s` (a body still trickling in
then gets a 408 naming the limit; a head, a plain close), and a streamed body, past that
grace, must average `min_streamed_rate` bytes a second or its handler is told to drop it and
the client gets a 408, so a slow-loris upload frees its connection (and the control plane's
worker behind it) within seconds of the grace. Keep-alive connections idle for
`idle_timeout_s` are closed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from ssl import SSLContext
from typing import Any

from edge.batch import WriteBatch
from edge.http_messages import Request
from edge.httpserver import HttpConnection

Handler = Callable[[Request, HttpConnection], Coroutine[Any, Any, None] | None]
AdmitHead = Callable[[str, str, dict[bytes, bytes]], tuple[int, str, str] | None]


class HttpServer:
    """Listens on one address and calls `handler` for each request."""

    def __init__(self, handler: Handler, max_body: int = 8 * 1024 * 1024,
                 idle_timeout_s: float = 75.0, request_timeout_s: float = 30.0,
                 streamed: Callable[[str], bool] | None = None,
                 max_streamed_body: int = 0, admit_head: AdmitHead | None = None,
                 min_streamed_rate: int = 0) -> None:
        self.handler = handler
        self.max_body = max_body
        # Called with (method, path, headers) once a head is read, before its body: a
        # (status, code, message) refuses the request unread (the admin API's auth check).
        self.admit_head = admit_head
        # Paths whose bodies are handed over as they arrive, up to max_streamed_body bytes,
        # at least min_streamed_rate bytes a second once request_timeout_s has passed.
        self.streamed = streamed
        self.max_streamed_body = max_streamed_body
        self.min_streamed_rate = min_streamed_rate
        self.idle_timeout_s = idle_timeout_s
        self.request_timeout_s = request_timeout_s
        self.connections: set[HttpConnection] = set()
        self.busy: set[HttpConnection] = set()  # answering a request
        self.batch = WriteBatch()
        self.closing = False
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def listen(self, host: str, port: int, ssl: SSLContext | None = None,
                     backlog: int = 1024) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: HttpConnection(self), host, port, ssl=ssl, backlog=backlog,
            reuse_address=True,
        )
        self._sweeper = loop.create_task(self._sweep_idle())
        server: Any = self._server  # uvloop's `sockets` is a list, not the stubs' tuple
        return int(server.sockets[0].getsockname()[1])

    async def _sweep_idle(self) -> None:
        # Keep-alive connections left idle, requests that take too long to arrive (a client
        # trickling its head or body) and streamed bodies arriving too slowly are ended
        # here, once a second at most.
        grace_s, min_rate = self.request_timeout_s, self.min_streamed_rate
        while True:
            await asyncio.sleep(min(1.0, self.idle_timeout_s, self.request_timeout_s))
            now = time.monotonic()
            idle_cutoff = now - self.idle_timeout_s
            slow_cutoff = now - self.request_timeout_s
            for conn in list(self.connections):
                if conn.idle:
                    if 0 < conn.request_begun_at < slow_cutoff:
                        conn.request_late(self.request_timeout_s)
                    elif conn.last_active < idle_cutoff:
                        conn.close()
                elif conn.streamed_body_late(now, grace_s, min_rate):
                    conn.end_late_body(grace_s, min_rate)

    async def close(self) -> None:
        """Stop listening and close idle connections; busy ones close after their response."""
        self.closing = True
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
            for conn in list(self.connections):
                if conn.idle:
                    conn.close()
            await self._server.wait_closed()

    def abort_all(self) -> None:
        for conn in list(self.connections):
            conn.abort()
