"""The engine CA's certificate math: pure functions over `cryptography` objects.

The control plane runs one small certificate authority for the data plane (DESIGN §7): a
server certificate per replica (its address in the subjectAltName), a client certificate
per edge, and client certificates for the scrapers (Prometheus, the control plane's own
readiness checks and scrapes). Nothing here touches the database, the environment or the
clock: callers pass `now`, and storage, renewal and revocation records live in
`controlplane.core.certificates`.

Keys are ECDSA P-256 (fast to make, accepted by every TLS stack vLLM and Prometheus use);
signatures SHA-256. `check_certificate` is what the control plane uses to refuse a
certificate, and every refusal is a `CertificateProblem` whose message names the
certificate (its common name and serial) and the problem.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from datetime import datetime, timedelta

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

KINDS = ("server", "client")
# Generous enough for clocks a little apart, small enough not to matter.
BACKDATE = timedelta(minutes=5)
_HOSTNAME = re.compile(r"^(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)"
                       r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")


class CertificateProblem(ValueError):
    """A certificate that must not be used: the message names it and says why."""


@dataclass(frozen=True)
class Authority:
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate


@dataclass(frozen=True)
class Issued:
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate

    @property
    def serial(self) -> str:
        return serial_hex(self.certificate)


def serial_hex(certificate: x509.Certificate) -> str:
    return format(certificate.serial_number, "x")


def common_name(certificate: x509.Certificate) -> str:
    names = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if names else "(no common name)"


def describe(certificate: x509.Certificate) -> str:
    """How a message names a certificate: `edge-eu (serial 1f3a…)`."""
    return f"{common_name(certificate)!r} (serial {serial_hex(certificate)})"


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "Meridian"),
                      x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _check_cn(cn: str) -> None:
    if not cn or len(cn) > 64 or any(c.isspace() or not c.isprintable() for c in cn):
        raise ValueError(f"common name {cn!r} must be 1-64 printable characters, no spaces")


def subject_alt_name(address: str) -> x509.GeneralName:
    """An IP address or a DNS name for the subjectAltName; ValueError naming a bad one."""
    host = address.strip("[]")
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        pass
    if not _HOSTNAME.match(host):
        raise ValueError(f"address {address!r} is neither an IP address nor a DNS name")
    return x509.DNSName(host.lower())


def new_authority(cn: str, now: datetime, lifetime: timedelta) -> Authority:
    """A self-signed CA that may sign leaf certificates only (path length 0)."""
    if not cn.strip() or len(cn) > 64:
        raise ValueError(f"CA common name {cn!r} must be 1-64 characters")
    if lifetime <= timedelta(0):
        raise ValueError(f"CA lifetime must be positive, not {lifetime}")
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(cn)
    ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
    certificate = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE).not_valid_after(now + lifetime)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False), critical=True)
        .add_extension(ski, critical=False)
        .sign(key, hashes.SHA256()))
    return Authority(key, certificate)


def issue(authority: Authority, kind: str, cn: str, addresses: list[str], now: datetime,
          lifetime: timedelta) -> Issued:
    """A leaf certificate and its new key. A server certificate must name at least one
    address (what clients check the connection against); a client one may name none."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {list(KINDS)}, not {kind!r}")
    _check_cn(cn)
    if lifetime <= timedelta(0):
        raise ValueError(f"lifetime must be positive, not {lifetime}")
    if kind == "server" and not addresses:
        raise ValueError(f"a server certificate for {cn!r} needs at least one address")
    sans = [subject_alt_name(a) for a in addresses]
    ca_cert = authority.certificate
    not_after = min(now + lifetime, ca_cert.not_valid_after_utc)
    if not_after <= now:
        raise CertificateProblem(f"the CA certificate {describe(ca_cert)} expired at "
                                 f"{ca_cert.not_valid_after_utc.isoformat()}: make a new CA")
    key = ec.generate_private_key(ec.SECP256R1())
    usage = ExtendedKeyUsageOID.SERVER_AUTH if kind == "server" else ExtendedKeyUsageOID.CLIENT_AUTH
    builder = (
        x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE).not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=False,
            crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(
            authority.key.public_key()), critical=False))
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return Issued(key, builder.sign(authority.key, hashes.SHA256()))


def check_certificate(certificate: x509.Certificate, ca_certificate: x509.Certificate,
                      now: datetime, revoked: frozenset[str] | set[str] = frozenset(),
                      kind: str | None = None) -> None:
    """Raise CertificateProblem, naming the certificate, unless it was signed by this CA,
    is valid at `now`, is not revoked and (when `kind` is given) is for that use."""
    who = describe(certificate)
    if certificate.issuer != ca_certificate.subject:
        raise CertificateProblem(f"certificate {who} was not issued by this CA (issuer "
                                 f"{certificate.issuer.rfc4514_string()!r})")
    try:
        certificate.verify_directly_issued_by(ca_certificate)
    except (InvalidSignature, ValueError, TypeError) as exc:
        raise CertificateProblem(f"certificate {who} was not signed by this CA's key "
                                 f"({type(exc).__name__})") from None
    if now < certificate.not_valid_before_utc:
        raise CertificateProblem(f"certificate {who} is not valid before "
                                 f"{certificate.not_valid_before_utc.isoformat()}")
    if now >= certificate.not_valid_after_utc:
        raise CertificateProblem(f"certificate {who} expired at "
                                 f"{certificate.not_valid_after_utc.isoformat()}")
    if serial_hex(certificate) in revoked:
        raise CertificateProblem(f"certificate {who} is revoked")
    if kind is not None:
        wanted = (ExtendedKeyUsageOID.SERVER_AUTH if kind == "server"
                  else ExtendedKeyUsageOID.CLIENT_AUTH)
        try:
            usages = certificate.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        except x509.ExtensionNotFound:
            usages = x509.ExtendedKeyUsage([])
        if wanted not in usages:
            raise CertificateProblem(f"certificate {who} is not a {kind} certificate")


def needs_renewal(certificate: x509.Certificate, now: datetime,
                  remaining_fraction: float = 1 / 3) -> bool:
    """Due once less than `remaining_fraction` of its lifetime is left (or it has expired)."""
    start, end = certificate.not_valid_before_utc, certificate.not_valid_after_utc
    return end - now <= (end - start) * remaining_fraction


def certificate_pem(certificate: x509.Certificate) -> bytes:
    return certificate.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def load_certificate(pem: bytes | str, source: str) -> x509.Certificate:
    data = pem.encode() if isinstance(pem, str) else pem
    try:
        return x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise CertificateProblem(f"{source} is not a PEM certificate: {exc}") from None


def load_authority(certificate_text: bytes | str, key_text: bytes | str,
                   source: str) -> Authority:
    """A CA from its PEM certificate and key; CertificateProblem naming `source` when the two
    do not belong together or the certificate is not a CA's."""
    certificate = load_certificate(certificate_text, f"{source} certificate")
    data = key_text.encode() if isinstance(key_text, str) else key_text
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise CertificateProblem(f"{source} key is not a PEM private key: {exc}") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise CertificateProblem(f"{source} key must be an EC key, not {type(key).__name__}")
    if key.public_key().public_numbers() != certificate.public_key().public_numbers():  # type: ignore[union-attr]
        raise CertificateProblem(f"{source} key does not match its certificate "
                                 f"{describe(certificate)}")
    try:
        constraints = certificate.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = x509.BasicConstraints(ca=False, path_length=None)
    if not constraints.ca:
        raise CertificateProblem(f"{source} certificate {describe(certificate)} is not a CA")
    return Authority(key, certificate)
