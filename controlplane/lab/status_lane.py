"""The lab's gunicorn worker: gthread, with a lane of its own for `GET /api/v1/status/`.

A gthread worker hands every connection to one FIFO thread pool, so under load a status poll
waits behind every list page queued before it (bench/api_load.py: p99 over a second at 32
clients, though status itself takes a few milliseconds). This worker peeks at the request
line of each connection it takes (MSG_PEEK: the bytes stay for the parser) and runs status
requests on a pool of their own; everything else goes the usual way. The interpreter's switch
interval is shortened from 5 ms to 1 ms, so the status thread, back from each Postgres or
Redis round-trip, does not wait 5 ms for the GIL behind a thread rendering a list.

    gunicorn controlplane.wsgi --worker-class controlplane.lab.status_lane.StatusLaneWorker
"""

from __future__ import annotations

import socket
import sys
from concurrent import futures
from typing import Any

from gunicorn.workers.gthread import ThreadWorker

STATUS_REQUEST = b"GET /api/v1/status/"
STATUS_THREADS = 2
SWITCH_INTERVAL_S = 0.001


def asks_for_status(sock: socket.socket) -> bool:
    """Whether the bytes already received on `sock` begin a status request (none read)."""
    try:
        head = sock.recv(len(STATUS_REQUEST), socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError, OSError):
        return False  # nothing there yet (or an error the usual lane will meet): usual lane
    return head == STATUS_REQUEST


class StatusLaneWorker(ThreadWorker):
    def init_process(self) -> None:
        self.status_pool = futures.ThreadPoolExecutor(max_workers=STATUS_THREADS,
                                                      thread_name_prefix="status")
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        super().init_process()

    def enqueue_req(self, conn: Any) -> None:
        if not asks_for_status(conn.sock):
            super().enqueue_req(conn)
            return
        done = self.status_pool.submit(self.handle, conn)
        done.add_done_callback(
            lambda fut: self.method_queue.defer(self.finish_request, conn, fut))

    def handle_quit(self, sig: Any, frame: Any) -> None:
        self.status_pool.shutdown(wait=False)
        super().handle_quit(sig, frame)
