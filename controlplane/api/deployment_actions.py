"""Operator actions on deployments and replicas: scale in a region, drain a replica."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.api.fields import RegionKeyField
from controlplane.api.strict_input import StrictSerializer
from controlplane.core.services import principal_for
from controlplane.deployments.lifecycle import IllegalTransition
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.scaling import services as scaling


class ScaleRequest(StrictSerializer):
    region = RegionKeyField()
    replicas = serializers.IntegerField(min_value=0, max_value=64)
    spot = serializers.BooleanField(default=False)
    reason = serializers.CharField(max_length=500, required=False, default="")


class ScaleResult(serializers.Serializer):
    region = serializers.CharField()
    before = serializers.IntegerField()
    after = serializers.IntegerField()
    added = serializers.ListField(child=serializers.CharField())
    draining = serializers.ListField(child=serializers.CharField())


class DrainRequest(StrictSerializer):
    reason = serializers.CharField(max_length=500, required=False, default="")


class DeploymentActions:
    """Mixed into the deployment viewset."""

    @extend_schema(request=ScaleRequest, responses=ScaleResult)
    @action(detail=True, methods=["post"])
    def scale(self, request: Request, pk: Any = None) -> Response:
        """Set how many replicas this deployment runs in one region (adds or drains)."""
        deployment: Deployment = self.get_object()  # type: ignore[attr-defined]
        body = ScaleRequest(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            result = scaling.scale_in_region(
                deployment, body.validated_data["region"], body.validated_data["replicas"],
                actor=principal_for(request.user).username, reason=body.validated_data["reason"],
                spot=body.validated_data["spot"],
            )
        except scaling.ScaleRefused as exc:
            return Response({exc.field: exc.message}, status=400)
        return Response(result.as_dict(), status=status.HTTP_202_ACCEPTED)


class ReplicaActions:
    """Mixed into the replica viewset."""

    @extend_schema(request=DrainRequest, responses={202: None})
    @action(detail=True, methods=["post"])
    def drain(self, request: Request, pk: Any = None) -> Response:
        """Stop sending new requests to the replica, then terminate it after the deadline."""
        # Roles and tenancy (shared replicas: platform staff only) are the viewset's checks.
        replica: Replica = self.get_object()  # type: ignore[attr-defined]
        body = DrainRequest(data=request.data)
        body.is_valid(raise_exception=True)
        if replica.state not in (S.READY, S.DEGRADED):
            return Response({"detail": f"{replica.public_id} is {replica.state}; only ready or "
                                       "degraded replicas can be drained."}, status=409)
        try:
            scaling.drain_replica(replica, actor=principal_for(request.user).username,
                                  reason=body.validated_data["reason"])
        except IllegalTransition as exc:
            return Response({"detail": str(exc)}, status=409)
        return Response({"replica": replica.public_id, "state": S.DRAINING,
                         "terminate_after_s": scaling.DRAIN_DEADLINE_S}, status=202)
