"""Costs API (read-only): spend grouped by model, region, tenant or time; hourly rollup rows;
tenants' budgets. Tenant users see their own tenant's rows and budget only."""

from __future__ import annotations

from datetime import datetime
from decimal import ROUND_HALF_UP
from typing import Any

import django_filters
from django.db.models import QuerySet
from django.http import Http404
from django.utils import timezone
from drf_spectacular.utils import OpenApiParameter, extend_schema
from rest_framework import mixins, serializers, viewsets
from rest_framework.request import Request
from rest_framework.response import Response
from rest_framework.views import APIView

from controlplane.api.query_params import ChecksQueryParams
from controlplane.core import money
from controlplane.core.models import Tenant
from controlplane.core.services import principal_for
from controlplane.costs import budgets, services
from controlplane.costs.models import CostRollup


class CostQuerySerializer(serializers.Serializer):
    group_by = serializers.ChoiceField(
        choices=services.GROUPS, default="model",
        help_text="What to group spend by; tenant \"(idle)\" is cost no tenant's tokens used "
                  "(platform staff only).")
    since = serializers.DateTimeField(
        required=False, help_text="From this hour on (default: the start of this UTC month).")
    until = serializers.DateTimeField(
        required=False, help_text="Hours starting before this (default: now).")
    model = serializers.CharField(required=False, help_text="Only this served model name.")
    region = serializers.CharField(required=False, help_text="Only this region (cloud:code).")
    tenant = serializers.CharField(required=False,
                                   help_text="Only this tenant (\"(idle)\": idle cost).")

    def validate(self, attrs: dict[str, Any]) -> dict[str, Any]:
        now = timezone.now()
        attrs.setdefault("until", now)
        attrs.setdefault("since", budgets.month_bounds(attrs["until"])[0])
        if attrs["since"] >= attrs["until"]:
            raise serializers.ValidationError({"until": "until must be after since."})
        return attrs


class CostGroupSerializer(serializers.Serializer):
    key = serializers.CharField(help_text="The model, region, tenant or time of this group.")
    usd = serializers.DecimalField(max_digits=16, decimal_places=2, rounding=ROUND_HALF_UP,
                                   help_text="To the cent.")
    prompt_tokens = serializers.IntegerField()
    completion_tokens = serializers.IntegerField()
    tokens = serializers.IntegerField()
    usd_per_mtok = serializers.FloatField(
        allow_null=True,
        help_text="$ per million tokens, four significant figures; null without tokens.")


class CostTotalSerializer(CostGroupSerializer):
    key = None  # type: ignore[assignment]
    idle_usd = serializers.DecimalField(max_digits=16, decimal_places=2, rounding=ROUND_HALF_UP,
                                        help_text="Cost no tenant's tokens used.")


class CostSummarySerializer(serializers.Serializer):
    group_by = serializers.CharField()
    since = serializers.DateTimeField()
    until = serializers.DateTimeField()
    total = CostTotalSerializer()
    results = CostGroupSerializer(many=True)


class CostSummaryView(ChecksQueryParams, APIView):
    """Spend from the hourly rollups, grouped; each replica's cost is allocated to tenants by
    the tokens the edges served them, and cost no tokens used is idle (tenant "")."""

    query_params = tuple(CostQuerySerializer().fields)

    @extend_schema(parameters=[CostQuerySerializer], responses=CostSummarySerializer,
                   operation_id="costs_summary")
    def get(self, request: Request) -> Response:
        query = CostQuerySerializer(data=request.query_params)
        query.is_valid(raise_exception=True)
        q = query.validated_data
        rows = CostRollup.objects.visible_to(principal_for(request.user))
        rows = rows.filter(hour__gte=services.hour_of(q["since"]), hour__lt=q["until"])
        if q.get("tenant") == services.IDLE_TENANT:
            q["tenant"] = ""
        for field in ("model", "region", "tenant"):
            if field in q:
                rows = rows.filter(**{field: q[field]})
        results = services.summarize(rows, q["group_by"])
        for row in results:
            if isinstance(row["key"], datetime):
                row["key"] = row["key"].isoformat()
        return Response(CostSummarySerializer({
            "group_by": q["group_by"], "since": q["since"], "until": q["until"],
            "total": services.totals(rows), "results": results,
        }).data)


