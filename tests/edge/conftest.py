"""Fixtures for the edge's tests: a control-plane signing key, a state directory, and a
table builder in the control plane's shape. Nothing here touches Django."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from edge.local import build_table, replica_entry

API_KEY = "sk-test"
TableFactory = Callable[..., dict[str, Any]]


@pytest.fixture
def signing_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


def replica(replica_id: str, url: str = "http://127.0.0.1:9", **extra: Any) -> dict[str, Any]:
    return replica_entry(replica_id, url, **extra)


def tenant(name: str = "acme", jurisdictions: Sequence[str] = ("EU",), rpm: int = 0,
           tpm: int = 0, **extra: Any) -> dict[str, Any]:
    return {"tenant": name, "jurisdictions": list(jurisdictions), "rpm": rpm, "tpm": tpm,
            "models": ["*"], "tier": "interactive", **extra}


@pytest.fixture
def make_table() -> TableFactory:
    """`make_table(models={"m": [replica(...)]}, tenants={"sk-test": tenant()}, version=1)`."""

    def make(models: Mapping[str, Sequence[Mapping[str, Any]]] | None = None,
             tenants: Mapping[str, Mapping[str, Any]] | None = None, version: int = 1,
             edge: str = "edge-test", policy: Mapping[str, Any] | None = None,
             aliases: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return build_table(
            version, edge, models if models is not None else {"m": [replica("r1")]},
            tenants if tenants is not None else {API_KEY: tenant()},
            policy=policy, aliases=aliases)

    return make
