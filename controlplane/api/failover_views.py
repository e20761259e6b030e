"""API for failover: incidents with their timelines, region health, and drills."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.api.base import TenantScopedViewSet
from controlplane.api.fields import RegionKeyField
from controlplane.api.strict_input import StrictSerializer
from controlplane.core.models import Role
from controlplane.core.services import principal_for
from controlplane.failover import drills
from controlplane.failover.models import Incident, RegionHealth
from controlplane.failover.timeline import missing as missing_stages
from controlplane.failover.timeline import timeline as timeline_of


class IncidentSerializer(serializers.ModelSerializer):
    region = RegionKeyField(read_only=True)
    timeline = serializers.SerializerMethodField()
    stage_notes = serializers.SerializerMethodField()
    open = serializers.BooleanField(read_only=True)

    class Meta:
        model = Incident
        fields = ["id", "kind", "region", "summary", "started_by", "started_at", "detected_at",
                  "tables_pushed_at", "replacement_ready_at", "traffic_back_at", "resolved_at",
                  "open", "timeline", "stage_notes", "failed_replicas", "replacements", "notes"]
        read_only_fields = fields

    def get_timeline(self, incident: Incident) -> dict[str, float | None]:
        """Seconds from the start to each stage; null where not reached yet."""
        return timeline_of(incident)

    def get_stage_notes(self, incident: Incident) -> dict[str, str]:
        """Why each stage not reached is missing, in words (keys as in `timeline`, less _s)."""
        return missing_stages(incident)


class DrillRequest(StrictSerializer):
    region = RegionKeyField(help_text="A local lab region, e.g. local:ap-tokyo.")


class RegionHealthSerializer(serializers.ModelSerializer):
    """A region's state is for everyone (a status page); what it was derived from counts every
    tenant's replicas there, so `reason`, `serving` and `failing` are platform data: tenant
    users get them empty and null."""

    region = RegionKeyField(read_only=True)
    reason = serializers.CharField(read_only=True, help_text=(
        "Why the region is in its state, in words: platform staff only (empty for tenant "
        "users)."))
    serving = serializers.IntegerField(read_only=True, allow_null=True, help_text=(
        "Replicas of every tenant serving there: platform staff only (null for tenant users)."))
    failing = serializers.IntegerField(read_only=True, allow_null=True, help_text=(
        "Replicas of every tenant failing there: platform staff only (null for tenant users)."))
    PLATFORM_FIELDS = {"reason": "", "serving": None, "failing": None}

    class Meta:
        model = RegionHealth
        fields = ["region", "state", "reason", "serving", "failing", "changed_at", "checked_at"]
        read_only_fields = fields

    def to_representation(self, instance: RegionHealth) -> dict[str, Any]:
        data: dict[str, Any] = super().to_representation(instance)
        request = self.context.get("request")
        if request is not None and not principal_for(request.user).is_platform:
            data.update(self.PLATFORM_FIELDS)
        return data


class IncidentViewSet(TenantScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                      viewsets.GenericViewSet):
    """Failures and drills, newest first, for platform staff alone (an incident names the
    replicas of every tenant in a region): every platform role reads them; platform
    operators drill. Tenant users get 403."""

    write_role = Role.OPERATOR
    platform_only = True
    platform_only_writes = True
    queryset = Incident.objects.select_related("region__cloud")
    serializer_class = IncidentSerializer
    filterset_fields = ["kind"]
    ordering_fields = ["started_at", "resolved_at"]

    @extend_schema(request=DrillRequest, responses={201: IncidentSerializer})
    @action(detail=False, methods=["post"])
    def drill(self, request: Request) -> Response:
        """Kill every replica of a local region now; the timeline fills in as failover acts."""
        body = DrillRequest(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            incident = drills.start_drill(body.validated_data["region"],
                                            actor=self.principal.username)
        except drills.DrillRefused as exc:
            return Response({exc.field: [exc.message]}, status=status.HTTP_400_BAD_REQUEST)
        return Response(IncidentSerializer(incident).data, status=status.HTTP_201_CREATED)


class RegionHealthViewSet(TenantScopedViewSet, mixins.ListModelMixin, viewsets.GenericViewSet):
    """Each region's health as the failover loop last derived it; its counts and reason are
    for platform staff (RegionHealthSerializer)."""

    queryset = RegionHealth.objects.select_related("region__cloud")
    serializer_class = RegionHealthSerializer
    filterset_fields = ["state"]
    ordering_fields = ["state", "changed_at", "checked_at"]
