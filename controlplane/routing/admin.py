"""Admin for edges, the routing policy and compiled tables (read-only)."""

from django.contrib import admin

from controlplane.core.admin import ReadOnlyAdmin
from controlplane.core.admin_audit import AuditedAdmin
from controlplane.routing.models import Edge, RoutingPolicy, RoutingTable


@admin.register(Edge)
class EdgeAdmin(AuditedAdmin):
    list_display = ["name", "region", "admin_url", "last_acked_version", "last_seen_at", "enabled"]
    list_select_related = ["region__cloud"]


@admin.register(RoutingPolicy)
class RoutingPolicyAdmin(AuditedAdmin):
    list_display = ["name", "retry_before_first_byte", "eject_after_failures", "updated_at"]


@admin.register(RoutingTable)
class RoutingTableAdmin(ReadOnlyAdmin):
    list_display = ["edge", "version", "payload_hash", "created_at"]
    list_filter = ["edge"]
