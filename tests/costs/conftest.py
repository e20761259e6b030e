"""Fixtures for cost tests: deployments with replicas whose billed times are set by hand."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import pytest

from controlplane.deployments.models import Deployment, Replica
from regions.models import Offer


@pytest.fixture
def make_replica(catalog):  # type: ignore[no-untyped-def]
    """A replica of `deployment` on the region's H100 offer, created (and terminated) at the
    given times; state as given."""

    def make(deployment: Deployment, region: str, created: datetime, *, state: str = "ready",
             terminated: datetime | None = None, changed: datetime | None = None,
             spot: bool = False, gpu: str = "h100") -> Replica:
        offer = Offer.objects.get(region=catalog[region], gpu_type=catalog[gpu])
        replica = Replica.objects.create(deployment=deployment, region=catalog[region],
                                         offer=offer, state=state, spot=spot)
        fields: dict[str, Any] = {"created_at": created, "terminated_at": terminated,
                                  "state_changed_at": changed or terminated or created}
        Replica.objects.filter(pk=replica.pk).update(**fields)
        replica.refresh_from_db()
        return replica

    return make


@pytest.fixture
def make_deployment(catalog):  # type: ignore[no-untyped-def]
    def make(name: str, served: str = "llama-3.1-8b", tenant: Any = None, tp: int = 1,
             pp: int = 1) -> Deployment:
        deployment = Deployment.objects.create(
            name=name, served_model_name=served, model=catalog["llama8b"], tenant=tenant,
            tensor_parallel=tp, pipeline_parallel=pp)
        deployment.allowed_jurisdictions.set([catalog["eu"], catalog["us"]])
        return deployment

    return make
