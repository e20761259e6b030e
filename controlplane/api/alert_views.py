"""REST API for alerts: list and read (every role), acknowledge (operators), rule thresholds."""

from __future__ import annotations

from typing import Any

import django_filters as filters
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.alerts import services
from controlplane.alerts.models import Alert, AlertState, NotifyState, Rule, Severity
from controlplane.api.base import TenantScopedViewSet
from controlplane.api.query_params import ChecksQueryParams
from controlplane.api.strict_input import StrictSerializer
from controlplane.core.models import Role
from controlplane.core.services import principal_for


class AlertSerializer(serializers.ModelSerializer):
    tenant: serializers.SlugRelatedField = serializers.SlugRelatedField(
        slug_field="name", read_only=True)
    rule_display = serializers.CharField(source="get_rule_display", read_only=True)
    duration_s = serializers.SerializerMethodField()

    class Meta:
        model = Alert
        fields = ["id", "rule", "rule_display", "subject", "tenant", "severity", "state",
                  "message", "value", "threshold", "unit", "firing_since", "opened_at",
                  "resolved_at", "duration_s", "last_evaluated_at", "escalated_at",
                  "acknowledged_at",
                  "acknowledged_by", "acknowledge_note", "notify_state"]
        read_only_fields = fields

    def get_duration_s(self, alert: Alert) -> float | None:
        """Seconds open: until resolution, or until the last evaluation while open."""
        end = alert.resolved_at or alert.last_evaluated_at
        return round((end - alert.opened_at).total_seconds(), 1) if end else None


class AlertFilter(filters.FilterSet):
    state = filters.ChoiceFilter(choices=AlertState.choices)
    rule = filters.ChoiceFilter(choices=Rule.choices)
    severity = filters.ChoiceFilter(choices=Severity.choices)
    notify_state = filters.ChoiceFilter(choices=NotifyState.choices)
    subject = filters.CharFilter(field_name="subject")
    tenant = filters.CharFilter(field_name="tenant__name")
    acknowledged = filters.ChoiceFilter(
        choices=[("true", "true"), ("false", "false")], method="filter_acknowledged",
        help_text="true: only alerts someone acknowledged; false: only those nobody did.")
    since = filters.IsoDateTimeFilter(field_name="opened_at", lookup_expr="gte",
                                      help_text="Opened at or after this time (ISO 8601).")

    class Meta:
        model = Alert
        fields = ["state", "rule", "severity", "notify_state", "subject", "tenant",
                  "acknowledged", "since"]

    def filter_acknowledged(self, queryset: Any, name: str, value: str) -> Any:
        return queryset.filter(acknowledged_at__isnull=value != "true")


class AcknowledgeRequest(StrictSerializer):
    note = serializers.CharField(max_length=500, required=False, default="", allow_blank=True,
                                 help_text="Why, or what is being done about it.")


class AlertViewSet(TenantScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                   viewsets.GenericViewSet):
    """Alerts opened and resolved by the rules; tenant users see their own tenant's only."""

    write_role = Role.OPERATOR
    queryset = Alert.objects.select_related("tenant")
    serializer_class = AlertSerializer
    filterset_class = AlertFilter
    ordering_fields = ["opened_at", "resolved_at", "severity"]
    ordering = ["-opened_at", "-id"]

    @extend_schema(request=AcknowledgeRequest, responses={200: AlertSerializer})
    @action(detail=True, methods=["post"])
    def acknowledge(self, request: Request, pk: Any = None) -> Response:
        """Mark an open alert as seen; 409 when it is resolved or already acknowledged."""
        alert = self.get_object()  # another tenant's alert: 404, whatever the body
        body = AcknowledgeRequest(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            services.acknowledge(alert.pk, principal_for(request.user).username,
                                 body.validated_data["note"])
        except services.AcknowledgeError as exc:
            return Response({"detail": str(exc)}, status=status.HTTP_409_CONFLICT)
        return Response(AlertSerializer(self.get_queryset().get(pk=alert.pk)).data)


class RuleThresholdsSerializer(serializers.Serializer):
    rule = serializers.ChoiceField(choices=Rule.choices)
    description = serializers.CharField()
    enabled = serializers.BooleanField()
    warning = serializers.FloatField(allow_null=True)
    critical = serializers.FloatField(allow_null=True)
    for_s = serializers.IntegerField()
    window_s = serializers.IntegerField()


class AlertRulesView(ChecksQueryParams, APIView):
    """Each rule's thresholds in effect: the defaults with the admin's RuleSetting overrides."""

    @extend_schema(responses=RuleThresholdsSerializer(many=True))
    def get(self, request: Request) -> Response:
        limits = services.thresholds()
        rows = [{"rule": rule.value, "description": rule.label, "enabled": t.enabled,
                 "warning": t.warning, "critical": t.critical, "for_s": t.for_s,
                 "window_s": t.window_s}
                for rule in Rule for t in [limits[rule.value]]]
        return Response(RuleThresholdsSerializer(rows, many=True).data,
                        status=status.HTTP_200_OK)
