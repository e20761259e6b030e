"""`Replica.objects.staying()`: the replicas a deployment keeps once its drains finish."""

from __future__ import annotations

import pytest

from controlplane.deployments.lifecycle import STAYING_STATES
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from tests.api.test_endpoints_crud import make_deployment


@pytest.mark.django_db
def test_staying_is_live_and_not_draining(catalog, tenants):  # type: ignore[no-untyped-def]
    deployment = make_deployment({**catalog, **tenants}, "chat")
    made = {state: Replica.objects.create(deployment=deployment, region=catalog["fra"],
                                          state=state).pk
            for state in S.values}
    staying = set(Replica.objects.staying().values_list("pk", flat=True))
    assert staying == {made[s] for s in (S.PENDING, S.PROVISIONING, S.STARTING, S.READY,
                                         S.DEGRADED)}
    assert staying == {made[s] for s in STAYING_STATES}
    # It chains with the other filters, tenancy's included.
    assert set(deployment.replicas.staying().filter(state=S.READY)
               .values_list("pk", flat=True)) == {made[S.READY]}
