"""The lab's gunicorn worker: gthread, with a lane of its own for `GET /api/v1/status/`, whose
threads run before the others whenever they have work.

A gthread worker hands every connection to one FIFO thread pool, so under load a status poll
waits behind every list page queued before it (bench/api_load.py: p99 over a second at 32
clients, though status itself takes a few milliseconds). This worker peeks at the request
line of each connection it takes (MSG_PEEK: the bytes stay for the parser) and runs status
requests on a pool of their own; everything else goes the usual way.

A lane of its own is not enough on a saturated machine: the status thread then waits for a
core, and for the GIL, behind the threads rendering list pages. Linux gives each thread a
nice value of its own, so the ordinary request threads lower theirs by REQUEST_NICE when they
start (`MERIDIAN_WEB_REQUEST_NICE`; 0 leaves them as they are) while the status threads and
the thread that accepts connections keep the worker's: whenever a status thread is runnable
the kernel runs it first. The interpreter's switch interval is shortened from 5 ms to 1 ms, so
the status thread, back from each Postgres or Redis round-trip, gets the GIL within 1 ms from
a thread rendering a list; unless that thread, niced, was descheduled while holding it: then
the status thread waits until it runs again (a status process of its own would not).
Under bench/api_load.py's 32 clients on two shared cores this took status p99 to about half
(README, Benchmarks), not under 50 ms.

    gunicorn controlplane.wsgi --worker-class controlplane.lab.status_lane.StatusLaneWorker
"""

from __future__ import annotations

import logging
import os
import selectors
import socket
import sys
import threading
import time
from concurrent import futures
from functools import partial
from typing import Any

from django.db import connection
from gunicorn.workers.gthread import DEFAULT_WORKER_DATA_TIMEOUT, ThreadWorker

STATUS_REQUEST = b"GET /api/v1/status/"
STATUS_THREADS = 2
SWITCH_INTERVAL_S = 0.001
REQUEST_NICE = 10  # what ordinary request threads add to their nice value
REQUEST_NICE_ENV = "MERIDIAN_WEB_REQUEST_NICE"

log = logging.getLogger(__name__)


def received_head(sock: socket.socket) -> bytes | None:
    """The first bytes received on `sock`, left there for the parser (MSG_PEEK); None while
    nothing has arrived, b"" once the client has closed, or on an error the parser will meet."""
    try:
        return sock.recv(len(STATUS_REQUEST), socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        return b""


def asks_for_status(sock: socket.socket) -> bool:
    """Whether the bytes already received on `sock` begin a status request (none read)."""
    return received_head(sock) == STATUS_REQUEST


def request_nice() -> int:
    """How much the ordinary request threads lower their priority: REQUEST_NICE unless
    MERIDIAN_WEB_REQUEST_NICE says otherwise (0 to 19)."""
    return max(0, min(19, int(os.environ.get(REQUEST_NICE_ENV, REQUEST_NICE))))


def lower_this_thread(by: int) -> None:
    """Raise the calling thread's nice value by `by` (only its own: Linux keeps one per
    thread; elsewhere a thread id is no process id, so nothing is changed)."""
    if not by or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + by)
    except OSError as exc:  # the thread serves at the worker's priority, as gthread's do
        log.warning("request thread %s keeps its priority: %s", tid, exc)


def request_pool(threads: int, nice: int) -> futures.ThreadPoolExecutor:
    """The pool for ordinary requests: each thread lowers its priority by `nice` as it starts."""
    return futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="request",
                                      initializer=lower_this_thread, initargs=(nice,))


def keep_database_connection() -> None:
    """The calling thread keeps its database connection from one request to the next (checked
    before each reuse): a status poll does not wait for Postgres to start a backend."""
    connection.settings_dict = {**connection.settings_dict, "CONN_MAX_AGE": None,
                                "CONN_HEALTH_CHECKS": True}


def status_pool() -> futures.ThreadPoolExecutor:
    """The pool for status polls: at the worker's own priority, each thread with a database
    connection it keeps."""
    return futures.ThreadPoolExecutor(max_workers=STATUS_THREADS, thread_name_prefix="status",
                                      initializer=keep_database_connection)


class StatusLaneWorker(ThreadWorker):
    def init_process(self) -> None:
        self.status_pool = status_pool()
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        super().init_process()

    def get_thread_pool(self) -> futures.ThreadPoolExecutor:
        return request_pool(self.cfg.threads, request_nice())

    def enqueue_req(self, conn: Any) -> None:
        head = received_head(conn.sock)
        if head is None and not conn.initialized and not conn.data_ready:
            # Accepted before its request arrived: wait on the poller (not on a pool thread,
            # as gthread does), so that the lane is chosen on the request line, never by
            # default. As patient as gthread: its wait on a thread, then on the poller.
            conn.timeout = time.monotonic() + DEFAULT_WORKER_DATA_TIMEOUT + self.cfg.keepalive
            self.pending_conns.append(conn)
            self.poller.register(conn.sock, selectors.EVENT_READ,
                                 partial(self.on_pending_socket_readable, conn))
            return
        if head != STATUS_REQUEST:
            super().enqueue_req(conn)
            return
        done = self.status_pool.submit(self.handle, conn)
        done.add_done_callback(
            lambda fut: self.method_queue.defer(self.finish_request, conn, fut))

    def handle_quit(self, sig: Any, frame: Any) -> None:
        self.status_pool.shutdown(wait=False)
        super().handle_quit(sig, frame)
