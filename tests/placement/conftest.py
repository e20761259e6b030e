"""Small placement worlds: GPUs, models, sites and builders for offers and deployments.

Builders are session fixtures (plain functions underneath) so hypothesis tests can use them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from controlplane.placement.capacity import GpuSpec, ModelSpec
from controlplane.placement.problem import DeploymentRequest, OfferOption

H100 = GpuSpec("H100", 80, 3350)
L40S = GpuSpec("L40S", 48, 864)
L4 = GpuSpec("L4", 24, 300)
LLAMA_8B = ModelSpec("llama-3.1-8b", 8.03, 32, 32, 8, 128)
LLAMA_70B = ModelSpec("llama-3.1-70b", 70.55, 80, 64, 8, 128)
LLAMA_405B = ModelSpec("llama-3.1-405b", 405.85, 126, 128, 8, 128)

# region, cloud, jurisdiction, latitude, longitude
SITES = (
    ("aws:eu-central-1", "aws", "EU", 50.1, 8.7),
    ("gcp:europe-west4", "gcp", "EU", 53.4, 6.8),
    ("aws:us-east-1", "aws", "US", 38.9, -77.4),
    ("azure:uksouth", "azure", "UK", 51.5, -0.1),
    ("gcp:europe-west1", "gcp", "EU", 50.4, 3.8),
)
FRANKFURT = (50.1, 8.7)


def make_offer(i: int, site: int, gpu: GpuSpec = H100, per_node: int = 1, price: float = 4.0,
               spot: float | None = 2.0) -> OfferOption:
    region, cloud, jurisdiction, lat, lon = SITES[site]
    return OfferOption(i, region, cloud, jurisdiction, gpu, per_node, price, spot, lat, lon,
                       f"{region} {gpu.name}×{per_node}")


def make_deployment(i: int = 1, **overrides: Any) -> DeploymentRequest:
    fields: dict[str, Any] = dict(
        id=i, name=f"d{i}", model=LLAMA_8B, context=4096, tokens_per_s=0.0, min_replicas=1,
        max_replicas=4, allowed_jurisdictions=frozenset({"EU"}))
    fields.update(overrides)
    return DeploymentRequest(**fields)


@pytest.fixture(scope="session")
def offer() -> Callable[..., OfferOption]:
    return make_offer


@pytest.fixture(scope="session")
def deployment() -> Callable[..., DeploymentRequest]:
    return make_deployment
