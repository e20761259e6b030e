"""TLS on both legs: clients to the edge (`--tls-cert`), and the edge to `https://` replicas,
whose certificates it verifies against the system's trust store (`SSL_CERT_FILE` here)."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import json
import ssl
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.x509.oid import NameOID

from .conftest import TableFactory, replica
from .fake_engine import FakeEngine
from .helpers import running_edge


def self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost, and its key, as PEM files."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([
                x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = directory / f"{name}.crt", directory / f"{name}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_file, key_file


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(cert, key)
    return context


def test_completions_cross_tls_on_both_legs(tmp_path: Path, signing_key: Ed25519PrivateKey,
                                            make_table: TableFactory,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    edge_cert, edge_key = self_signed(tmp_path, "edge")
    engine_cert, engine_key = self_signed(tmp_path, "engine")
    # The edge trusts the system's store; this engine's certificate is that store here.
    monkeypatch.setenv("SSL_CERT_FILE", str(engine_cert))
    client = ssl.create_default_context(cafile=str(edge_cert))

    async def scenario() -> None:
        engine = FakeEngine("m")
        await engine.start(tls=server_context(engine_cert, engine_key))
        assert engine.url.startswith("https://")
        try:
            async with running_edge(signing_key, tmp_path / "state",
                                    tls=server_context(edge_cert, edge_key),
                                    client_tls=client) as edge:
                status, body = await edge.push(
                    make_table(models={"m": [replica("r1", engine.url)]}), signing_key)
                assert status == 200, body
                assert edge.url.startswith("https://")
                response = await edge.chat("m", "hello over tls")
                assert response.status == 200, await response.text()
                answer = await response.json()
                assert answer["object"] == "chat.completion"
                stream = await edge.chat("m", "a stream over tls", stream=True)
                assert stream.status == 200
                events = (await stream.read()).split(b"\n\n")
                assert events[-2] == b"data: [DONE]"
                assert json.loads(events[0][len(b"data: "):])["object"] == "chat.completion.chunk"
                assert [r["messages"][0]["content"] for r in engine.requests] == [
                    "hello over tls", "a stream over tls"]
        finally:
            await engine.stop()

    asyncio.run(scenario())


def test_an_untrusted_replica_certificate_is_refused(tmp_path: Path,
                                                     signing_key: Ed25519PrivateKey,
                                                     make_table: TableFactory,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    engine_cert, engine_key = self_signed(tmp_path, "engine")
    other_cert, _ = self_signed(tmp_path, "other")
    monkeypatch.setenv("SSL_CERT_FILE", str(other_cert))

    async def scenario() -> None:
        engine = FakeEngine("m")
        await engine.start(tls=server_context(engine_cert, engine_key))
        try:
            async with running_edge(signing_key, tmp_path / "state") as edge:
                status, body = await edge.push(
                    make_table(models={"m": [replica("r1", engine.url)]}), signing_key)
                assert status == 200, body
                response = await edge.chat("m")
                body = await response.json()
                assert response.status == 502, body
                assert body["error"]["code"] == "upstream_unavailable"
                assert engine.requests == []
        finally:
            await engine.stop()

    asyncio.run(scenario())
