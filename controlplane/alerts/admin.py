"""Admin: alerts and their deliveries (read-only), rule settings (editable, audited)."""

from __future__ import annotations

from typing import Any

from django.contrib import admin

from controlplane.alerts.models import Alert, AlertCondition, AlertDelivery, RuleSetting
from controlplane.alerts.thresholds import DEFAULTS
from controlplane.core.admin import ReadOnlyAdmin
from controlplane.core.admin_audit import AuditedAdmin

DELIVERY_FIELDS = ("event", "state", "attempts", "response_status", "last_error", "created_at",
                   "delivered_at")


class AlertDeliveryInline(admin.TabularInline):
    model = AlertDelivery
    extra = 0
    can_delete = False
    fields = DELIVERY_FIELDS
    readonly_fields = DELIVERY_FIELDS

    def has_add_permission(self, request: Any, obj: Any = None) -> bool:
        return False


@admin.register(Alert)
class AlertAdmin(ReadOnlyAdmin):
    list_display = ["opened_at", "rule", "subject", "severity", "state", "resolved_at",
                    "notify_state", "acknowledged_by"]
    list_filter = ["state", "rule", "severity", "notify_state"]
    search_fields = ["subject", "message"]
    list_select_related = ["tenant"]
    inlines = [AlertDeliveryInline]


@admin.register(AlertCondition)
class AlertConditionAdmin(ReadOnlyAdmin):
    list_display = ["rule", "subject", "since", "last_seen_at"]


@admin.register(RuleSetting)
class RuleSettingAdmin(AuditedAdmin):
    list_display = ["rule", "enabled", "warning", "critical", "for_s", "window_s", "defaults",
                    "updated_at"]

    @admin.display(description="defaults (warning / critical / for / window)")
    def defaults(self, obj: RuleSetting) -> str:
        d = DEFAULTS[obj.rule]
        return f"{d.warning} / {d.critical} / {d.for_s} s / {d.window_s} s"
