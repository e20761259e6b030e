"""API for GPU health: agents POST reports; everyone with a role reads the nodes.

POST /api/v1/gpu-reports/  (operator, platform staff): one node's readings, validated field by
field (400 names the field; nothing is stored unless everything is valid).
GET /api/v1/gpu-nodes/     nodes with their health and their GPUs' latest readings.
"""

from __future__ import annotations

import math
from datetime import timedelta
from typing import Any

from django.db.models import OuterRef, Prefetch, Subquery
from django.utils import timezone
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import extend_schema, extend_schema_field
from rest_framework import serializers, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api.base import TenantScopedViewSet
from controlplane.api.strict_input import StrictSerializer
from controlplane.core.models import Role
from controlplane.core.services import principal_for
from controlplane.deployments.models import Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.telemetry.gpu_reports import ingest_report, retention
from controlplane.telemetry.models import GpuNode, GpuReading

MAX_GPUS = 64
MAX_FUTURE = timedelta(minutes=5)
BIG = 2**63 - 1


class FiniteFloatField(serializers.FloatField):
    default_error_messages = {"finite": "Must be a finite number."}

    def to_internal_value(self, data: Any) -> float:
        value = super().to_internal_value(data)
        if not math.isfinite(value):
            self.fail("finite")
        return value


def _figure(lo: float, hi: float, **kw: Any) -> FiniteFloatField:
    return FiniteFloatField(min_value=lo, max_value=hi, allow_null=True, **kw)


class GpuReadingSerializer(StrictSerializer):
    """One GPU as the agent read it. Figures are required keys; null where NVML cannot say."""

    index = serializers.IntegerField(min_value=0, max_value=MAX_GPUS - 1)
    uuid = serializers.CharField(max_length=96)
    name = serializers.CharField(max_length=96)
    memory_total_bytes = serializers.IntegerField(min_value=0, max_value=BIG, allow_null=True)
    memory_used_bytes = serializers.IntegerField(min_value=0, max_value=BIG, allow_null=True)
    utilization_gpu_pct = _figure(0, 100)
    utilization_memory_pct = _figure(0, 100)
    temperature_c = _figure(-60, 200)
    power_w = _figure(0, 10_000)
    power_limit_w = _figure(0, 10_000)
    ecc_corrected = serializers.IntegerField(min_value=0, max_value=BIG, allow_null=True)
    ecc_uncorrected = serializers.IntegerField(min_value=0, max_value=BIG, allow_null=True)
    xid_supported = serializers.BooleanField(required=False, default=False)
    xid_errors = serializers.ListField(
        child=serializers.IntegerField(min_value=0, max_value=1_000_000), max_length=256,
        required=False, default=list)
    lost = serializers.BooleanField(required=False, default=False)
    errors = serializers.DictField(  # type: ignore[assignment]
        child=serializers.CharField(max_length=300, allow_blank=True), required=False,
        default=dict)

    def validate_errors(self, value: dict[str, str]) -> dict[str, str]:
        if len(value) > 32 or any(len(k) > 64 for k in value):
            raise serializers.ValidationError("At most 32 entries with keys of 64 characters.")
        return value

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        total, used = attrs.get("memory_total_bytes"), attrs.get("memory_used_bytes")
        if total is not None and used is not None and used > total:
            raise serializers.ValidationError(
                {"memory_used_bytes": f"{used} is more than memory_total_bytes ({total})."})
        return attrs


@extend_schema_field(OpenApiTypes.STR)
class ReplicaRefField(serializers.Field):
    """A replica as `r-12` (or its number); null unlinks the node."""

    default_error_messages = {
        "format": "Expected a replica as 'r-<number>', e.g. 'r-12'; got {value!r}.",
        "missing": "Replica {value!r} does not exist.",
        "gone": "Replica {value!r} is {state}; link a live replica.",
    }

    def to_representation(self, value: Replica) -> str:
        return value.public_id

    def to_internal_value(self, data: Any) -> Replica:
        text = str(data) if isinstance(data, (str, int)) and not isinstance(data, bool) else ""
        number = text[2:] if text.startswith("r-") else text
        if not number.isdigit() or len(number) > 18:
            self.fail("format", value=data)
        replica = Replica.objects.filter(pk=int(number)).first()
        if replica is None:
            self.fail("missing", value=data)
        if replica.state in (S.TERMINATED, S.FAILED):
            self.fail("gone", value=data, state=replica.state)
        return replica


