"""The overview at `/`: headline figures, the world map of regions and edges, what needs care."""

from __future__ import annotations

from django.http import HttpRequest, HttpResponse

from controlplane.alerts.services import open_counts
from frontend import charts, fleet, traffic
from frontend.access import principal_of
from frontend.views.common import dashboard_view, render_page

ATTENTION_LIMIT = 10


def _figures(request: HttpRequest) -> dict[str, object]:
    principal = principal_of(request)
    data = fleet.overview(principal)
    attention = sorted(
        (r for r in data.regions if r.health in (fleet.DOWN, fleet.DEGRADED)),
        key=lambda r: (r.health != fleet.DOWN, r.key),
    )
    return {
        "fleet": data,
        "refresh_s": fleet.refresh_s(data.in_flight),
        "now": traffic.fleet_now(principal),
        "health_seen": {h: n for h, n in data.health_counts().items() if n and h != fleet.IDLE},
        "attention": attention[:ATTENTION_LIMIT],
        "attention_more": max(len(attention) - ATTENTION_LIMIT, 0),
        "edges_behind": [e for e in data.edges if e.enabled and not e.in_sync][:ATTENTION_LIMIT],
        "alerts_open": open_counts(principal),
    }


def _with_map(context: dict[str, object]) -> dict[str, object]:
    data = context["fleet"]
    context["world_map"] = charts.world_map(data.regions, data.edges)  # type: ignore[attr-defined]
    context["legend"] = charts.health_legend()
    return context


@dashboard_view()
def overview(request: HttpRequest) -> HttpResponse:
    return render_page(request, "frontend/overview.html", _with_map(_figures(request)))


LIVE_PARTS = {
    "figures": "frontend/partials/overview_figures.html",
    "attention": "frontend/partials/overview_attention.html",
    "map": "frontend/partials/overview_map.html",
}


@dashboard_view()
def overview_live(request: HttpRequest) -> HttpResponse:
    """One live part of the overview (`?part=figures|attention|map`), re-fetched by htmx
    every few seconds while something is in flight, else every 15 s."""
    part = request.GET.get("part", "")
    template = LIVE_PARTS.get(part, LIVE_PARTS["figures"])
    context = _figures(request)
    return render_page(request, template, _with_map(context) if part == "map" else context,
                       section="overview")
