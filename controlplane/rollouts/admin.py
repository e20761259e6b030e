"""Admin for rollouts (read-mostly: state changes go through the API's actions)."""

from django.contrib import admin

from controlplane.rollouts.models import Rollout, RolloutStep


@admin.register(Rollout)
class RolloutAdmin(admin.ModelAdmin):
    list_display = ["id", "deployment", "from_revision", "to_revision", "state", "current_step"]
    list_filter = ["state"]
    readonly_fields = [f.name for f in Rollout._meta.fields]


@admin.register(RolloutStep)
class RolloutStepAdmin(admin.ModelAdmin):
    list_display = ["rollout", "step", "weight", "started_at", "ended_at", "decision"]
    readonly_fields = [f.name for f in RolloutStep._meta.fields]
