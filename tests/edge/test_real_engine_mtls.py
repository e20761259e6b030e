"""mTLS on the real engine: vLLM's CPU build started with `--ssl-keyfile/--ssl-certfile/
--ssl-ca-certs/--ssl-cert-reqs 2` and its key in VLLM_API_KEY (as the local provider and
the SkyPilot task start it), certificates from the engine CA's own math. Without a client
certificate no path answers, `/invocations`, `/tokenize` and `/metrics` included, and plain
HTTP gets nothing; through an edge holding its certificate, answers and streams pass. One
engine for the module."""

from __future__ import annotations

import asyncio
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.lab.engines import (
    SERVED,
    START_TIMEOUT_S,
    engine_missing,
    engine_unavailable,
    free_port,
    log_tail,
    start_vllm,
    stop_group,
)
from controlplane.lab.waiting import wait_until
from edge.upstream_tls import UpstreamTLS
from tests.mtls import REFUSED, Pki, answer, client_context, make_pki

from .conftest import TableFactory, replica
from .helpers import running_edge

ENGINE_KEY = "sk-engine-real-replica-own-key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def engine(pki: Pki) -> Iterator[int]:
    unavailable = engine_unavailable()
    if unavailable:
        pytest.skip(f"no real engine on this machine: {unavailable}")
    missing = engine_missing()
    if missing:
        pytest.fail(missing)
    port = free_port()
    log = Path(tempfile.mkstemp(prefix=f"vllm-mtls-{port}-", suffix=".log")[1])
    proc = start_vllm(port, log, *pki.engine_flags(), env={"VLLM_API_KEY": ENGINE_KEY})
    context = client_context(pki, pki.edge)

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}: {log_tail(log)}")
        return answer("127.0.0.1", port, "GET", "/health", context) == 200

    try:
        wait_until(healthy, START_TIMEOUT_S, "vLLM answering /health over mTLS")
        yield port
    finally:
        stop_group(proc)
        log.unlink(missing_ok=True)


INVOCATION = json.dumps({"model": SERVED, "prompt": "Hi", "max_tokens": 2})


@pytest.mark.parametrize(("method", "path", "body"), [
    ("GET", "/health", None), ("GET", "/metrics", None), ("GET", "/v1/models", None),
    ("POST", "/invocations", INVOCATION), ("POST", "/tokenize", INVOCATION),
])
def test_without_a_client_certificate_nothing_answers(pki: Pki, engine: int, method: str,
                                                     path: str, body: str | None) -> None:
    assert answer("127.0.0.1", engine, method, path, client_context(pki, None), body) in REFUSED
    assert answer("127.0.0.1", engine, method, path, None, body) in REFUSED  # plain HTTP
    assert answer("127.0.0.1", engine, method, path, client_context(pki, pki.foreign_edge),
                  body) in REFUSED


def test_with_an_edge_certificate_it_answers_and_v1_wants_the_replica_key(
        pki: Pki, engine: int) -> None:
    context = client_context(pki, pki.edge)
    assert answer("127.0.0.1", engine, "GET", "/metrics", context) == 200
    assert answer("127.0.0.1", engine, "GET", "/v1/models", context) == 401
    assert answer("127.0.0.1", engine, "GET", "/v1/models", context,
                  headers={"authorization": f"Bearer {ENGINE_KEY}"}) == 200


def test_through_the_edge_answers_and_streams_pass(
        pki: Pki, engine: int, tmp_path: Path, signing_key: Ed25519PrivateKey,
        make_table: TableFactory) -> None:
    async def scenario() -> None:
        async with running_edge(signing_key, tmp_path / "state", upstream_tls=UpstreamTLS(
                pki.edge.cert, pki.edge.key, pki.ca)) as edge:
            table = make_table(models={SERVED: [replica(
                "r1", f"https://127.0.0.1:{engine}", engine_key=ENGINE_KEY,
                tls_name="localhost")]})
            status, body = await edge.push(table, signing_key)
            assert status == 200, body
            response = await edge.chat(SERVED, "Say hi.", max_tokens=4)
            assert response.status == 200, await response.text()
            assert (await response.json())["choices"][0]["message"]["content"]
            stream = await edge.chat(SERVED, "Count to three.", stream=True, max_tokens=6)
            assert stream.status == 200
            events = [e for e in (await stream.read()).split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]" and len(events) >= 3
            assert edge.edge.metrics.upstream_tls_failures.values == {}

    asyncio.run(scenario())
