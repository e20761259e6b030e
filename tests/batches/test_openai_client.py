"""The official `openai` package, unchanged, against the control plane's /v1/ (a live server)
and against an edge that forwards to it, with the lines run on a real enginesim: upload,
create, list, retrieve, cancel, read the output."""

from __future__ import annotations

import asyncio
import io
import json
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
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.lab.processes import die_with_parent
from controlplane.lab.waiting import wait_until
from edge.server import Edge, EdgeConfig

from .conftest import drive, jsonl, line

openai = pytest.importorskip("openai")
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
            return bool(response.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def enginesim_url() -> Iterator[str]:
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "enginesim", "--port", str(port), "--model", "llama-3.1-8b"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent())
    try:
        wait_until(lambda: _answers(port), 60, "enginesim answering /health", every_s=0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


@pytest.fixture
def live_fleet(transactional_db: Any, fleet: Any, enginesim_url: str) -> Any:
    from controlplane.deployments.models import Replica

    Replica.objects.filter(region__jurisdiction__code="EU").update(url=enginesim_url)
    return fleet


def test_the_openai_client_runs_a_batch_end_to_end(live_fleet: Any, live_server: Any) -> None:
    client = openai.OpenAI(api_key=live_fleet["acme"], base_url=f"{live_server.url}/v1",
                           max_retries=0)
    try:
        _run(client, live_fleet)
    finally:
        client.close()   # no kept-alive connection holds a server thread (and its database)


@pytest.fixture
def edge_url(live_server: Any, tmp_path: Path) -> Iterator[str]:
    """An edge in its own thread and event loop, forwarding to the live control plane (it
    has no routing table: the Files and Batches API does not need one)."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    edge = Edge(EdgeConfig(name="edge-batch", region="local:test-1",
                           state_dir=tmp_path / "edge",
                           public_keys=[Ed25519PrivateKey.generate().public_key()],
                           control_plane=live_server.url, pull_interval_s=3600, probes=False))
    port, _ = asyncio.run_coroutine_threadsafe(
        edge.start(("127.0.0.1", 0), ("127.0.0.1", 0)), loop).result(10)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        asyncio.run_coroutine_threadsafe(edge.stop(drain_s=0.5), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_the_openai_client_runs_a_batch_through_an_edge(live_fleet: Any,
                                                        edge_url: str) -> None:
    client = openai.OpenAI(api_key=live_fleet["acme"], base_url=f"{edge_url}/v1",
                           max_retries=0)
    try:
        _run(client, live_fleet)
        _cancel(client)
    finally:
        client.close()


def _cancel(client: Any) -> None:
    content = jsonl(*(line(f"c-{i}", f"Wait {i}") for i in range(3)))
    uploaded = client.files.create(file=("later.jsonl", io.BytesIO(content)), purpose="batch")
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    assert client.batches.retrieve(batch.id).status == "validating"
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelled" and cancelled.output_file_id is None
    assert [b.id for b in client.batches.list(limit=1).data] == [batch.id]
    with pytest.raises(openai.ConflictError) as refused:
        client.batches.cancel(batch.id)
    assert "already cancelled" in str(refused.value)
    with pytest.raises(openai.ConflictError) as in_use:
        client.files.delete(uploaded.id)
    assert f"is the input of {batch.id}" in str(in_use.value)


def _run(client: Any, live_fleet: Any) -> None:
    content = jsonl(*(line(f"req-{i}", f"Say {i}") for i in range(5)))
    uploaded = client.files.create(file=("requests.jsonl", io.BytesIO(content)), purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.bytes == len(content)
    assert client.files.retrieve(uploaded.id).filename == "requests.jsonl"
    assert client.files.content(uploaded.id).content == content

    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                  completion_window="24h", metadata={"run": "nightly"})
    assert batch.status == "validating" and batch.input_file_id == uploaded.id

    drive(batch.id)   # what the Celery task does

    done = client.batches.retrieve(batch.id)
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (5, 5, 0)
    assert done.error_file_id is None and done.output_file_id is not None
    rows = [json.loads(raw) for raw in client.files.content(done.output_file_id).text.splitlines()]
    assert [row["custom_id"] for row in rows] == [f"req-{i}" for i in range(5)]
    for row in rows:
        assert row["error"] is None and row["response"]["status_code"] == 200
        body = row["response"]["body"]
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
    assert [b.id for b in client.batches.list(limit=10).data] == [batch.id]
    assert live_fleet["us"].prompts() == []

    with pytest.raises(openai.ConflictError) as refused:
        client.batches.cancel(batch.id)
    assert "already completed" in str(refused.value)
    with pytest.raises(openai.BadRequestError) as bad:
        client.files.create(file=("bad.jsonl", io.BytesIO(b"{nope\n")), purpose="batch")
    assert "line 1: not valid JSON" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")
