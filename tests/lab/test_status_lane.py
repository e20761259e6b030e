"""The lab's gunicorn worker sends status polls to a lane of their own, reading nothing, on
threads that run at the worker's priority while those serving other requests run niced."""

from __future__ import annotations

import os
import selectors
import socket
import sys
import threading
from collections import deque
from concurrent import futures
from types import SimpleNamespace
from typing import Any, cast

import pytest
from django.db import connection
from gunicorn.workers.gthread import TConn

from controlplane.lab.status_lane import (
    REQUEST_NICE,
    REQUEST_NICE_ENV,
    StatusLaneWorker,
    asks_for_status,
    request_nice,
    request_pool,
    status_pool,
)


def test_a_status_request_is_recognised_and_left_for_the_parser() -> None:
    server, client = socket.socketpair()
    with server, client:
        request = b"GET /api/v1/status/ HTTP/1.1\r\nHost: x\r\n\r\n"
        client.sendall(request)
        assert asks_for_status(server)
        assert server.recv(1024) == request  # the peek consumed nothing


def test_other_requests_and_an_empty_socket_take_the_usual_lane() -> None:
    server, client = socket.socketpair()
    with server, client:
        assert not asks_for_status(server)  # nothing received yet
        client.sendall(b"GET /api/v1/status/?x HTTP/1.1\r\n")
        assert asks_for_status(server)
        server.recv(1024)
        for line in (b"GET /api/v1/replicas/ HTTP/1.1\r\n", b"POST /api/v1/status/ HTTP/1.1\r\n",
                     b"GET /api/v1/statuses/ HTTP/1.1\r\n"[:12]):
            client.sendall(line)
            assert not asks_for_status(server), line
            server.recv(1024)


def priority_of_a_thread_in(pool: futures.ThreadPoolExecutor) -> int:
    with pool:
        return pool.submit(
            lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())).result()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a nice value per thread")
def test_ordinary_request_threads_run_niced_and_status_threads_do_not() -> None:
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    if own + 3 > 19:
        pytest.skip(f"this test already runs at nice {own}")
    assert priority_of_a_thread_in(request_pool(1, 3)) == own + 3
    assert priority_of_a_thread_in(request_pool(1, 0)) == own
    assert priority_of_a_thread_in(status_pool()) == own
    # The thread that lowered its priority was the pool's: this one keeps its own.
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own


def test_the_request_threads_nice_value_comes_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REQUEST_NICE_ENV, raising=False)
    assert request_nice() == REQUEST_NICE
    for value, nice in (("0", 0), ("5", 5), ("40", 19), ("-3", 0)):
        monkeypatch.setenv(REQUEST_NICE_ENV, value)
        assert request_nice() == nice


def test_status_threads_keep_their_database_connection_and_others_do_not() -> None:
    def settings_in(pool: futures.ThreadPoolExecutor) -> tuple[Any, Any]:
        with pool:
            return pool.submit(lambda: (connection.settings_dict["CONN_MAX_AGE"],
                                        connection.settings_dict["CONN_HEALTH_CHECKS"])).result()

    assert settings_in(status_pool()) == (None, True)  # kept, checked before each reuse
    shared = (connection.settings_dict["CONN_MAX_AGE"],
              connection.settings_dict["CONN_HEALTH_CHECKS"])
    assert settings_in(request_pool(1, 0)) == shared  # as the settings say


class Submissions:
    """A pool that records what it is given instead of running it."""

    def __init__(self) -> None:
        self.given: list[Any] = []

    def submit(self, fn: Any, conn: Any) -> futures.Future[Any]:
        self.given.append(conn)
        return futures.Future()


def idle_worker() -> tuple[StatusLaneWorker, Submissions, Submissions]:
    """The worker's state as its event loop holds it, without a gunicorn master; and what
    its request pool and its status pool are given."""
    worker = StatusLaneWorker.__new__(StatusLaneWorker)
    ordinary, status = Submissions(), Submissions()
    worker.cfg = SimpleNamespace(keepalive=2, is_ssl=False)
    worker.poller = selectors.DefaultSelector()
    worker.pending_conns = deque()
    worker.tpool = cast(Any, ordinary)
    worker.status_pool = cast(Any, status)
    worker.method_queue = SimpleNamespace(defer=lambda *args: None)
    return worker, ordinary, status


def test_a_connection_without_its_request_yet_waits_for_it_on_the_poller() -> None:
    worker, ordinary, status_lane = idle_worker()
    server, client = socket.socketpair()
    with server, client, worker.poller:
        conn = TConn(worker.cfg, server, ("127.0.0.1", 1), ("127.0.0.1", 2))
        worker.enqueue_req(conn)  # accepted before the request line arrived
        assert list(worker.pending_conns) == [conn]
        assert not ordinary.given and not status_lane.given
        client.sendall(b"GET /api/v1/status/ HTTP/1.1\r\nHost: x\r\n\r\n")
        [(key, _)] = worker.poller.select(timeout=1)
        key.data(key.fileobj)  # the event loop's dispatch
        assert status_lane.given == [conn] and not ordinary.given
        assert not worker.pending_conns


def test_connections_whose_request_arrived_take_their_lane_at_once() -> None:
    worker, ordinary, status_lane = idle_worker()
    pairs = [socket.socketpair() for _ in range(2)]
    try:
        (status_server, status_client), (list_server, list_client) = pairs
        status_client.sendall(b"GET /api/v1/status/ HTTP/1.1\r\n\r\n")
        list_client.sendall(b"GET /api/v1/replicas/ HTTP/1.1\r\n\r\n")
        status = TConn(worker.cfg, status_server, ("127.0.0.1", 1), ("127.0.0.1", 2))
        listing = TConn(worker.cfg, list_server, ("127.0.0.1", 1), ("127.0.0.1", 2))
        worker.enqueue_req(status)
        worker.enqueue_req(listing)
        assert status_lane.given == [status] and ordinary.given == [listing]
        assert not worker.pending_conns
    finally:
        for pair in pairs:
            for sock in pair:
                sock.close()
        worker.poller.close()
