"""REST API for operators' view of batches (`/api/v1/batches/`): list and read every batch
the caller may see, with progress and cost, and cancel one (operators). The OpenAI-shaped
`/v1/batches` (tenants' keys) is `batch_views.py`; both act through `batches.intake`."""

from __future__ import annotations

from typing import Any

import django_filters as filters
from drf_spectacular.utils import extend_schema
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.decorators import action
from rest_framework.request import Request
from rest_framework.response import Response

from controlplane.api.base import TenantScopedViewSet
from controlplane.api.strict_input import StrictSerializer
from controlplane.batches import audit, intake, progress
from controlplane.batches.cost import batch_cost, cost_json
from controlplane.batches.errors import BatchError
from controlplane.batches.models import Batch, BatchStatus
from controlplane.core.models import Role


class BatchSerializer(serializers.ModelSerializer):
    tenant: serializers.SlugRelatedField = serializers.SlugRelatedField(
        slug_field="name", read_only=True)
    request_counts = serializers.SerializerMethodField()
    eta_s = serializers.SerializerMethodField(
        help_text="Seconds left at the pace of the last 5 minutes; null when not known.")

    class Meta:
        model = Batch
        fields = ["id", "tenant", "model", "endpoint", "status", "completion_window",
                  "input_file", "output_file", "error_file", "metadata", "errors",
                  "request_counts", "eta_s", "created_at", "in_progress_at",
                  "finalizing_at", "completed_at", "failed_at", "expired_at",
                  "cancelling_at", "cancelled_at", "expires_at"]
        read_only_fields = fields

    def _progress(self, batch: Batch) -> progress.Progress:
        """From the context's `progress` (a list's, counted in one go), else counted now."""
        known: dict[str, progress.Progress] = self.context.get("progress") or {}
        return known.get(batch.pk) or progress.progress_of([batch])[batch.pk]

    def get_request_counts(self, batch: Batch) -> dict[str, int]:
        p = self._progress(batch)
        return {"total": p.total, "completed": p.completed, "failed": p.failed,
                "running": p.running}

    def get_eta_s(self, batch: Batch) -> float | None:
        eta = self._progress(batch).eta_s
        return None if eta is None else round(eta, 1)


class BatchDetailSerializer(BatchSerializer):
    cost = serializers.SerializerMethodField(help_text=(
        "Its share, by tokens, of its replicas' cost while it ran, and the interactive "
        "$/Mtok of the same model beside it (as `meridian.cost` in /v1/batches)."))

    class Meta(BatchSerializer.Meta):
        fields = [*BatchSerializer.Meta.fields, "cost"]
        read_only_fields = fields

    def get_cost(self, batch: Batch) -> dict[str, Any]:
        return cost_json(batch_cost(batch))


class BatchFilter(filters.FilterSet):
    status = filters.ChoiceFilter(choices=BatchStatus.choices)
    model = filters.CharFilter(field_name="model")
    tenant = filters.CharFilter(field_name="tenant__name")

    class Meta:
        model = Batch
        fields = ["status", "model", "tenant"]


class CancelRequest(StrictSerializer):
    reason = serializers.CharField(max_length=500, required=False, default="",
                                   allow_blank=True, help_text="Why, for the audit log.")


class BatchViewSet(TenantScopedViewSet, mixins.ListModelMixin, mixins.RetrieveModelMixin,
                   viewsets.GenericViewSet):
    """Batches sent to /v1/batches; tenant users see their own tenant's only."""

    write_role = Role.OPERATOR
    queryset = Batch.objects.select_related("tenant")
    serializer_class = BatchSerializer
    filterset_class = BatchFilter
    ordering_fields = ["created_at", "status"]
    ordering = ["-created_at", "id"]

    def get_serializer_class(self) -> type[serializers.BaseSerializer[Any]]:
        return BatchDetailSerializer if self.action == "retrieve" else BatchSerializer

    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        batches = self.filter_queryset(self.get_queryset())
        page = self.paginate_queryset(batches)
        rows = list(page if page is not None else batches)
        context = {**self.get_serializer_context(), "progress": progress.progress_of(rows)}
        data = BatchSerializer(rows, many=True, context=context).data
        return self.get_paginated_response(data) if page is not None else Response(data)

    @extend_schema(request=CancelRequest, responses={200: BatchDetailSerializer})
    @action(detail=True, methods=["post"])
    def cancel(self, request: Request, pk: Any = None) -> Response:
        """Stop new sends (results already stored are kept); 409 when it has finished."""
        batch = self.get_object()  # another tenant's batch: 404, whatever the body
        body = CancelRequest(data=request.data)
        body.is_valid(raise_exception=True)
        try:
            with audit.acting_as(self.principal.username, body.validated_data["reason"]):
                intake.cancel_batch(batch.pk)
        except BatchError as refused:
            return Response({"detail": refused.message}, status=status.HTTP_409_CONFLICT)
        found = self.get_queryset().get(pk=batch.pk)
        return Response(BatchDetailSerializer(found, context=self.get_serializer_context()).data)
