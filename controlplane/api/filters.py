"""FilterSets for list endpoints."""

from __future__ import annotations

import django_filters as filters
from django.db.models import QuerySet

from controlplane.api.fields import deployment_lookup
from controlplane.core.models import ApiKey, AuditLog
from controlplane.deployments.models import Deployment, Replica, ReplicaState
from regions.models import Offer, Quota, Region


def _by_region_key(queryset: QuerySet, prefix: str, value: str) -> QuerySet:
    return queryset.filter(**Region.key_filter(value, prefix))


class RegionFilter(filters.FilterSet):
    cloud = filters.CharFilter(field_name="cloud__name")
    jurisdiction = filters.CharFilter(field_name="jurisdiction__code")
    country = filters.CharFilter(field_name="country", lookup_expr="iexact")

    class Meta:
        model = Region
        fields = ["cloud", "jurisdiction", "country", "enabled"]


class OfferFilter(filters.FilterSet):
    gpu = filters.CharFilter(field_name="gpu_type__name")
    region = filters.CharFilter(method="filter_region", help_text="cloud:code")
    cloud = filters.CharFilter(field_name="region__cloud__name")
    jurisdiction = filters.CharFilter(field_name="region__jurisdiction__code")
    max_price = filters.NumberFilter(field_name="on_demand_usd_h", lookup_expr="lte")
    spot = filters.BooleanFilter(
        field_name="spot_usd_h", lookup_expr="isnull", exclude=True,
        help_text="true: only offers sold as spot too.",
    )
    min_gpus = filters.NumberFilter(field_name="gpus_per_node", lookup_expr="gte")

    class Meta:
        model = Offer
        fields = ["gpu", "region", "cloud", "jurisdiction", "max_price", "spot", "min_gpus"]

    def filter_region(self, queryset: QuerySet, name: str, value: str) -> QuerySet:
        return _by_region_key(queryset, "region__", value)


class QuotaFilter(filters.FilterSet):
    gpu = filters.CharFilter(field_name="gpu_type__name")
    region = filters.CharFilter(method="filter_region")
    cloud = filters.CharFilter(field_name="region__cloud__name")

    class Meta:
        model = Quota
        fields = ["gpu", "region", "cloud"]

    def filter_region(self, queryset: QuerySet, name: str, value: str) -> QuerySet:
        return _by_region_key(queryset, "region__", value)


class ApiKeyFilter(filters.FilterSet):
    tenant = filters.CharFilter(field_name="tenant__name")
    revoked = filters.BooleanFilter(field_name="revoked_at", lookup_expr="isnull", exclude=True)

    class Meta:
        model = ApiKey
        fields = ["tenant", "tier", "revoked"]


class DeploymentFilter(filters.FilterSet):
    tenant = filters.CharFilter(field_name="tenant__name")
    model = filters.CharFilter(field_name="model__name")

    class Meta:
        model = Deployment
        fields = ["tenant", "model", "tier"]


def by_deployment(queryset: QuerySet, name: str, value: str) -> QuerySet:
    """`?deployment=chat-eu` or `?deployment=12`: by name, or by id when all digits."""
    return queryset.filter(**deployment_lookup(value, "deployment__"))


class ReplicaFilter(filters.FilterSet):
    deployment = filters.CharFilter(method=by_deployment, help_text="Name or id.")
    region = filters.CharFilter(method="filter_region")
    state = filters.ChoiceFilter(choices=ReplicaState.choices)

    class Meta:
        model = Replica
        fields = ["deployment", "region", "state", "provider", "spot"]

    def filter_region(self, queryset: QuerySet, name: str, value: str) -> QuerySet:
        return _by_region_key(queryset, "region__", value)


class AuditLogFilter(filters.FilterSet):
    since = filters.IsoDateTimeFilter(field_name="at", lookup_expr="gte")

    class Meta:
        model = AuditLog
        fields = ["actor", "action", "object_type", "object_id", "since"]
