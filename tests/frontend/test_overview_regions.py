"""The overview's regions figure is a share a reader of a small lab understands: regions
serving of the regions this fleet uses, with the regions open to placement beside it (it
said "1 of 71 open" in a three-region lab)."""

from __future__ import annotations

from typing import Any

import pytest

from controlplane.core.models import Role
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from tests.api.test_endpoints_crud import make_deployment

pytestmark = pytest.mark.django_db


def test_regions_serving_are_counted_of_the_regions_in_use(signed_in, catalog: dict[str, Any],  # type: ignore[no-untyped-def]
                                                           tenants: dict[str, Any]) -> None:
    deployment = make_deployment({**catalog, **tenants}, "chat", tenant=None)
    Replica.objects.filter(deployment=deployment).delete()
    for region, state in ((catalog["fra"], S.READY), (catalog["ams"], S.FAILED),
                          (catalog["fra"], S.TERMINATED)):
        Replica.objects.create(deployment=deployment, region=region, state=state)
    response = signed_in(Role.VIEWER).get("/")
    overview = response.context["fleet"]
    assert (overview.regions_serving, overview.regions_used) == (1, 2)
    assert overview.regions_enabled > 2  # more regions are open than the fleet uses
    html = response.content.decode()
    assert '1<span class="unit"> of 2 regions in use</span>' in html
    assert f"{overview.regions_enabled} regions open to placement" in html
    assert " open</span>" not in html
