"""Admin page for the autoscaler's decisions (read-mostly: the loop writes them)."""

from django.contrib import admin

from controlplane.core.admin_audit import AuditedAdmin
from controlplane.scaling.models import ScalingDecision


@admin.register(ScalingDecision)
class ScalingDecisionAdmin(AuditedAdmin):
    list_display = ("at", "deployment", "direction", "replicas_before", "replicas_after", "reason")
    list_filter = ("direction",)
