"""Admin pages for region health and incidents (read-mostly: the loops write them)."""

from django.contrib import admin

from controlplane.core.admin_audit import AuditedAdmin
from controlplane.failover.models import Incident, RegionHealth


@admin.register(RegionHealth)
class RegionHealthAdmin(AuditedAdmin):
    list_display = ("region", "state", "serving", "failing", "changed_at", "reason")
    list_filter = ("state",)


@admin.register(Incident)
class IncidentAdmin(AuditedAdmin):
    list_display = ("started_at", "kind", "region", "summary", "resolved_at")
    list_filter = ("kind",)
    date_hierarchy = "started_at"

