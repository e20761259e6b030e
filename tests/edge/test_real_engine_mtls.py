"""mTLS on the real engine: vLLM's CPU build started with `--ssl-keyfile/--ssl-certfile/
--ssl-ca-certs/--ssl-cert-reqs 2` and its key in VLLM_API_KEY (as the local provider and
the SkyPilot task start it), certificates from the engine CA's own math. Without a client
certificate no path answers, `/invocations`, `/tokenize` and `/metrics` included, and plain
HTTP gets nothing; through an edge holding its certificate, answers and streams pass, and a
stream whose engine is killed mid-answer goes on from a second engine as one coherent answer.
One engine for the module; the last test starts a second and kills whichever serves it."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
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

from .conftest import API_KEY, TableFactory, replica
from .helpers import running_edge

ENGINE_KEY = "sk-engine-real-replica-own-key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@contextmanager
def mtls_vllm(pki: Pki, cores: str | None = None) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    """A real vLLM demanding the edge's client certificate, healthy; stopped at the end."""
    unavailable = engine_unavailable()
    if unavailable:
        pytest.skip(f"no real engine on this machine: {unavailable}")
    missing = engine_missing()
    if missing:
        pytest.fail(missing)
    port = free_port()
    log = Path(tempfile.mkstemp(prefix=f"vllm-mtls-{port}-", suffix=".log")[1])
    proc = start_vllm(port, log, *pki.engine_flags(), cores=cores,
                      env={"VLLM_API_KEY": ENGINE_KEY})
    context = client_context(pki, pki.edge)

    def healthy() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with {proc.returncode}: {log_tail(log)}")
        return answer("127.0.0.1", port, "GET", "/health", context) == 200

    try:
        wait_until(healthy, START_TIMEOUT_S, "vLLM answering /health over mTLS")
        yield port, proc
    finally:
        stop_group(proc)
        log.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def engine_process(pki: Pki) -> Iterator[tuple[int, subprocess.Popen[bytes]]]:
    cores = sorted(os.sched_getaffinity(0))
    with mtls_vllm(pki, cores=str(cores[-1])) as started:
        yield started


@pytest.fixture(scope="module")
def engine(engine_process: tuple[int, subprocess.Popen[bytes]]) -> int:
    return engine_process[0]


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


def test_a_stream_whose_engine_is_killed_mid_answer_goes_on_from_the_other(
        pki: Pki, engine_process: tuple[int, subprocess.Popen[bytes]], tmp_path: Path,
        signing_key: Ed25519PrivateKey, make_table: TableFactory) -> None:
    """Over mTLS, as the lab runs: temperature 0 on the same model, so the other engine
    continues the text the client has (continue_final_message), and the client reads one
    stream, ending in [DONE]. It kills the module's engine or the one it starts: last here."""
    messages = [{"role": "user", "content": "Explain in detail how a river forms, from rain "
                 "falling on mountains to the sea. Write at least three paragraphs."}]
    request = {"model": SERVED, "messages": messages, "temperature": 0, "max_tokens": 100}
    context = client_context(pki, pki.edge)
    cores = sorted(os.sched_getaffinity(0))
    with mtls_vllm(pki, cores=str(cores[0])) as fresh:
        pair = [engine_process, fresh]

        def reference(port: int) -> str:
            post = urllib.request.Request(
                f"https://localhost:{port}/v1/chat/completions", method="POST",
                data=json.dumps(request).encode(),
                headers={"content-type": "application/json",
                         "authorization": f"Bearer {ENGINE_KEY}"})
            with urllib.request.urlopen(post, timeout=120, context=context) as response:
                return str(json.loads(response.read())["choices"][0]["message"]["content"])

        whole = reference(pair[0][0])
        assert whole == reference(pair[1][0])  # greedy decoding: the same answer on both

        async def scenario() -> None:
            async with running_edge(signing_key, tmp_path / "state", upstream_tls=UpstreamTLS(
                    pki.edge.cert, pki.edge.key, pki.ca)) as edge:
                table = make_table(models={SERVED: [
                    replica(f"r{i}", f"https://127.0.0.1:{port}", engine_key=ENGINE_KEY,
                            tls_name="localhost") for i, (port, _) in enumerate(pair)]},
                    policy={"scorers": {"load": 1.0}, "retry_before_first_byte": 2,
                            "eject_after_failures": 1, "stream_stall_s": 20})
                assert (await edge.push(table, signing_key))[0] == 200
                response = await edge.session.post(
                    edge.url + "/v1/chat/completions", headers={"authorization": f"Bearer {API_KEY}"},
                    json={**request, "stream": True, "stream_options": {"include_usage": True}},
                    timeout=aiohttp.ClientTimeout(total=None, sock_read=120))  # a busy CPU
                assert response.status == 200
                serving = pair[int(response.headers["x-meridian-replica"][1:])][1]
                raw = b""
                while raw.count(b'"content":"') < 12:  # a dozen tokens reached the client
                    raw += await response.content.readany()
                before = "".join(texts(raw.decode().rsplit("\n\n", 1)[0]))
                os.killpg(serving.pid, signal.SIGKILL)
                raw += await response.content.read()
                body = raw.decode()
                assert body.endswith("data: [DONE]\n\n")
                chunks = [json.loads(e[6:]) for e in body.split("\n\n")[:-2]]
                assert not any("error" in c for c in chunks)
                assert len({(c["id"], c["created"], c["model"]) for c in chunks}) == 1
                assert sum("role" in c["choices"][0]["delta"]
                           for c in chunks if c["choices"]) == 1
                text = "".join(texts(body))
                # What came before the kill is the answer's start, said once; the rest
                # continues it (the seam may be tokenised differently, so the two answers
                # may part there, but not before).
                assert before and whole.startswith(before)
                assert text.startswith(before) and text.count(before) == 1
                common = len(os.path.commonprefix([text, whole]))
                assert common >= len(before), (before, text, whole)
                assert len(text) >= len(before) + 40, (before, text)
                usage = [c["usage"] for c in chunks if c.get("usage")]
                assert len(usage) == 1 and 0 < usage[0]["completion_tokens"] <= 100
                assert edge.edge.metrics.resumptions.get(("resumed",)) == 1
                assert edge.edge.metrics.upstream_tls_failures.values == {}
                print(f"\nkilled after {len(before)} chars; {len(text)} chars in all, "
                      f"{common} equal to the uninterrupted answer ({len(whole)} chars); "
                      f"usage {usage[0]}")

        asyncio.run(scenario())


def texts(body: str) -> list[str]:
    """The content pieces of a chat stream's chunks."""
    out = []
    for event in body.split("\n\n"):
        if event.startswith("data: {"):
            chunk = json.loads(event[6:])
            for choice in chunk.get("choices") or []:
                out.append(choice.get("delta", {}).get("content") or "")
    return out
