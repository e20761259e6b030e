"""Admin for models, deployments and replicas."""

from django.contrib import admin

from controlplane.core.admin_audit import AuditedAdmin
from controlplane.deployments.models import Deployment, Model, Replica


@admin.register(Model)
class ModelAdmin(AuditedAdmin):
    list_display = ["name", "hf_id", "parameters_b", "layers", "kv_heads", "max_context"]
    search_fields = ["name", "hf_id"]


@admin.register(Deployment)
class DeploymentAdmin(AuditedAdmin):
    list_display = ["name", "model", "tenant", "tier", "min_replicas", "max_replicas"]
    list_filter = ["tier", "tenant"]
    filter_horizontal = ["allowed_jurisdictions", "user_regions"]
    list_select_related = ["model", "tenant"]


@admin.register(Replica)
class ReplicaAdmin(AuditedAdmin):
    list_display = ["id", "deployment", "region", "provider", "state", "spot", "url"]
    list_filter = ["state", "provider"]
    list_select_related = ["deployment", "region__cloud"]
