"""The protocol's small types: errors keep their kind across process boundaries."""

from __future__ import annotations

import pickle

from controlplane.provisioning.base import ProviderError, ProviderStatus


def test_provider_error_survives_pickling_with_its_kind() -> None:
    error = pickle.loads(pickle.dumps(ProviderError("quota", "no H100:8 quota in aws:us-east-1")))
    assert (error.kind, error.message) == ("quota", "no H100:8 quota in aws:us-east-1")
    assert str(error) == "quota: no H100:8 quota in aws:us-east-1"


def test_unknown_error_kinds_become_other() -> None:
    assert ProviderError("cosmic-rays", "bit flip").kind == "other"


def test_only_timeouts_and_unavailability_are_transient() -> None:
    assert ProviderError("timeout", "").transient and ProviderError("unavailable", "").transient
    for kind in ("no_capacity", "quota", "credentials", "invalid", "other"):
        assert not ProviderError(kind, "").transient


def test_a_status_says_why_it_failed_only_when_known() -> None:
    assert ProviderStatus("running").error_kind == ""
    assert ProviderStatus("failed", "no capacity", error_kind="no_capacity").error_kind
