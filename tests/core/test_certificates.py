"""The engine CA's services: the CA key kept like the signing key, issuing into a directory,
renewal before expiry (the periodic task), and revocation that is final."""

from __future__ import annotations

import stat
from datetime import timedelta
from pathlib import Path

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.utils import timezone

from controlplane.core import ca, certificates
from controlplane.core.models import AuditLog, Certificate
from controlplane.core.tasks import renew_certificates
from tests.engine_ca import engine_ca

pytestmark = pytest.mark.django_db
__all__ = ["engine_ca"]


def test_without_a_ca_the_message_names_the_variable_and_the_command(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MERIDIAN_CA_DIR", str(tmp_path / "none"))
    monkeypatch.delenv("MERIDIAN_CA_CERT", raising=False)
    certificates.authority_from_environment.cache_clear()
    with pytest.raises(ImproperlyConfigured, match=r"MERIDIAN_CA_DIR .* generate_ca"):
        certificates.authority()
    certificates.authority_from_environment.cache_clear()


def test_the_ca_can_come_from_the_environment_as_pem(engine_ca, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("MERIDIAN_CA_CERT", (engine_ca / "ca.pem").read_text())
    monkeypatch.setenv("MERIDIAN_CA_KEY", "not a key")
    certificates.authority_from_environment.cache_clear()
    with pytest.raises(ImproperlyConfigured, match="MERIDIAN_CA_CERT/MERIDIAN_CA_KEY key is not"):
        certificates.authority()
    monkeypatch.setenv("MERIDIAN_CA_KEY", (engine_ca / "ca-key.pem").read_text())
    certificates.authority_from_environment.cache_clear()
    assert certificates.authority().certificate.subject.rfc4514_string().endswith("O=Meridian")


def test_generate_ca_refuses_to_replace_one(engine_ca) -> None:  # type: ignore[no-untyped-def]
    assert stat.S_IMODE((engine_ca / "ca-key.pem").stat().st_mode) == 0o600
    with pytest.raises(CommandError, match="exists; pass --force"):
        call_command("generate_ca", "--dir", str(engine_ca))


def test_issuing_records_it_and_installs_its_files(engine_ca, tmp_path) -> None:  # type: ignore[no-untyped-def]
    row, issued = certificates.issue("replica:r-1", "server", "r-1", ["127.0.0.1"],
                                     tmp_path / "r-1")
    bundle = certificates.Bundle(tmp_path / "r-1")
    assert bundle.cert.read_text() == row.pem
    assert stat.S_IMODE(bundle.key.stat().st_mode) == 0o600
    assert bundle.ca.read_bytes() == (engine_ca / "ca.pem").read_bytes()
    assert row.serial == issued.serial and row.not_after > timezone.now() + timedelta(hours=47)
    assert "PRIVATE KEY" not in row.pem
    assert certificates.check(row.pem, kind="server") == row


def test_renewal_rewrites_the_files_of_certificates_near_expiry(engine_ca, tmp_path) -> None:  # type: ignore[no-untyped-def]
    old, _ = certificates.issue("edge:edge-eu", "client", "edge-eu", [], tmp_path / "edge")
    fresh, _ = certificates.issue("edge:edge-us", "client", "edge-us", [], tmp_path / "edge-us")
    nearly_over = old.not_after - timedelta(hours=1)
    assert renew_certificates() == {"renewed": []}
    # An hour before the end every certificate is due; with the clock there, both renew.
    renewed = certificates.renew_due(now=nearly_over)
    assert sorted(renewed) == ["edge:edge-eu", "edge:edge-us"]
    old.refresh_from_db()
    new = certificates.current("edge:edge-eu")
    assert new is not None and old.renewed_by == new and new.serial != old.serial
    assert certificates.Bundle(tmp_path / "edge").cert.read_text() == new.pem
    assert certificates.renew_due() == []  # the new ones are fresh: nothing is due now
    assert fresh.pk != new.pk


def test_a_revoked_certificate_is_refused_and_never_renewed(engine_ca, tmp_path) -> None:  # type: ignore[no-untyped-def]
    row, _ = certificates.issue("edge:edge-eu", "client", "edge-eu", [], tmp_path / "edge")
    certificates.revoke(row.serial.upper(), "laptop stolen", actor="alice")
    assert row.serial in certificates.revoked_serials()
    with pytest.raises(ca.CertificateProblem, match=rf"'edge-eu' \(serial {row.serial}\) is revoked"):
        certificates.check(row.pem)
    assert certificates.renew_due(now=row.not_after - timedelta(minutes=1)) == []
    audit = AuditLog.objects.get(action="certificate.revoke")
    assert (audit.actor, audit.reason) == ("alice", "laptop stolen")
    again = certificates.revoke(row.serial, "again", actor="bob")  # a second call changes nothing
    assert again.revoked_reason == "laptop stolen"
    assert AuditLog.objects.filter(action="certificate.revoke").count() == 1


def test_revocation_needs_a_known_serial_and_a_reason(engine_ca) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(LookupError, match="no certificate with serial 'abc'"):
        certificates.revoke("abc", "why", actor="alice")
    with pytest.raises(ValueError, match="needs a reason"):
        certificates.revoke("abc", " ", actor="alice")
    with pytest.raises(CommandError, match="no certificate with serial"):
        call_command("revoke_certificate", "abc", "--reason", "x")


def test_check_refuses_expired_foreign_and_unrecorded_certificates(engine_ca, tmp_path) -> None:  # type: ignore[no-untyped-def]
    row, _ = certificates.issue("edge:e", "client", "e", [], None)
    with pytest.raises(ca.CertificateProblem, match="expired at"):
        certificates.check(row.pem, now=row.not_after + timedelta(seconds=1))
    other = ca.new_authority("other CA", timezone.now(), timedelta(days=1))
    foreign = ca.issue(other, "client", "e", [], timezone.now(), timedelta(hours=1))
    with pytest.raises(ca.CertificateProblem, match="not issued by this CA"):
        certificates.check(ca.certificate_pem(foreign.certificate))
    unrecorded = ca.issue(certificates.authority(), "client", "e", [], timezone.now(),
                          timedelta(hours=1))
    with pytest.raises(ca.CertificateProblem, match="has no record"):
        certificates.check(ca.certificate_pem(unrecorded.certificate))
    with pytest.raises(ca.CertificateProblem, match="is not a PEM certificate"):
        certificates.check("-----BEGIN nonsense")


def test_issue_certificate_command_writes_an_edge_bundle(engine_ca, tmp_path) -> None:  # type: ignore[no-untyped-def]
    call_command("issue_certificate", "--subject", "edge:edge-eu", "--out", str(tmp_path / "e"))
    row = Certificate.objects.get(subject="edge:edge-eu")
    assert (row.kind, row.common_name) == ("client", "edge-eu")
    assert Path(tmp_path / "e" / "key.pem").is_file()
    with pytest.raises(CommandError, match="needs at least one address"):
        call_command("issue_certificate", "--subject", "replica:r-9", "--kind", "server",
                     "--out", str(tmp_path / "s"))


def test_the_control_plane_client_context_reuses_its_certificate(engine_ca) -> None:  # type: ignore[no-untyped-def]
    certificates.client_context()
    certificates.client_context()
    assert Certificate.objects.filter(subject=certificates.CONTROL_PLANE_SUBJECT).count() == 1
