"""Routing: edges with their newest table and acknowledged version, and diffs between tables."""

from __future__ import annotations

from typing import Any

from django.db.models import Count, F, OuterRef, Q, Subquery
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404

from controlplane.routing.models import Edge, RoutingPolicy, RoutingTable
from frontend.access import principal_of
from frontend.fleet import edge_routes, edges_with_versions
from frontend.tablediff import diff_tables
from frontend.views.common import (
    dashboard_view,
    forbidden,
    paginate,
    query_without_page,
    render_page,
)

VERSION_CHOICES = 100


def _edge_summary() -> dict[str, Any]:
    newest = RoutingTable.objects.filter(edge=OuterRef("pk")).order_by("-version")
    enabled = Q(enabled=True)
    return Edge.objects.annotate(latest=Subquery(newest.values("version")[:1])).aggregate(
        total=Count("pk"),
        enabled_count=Count("pk", filter=enabled),
        in_sync=Count("pk", filter=enabled & (Q(latest__isnull=True)
                                              | Q(last_acked_version=F("latest")))),
        failing=Count("pk", filter=enabled & ~Q(last_error="")),
    )


def _edge_rows(request: HttpRequest) -> dict[str, Any]:
    page = paginate(request, edges_with_versions())
    routes = edge_routes()
    for edge in page:
        edge.routes = routes.get(edge.pk, [])
        edge.in_sync = edge.latest_version is None or edge.last_acked_version == edge.latest_version
        edge.behind = (edge.latest_version or 0) - (edge.last_acked_version or 0)
    # Routes reveal where other tenants' replicas run: tenant users see their own on the map.
    return {"page": page, "query": query_without_page(request),
            "show_routes": principal_of(request).is_platform}


@dashboard_view()
def routing(request: HttpRequest) -> HttpResponse:
    newest = RoutingTable.objects.order_by("-version").values("version", "created_at").first()
    return render_page(request, "frontend/routing/index.html", {
        **_edge_rows(request),
        "summary": _edge_summary(),
        "newest": newest,
        "policy": RoutingPolicy.objects.filter(name="default").first(),
    })


@dashboard_view()
def edge_table(request: HttpRequest) -> HttpResponse:
    """The edge table alone, which the routing page re-fetches every few seconds."""
    return render_page(request, "frontend/routing/edge_table.html", _edge_rows(request),
                       section="routing")


def _version(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None


@dashboard_view()
def table_diff(request: HttpRequest, edge: str) -> HttpResponse:
    # A table lists every tenant's key digests and rules; tenant users see only their own rows
    # everywhere else, so the raw tables are for platform staff.
    if not principal_of(request).is_platform:
        return forbidden(request, "Routing tables hold every tenant's rules; only platform "
                                  "staff may read them.")
    row = get_object_or_404(Edge.objects.select_related("region__cloud"), name=edge)
    versions = list(RoutingTable.objects.filter(edge=row).order_by("-version")
                    .values("version", "created_at", "payload_hash")[:VERSION_CHOICES])
    context: dict[str, Any] = {"edge": row, "versions": versions, "diff": None}
    if len(versions) >= 1:
        newer = _version(request.GET.get("to")) or versions[0]["version"]
        default_older = (row.last_acked_version if row.last_acked_version not in (None, newer)
                         else (versions[1]["version"] if len(versions) > 1 else newer))
        older = _version(request.GET.get("from")) or default_older
        payloads = dict(RoutingTable.objects.filter(edge=row, version__in={older, newer})
                        .values_list("version", "payload"))
        context.update(older=older, newer=newer)
        if older in payloads and newer in payloads:
            context["diff"] = diff_tables(payloads[older], payloads[newer])
        else:
            context["missing"] = sorted({older, newer} - payloads.keys())
    return render_page(request, "frontend/routing/diff.html", context, section="routing")
