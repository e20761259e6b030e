"""The engine CA's certificate math: what it issues, and every refusal naming the problem."""

from __future__ import annotations

import ipaddress
import ssl
from datetime import UTC, datetime, timedelta

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from controlplane.core import ca

NOW = datetime(2026, 11, 27, 12, 0, tzinfo=UTC)
DAY = timedelta(days=1)


@pytest.fixture(scope="module")
def authority() -> ca.Authority:
    return ca.new_authority("test CA", NOW, timedelta(days=30))


def test_a_server_certificate_names_its_addresses_and_is_for_servers(authority) -> None:  # type: ignore[no-untyped-def]
    issued = ca.issue(authority, "server", "r-12", ["10.0.0.7", "engine.example.com"], NOW, DAY)
    cert = issued.certificate
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]
    assert sans.get_values_for_type(x509.DNSName) == ["engine.example.com"]
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(usage) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert cert.not_valid_after_utc == NOW + DAY
    ca.check_certificate(cert, authority.certificate, NOW, kind="server")


def test_python_tls_accepts_the_pair_and_the_chain(authority, tmp_path) -> None:  # type: ignore[no-untyped-def]
    issued = ca.issue(authority, "client", "edge-eu", [], NOW, DAY)
    (tmp_path / "c.pem").write_bytes(ca.certificate_pem(issued.certificate))
    (tmp_path / "k.pem").write_bytes(ca.key_pem(issued.key))
    (tmp_path / "ca.pem").write_bytes(ca.certificate_pem(authority.certificate))
    context = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    context.load_cert_chain(str(tmp_path / "c.pem"), str(tmp_path / "k.pem"))


@pytest.mark.parametrize(("at", "problem"), [
    (NOW + 2 * DAY, "expired at"),
    (NOW - DAY, "is not valid before"),
])
def test_outside_its_lifetime_a_certificate_is_refused(authority, at, problem) -> None:  # type: ignore[no-untyped-def]
    issued = ca.issue(authority, "client", "edge-eu", [], NOW, DAY)
    with pytest.raises(ca.CertificateProblem, match=rf"'edge-eu' \(serial {issued.serial}\) {problem}"):
        ca.check_certificate(issued.certificate, authority.certificate, at)


def test_a_revoked_certificate_is_refused(authority) -> None:  # type: ignore[no-untyped-def]
    issued = ca.issue(authority, "client", "edge-eu", [], NOW, DAY)
    with pytest.raises(ca.CertificateProblem, match="'edge-eu' .* is revoked"):
        ca.check_certificate(issued.certificate, authority.certificate, NOW,
                             revoked={issued.serial})


def test_a_certificate_from_another_ca_is_refused(authority) -> None:  # type: ignore[no-untyped-def]
    other = ca.new_authority("other CA", NOW, timedelta(days=30))
    issued = ca.issue(other, "client", "edge-eu", [], NOW, DAY)
    with pytest.raises(ca.CertificateProblem, match="not issued by this CA"):
        ca.check_certificate(issued.certificate, authority.certificate, NOW)
    # The same name, another key: the signature gives it away.
    impostor = ca.new_authority("test CA", NOW, timedelta(days=30))
    forged = ca.issue(impostor, "client", "edge-eu", [], NOW, DAY)
    with pytest.raises(ca.CertificateProblem, match="not signed by this CA's key"):
        ca.check_certificate(forged.certificate, authority.certificate, NOW)


def test_a_client_certificate_is_not_a_server_one(authority) -> None:  # type: ignore[no-untyped-def]
    issued = ca.issue(authority, "client", "edge-eu", [], NOW, DAY)
    with pytest.raises(ca.CertificateProblem, match="is not a server certificate"):
        ca.check_certificate(issued.certificate, authority.certificate, NOW, kind="server")


@pytest.mark.parametrize(("kind", "cn", "addresses", "lifetime", "message"), [
    ("peer", "x", [], DAY, "kind must be one of"),
    ("server", "r-1", [], DAY, "needs at least one address"),
    ("server", "r-1", ["not a host!"], DAY, "neither an IP address nor a DNS name"),
    ("client", "", [], DAY, "common name"),
    ("client", "two words", [], DAY, "common name"),
    ("client", "x", [], timedelta(0), "lifetime must be positive"),
])
def test_bad_requests_are_refused_naming_the_field(authority, kind, cn, addresses, lifetime,  # type: ignore[no-untyped-def]
                                                   message) -> None:
    with pytest.raises(ValueError, match=message):
        ca.issue(authority, kind, cn, addresses, NOW, lifetime)


def test_a_leaf_never_outlives_its_ca(authority) -> None:  # type: ignore[no-untyped-def]
    issued = ca.issue(authority, "client", "edge-eu", [], NOW, timedelta(days=365))
    assert issued.certificate.not_valid_after_utc == authority.certificate.not_valid_after_utc
    with pytest.raises(ca.CertificateProblem, match="CA certificate .* expired"):
        ca.issue(authority, "client", "edge-eu", [], NOW + timedelta(days=31), DAY)


def test_renewal_is_due_once_a_third_of_the_life_is_left(authority) -> None:  # type: ignore[no-untyped-def]
    cert = ca.issue(authority, "client", "e", [], NOW, timedelta(hours=30)).certificate
    life = cert.not_valid_after_utc - cert.not_valid_before_utc
    assert not ca.needs_renewal(cert, cert.not_valid_after_utc - life / 3 - timedelta(minutes=1))
    assert ca.needs_renewal(cert, cert.not_valid_after_utc - life / 3)
    assert ca.needs_renewal(cert, cert.not_valid_after_utc + DAY)


def test_loading_a_ca_checks_its_key_and_that_it_is_one(authority) -> None:  # type: ignore[no-untyped-def]
    cert_pem = ca.certificate_pem(authority.certificate)
    loaded = ca.load_authority(cert_pem, ca.key_pem(authority.key), "MERIDIAN_CA_DIR")
    assert loaded.certificate == authority.certificate
    other = ca.new_authority("other CA", NOW, DAY)
    with pytest.raises(ca.CertificateProblem, match="MERIDIAN_CA_DIR key does not match"):
        ca.load_authority(cert_pem, ca.key_pem(other.key), "MERIDIAN_CA_DIR")
    leaf = ca.issue(authority, "client", "e", [], NOW, DAY)
    with pytest.raises(ca.CertificateProblem, match="is not a CA"):
        ca.load_authority(ca.certificate_pem(leaf.certificate), ca.key_pem(leaf.key), "X")
    with pytest.raises(ca.CertificateProblem, match="X certificate is not a PEM certificate"):
        ca.load_authority(b"garbage", ca.key_pem(leaf.key), "X")