class GpuReportSerializer(StrictSerializer):
    node = serializers.RegexField(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$", max_length=128,
                                  error_messages={"invalid": "Use letters, digits and . _ : - "
                                                             "(at most 128), e.g. 'gpu-node-7'."})
    replica = ReplicaRefField(required=False, allow_null=True)
    at = serializers.DateTimeField(required=False)
    interval_s = FiniteFloatField(min_value=1, max_value=3600, required=False)
    driver_version = serializers.CharField(max_length=64, required=False, allow_blank=True)
    nvml_version = serializers.CharField(max_length=64, required=False, allow_blank=True)
    cuda_driver_version = serializers.IntegerField(min_value=0, max_value=10**9, required=False,
                                                   allow_null=True)
    gpus = GpuReadingSerializer(many=True, allow_empty=False,
                                max_length=MAX_GPUS)  # type: ignore[call-arg]

    def validate_at(self, value: Any) -> Any:
        now = timezone.now()
        if value > now + MAX_FUTURE:
            raise serializers.ValidationError(
                f"{value.isoformat()} is in the future (server time {now.isoformat()}); "
                "check the node's clock.")
        if value < now - retention():
            raise serializers.ValidationError(
                f"{value.isoformat()} is older than the readings kept ({retention()}).")
        return value

    def validate_gpus(self, value: list[dict[str, Any]]) -> list[dict[str, Any]]:
        indices = [g["index"] for g in value]
        if len(set(indices)) != len(indices):
            raise serializers.ValidationError("Each GPU index may appear once.")
        uuids = [g["uuid"] for g in value]
        if len(set(uuids)) != len(uuids):
            raise serializers.ValidationError("Each GPU uuid may appear once.")
        return value


class GpuReportAnswerSerializer(serializers.Serializer):
    node = serializers.CharField()
    health = serializers.CharField()
    health_reason = serializers.CharField()
    readings = serializers.IntegerField()
    replica = serializers.CharField(allow_null=True)
    replica_action = serializers.CharField()


class GpuReportView(APIView):
    """A GPU node's agent reports its GPUs; the node's health is judged on arrival."""

    write_role = Role.OPERATOR
    platform_only_writes = True

    @extend_schema(request=GpuReportSerializer, responses={201: GpuReportAnswerSerializer})
    def post(self, request: Request) -> Response:
        serializer = GpuReportSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        outcome = ingest_report(dict(serializer.validated_data),
                                actor=principal_for(request.user).username)
        node = outcome.node
        return Response({
            "node": node.name, "health": node.health, "health_reason": node.health_reason,
            "readings": outcome.readings,
            "replica": f"r-{node.replica_id}" if node.replica_id else None,
            "replica_action": outcome.replica_action,
        }, status=status.HTTP_201_CREATED)


class GpuLatestSerializer(serializers.ModelSerializer):
    class Meta:
        model = GpuReading
        fields = ["index", "uuid", "name", "at", "memory_total_bytes", "memory_used_bytes",
                  "utilization_gpu_pct", "utilization_memory_pct", "temperature_c", "power_w",
                  "power_limit_w", "ecc_corrected", "ecc_uncorrected", "xid_supported",
                  "xid_errors", "lost", "errors"]
        read_only_fields = fields


class GpuNodeSerializer(serializers.ModelSerializer):
    replica = serializers.SerializerMethodField()
    stale = serializers.SerializerMethodField()
    gpus = serializers.SerializerMethodField()

    class Meta:
        model = GpuNode
        fields = ["id", "name", "replica", "health", "health_reason", "health_changed_at",
                  "last_seen_at", "stale", "interval_s", "gpu_count", "driver_version",
                  "nvml_version", "cuda_driver_version", "gpus"]
        read_only_fields = fields

    def get_replica(self, obj: GpuNode) -> str | None:
        return f"r-{obj.replica_id}" if obj.replica_id else None

    def get_stale(self, obj: GpuNode) -> bool:
        """No report for three intervals: the agent or the node is gone."""
        if obj.last_seen_at is None:
            return True
        return timezone.now() - obj.last_seen_at > timedelta(seconds=3 * obj.interval_s)

    @extend_schema(responses=GpuLatestSerializer(many=True))
    def get_gpus(self, obj: GpuNode) -> Any:
        latest = getattr(obj, "latest_readings", None)
        if latest is None:
            at = obj.readings.order_by("-at").values_list("at", flat=True).first()
            latest = list(obj.readings.filter(at=at)) if at else []
        return GpuLatestSerializer(sorted(latest, key=lambda r: r.index), many=True).data


class GpuNodeViewSet(TenantScopedViewSet, viewsets.ReadOnlyModelViewSet):
    """GPU nodes and their latest readings; tenant users see the nodes of their replicas."""

    queryset = GpuNode.objects.prefetch_related(Prefetch(
        "readings",
        queryset=GpuReading.objects.filter(at=Subquery(
            GpuReading.objects.filter(node=OuterRef("node")).order_by("-at").values("at")[:1])),
        to_attr="latest_readings"))
    serializer_class = GpuNodeSerializer
    filterset_fields = ["health"]
    ordering_fields = ["name", "last_seen_at", "health"]
    lookup_field = "name"
    lookup_value_regex = r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}"
