"""Admin for the GPU inventory."""

from django.contrib import admin

from controlplane.core.admin_audit import AuditedAdmin
from regions.models import Cloud, GpuType, Jurisdiction, Offer, Quota, Region


@admin.register(Cloud)
class CloudAdmin(AuditedAdmin):
    list_display = ["name", "display_name", "skypilot_name", "enabled"]


@admin.register(Jurisdiction)
class JurisdictionAdmin(AuditedAdmin):
    list_display = ["code", "name"]


@admin.register(Region)
class RegionAdmin(AuditedAdmin):
    list_display = ["code", "cloud", "display_name", "country", "jurisdiction", "enabled"]
    list_filter = ["cloud", "jurisdiction", "enabled"]
    search_fields = ["code", "display_name", "country"]
    list_select_related = ["cloud", "jurisdiction"]


@admin.register(GpuType)
class GpuTypeAdmin(AuditedAdmin):
    list_display = ["name", "vendor", "memory_gib", "memory_bandwidth_gbps", "bf16_tflops"]


@admin.register(Offer)
class OfferAdmin(AuditedAdmin):
    list_display = [
        "region", "gpu_type", "gpus_per_node", "instance_type", "on_demand_usd_h", "spot_usd_h",
        "source", "observed_at",
    ]
    list_filter = ["gpu_type", "region__cloud", "source"]
    list_select_related = ["region__cloud", "gpu_type"]


@admin.register(Quota)
class QuotaAdmin(AuditedAdmin):
    list_display = ["region", "gpu_type", "limit_gpus", "in_use_gpus", "observed_at"]
    list_filter = ["gpu_type", "region__cloud"]
    list_select_related = ["region__cloud", "gpu_type"]
