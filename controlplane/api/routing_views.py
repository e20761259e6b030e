"""API for edges: the registry, the routing policy, and the table pull with If-None-Match."""

from __future__ import annotations

from django.db.models import OuterRef, Subquery
from django.shortcuts import get_object_or_404
from django.utils import timezone
from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework import mixins, viewsets
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api import serializers
from controlplane.api.base import MeridianViewSet, TenantScopedViewSet
from controlplane.core.models import Role
from controlplane.core.services import record_audit
from controlplane.routing import services as routing
from controlplane.routing.models import Edge, RoutingPolicy, RoutingTable


class EdgeViewSet(MeridianViewSet):
    write_role = Role.ADMIN
    platform_only_writes = True
    queryset = Edge.objects.select_related("region__cloud").annotate(
        latest_version=Subquery(
            RoutingTable.objects.filter(edge=OuterRef("pk")).order_by("-version").values("version")[:1]
        )
    )
    serializer_class = serializers.EdgeSerializer
    filterset_fields = ["enabled"]
    ordering_fields = ["name", "last_acked_version", "last_seen_at"]


class RoutingPolicyViewSet(
    TenantScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin,
    mixins.UpdateModelMixin, viewsets.GenericViewSet,
):
    """The routing policy edges apply; changing it pushes new tables."""

    write_role = Role.ADMIN
    platform_only_writes = True
    queryset = RoutingPolicy.objects.all()
    serializer_class = serializers.RoutingPolicySerializer
    ordering_fields = ["updated_at"]

    def get_queryset(self):  # type: ignore[no-untyped-def]
        routing.current_policy()
        return super().get_queryset()

    def perform_update(self, serializer) -> None:  # type: ignore[no-untyped-def]
        instance = serializer.save()
        changes = {field: [str(item) for item in value] if isinstance(value, list) else value
                   for field, value in serializer.validated_data.items()}
        record_audit(self.principal.username, "update", instance, changes=changes, reason="api")


class EdgeTableView(APIView):
    """The newest signed table for an edge; edges poll this with If-None-Match. Platform
    staff only: a table holds every tenant's keys (hashed) and rules, and every replica's
    address."""

    platform_only = True

    @extend_schema(responses={200: OpenApiResponse(description="the signed table"),
                              304: OpenApiResponse(description="unchanged"),
                              403: OpenApiResponse(description="not platform staff"),
                              404: OpenApiResponse(description="unknown edge or no table yet")})
    def get(self, request: Request, name: str) -> Response:
        edge = get_object_or_404(Edge, name=name)
        table = routing.latest_table(edge)
        if table is None:
            return Response({"detail": f"No table compiled for edge {name} yet."}, status=404)
        etag = f'"{table.payload_hash}"'
        Edge.objects.filter(pk=edge.pk).update(last_seen_at=timezone.now())
        if request.headers.get("If-None-Match") == etag:
            return Response(status=304, headers={"ETag": etag})
        return Response(table.payload, headers={"ETag": etag})