class CostRollupSerializer(serializers.ModelSerializer):
    tokens = serializers.IntegerField(read_only=True)
    tenant = serializers.SerializerMethodField(help_text="\"(idle)\": cost no tokens used.")
    usd = serializers.DecimalField(max_digits=16, decimal_places=2, rounding=ROUND_HALF_UP,
                                   read_only=True, help_text="To the cent.")
    usd_per_mtok = serializers.SerializerMethodField()

    class Meta:
        model = CostRollup
        fields = ["hour", "model", "region", "tenant", "prompt_tokens", "completion_tokens",
                  "tokens", "usd", "usd_per_mtok", "computed_at"]

    def get_tenant(self, row: CostRollup) -> str:
        return row.tenant or services.IDLE_TENANT

    def get_usd_per_mtok(self, row: CostRollup) -> float | None:
        return services.usd_per_mtok(row.usd, row.tokens)


class CostRollupFilter(django_filters.FilterSet):
    since = django_filters.IsoDateTimeFilter(field_name="hour", lookup_expr="gte",
                                             label="Hours from this time on.")
    until = django_filters.IsoDateTimeFilter(field_name="hour", lookup_expr="lt",
                                             label="Hours starting before this time.")

    class Meta:
        model = CostRollup
        fields = ["model", "region", "tenant"]


class CostRollupViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """Hourly rollup rows: per hour, model, region and tenant, the tokens served and the $."""

    queryset = CostRollup.objects.all()
    serializer_class = CostRollupSerializer
    filterset_class = CostRollupFilter
    ordering_fields = ["hour", "usd"]

    def get_queryset(self) -> QuerySet[CostRollup]:
        return CostRollup.objects.visible_to(principal_for(self.request.user))


class CentsField(serializers.FloatField):
    """An amount in dollars, to the cent (under a cent, to four significant figures), as
    everywhere (`core.money.amount`)."""

    def to_representation(self, value: Any) -> float:  # type: ignore[override]
        return float(money.amount(value))


class RatioField(serializers.FloatField):
    """A fraction to three decimals, as everywhere (`core.money.ratio`)."""

    def to_representation(self, value: Any) -> float | None:  # type: ignore[override]
        return money.ratio(value)


class BudgetSerializer(serializers.Serializer):
    tenant = serializers.CharField()
    spent_usd = CentsField(help_text="Spent this UTC month so far.")
    budget_usd = CentsField(allow_null=True, help_text="Monthly budget; null: none.")
    fraction = RatioField(allow_null=True, help_text="spent ÷ budget, to three decimals.")
    projected_usd = CentsField(help_text="Month-end spend if the last 24 hours' rate goes on.")
    projected_fraction = RatioField(allow_null=True, help_text="projected ÷ budget, to three "
                                                              "decimals.")
    over_budget = serializers.BooleanField()
    projected_over = serializers.BooleanField()
    month_start = serializers.DateTimeField()
    month_end = serializers.DateTimeField()


class BudgetViewSet(mixins.ListModelMixin, viewsets.GenericViewSet):
    """Each tenant's spend this month against its monthly budget, with a month-end
    projection. Budgets are set on the tenant (`monthly_budget_usd`)."""

    serializer_class = BudgetSerializer
    pagination_class = None
    ordering_fields = ["name", "created_at"]
    ordering = ["name"]
    lookup_field = "name"
    lookup_value_regex = r"[-a-zA-Z0-9_]+"

    def _tenants(self, request: Request) -> QuerySet[Tenant]:
        return Tenant.objects.visible_to(principal_for(request.user)).order_by("name")

    def get_queryset(self) -> QuerySet[Tenant]:
        return self._tenants(self.request)

    def list(self, request: Request, *args: Any, **kwargs: Any) -> Response:
        tenants = self.filter_queryset(self.get_queryset())
        return Response(BudgetSerializer(budgets.budget_statuses(list(tenants)), many=True).data)

    @extend_schema(responses=BudgetSerializer,
                   parameters=[OpenApiParameter("name", str, OpenApiParameter.PATH,
                                                description="The tenant's name.")])
    def retrieve(self, request: Request, name: str) -> Response:
        tenant = self._tenants(request).filter(name=name).first()
        if tenant is None:
            raise Http404(f"no tenant {name!r}")
        return Response(BudgetSerializer(budgets.budget_status(tenant)).data)
