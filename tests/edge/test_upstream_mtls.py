"""mTLS between edges and engines, on enginesim started with vLLM's own TLS flags
(`--ssl-cert-reqs 2`): no path answers without a client certificate from the engine CA;
through an edge with one, answers and streams pass; an edge whose certificate is expired,
revoked or foreign, or a table with an http:// replica, fails upstream with a log line and
`meridian_edge_upstream_tls_failures_total`, never plain HTTP."""

from __future__ import annotations

import asyncio
import logging
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from controlplane.lab.processes import die_with_parent
from controlplane.lab.waiting import wait_until
from edge.upstream_tls import UpstreamTLS
from tests.mtls import REFUSED, Pair, Pki, answer, client_context, make_pki

from .conftest import TableFactory, replica
from .helpers import REPO, enginesim_command, enginesim_env, free_port, running_edge

ENGINE_KEY = "sk-replica-1-own-key"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def engine(pki: Pki) -> Iterator[int]:
    """One enginesim demanding client certificates, its key from VLLM_API_KEY."""
    port = free_port()
    process = subprocess.Popen(
        [*enginesim_command(port), *pki.engine_flags()], cwd=REPO,
        env={**enginesim_env(), "VLLM_API_KEY": ENGINE_KEY}, stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent())
    context = client_context(pki, pki.edge)
    try:
        wait_until(lambda: answer("127.0.0.1", port, "GET", "/health", context) == 200,
                   60, "enginesim answering /health over mTLS")
        yield port
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize("path", ["/health", "/metrics", "/v1/models", "/tokenize"])
def test_without_a_client_certificate_no_path_answers(pki: Pki, engine: int, path: str) -> None:
    method = "POST" if path == "/tokenize" else "GET"
    body = '{"model": "sim", "prompt": "hi"}' if method == "POST" else None
    # No HTTP status at all, only the error that ended the exchange: the TLS alert or the
    # connection closed (curl's exit 56), for plain HTTP too (curl's 52).
    assert answer("127.0.0.1", engine, method, path, client_context(pki, None), body) \
        in REFUSED
    assert answer("127.0.0.1", engine, method, path, None, body) in REFUSED
    # A certificate from another CA, however it is named, is refused the same way.
    assert answer("127.0.0.1", engine, method, path, client_context(pki, pki.foreign_edge),
                  body) in REFUSED


def test_with_the_edge_certificate_the_engine_answers_and_wants_its_own_key(
        pki: Pki, engine: int) -> None:
    context = client_context(pki, pki.edge)
    assert answer("127.0.0.1", engine, "GET", "/metrics", context) == 200
    assert answer("127.0.0.1", engine, "GET", "/v1/models", context) == 401
    assert answer("127.0.0.1", engine, "GET", "/v1/models", context,
                  headers={"authorization": f"Bearer {ENGINE_KEY}"}) == 200


def failures(edge: object, reason: str) -> float:
    return edge.edge.metrics.upstream_tls_failures.get((reason,))  # type: ignore[attr-defined]


def edge_tls(pair: Pair, pki: Pki) -> UpstreamTLS:
    return UpstreamTLS(pair.cert, pair.key, pki.ca)


def test_through_the_edge_answers_and_streams_pass(
        pki: Pki, engine: int, tmp_path: Path, signing_key: Ed25519PrivateKey,
        make_table: TableFactory) -> None:
    async def scenario() -> None:
        async with running_edge(signing_key, tmp_path / "state",
                                upstream_tls=edge_tls(pki.edge, pki)) as edge:
            table = make_table(models={"sim": [replica(
                "r1", f"https://127.0.0.1:{engine}", engine_key=ENGINE_KEY)]})
            status, body = await edge.push(table, signing_key)
            assert status == 200, body
            response = await edge.chat("sim", "hello over mTLS", max_tokens=5)
            assert response.status == 200, await response.text()
            assert (await response.json())["object"] == "chat.completion"
            stream = await edge.chat("sim", "a stream over mTLS", stream=True, max_tokens=5)
            assert stream.status == 200
            events = (await stream.read()).split(b"\n\n")
            assert events[-2] == b"data: [DONE]"
            assert failures(edge, "handshake") == 0

    asyncio.run(scenario())


