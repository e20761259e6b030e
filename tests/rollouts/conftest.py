"""The rollouts tests' shared fixtures: a platform deployment with one ready replica in
Frankfurt, and a platform operator's API client (a module may define its own instead)."""

from __future__ import annotations

import pytest

from controlplane.core.models import Role
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from tests.api.test_endpoints_crud import make_deployment


@pytest.fixture
def deployment(catalog, tenants):  # type: ignore[no-untyped-def]
    deployment = make_deployment({**catalog, **tenants}, "chat-eu", tenant=None)
    Replica.objects.create(deployment=deployment, region=catalog["fra"], state=S.READY,
                           url="http://10.0.0.1:8000")
    return deployment


@pytest.fixture
def operator(make_client):  # type: ignore[no-untyped-def]
    return make_client(Role.OPERATOR)
