"""An upload trickling into the control plane itself (past the edges) cannot hold gunicorn's
worker: once it has had its grace and fallen below the minimum rate its socket's reading
side is cut, the client gets a 408 naming both limits, and the worker's one thread answers
the next request. Against a real gunicorn over a real socket."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.db import connection

from controlplane.batches.models import BatchFile
from controlplane.lab.engines import free_port
from controlplane.lab.processes import die_with_parent
from controlplane.lab.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)
REPO = Path(__file__).resolve().parents[2]
BOUNDARY = b"TrIcKlE"


def answers(url: str) -> bool:
    try:
        urllib.request.urlopen(url, timeout=2).read()
    except urllib.error.HTTPError:
        return True  # it answered: a 401 is an answer
    except OSError:
        return False
    return True


@pytest.fixture
def gunicorn() -> Iterator[int]:
    """The control plane under gunicorn, one worker with one thread, on the test database,
    with a 0.5 s grace and a 1 MiB/s minimum for uploads."""
    db = connection.settings_dict
    port = free_port()
    env = {**os.environ, "MERIDIAN_LAB": "1",
           "DATABASE_URL": f"postgresql://{db['USER']}@{db['HOST']}:{db['PORT']}/{db['NAME']}",
           "MERIDIAN_BATCH_UPLOAD_GRACE_S": "0.5",
           "MERIDIAN_BATCH_UPLOAD_MIN_BYTES_PER_S": str(1024 * 1024)}
    process = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "controlplane.wsgi", "--bind", f"127.0.0.1:{port}",
         "--workers", "1", "--threads", "1"], cwd=REPO, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=die_with_parent())
    try:
        wait_until(lambda: answers(f"http://127.0.0.1:{port}/v1/files"), 60,
                   "gunicorn to answer")
        yield port
    finally:
        process.terminate()
        process.wait(10)


def test_a_trickled_upload_is_cut_with_408_and_the_worker_serves_again(
        fleet: Any, gunicorn: int) -> None:
    key = fleet["acme"]
    preamble = (b"--" + BOUNDARY + b"\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\n"
                b"batch\r\n--" + BOUNDARY + b"\r\nContent-Disposition: form-data; name=\"file\"; "
                b"filename=\"in.jsonl\"\r\nContent-Type: application/jsonl\r\n\r\n")
    length = len(preamble) + 1_000_000
    client = socket.create_connection(("127.0.0.1", gunicorn))
    client.settimeout(30)  # a backstop: the answer is the evidence awaited
    client.sendall(b"POST /v1/files HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " +
                   key.encode() + b"\r\nContent-Type: multipart/form-data; boundary=" +
                   BOUNDARY + b"\r\nContent-Length: %d\r\n\r\n" % length + preamble)
    answered = threading.Event()

    def drip() -> None:
        for _ in range(1_000_000):
            if answered.wait(0.02):
                return
            try:
                client.sendall(b"x")
            except OSError:
                return

    dripping = threading.Thread(target=drip, daemon=True)
    dripping.start()
    answer = b""
    try:
        while b"}}" not in answer:  # the whole error object, or the connection's end
            piece = client.recv(65536)
            if not piece:
                break
            answer += piece
    finally:
        answered.set()
        dripping.join(5)
        client.close()
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b'"code": "request_timeout"' in answer
    assert b"slower than 1048576 bytes/s after its first 0.5 s" in answer
    assert b"BATCH_UPLOAD_MIN_BYTES_PER_S" in answer
    # The worker's only thread is free: it answers the next request.
    request = urllib.request.Request(f"http://127.0.0.1:{gunicorn}/v1/files",
                                     headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(request, timeout=10) as listing:
        assert listing.status == 200
    assert BatchFile.objects.count() == 0
