"""API for the autoscaler's decisions: read-only, newest first, with the signals behind each."""

from __future__ import annotations

import django_filters as filters
from rest_framework import serializers, viewsets

from controlplane.api.base import TenantScopedViewSet
from controlplane.api.filters import by_deployment
from controlplane.scaling.models import ScalingDecision


class ScalingDecisionSerializer(serializers.ModelSerializer):
    deployment: serializers.SlugRelatedField = serializers.SlugRelatedField(
        slug_field="name", read_only=True)
    signals = serializers.JSONField(read_only=True, help_text=(
        "The values the decision was taken on: serving and starting replicas, in-flight, "
        "waiting, KV usage, TTFT p95 against the SLO, and how long each signal held (s)."))
    placed = serializers.ListField(child=serializers.CharField(), read_only=True,
                                   help_text="Region (cloud:code) of each replica requested.")
    open = serializers.BooleanField(read_only=True, help_text=(
        "It placed fewer replicas than wanted; the same attempt on later ticks updates this "
        "row (repeats, last_at) instead of adding one."))

    class Meta:
        model = ScalingDecision
        fields = ["id", "deployment", "at", "direction", "replicas_before", "replicas_after",
                  "replicas_wanted", "open", "repeats", "last_at", "reason", "signals",
                  "placed"]
        read_only_fields = fields


class ScalingDecisionFilter(filters.FilterSet):
    deployment = filters.CharFilter(method=by_deployment, help_text="Name or id.")
    direction = filters.ChoiceFilter(choices=[("up", "up"), ("down", "down")])
    since = filters.IsoDateTimeFilter(field_name="at", lookup_expr="gte")

    class Meta:
        model = ScalingDecision
        fields = ["deployment", "direction", "since"]


class ScalingDecisionViewSet(TenantScopedViewSet, viewsets.ReadOnlyModelViewSet):
    """The autoscaler's decisions. Tenant users see their own deployments' decisions and
    those of shared deployments they may use, as with the deployments themselves."""

    shared_visible = True
    queryset = ScalingDecision.objects.select_related("deployment").order_by("-at", "-id")
    serializer_class = ScalingDecisionSerializer
    filterset_class = ScalingDecisionFilter
    ordering_fields = ["at", "last_at"]
