"""Serializers for the catalog: clouds, jurisdictions, regions, GPU types, and the offers and
quota observed in them (stale once they should have refreshed and did not)."""

from __future__ import annotations

from typing import Any

from django.conf import settings
from django.utils import timezone
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from controlplane.api.fields import RegionKeyField
from controlplane.api.strict_input import StrictModelSerializer
from regions.models import Cloud, GpuType, Jurisdiction, Offer, Quota, Region


class CloudSerializer(StrictModelSerializer):
    class Meta:
        model = Cloud
        fields = ["id", "name", "display_name", "skypilot_name", "enabled"]


class JurisdictionSerializer(StrictModelSerializer):
    class Meta:
        model = Jurisdiction
        fields = ["id", "code", "name"]


class RegionSerializer(StrictModelSerializer):
    cloud = serializers.SlugRelatedField(slug_field="name", queryset=Cloud.objects.all())
    jurisdiction = serializers.SlugRelatedField(
        slug_field="code", queryset=Jurisdiction.objects.all()
    )
    key = serializers.CharField(read_only=True)

    class Meta:
        model = Region
        fields = [
            "id", "key", "cloud", "code", "display_name", "latitude", "longitude",
            "country", "jurisdiction", "enabled",
        ]

    def validate_country(self, value: str) -> str:
        if len(value) != 2 or not value.isalpha():
            raise serializers.ValidationError("Use the ISO 3166-1 alpha-2 code, e.g. 'DE'.")
        return value.upper()


class GpuTypeSerializer(StrictModelSerializer):
    class Meta:
        model = GpuType
        fields = [
            "id", "name", "vendor", "memory_gib", "memory_bandwidth_gbps", "bf16_tflops",
            "fp16_tflops", "skypilot_name",
        ]


class _Observed(StrictModelSerializer):
    stale = serializers.SerializerMethodField()

    @extend_schema_field(serializers.BooleanField())
    def get_stale(self, obj: Offer | Quota) -> bool:
        """An observation that was supposed to refresh and did not; a row from the catalog
        file (source `catalog:<as_of>`) is a dated list price or default, never stale."""
        if obj.source.startswith("catalog:"):
            return False
        return timezone.now() - obj.observed_at > settings.MERIDIAN["CATALOG_STALE_AFTER"]


class OfferSerializer(_Observed):
    region = RegionKeyField()
    gpu_type = serializers.SlugRelatedField(slug_field="name", queryset=GpuType.objects.all())
    jurisdiction = serializers.CharField(source="region.jurisdiction.code", read_only=True)
    observed_at = serializers.DateTimeField(required=False)

    class Meta:
        model = Offer
        fields = [
            "id", "region", "jurisdiction", "gpu_type", "gpus_per_node", "instance_type",
            "on_demand_usd_h", "spot_usd_h", "source", "observed_at", "stale",
        ]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        on_demand = attrs.get("on_demand_usd_h", getattr(self.instance, "on_demand_usd_h", None))
        spot = attrs.get("spot_usd_h", getattr(self.instance, "spot_usd_h", None))
        if spot is not None and on_demand is not None and spot > on_demand:
            raise serializers.ValidationError(
                {"spot_usd_h": f"Spot price {spot} is above the on-demand price {on_demand}."}
            )
        attrs.setdefault("observed_at", timezone.now())
        return attrs


class QuotaSerializer(_Observed):
    region = RegionKeyField()
    gpu_type = serializers.SlugRelatedField(slug_field="name", queryset=GpuType.objects.all())
    available_gpus = serializers.IntegerField(read_only=True)
    observed_at = serializers.DateTimeField(required=False)

    class Meta:
        model = Quota
        fields = [
            "id", "region", "gpu_type", "limit_gpus", "in_use_gpus", "available_gpus",
            "source", "observed_at", "stale",
        ]

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        attrs.setdefault("observed_at", timezone.now())
        return attrs
