"""Admin for edges, the routing policy and compiled tables (read-only)."""

from django import forms
from django.contrib import admin

from controlplane.core.admin import ReadOnlyAdmin
from controlplane.core.admin_audit import AuditedAdmin
from controlplane.routing.models import Edge, RoutingPolicy, RoutingTable
from controlplane.routing.names import alias_problems


@admin.register(Edge)
class EdgeAdmin(AuditedAdmin):
    list_display = ["name", "region", "admin_url", "last_acked_version", "last_seen_at", "enabled"]
    list_select_related = ["region__cloud"]


class RoutingPolicyForm(forms.ModelForm):
    class Meta:
        model = RoutingPolicy
        fields = "__all__"

    def clean_aliases(self) -> object:
        # The API's rules (routing/names.py): the edge's parser, and no served name.
        aliases = self.cleaned_data["aliases"]
        problem = alias_problems(aliases)
        if problem:
            raise forms.ValidationError(problem)
        return aliases


@admin.register(RoutingPolicy)
class RoutingPolicyAdmin(AuditedAdmin):
    form = RoutingPolicyForm
    list_display = ["name", "retry_before_first_byte", "eject_after_failures", "updated_at"]


@admin.register(RoutingTable)
class RoutingTableAdmin(ReadOnlyAdmin):
    list_display = ["edge", "version", "payload_hash", "excluded", "created_at"]
    list_filter = ["edge"]
