"""The lab's gunicorn worker sends status polls to a lane of their own, reading nothing."""

from __future__ import annotations

import socket

from controlplane.lab.status_lane import asks_for_status


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
