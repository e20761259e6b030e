"""Admin for token usage, hourly cost rollups and rollup passes (read-only: derived data)."""

from django.contrib import admin

from controlplane.core.admin import ReadOnlyAdmin
from controlplane.costs.models import CostRollup, RollupHour, TokenUsage


@admin.register(TokenUsage)
class TokenUsageAdmin(ReadOnlyAdmin):
    list_display = ["hour", "model", "region", "tenant", "prompt_tokens", "completion_tokens"]
    list_filter = ["model", "region", "tenant"]
    date_hierarchy = "hour"


@admin.register(CostRollup)
class CostRollupAdmin(ReadOnlyAdmin):
    list_display = ["hour", "model", "region", "tenant", "prompt_tokens", "completion_tokens",
                    "usd", "computed_at"]
    list_filter = ["model", "region", "tenant"]
    date_hierarchy = "hour"


@admin.register(RollupHour)
class RollupHourAdmin(ReadOnlyAdmin):
    list_display = ["hour", "usd", "tokens", "computed_at"]
    date_hierarchy = "hour"
