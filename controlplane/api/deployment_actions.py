"""Operator actions on deployments and replicas: scale in a region, drain a replica."""

from __future__ import annotations

from typing import Any

from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.api.fields import RegionKeyField
from controlplane.core.services import principal_for
from controlplane.deployments.lifecycle import LIVE_STATES, IllegalTransition
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S


class ScaleRequest(serializers.Serializer):
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


class DrainRequest(serializers.Serializer):
    reason = serializers.CharField(max_length=500, required=False, default="")


class DeploymentActions:
    """Mixed into the deployment viewset."""

    @extend_schema(request=ScaleRequest, responses=ScaleResult)
    @action(detail=True, methods=["post"])
    def scale(self, request: Request, pk: Any = None) -> Response:
        """Set how many replicas this deployment runs in one region (adds or drains)."""
        from controlplane.provisioning import services as provisioning

        deployment: Deployment = self.get_object()  # type: ignore[attr-defined]
        body = ScaleRequest(data=request.data)
        body.is_valid(raise_exception=True)
        region = body.validated_data["region"]
        target = body.validated_data["replicas"]
        if region.jurisdiction not in deployment.allowed_jurisdictions.all():
            return Response(
                {"region": f"{region.key} is in {region.jurisdiction.code}, outside this "
                           "deployment's allowed jurisdictions."}, status=400)
        live = list(deployment.replicas.filter(region=region, state__in=LIVE_STATES)
                    .exclude(state=S.DRAINING).order_by("-created_at"))
        others = deployment.replicas.filter(state__in=LIVE_STATES).exclude(
            region=region).exclude(state=S.DRAINING).count()
        if others + target > deployment.max_replicas:
            return Response({"replicas": f"{others} replicas run elsewhere; {target} more would "
                             f"exceed max_replicas ({deployment.max_replicas})."}, status=400)
        if others + target < deployment.min_replicas:
            return Response({"replicas": f"{others + target} in total would fall below "
                             f"min_replicas ({deployment.min_replicas})."}, status=400)
        actor = principal_for(request.user).username
        reason = body.validated_data["reason"] or f"scaled by {actor}"
        added, draining = [], []
        if target > len(live):
            made = provisioning.request_replicas(
                deployment, region, target - len(live), actor=actor, reason=reason,
                spot=body.validated_data["spot"],
            )
            added = [r.public_id for r in made]
        for replica in live[target:]:
            self._drain(replica, actor, reason)
            draining.append(replica.public_id)
        result = {"region": region.key, "before": len(live), "after": target,
                  "added": added, "draining": draining}
        return Response(result, status=status.HTTP_202_ACCEPTED)

    @staticmethod
    def _drain(replica: Replica, actor: str, reason: str) -> None:
        from controlplane.provisioning import services as provisioning
        from controlplane.provisioning.tasks import terminate_replica

        if replica.state in (S.READY, S.DEGRADED):
            provisioning.drain(replica.pk, actor=actor, reason=reason)
            terminate_replica.apply_async((replica.pk, reason), countdown=DRAIN_DEADLINE_S)
        else:  # not serving yet: nothing to drain
            terminate_replica.delay(replica.pk, reason)


DRAIN_DEADLINE_S = 30


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
        actor = principal_for(request.user).username
        reason = body.validated_data["reason"] or f"drained by {actor}"
        if replica.state not in (S.READY, S.DEGRADED):
            return Response({"detail": f"{replica.public_id} is {replica.state}; only ready or "
                                       "degraded replicas can be drained."}, status=409)
        try:
            DeploymentActions._drain(replica, actor, reason)
        except IllegalTransition as exc:
            return Response({"detail": str(exc)}, status=409)
        return Response({"replica": replica.public_id, "state": S.DRAINING,
                         "terminate_after_s": DRAIN_DEADLINE_S}, status=202)
