"""Fixtures for the dashboard: the app wired in, a fake task broker, users per role, a fleet."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.frontend.fleet import Fleet, seed_fleet


@pytest.fixture(autouse=True)
def no_broker(sent_tasks: list[Any]) -> list[Any]:
    """Every dashboard test records its tasks instead of sending them (tests/conftest.py)."""
    return sent_tasks


@pytest.fixture
def make_user(db: Any) -> Callable[..., Any]:
    """A dashboard user with a role (and tenant), password `pw-<username>`."""
    from controlplane.core.services import ensure_user

    def make(role: str, tenant: Any = None, username: str | None = None) -> Any:
        name = username or f"{role}-{tenant.name if tenant else 'platform'}"
        user = ensure_user(name, role, tenant)
        user.set_password(f"pw-{name}")
        user.save()
        return user

    return make


@pytest.fixture
def signed_in(client: Any, make_user: Callable[..., Any]) -> Callable[..., Any]:
    """The test client, signed in as a fresh user of the given role (and tenant)."""

    def sign_in(role: str, tenant: Any = None) -> Any:
        client.force_login(make_user(role, tenant))
        return client

    return sign_in


@pytest.fixture
def fleet(catalog: dict[str, Any], tenants: dict[str, Any]) -> Fleet:
    return seed_fleet(catalog, tenants, regions=6, replicas=24, edges=2)
