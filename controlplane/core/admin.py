"""Admin for tenants, roles, tokens, keys and the (read-only) audit log."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.http import HttpRequest

from controlplane.core.admin_audit import AuditedAdmin
from controlplane.core.models import ApiKey, ApiToken, AuditLog, Heartbeat, Membership, Tenant


@admin.register(Tenant)
class TenantAdmin(AuditedAdmin):
    list_display = ["name", "display_name", "rpm_limit", "tpm_limit", "monthly_budget_usd"]
    search_fields = ["name", "display_name"]
    filter_horizontal = ["allowed_jurisdictions", "allowed_regions"]


@admin.register(Membership)
class MembershipAdmin(AuditedAdmin):
    list_display = ["user", "role", "tenant"]
    list_filter = ["role", "tenant"]


@admin.register(ApiToken)
class ApiTokenAdmin(AuditedAdmin):
    list_display = ["prefix", "user", "name", "created_at", "last_used_at", "revoked_at"]
    readonly_fields = ["prefix", "token_hash", "created_at", "last_used_at"]


@admin.register(ApiKey)
class ApiKeyAdmin(AuditedAdmin):
    list_display = ["prefix", "tenant", "name", "tier", "created_at", "revoked_at"]
    list_filter = ["tier", "tenant"]
    readonly_fields = ["prefix", "key_hash", "created_at"]


class ReadOnlyAdmin(admin.ModelAdmin):
    def has_add_permission(self, request: HttpRequest) -> bool:
        return False

    def has_change_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False

    def has_delete_permission(self, request: HttpRequest, obj: Any = None) -> bool:
        return False


@admin.register(AuditLog)
class AuditLogAdmin(ReadOnlyAdmin):
    list_display = ["at", "actor", "action", "object_type", "object_repr", "reason"]
    list_filter = ["action", "object_type"]
    search_fields = ["actor", "object_repr", "reason"]


@admin.register(Heartbeat)
class HeartbeatAdmin(ReadOnlyAdmin):
    list_display = ["name", "at"]
