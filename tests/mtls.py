"""Certificates for mTLS tests, made with the engine CA's own math (controlplane.core.ca),
and a raw client that says how an engine answered: with a status, or by refusing."""

from __future__ import annotations

import http.client
import ssl
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from controlplane.core import ca


@dataclass(frozen=True)
class Pair:
    cert: Path
    key: Path
    serial: str


@dataclass(frozen=True)
class Pki:
    ca: Path
    server: Pair  # for 127.0.0.1 and localhost
    edge: Pair
    expired_edge: Pair
    foreign_edge: Pair  # the same name, from another CA

    def engine_flags(self) -> list[str]:
        """vLLM's (and enginesim's) flags for an engine that demands a client certificate."""
        return ["--ssl-keyfile", str(self.server.key), "--ssl-certfile", str(self.server.cert),
                "--ssl-ca-certs", str(self.ca), "--ssl-cert-reqs", "2"]


def _write(directory: Path, name: str, issued: ca.Issued) -> Pair:
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    cert.write_bytes(ca.certificate_pem(issued.certificate))
    key.write_bytes(ca.key_pem(issued.key))
    key.chmod(0o600)
    return Pair(cert, key, issued.serial)


def make_pki(directory: Path) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.now(UTC)
    authority = ca.new_authority("test engine CA", now - timedelta(days=3), timedelta(days=30))
    other = ca.new_authority("test engine CA", now - timedelta(days=3), timedelta(days=30))
    (directory / "ca.pem").write_bytes(ca.certificate_pem(authority.certificate))
    day = timedelta(days=1)
    return Pki(
        ca=directory / "ca.pem",
        server=_write(directory, "server", ca.issue(authority, "server", "r-1",
                                                    ["127.0.0.1", "localhost"], now, day)),
        edge=_write(directory, "edge", ca.issue(authority, "client", "edge-test", [], now, day)),
        expired_edge=_write(directory, "expired", ca.issue(
            authority, "client", "edge-test", [], now - 2 * day, day)),
        foreign_edge=_write(directory, "foreign", ca.issue(
            other, "client", "edge-test", [], now, day)),
    )


def client_context(pki: Pki, pair: Pair | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca))
    if pair is not None:
        context.load_cert_chain(str(pair.cert), str(pair.key))
    return context


# What `answer` returns when an engine demanding a client certificate refuses the exchange.
REFUSED = ("SSLError", "SSLEOFError", "ConnectionResetError", "RemoteDisconnected",
           "BadStatusLine")


def answer(host: str, port: int, method: str, path: str, context: ssl.SSLContext | None,
           body: str | None = None, headers: dict[str, str] | None = None) -> int | str:
    """The HTTP status, or the name of the error that ended the exchange (the TLS alert, or
    the connection closed without an answer): what `curl` reports as exit 56 or 52."""
    connection: http.client.HTTPConnection = (
        http.client.HTTPSConnection(host, port, context=context, timeout=10)
        if context is not None else http.client.HTTPConnection(host, port, timeout=10))
    try:
        connection.request(method, path, body=body,
                           headers={"content-type": "application/json", **(headers or {})})
        response = connection.getresponse()
        response.read()
        return response.status
    except (ssl.SSLError, ConnectionError, http.client.HTTPException) as exc:
        return type(exc).__name__
    finally:
        connection.close()
