"""Regions and inventory: clouds, regions, GPU offers with prices, quota and data freshness."""

from __future__ import annotations

from django.conf import settings
from django.contrib.postgres.aggregates import ArrayAgg
from django.db.models import (
    Count,
    DecimalField,
    ExpressionWrapper,
    F,
    Min,
    OuterRef,
    Q,
    Subquery,
    Value,
)
from django.db.models.functions import Coalesce, Greatest
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

from controlplane.deployments.lifecycle import LIVE_STATES
from frontend.access import principal_of
from frontend.fleet import visible_replicas
from frontend.forms import InventoryFilter
from frontend.views.common import dashboard_view, paginate, query_without_page, render_page
from regions.models import Cloud, GpuType, Jurisdiction, Offer, Quota, Region

OFFER_SORTS = {
    "region": ("region__cloud__name", "region__code", "gpu_type__name", "gpus_per_node"),
    "on_demand": ("on_demand_usd_h", "region__cloud__name", "region__code"),
    "spot": (F("spot_usd_h").asc(nulls_last=True), "region__cloud__name", "region__code"),
    "per_gpu": ("per_gpu_usd_h", "region__cloud__name", "region__code"),
}


def _offers(filters: dict[str, str]):  # type: ignore[no-untyped-def]
    quota = Quota.objects.filter(region=OuterRef("region"), gpu_type=OuterRef("gpu_type"))
    offers = Offer.objects.select_related(
        "region__cloud", "region__jurisdiction", "gpu_type"
    ).annotate(
        quota_limit=Subquery(quota.values("limit_gpus")[:1]),
        quota_used=Subquery(quota.values("in_use_gpus")[:1]),
        quota_left=Subquery(quota.annotate(
            left=Greatest(F("limit_gpus") - F("in_use_gpus"), Value(0))).values("left")[:1]),
        quota_observed_at=Subquery(quota.values("observed_at")[:1]),
        quota_source=Subquery(quota.values("source")[:1]),
        per_gpu_usd_h=ExpressionWrapper(
            F("on_demand_usd_h") / F("gpus_per_node"),
            output_field=DecimalField(max_digits=10, decimal_places=4)),
    )
    if filters.get("jurisdiction"):
        offers = offers.filter(region__jurisdiction__code=filters["jurisdiction"])
    if filters.get("gpu"):
        offers = offers.filter(gpu_type__name=filters["gpu"])
    if filters.get("cloud"):
        offers = offers.filter(region__cloud__name=filters["cloud"])
    return offers.order_by(*OFFER_SORTS[filters.get("sort") or "region"])


def _regions(filters: dict[str, str], request: HttpRequest):  # type: ignore[no-untyped-def]
    live = (visible_replicas(principal_of(request))
            .filter(region=OuterRef("pk"), state__in=LIVE_STATES)
            .order_by().values("region").annotate(n=Count("id")).values("n"))
    regions = Region.objects.select_related("cloud", "jurisdiction").annotate(
        offer_count=Count("offers"),
        gpu_names=ArrayAgg("offers__gpu_type__name", distinct=True, default=[],
                           order_by="offers__gpu_type__name"),
        cheapest_gpu_usd_h=Min(ExpressionWrapper(
            F("offers__on_demand_usd_h") / F("offers__gpus_per_node"),
            output_field=DecimalField(max_digits=10, decimal_places=4))),
        live_replicas=Coalesce(Subquery(live), 0),
    )
    if filters.get("jurisdiction"):
        regions = regions.filter(jurisdiction__code=filters["jurisdiction"])
    if filters.get("gpu"):
        # A subquery, not a join: a second join on offers would multiply the aggregates.
        regions = regions.filter(pk__in=Offer.objects.filter(
            gpu_type__name=filters["gpu"]).values("region_id"))
    if filters.get("cloud"):
        regions = regions.filter(cloud__name=filters["cloud"])
    return regions.order_by("cloud__name", "code")


@dashboard_view()
def inventory(request: HttpRequest) -> HttpResponse:
    form = InventoryFilter(
        request.GET or None,
        jurisdictions=Jurisdiction.objects.values_list("code", "name"),
        gpus=GpuType.objects.values_list("name", flat=True),
        clouds=Cloud.objects.values_list("name", "display_name"),
    )
    filters = form.cleaned_data if form.is_valid() else {}
    tab = filters.get("tab") or "offers"
    clouds = Cloud.objects.annotate(
        region_count=Count("regions", distinct=True),
        offer_count=Count("regions__offers", distinct=True),
        gpu_count=Count("regions__offers__gpu_type", distinct=True),
        cheapest_gpu_usd_h=Min(ExpressionWrapper(
            F("regions__offers__on_demand_usd_h") / F("regions__offers__gpus_per_node"),
            output_field=DecimalField(max_digits=10, decimal_places=4)),
            filter=Q(regions__enabled=True)),
    ).order_by("name")
    rows = _offers(filters) if tab == "offers" else _regions(filters, request)
    stale_after = settings.MERIDIAN["CATALOG_STALE_AFTER"]
    return render_page(request, "frontend/inventory.html", {
        "form": form,
        "tab": tab,
        "clouds": clouds,
        "page": paginate(request, rows),
        "query": query_without_page(request),
        "stale_before": timezone.now() - stale_after,
        "stale_days": round(stale_after.total_seconds() / 86400, 1),
    })