@pytest.mark.parametrize(("case", "reason"), [
    ("expired", "expired"), ("revoked", "revoked"), ("foreign", "handshake"),
    ("plain_http", "plain_http"),
])
def test_an_unusable_certificate_fails_upstream_with_a_log_line_and_a_metric(
        pki: Pki, engine: int, tmp_path: Path, signing_key: Ed25519PrivateKey,
        make_table: TableFactory, caplog: pytest.LogCaptureFixture, case: str,
        reason: str) -> None:
    pair = {"expired": pki.expired_edge, "foreign": pki.foreign_edge}.get(case, pki.edge)
    url = f"http://127.0.0.1:{engine}" if case == "plain_http" else f"https://127.0.0.1:{engine}"

    async def scenario() -> None:
        async with running_edge(signing_key, tmp_path / "state",
                                upstream_tls=edge_tls(pair, pki)) as edge:
            table = make_table(models={"sim": [replica("r1", url, engine_key=ENGINE_KEY)]})
            if case == "revoked":
                table["revoked_certificates"] = [pki.edge.serial]
            status, body = await edge.push(table, signing_key)
            assert status == 200, body
            response = await edge.chat("sim", "hello", max_tokens=5)
            assert response.status in (502, 503), await response.text()
            assert failures(edge, reason) >= 1

    with caplog.at_level(logging.ERROR, logger="meridian.edge.tls"):
        asyncio.run(scenario())
    line = next(r.getMessage() for r in caplog.records if r.name == "meridian.edge.tls")
    assert f"upstream TLS refused ({reason})" in line
    expected = {"expired": "expired at", "revoked": "is revoked", "foreign": "TLS",
                "plain_http": "refusing plain HTTP"}[case]
    assert expected in line


def test_a_renewed_certificate_is_picked_up_without_a_restart(pki: Pki, tmp_path: Path) -> None:
    files = tmp_path / "edge"
    files.mkdir()
    cert, key = files / "cert.pem", files / "key.pem"
    cert.write_bytes(pki.expired_edge.cert.read_bytes())
    key.write_bytes(pki.expired_edge.key.read_bytes())
    tls = UpstreamTLS(cert, key, pki.ca)
    assert tls.own_problem(frozenset()) is not None
    key.write_bytes(pki.edge.key.read_bytes())
    cert.write_bytes(pki.edge.cert.read_bytes())
    import os
    os.utime(cert, (1, 1))  # a different stamp, whatever the clock's resolution
    tls._checked_at = 0.0
    assert tls.own_problem(frozenset()) is None and tls.serial == pki.edge.serial


@pytest.mark.parametrize(("change", "field"), [
    ({"revoked_certificates": ["XYZ"]}, "revoked_certificates"),
    ({"revoked_certificates": "1f"}, "revoked_certificates"),
    ({"engine_key": "two words"}, "models.sim.replicas[0].engine_key"),
    ({"engine_key": 7}, "models.sim.replicas[0].engine_key"),
    ({"tls_name": 7}, "models.sim.replicas[0].tls_name"),
])
def test_bad_tls_fields_in_a_table_are_refused_naming_them(
        make_table: TableFactory, change: dict[str, object], field: str) -> None:
    from edge.table import TableError, parse_table

    top = "revoked_certificates" in change
    entry = replica("r1", "https://127.0.0.1:9", **({} if top else change))
    table = make_table(models={"sim": [entry]})
    if top:
        table.update(change)
    with pytest.raises(TableError) as caught:
        parse_table(table)
    assert caught.value.field == field
