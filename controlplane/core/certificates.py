"""The engine CA's services: where its key lives, issuing, renewing and revoking certificates.

The CA's certificate and key come from MERIDIAN_CA_CERT and MERIDIAN_CA_KEY (PEM text), or
from the files in MERIDIAN_CA_DIR (default var/keys: `ca.pem`, `ca-key.pem`, written by
`python manage.py generate_ca`), never from the repository, like the table signing key.

Every certificate issued is recorded (`core.models.Certificate`, never its key). One with an
`install_dir` has its files there (`cert.pem`, `key.pem` 0600, `ca.pem`), and
`renew_due` rewrites them before it expires, atomically, so that vLLM's
`--enable-ssl-refresh` and the edge pick the new pair up. A revoked certificate is refused
here from then on (`check`), is never renewed, and is listed in every routing table so that
edges refuse it too. Certificate math is `controlplane.core.ca`'s.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import lru_cache
from pathlib import Path

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.utils import timezone

from controlplane.core import ca
from controlplane.core.locks import advisory_lock
from controlplane.core.models import Certificate
from controlplane.core.services import record_audit
from controlplane.env import env_float

CA_CERT_FILE = "ca.pem"
CA_KEY_FILE = "ca-key.pem"
CERT_FILE, KEY_FILE, BUNDLE_FILE = "cert.pem", "key.pem", "ca.pem"
CA_LIFETIME = timedelta(days=3650)
RENEW_LOCK = "core.renew_certificates"
# The control plane's own client certificate (readiness checks, scrapes, probes).
CONTROL_PLANE_SUBJECT = "scraper:controlplane"


def lifetime() -> timedelta:
    """How long a leaf certificate lives (MERIDIAN_CERT_LIFETIME_H, default 48 h); it is
    renewed once a third of that is left."""
    return timedelta(hours=env_float("MERIDIAN_CERT_LIFETIME_H", 48.0, above=0.0))


def ca_dir() -> Path:
    return Path(os.environ.get("MERIDIAN_CA_DIR", settings.VAR_DIR / "keys"))


def generate_ca_files(directory: Path, overwrite: bool = False,
                      cn: str = "Meridian engine CA") -> tuple[Path, Path]:
    """Write a new CA certificate and its key (0600); refuse to replace one unless told."""
    cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
    if key_path.exists() and not overwrite:
        raise FileExistsError(f"{key_path} exists; pass --force to replace it (every "
                              "certificate it issued stops being trusted)")
    authority = ca.new_authority(cn, timezone.now(), CA_LIFETIME)
    directory.mkdir(parents=True, exist_ok=True)
    _write(key_path, ca.key_pem(authority.key), private=True)
    _write(cert_path, ca.certificate_pem(authority.certificate))
    authority_from_environment.cache_clear()
    return cert_path, key_path


@lru_cache(maxsize=1)
def authority_from_environment() -> ca.Authority:
    cert_text, key_text = os.environ.get("MERIDIAN_CA_CERT"), os.environ.get("MERIDIAN_CA_KEY")
    source = "MERIDIAN_CA_CERT/MERIDIAN_CA_KEY"
    if not cert_text or not key_text:
        directory = ca_dir()
        source = f"MERIDIAN_CA_DIR ({directory})"
        cert_path, key_path = directory / CA_CERT_FILE, directory / CA_KEY_FILE
        if not key_path.exists() or not cert_path.exists():
            raise ImproperlyConfigured(f"{source} holds no engine CA ({CA_CERT_FILE}, "
                                       f"{CA_KEY_FILE}); run `python manage.py generate_ca`")
        cert_text, key_text = cert_path.read_text(), key_path.read_text()
    try:
        return ca.load_authority(cert_text, key_text, source)
    except ca.CertificateProblem as exc:
        raise ImproperlyConfigured(str(exc)) from None


def authority() -> ca.Authority:
    return authority_from_environment()


def ca_pem() -> bytes:
    return ca.certificate_pem(authority().certificate)


def _write(path: Path, data: bytes, private: bool = False) -> None:
    """Atomically: a reader (vLLM's refresh, the edge) sees the old file or the new one."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)
    tmp.replace(path)


def install(directory: Path, issued: ca.Issued) -> None:
    """The key first, then the certificate: a pair is only ever complete once both moved."""
    directory.mkdir(parents=True, exist_ok=True)
    _write(directory / BUNDLE_FILE, ca_pem())
    _write(directory / KEY_FILE, ca.key_pem(issued.key), private=True)
    _write(directory / CERT_FILE, ca.certificate_pem(issued.certificate))


@dataclass(frozen=True)
class Bundle:
    """Where an installed certificate's files are."""

    directory: Path

    @property
    def cert(self) -> Path:
        return self.directory / CERT_FILE

    @property
    def key(self) -> Path:
        return self.directory / KEY_FILE

    @property
    def ca(self) -> Path:
        return self.directory / BUNDLE_FILE


def issue(subject: str, kind: str, cn: str, addresses: list[str] | None = None,
          install_dir: Path | str | None = None, *,
          valid_for: timedelta | None = None) -> tuple[Certificate, ca.Issued]:
    """Issue and record a certificate; with `install_dir`, write its files there too."""
    if not subject or len(subject) > 100:
        raise ValueError(f"subject {subject!r} must be 1-100 characters")
    now = timezone.now()
    issued = ca.issue(authority(), kind, cn, list(addresses or []), now,
                      valid_for or lifetime())
    with transaction.atomic():
        row = Certificate.objects.create(
            subject=subject, kind=kind, serial=issued.serial, common_name=cn,
            addresses=list(addresses or []),
            not_before=issued.certificate.not_valid_before_utc,
            not_after=issued.certificate.not_valid_after_utc,
            pem=ca.certificate_pem(issued.certificate).decode(),
            install_dir=str(install_dir or ""))
        if install_dir:
            install(Path(install_dir), issued)
    return row, issued


def current(subject: str) -> Certificate | None:
    """The subject's newest certificate that is neither revoked nor renewed."""
    return (Certificate.objects.filter(subject=subject, revoked_at__isnull=True,
                                       renewed_by__isnull=True)
            .order_by("-not_after").first())


def ensure_installed(subject: str, kind: str, cn: str, addresses: list[str],
                     directory: Path) -> Bundle:
    """The subject's certificate in `directory`, issued now unless a usable one with the
    same addresses is already there (so a restart does not mint a new one). Processes that
    ask at once (the lab's web and workers) take turns, so a key and a certificate written
    into one directory always belong together."""
    bundle = Bundle(directory)
    with advisory_lock(f"certificates:{directory}", wait_s=30.0):
        row = current(subject)
        if (row is not None and row.install_dir == str(directory)
                and row.addresses == addresses
                and bundle.cert.is_file() and bundle.key.is_file()
                and bundle.cert.read_text() == row.pem
                and not ca.needs_renewal(ca.load_certificate(row.pem, subject),
                                         timezone.now())):
            return bundle
        issue(subject, kind, cn, addresses, directory)
    return bundle


def revoke(serial: str, reason: str, actor: str) -> Certificate:
    """Record the revocation (once; a second call changes nothing). LookupError naming the
    serial when no such certificate was issued."""
    if not reason.strip():
        raise ValueError("a revocation needs a reason")
    with transaction.atomic():
        row = Certificate.objects.select_for_update().filter(serial=serial.lower()).first()
        if row is None:
            raise LookupError(f"no certificate with serial {serial!r} was issued by this CA")
        if row.revoked_at is None:
            row.revoked_at, row.revoked_reason = timezone.now(), reason
            row.save(update_fields=["revoked_at", "revoked_reason"])
            record_audit(actor, "certificate.revoke", row, reason=reason,
                         changes={"serial": row.serial, "subject": row.subject})
    return row


def revoked_serials(now: datetime | None = None) -> frozenset[str]:
    """Serials revoked and not yet expired: what tables carry and edges refuse."""
    rows = Certificate.objects.filter(revoked_at__isnull=False,
                                      not_after__gt=now or timezone.now())
    return frozenset(rows.values_list("serial", flat=True))


def check(pem: str | bytes, kind: str | None = None, now: datetime | None = None) -> Certificate:
    """The record of a certificate this CA issued, or CertificateProblem naming it: not
    ours, not yet valid, expired, revoked or for another use."""
    certificate = ca.load_certificate(pem, "the certificate")
    ca.check_certificate(certificate, authority().certificate, now or timezone.now(),
                         revoked_serials(), kind)
    row = Certificate.objects.filter(serial=ca.serial_hex(certificate)).first()
    if row is None:
        raise ca.CertificateProblem(f"certificate {ca.describe(certificate)} has no record: "
                                    "the CA's key signed it, but the control plane did not")
    return row


def renew_due(now: datetime | None = None) -> list[str]:
    """Renew every installed certificate with less than a third of its life left; returns
    the subjects renewed. Revoked ones are refused: a revocation is never undone here."""
    now = now or timezone.now()
    renewed = []
    rows = Certificate.objects.filter(revoked_at__isnull=True, renewed_by__isnull=True,
                                      not_after__gt=now - timedelta(days=1)).exclude(install_dir="")
    for row in rows:
        certificate = ca.load_certificate(row.pem, row.subject)
        if not ca.needs_renewal(certificate, now):
            continue
        with (advisory_lock(f"certificates:{row.install_dir}", wait_s=30.0),
              transaction.atomic()):
            locked = Certificate.objects.select_for_update().get(pk=row.pk)
            if locked.renewed_by_id is not None or locked.revoked_at is not None:
                continue
            new, _ = issue(locked.subject, locked.kind, locked.common_name,
                           list(locked.addresses), locked.install_dir)
            locked.renewed_by = new
            locked.save(update_fields=["renewed_by"])
        renewed.append(row.subject)
    return renewed


def replica_tls_name(replica_id: str) -> str:
    """The DNS-style name every replica's server certificate carries, whatever its address
    (unknown before a cloud node is up): what edges check (the table's `tls_name`)."""
    return f"{replica_id}.replicas.meridian"


def engine_client_context() -> ssl.SSLContext | None:
    """The control plane's client context for engines, or None where engines run without
    mTLS (settings.ENGINE_TLS off: tests with fake engines only)."""
    return client_context() if settings.ENGINE_TLS else None


def client_context(subject: str = CONTROL_PLANE_SUBJECT,
                   directory: Path | None = None) -> ssl.SSLContext:
    """A TLS client context that trusts the engine CA and presents `subject`'s client
    certificate: for the control plane's own readiness checks, scrapes and probes."""
    directory = directory or ca_dir() / "clients" / subject.replace(":", "-")
    bundle = ensure_installed(subject, "client", subject.split(":", 1)[-1], [], directory)
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(bundle.ca))
    # The chain to the engine CA and the server usage are checked, not the name: a cloud
    # node's address is not known when its certificate is issued (edges check the name the
    # table gives, `tls_name`).
    context.check_hostname = False
    context.load_cert_chain(str(bundle.cert), str(bundle.key))
    return context
