"""A throwaway engine CA for a test: `engine_ca` points MERIDIAN_CA_DIR at a fresh one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from controlplane.core import certificates


@pytest.fixture
def engine_ca(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    directory = tmp_path / "ca"
    monkeypatch.setenv("MERIDIAN_CA_DIR", str(directory))
    monkeypatch.delenv("MERIDIAN_CA_CERT", raising=False)
    monkeypatch.delenv("MERIDIAN_CA_KEY", raising=False)
    certificates.generate_ca_files(directory)
    yield directory
    certificates.authority_from_environment.cache_clear()
