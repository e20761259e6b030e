"""The lab's local regions: each stands for a real cloud region on another continent.

A local region copies its real region's coordinates and jurisdiction, and offers the real
region's single-GPU H100 price, so placement, latency emulation and residency in the lab
behave as they would in that cloud.
"""

from __future__ import annotations

from dataclasses import dataclass
from decimal import Decimal

from django.db import transaction
from django.utils import timezone

from regions.models import Cloud, GpuType, Offer, Quota, Region


@dataclass(frozen=True)
class LabRegion:
    code: str
    stands_for: str  # cloud:code of a catalog region


LAB_REGIONS = (
    LabRegion("eu-frankfurt", "aws:eu-central-1"),
    LabRegion("us-virginia", "aws:us-east-1"),
    LabRegion("ap-tokyo", "aws:ap-northeast-1"),
)
LAB_GPU = "H100"
LAB_QUOTA_GPUS = 8
DEFAULT_PRICE = Decimal("4.0000")


@transaction.atomic
def ensure_lab_regions(regions: tuple[LabRegion, ...] = LAB_REGIONS) -> list[Region]:
    """Create or refresh the `local` cloud's regions, offers and quota (idempotent)."""
    cloud, _ = Cloud.objects.update_or_create(
        name="local", defaults={"display_name": "Local lab", "skypilot_name": ""}
    )
    gpu = GpuType.objects.get(name=LAB_GPU)
    now = timezone.now()
    made = []
    for lab in regions:
        cloud_name, code = lab.stands_for.split(":")
        real = Region.objects.select_related("jurisdiction").get(cloud__name=cloud_name, code=code)
        region, _ = Region.objects.update_or_create(
            cloud=cloud, code=lab.code,
            defaults={
                "display_name": f"Lab: {real.display_name}", "latitude": real.latitude,
                "longitude": real.longitude, "country": real.country,
                "jurisdiction": real.jurisdiction,
            },
        )
        real_offer = (
            Offer.objects.filter(region=real, gpu_type=gpu, gpus_per_node=1)
            .order_by("on_demand_usd_h").first()
        )
        price = real_offer.on_demand_usd_h if real_offer else DEFAULT_PRICE
        spot = real_offer.spot_usd_h if real_offer else None
        Offer.objects.update_or_create(
            region=region, gpu_type=gpu, gpus_per_node=1, instance_type="enginesim",
            defaults={"on_demand_usd_h": price, "spot_usd_h": spot, "source": "lab",
                      "observed_at": now},
        )
        Quota.objects.update_or_create(
            region=region, gpu_type=gpu,
            defaults={"limit_gpus": LAB_QUOTA_GPUS, "source": "lab", "observed_at": now},
        )
        made.append(region)
    return made
