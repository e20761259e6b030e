"""The edge's side of mTLS to replicas: its client certificate, and what it refuses.

With `python -m edge --upstream-cert/--upstream-key/--upstream-ca` (files the control
plane's CA issued and renews in place), every connection to a replica is TLS, verifies the
replica's server certificate against that CA and its address, and presents the edge's
client certificate, which vLLM's `--ssl-cert-reqs 2` demands on every path. The edge
refuses, with a log line and `meridian_edge_upstream_tls_failures_total{reason}`, rather
than ever falling back to plain HTTP:

- `plain_http`: the table lists an `http://` replica;
- `expired` / `revoked`: its own certificate is past its end or listed as revoked in the
  table (`revoked_certificates`);
- `replica_revoked`: the replica presented a revoked certificate;
- `handshake`: the TLS handshake failed (an unknown CA, a wrong address, the engine
  refusing the edge's certificate).

Connections use TLS 1.2 (ECDHE, AES-GCM), so that an engine refusing the edge's certificate
fails the handshake with a named alert instead of closing the connection after it.
The files are re-read when they change (checked at most once a second, on connect), so a
renewal takes effect for new connections without a restart.
"""

from __future__ import annotations

import datetime
import logging
import os
import ssl
import time
from pathlib import Path

from cryptography import x509
from cryptography.x509.oid import NameOID

log = logging.getLogger("meridian.edge.tls")

REASONS = ("plain_http", "expired", "revoked", "replica_revoked", "handshake")
RELOAD_CHECK_S = 1.0
LOG_EVERY_S = 10.0


class TlsFilesError(ValueError):
    """The certificate, key or CA file cannot be used; the message names the file."""


def describe(certificate: x509.Certificate) -> str:
    names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    cn = str(names[0].value) if names else "(no common name)"
    return f"{cn!r} (serial {format(certificate.serial_number, 'x')})"


def peer_serial(ssl_object: ssl.SSLObject | ssl.SSLSocket | None) -> str | None:
    """The serial (hex) of the certificate a TLS peer presented."""
    if ssl_object is None:
        return None
    der = ssl_object.getpeercert(binary_form=True)
    if not der:
        return None
    return format(x509.load_der_x509_certificate(der).serial_number, "x")


class UpstreamTLS:
    """The edge's client certificate for replicas, reloaded when its files change."""

    def __init__(self, cert: Path, key: Path, ca: Path) -> None:
        self.cert, self.key, self.ca = cert, key, ca
        self._stamp: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self._checked_at = 0.0
        self._context: ssl.SSLContext | None = None
        self.serial = ""
        self.described = ""
        self.not_after = 0.0
        self._logged: dict[str, float] = {}
        self.load()

    def _mtimes(self) -> tuple[float, float, float]:
        try:
            return (os.stat(self.cert).st_mtime, os.stat(self.key).st_mtime,
                    os.stat(self.ca).st_mtime)
        except OSError as exc:
            raise TlsFilesError(f"cannot read the upstream TLS files: {exc}") from None

    def load(self) -> None:
        """Build a new context from the files; TlsFilesError naming the file at fault."""
        stamp = self._mtimes()
        try:
            certificate = x509.load_pem_x509_certificate(self.cert.read_bytes())
        except (OSError, ValueError) as exc:
            raise TlsFilesError(f"--upstream-cert {self.cert}: not a PEM certificate "
                                f"({exc})") from None
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        # TLS 1.2: an engine refusing the edge's certificate then fails the handshake itself,
        # which names the alert; in TLS 1.3 the refusal comes after it, as a bare close.
        context.maximum_version = ssl.TLSVersion.TLSv1_2
        try:
            context.load_verify_locations(cafile=str(self.ca))
        except (OSError, ssl.SSLError) as exc:
            raise TlsFilesError(f"--upstream-ca {self.ca}: {exc}") from None
        try:
            context.load_cert_chain(str(self.cert), str(self.key))
        except (OSError, ssl.SSLError) as exc:
            raise TlsFilesError(f"--upstream-key {self.key} does not go with --upstream-cert "
                                f"{self.cert}: {exc}") from None
        self._context = context
        self._stamp = stamp
        self.serial = format(certificate.serial_number, "x")
        self.described = describe(certificate)
        self.not_after = certificate.not_valid_after_utc.timestamp()

    def context(self) -> ssl.SSLContext:
        """The current context; re-read first if the files changed (a renewal)."""
        now = time.monotonic()
        if now - self._checked_at >= RELOAD_CHECK_S:
            self._checked_at = now
            try:
                if self._mtimes() != self._stamp:
                    self.load()
                    log.info("upstream TLS: loaded client certificate %s", self.described)
            except TlsFilesError as exc:
                self.note("handshake", f"keeping the previous client certificate: {exc}")
        assert self._context is not None
        return self._context

    def own_problem(self, revoked: frozenset[str]) -> tuple[str, str] | None:
        """(reason, message) when this edge's certificate must not be used."""
        self.context()  # a renewed certificate replaces an expired one here
        if time.time() >= self.not_after:
            end = datetime.datetime.fromtimestamp(self.not_after, datetime.UTC).isoformat()
            return "expired", (f"this edge's client certificate {self.described} expired at "
                               f"{end}: renew it (the control plane's CA rewrites "
                               f"{self.cert})")
        if self.serial in revoked:
            return "revoked", (f"this edge's client certificate {self.described} is revoked "
                               "(listed in the routing table): issue the edge a new one")
        return None

    def note(self, reason: str, message: str) -> None:
        """Log a refusal, at most once per reason every LOG_EVERY_S."""
        now = time.monotonic()
        if now - self._logged.get(reason, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[reason] = now
            log.error("upstream TLS refused (%s): %s", reason, message)
