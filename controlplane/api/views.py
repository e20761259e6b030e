"""Viewsets of the REST API: three attributes each on the shared base."""

from __future__ import annotations

from django.db import transaction
from django.db.models import Count, Prefetch, Q
from django.db.models import Model as DjangoModel
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, status, viewsets
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api import catalog_serializers, filters, serializers
from controlplane.api.base import ByNameOrId, MeridianViewSet, TenantScopedViewSet
from controlplane.api.deployment_actions import DeploymentActions, ReplicaActions
from controlplane.api.query_params import ChecksQueryParams
from controlplane.core import status as system_status
from controlplane.core.models import ApiKey, AuditLog, Role, Tenant
from controlplane.core.services import set_key_revoked
from controlplane.deployments.models import Deployment, Model, Replica, ReplicaState
from controlplane.provisioning.models import Operation
from regions.models import Cloud, GpuType, Jurisdiction, Offer, Quota, Region


class CatalogViewSet(MeridianViewSet):
    """The shared GPU catalog: everyone reads, platform admins write."""

    write_role = Role.ADMIN
    platform_only_writes = True


class CloudViewSet(CatalogViewSet):
    queryset = Cloud.objects.all()
    serializer_class = catalog_serializers.CloudSerializer
    filterset_fields = ["enabled"]
    ordering_fields = ["name"]


class JurisdictionViewSet(CatalogViewSet):
    queryset = Jurisdiction.objects.all()
    serializer_class = catalog_serializers.JurisdictionSerializer
    ordering_fields = ["code", "name"]


class RegionViewSet(CatalogViewSet):
    queryset = Region.objects.select_related("cloud", "jurisdiction")
    serializer_class = catalog_serializers.RegionSerializer
    filterset_class = filters.RegionFilter
    ordering_fields = ["code", "country", "latitude", "longitude"]


class GpuTypeViewSet(CatalogViewSet):
    queryset = GpuType.objects.all()
    serializer_class = catalog_serializers.GpuTypeSerializer
    ordering_fields = ["name", "memory_gib", "bf16_tflops"]


class OfferViewSet(CatalogViewSet):
    queryset = Offer.objects.select_related("region__cloud", "region__jurisdiction", "gpu_type")
    serializer_class = catalog_serializers.OfferSerializer
    filterset_class = filters.OfferFilter
    ordering_fields = ["on_demand_usd_h", "spot_usd_h", "gpus_per_node", "observed_at"]


class QuotaViewSet(CatalogViewSet):
    queryset = Quota.objects.select_related("region__cloud", "gpu_type")
    serializer_class = catalog_serializers.QuotaSerializer
    filterset_class = filters.QuotaFilter
    ordering_fields = ["limit_gpus", "in_use_gpus", "observed_at"]


# LLM architectures (deployments.Model), named apart from DRF's ModelViewSet.
class LlmModelViewSet(CatalogViewSet):
    queryset = Model.objects.all()
    serializer_class = serializers.LlmModelSerializer
    filterset_fields = ["family", "dtype"]
    ordering_fields = ["name", "parameters_b"]


class TenantViewSet(MeridianViewSet):
    write_role = Role.ADMIN
    platform_only_writes = True
    queryset = Tenant.objects.prefetch_related(
        "allowed_jurisdictions", Prefetch("allowed_regions", Region.objects.select_related("cloud"))
    )
    serializer_class = serializers.TenantSerializer
    filterset_fields = ["name"]
    ordering_fields = ["name", "created_at"]


class ApiKeyViewSet(MeridianViewSet):
    """Inference keys for the edges. DELETE revokes: the row stays for the record."""

    write_role = Role.ADMIN
    queryset = ApiKey.objects.select_related("tenant")
    serializer_class = serializers.ApiKeySerializer
    filterset_class = filters.ApiKeyFilter
    ordering_fields = ["name", "created_at"]

    @transaction.atomic
    def perform_destroy(self, instance: DjangoModel) -> None:
        assert isinstance(instance, ApiKey)  # the queryset holds only API keys
        set_key_revoked(instance, True, self.principal)
        self._audit("revoke", instance, {})


class DeploymentViewSet(ByNameOrId, DeploymentActions, MeridianViewSet):
    write_role = Role.OPERATOR
    queryset = (
        Deployment.objects.select_related("model", "tenant")
        .prefetch_related(
            "allowed_jurisdictions",
            Prefetch("user_regions", Region.objects.select_related("cloud")),
        )
        .annotate(replicas_ready=Count("replicas", filter=Q(replicas__state=ReplicaState.READY)))
        .order_by("name")
    )
    serializer_class = serializers.DeploymentSerializer
    filterset_class = filters.DeploymentFilter
    ordering_fields = ["name", "created_at", "updated_at", "min_replicas", "max_replicas"]


class ReplicaViewSet(ReplicaActions, TenantScopedViewSet, viewsets.ReadOnlyModelViewSet):
    queryset = Replica.objects.select_related("deployment", "region__cloud")
    serializer_class = serializers.ReplicaSerializer
    filterset_class = filters.ReplicaFilter
    ordering_fields = ["created_at", "state", "state_changed_at"]


class AuditLogViewSet(TenantScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin):
    """The append-only record; tenant users see their own tenant's events only."""

    write_role = Role.ADMIN
    queryset = AuditLog.objects.all()
    serializer_class = serializers.AuditLogSerializer
    filterset_class = filters.AuditLogFilter
    ordering_fields = ["at"]


class StatusView(ChecksQueryParams, APIView):
    """Whether the database, Redis, Celery workers and beat are alive."""

    @extend_schema(responses=serializers.StatusSerializer)
    def get(self, request: Request) -> Response:
        report = system_status.collect()
        code = status.HTTP_200_OK if report["ok"] else status.HTTP_503_SERVICE_UNAVAILABLE
        return Response(report, status=code)



class OperationViewSet(TenantScopedViewSet, viewsets.ReadOnlyModelViewSet):
    """Provider jobs (launch, terminate, …) with their status and log."""

    queryset = Operation.objects.all()
    serializer_class = serializers.OperationSerializer
    filterset_fields = ["kind", "status", "provider", "replica"]
    ordering_fields = ["created_at", "kind", "status"]
