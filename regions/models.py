"""The GPU inventory: clouds, jurisdictions, regions, GPU types, offers (prices) and quota.

Offers and quota are observations: each carries where it came from and when, so stale
figures can be shown as stale instead of passing for current ones.
"""

from __future__ import annotations

from decimal import Decimal

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models
from django.db.models import F, Q


class Cloud(models.Model):
    name = models.SlugField(max_length=32, unique=True)
    display_name = models.CharField(max_length=64)
    skypilot_name = models.CharField(
        max_length=32, blank=True, help_text="SkyPilot's identifier; empty if not SkyPilot-driven."
    )
    enabled = models.BooleanField(default=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Jurisdiction(models.Model):
    """A legal area data may be restricted to (EU, US, UK, …)."""

    code = models.CharField(max_length=8, unique=True)
    name = models.CharField(max_length=128)

    class Meta:
        ordering = ["code"]

    def __str__(self) -> str:
        return self.code


class Region(models.Model):
    cloud = models.ForeignKey(Cloud, on_delete=models.PROTECT, related_name="regions")
    code = models.CharField(max_length=64)
    display_name = models.CharField(max_length=128)
    latitude = models.FloatField(validators=[MinValueValidator(-90), MaxValueValidator(90)])
    longitude = models.FloatField(validators=[MinValueValidator(-180), MaxValueValidator(180)])
    country = models.CharField(max_length=2, help_text="ISO 3166-1 alpha-2")
    jurisdiction = models.ForeignKey(
        Jurisdiction, on_delete=models.PROTECT, related_name="regions"
    )
    enabled = models.BooleanField(default=True)

    class Meta:
        ordering = ["cloud__name", "code"]
        constraints = [
            models.UniqueConstraint(fields=["cloud", "code"], name="region_unique_per_cloud")
        ]

    @property
    def key(self) -> str:
        """`cloud:code`, the name used in routing tables and on the command line."""
        return f"{self.cloud.name}:{self.code}"

    @staticmethod
    def key_filter(key: str, prefix: str = "") -> dict[str, str]:
        """Filter arguments that select the region named `key` (`cloud:code`), from a model
        that reaches regions through `prefix` (e.g. "region__")."""
        cloud, _, code = (key or "").partition(":")
        return {f"{prefix}cloud__name": cloud, f"{prefix}code": code}

    def __str__(self) -> str:
        return self.key


class GpuType(models.Model):
    name = models.CharField(max_length=32, unique=True)
    vendor = models.CharField(max_length=16, default="nvidia")
    memory_gib = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    memory_bandwidth_gbps = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    bf16_tflops = models.FloatField(validators=[MinValueValidator(0)])
    fp16_tflops = models.FloatField(validators=[MinValueValidator(0)])
    skypilot_name = models.CharField(max_length=32, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Offer(models.Model):
    """A machine shape a region sells: GPUs per node and its $/h, on demand and spot."""

    region = models.ForeignKey(Region, on_delete=models.CASCADE, related_name="offers")
    gpu_type = models.ForeignKey(GpuType, on_delete=models.PROTECT, related_name="offers")
    gpus_per_node = models.PositiveSmallIntegerField(
        validators=[MinValueValidator(1), MaxValueValidator(16)]
    )
    instance_type = models.CharField(max_length=64, blank=True)
    on_demand_usd_h = models.DecimalField(
        max_digits=10, decimal_places=4, validators=[MinValueValidator(Decimal("0"))]
    )
    spot_usd_h = models.DecimalField(
        max_digits=10, decimal_places=4, null=True, blank=True,
        validators=[MinValueValidator(Decimal("0"))],
    )
    source = models.CharField(max_length=64, default="catalog")
    observed_at = models.DateTimeField()

    class Meta:
        ordering = ["region__cloud__name", "region__code", "gpu_type__name", "gpus_per_node"]
        constraints = [
            models.UniqueConstraint(
                fields=["region", "gpu_type", "gpus_per_node", "instance_type"],
                name="offer_unique_shape",
            ),
            models.CheckConstraint(
                condition=Q(spot_usd_h__isnull=True) | Q(spot_usd_h__lte=F("on_demand_usd_h")),
                name="offer_spot_not_above_on_demand",
            ),
        ]

    @property
    def is_list_price(self) -> bool:
        """A price from the catalog file (source `catalog:<as_of>`): information dated by the
        file, not an observation that was supposed to refresh, so never stale."""
        return self.source.startswith("catalog:")

    @property
    def list_price_date(self) -> str:
        return self.source.removeprefix("catalog:") if self.is_list_price else ""

    def __str__(self) -> str:
        return f"{self.region} {self.gpu_type}:{self.gpus_per_node}"


class Quota(models.Model):
    """How many GPUs of a type an account may run in a region, and how many it runs."""

    region = models.ForeignKey(Region, on_delete=models.CASCADE, related_name="quotas")
    gpu_type = models.ForeignKey(GpuType, on_delete=models.PROTECT, related_name="quotas")
    limit_gpus = models.PositiveIntegerField()
    in_use_gpus = models.PositiveIntegerField(default=0)
    source = models.CharField(max_length=64, default="catalog")
    observed_at = models.DateTimeField()

    class Meta:
        ordering = ["region__cloud__name", "region__code", "gpu_type__name"]
        constraints = [
            models.UniqueConstraint(fields=["region", "gpu_type"], name="quota_unique"),
        ]

    @property
    def available_gpus(self) -> int:
        return max(self.limit_gpus - self.in_use_gpus, 0)

    def __str__(self) -> str:
        return f"{self.region} {self.gpu_type}: {self.in_use_gpus}/{self.limit_gpus}"
