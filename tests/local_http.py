"""Fake HTTP peers for tests: a server on a free loopback port that serves from a daemon
thread until closed, and a JSON answer for its handlers."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class LocalServer:
    """`handler` served on 127.0.0.1 (a free port) from a daemon thread; `url` reaches it."""

    def __init__(self, handler: type[BaseHTTPRequestHandler]) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class QuietHandler(BaseHTTPRequestHandler):
    """A handler that logs nothing and answers JSON with `answer`."""

    def log_message(self, *args: Any) -> None:
        pass

    def answer(self, status: int, document: Any) -> None:
        send_json(self, status, document)


def send_json(handler: BaseHTTPRequestHandler, status: int, document: Any) -> None:
    raw = json.dumps(document).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(raw)))
    handler.end_headers()
    handler.wfile.write(raw)
