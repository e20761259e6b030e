"""Failover: region health, incidents and drills with their timelines; start a drill.

For platform staff alone, as in the API: an incident names the replicas of every tenant in a
region."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect

from controlplane.core.models import Role
from controlplane.failover import drills
from controlplane.failover.health import DOWN_HOLD_S
from controlplane.failover.models import Health, Incident, RegionHealth
from controlplane.failover.timeline import MEANINGS, missing, timeline
from frontend import charts, fleet
from frontend.access import principal_of
from frontend.views.common import dashboard_view, forbidden, paginate, render_page

CHARTED = 12
HEALTH_ORDER = {"down": 0, "degraded": 1, "idle": 2, "healthy": 3}


def drill_regions() -> list[tuple[str, int]]:
    """Local regions with replicas a drill could kill: (key, how many)."""
    counts: dict[str, int] = {}
    for cloud, code in drills.drillable().values_list("region__cloud__name", "region__code"):
        key = f"{cloud}:{code}"
        counts[key] = counts.get(key, 0) + 1
    return sorted(counts.items())


def _may_drill(request: HttpRequest) -> bool:
    principal = principal_of(request)
    return principal.has_role(Role.OPERATOR) and principal.is_platform


def _live_context(request: HttpRequest) -> dict[str, object]:
    """Region health and incidents: the part of the page that refreshes itself."""
    health = sorted(RegionHealth.objects.select_related("region__cloud", "region__jurisdiction"),
                    key=lambda h: (HEALTH_ORDER.get(h.state, 4), h.region.key))
    incidents = Incident.objects.select_related("region__cloud").order_by("-started_at")
    page = paginate(request, incidents, per_page=20)
    charted = [{"label": f"#{i.pk} {i.get_kind_display()} · {i.region.key if i.region else '—'}",
                "timeline": timeline(i)} for i in incidents[:CHARTED]]
    in_flight = (incidents.filter(resolved_at__isnull=True).exists()
                 or any(h.state in (Health.DOWN, Health.DEGRADED) for h in health))
    return {
        "health": health,
        "page": page,
        "rows": [(i, timeline(i), missing(i)) for i in page],
        "figure": charts.incident_timeline_figure(charted) if charted else None,
        "in_flight": in_flight,
        "refresh_s": fleet.refresh_s(in_flight),
    }


@dashboard_view(platform_only=True)
def failover(request: HttpRequest) -> HttpResponse:
    return render_page(request, "frontend/failover.html", {
        **_live_context(request),
        "may_drill": _may_drill(request),
        "drill_regions": drill_regions(),
        "meanings": [(stage.replace("_", " ").capitalize(), meaning)
                     for stage, meaning in MEANINGS.items()],
        "down_hold_s": DOWN_HOLD_S,
    })


@dashboard_view(platform_only=True)
def failover_live(request: HttpRequest) -> HttpResponse:
    """Region health and incidents alone, re-fetched by htmx: every 2 s while an incident
    is open or a region is down or degraded, else every 15 s."""
    return render_page(request, "frontend/partials/failover_live.html", _live_context(request),
                       section="failover")


@dashboard_view(role=Role.OPERATOR, methods=("POST",), platform_only=True)
def drill(request: HttpRequest) -> HttpResponse:
    """Two steps: the first POST names what will be killed, the second (confirm=yes) kills."""
    if not principal_of(request).is_platform:
        return forbidden(request, "Drills are for platform staff (users with no tenant).")
    key = request.POST.get("region", "")
    try:
        region = drills.region_by_key(key)
        if request.POST.get("confirm") != "yes":
            victims = drills.drill_victims(region)
            return render_page(request, "frontend/failover_confirm.html",
                               {"region": region, "victims": victims}, section="failover")
        incident = drills.start_drill(region, actor=principal_of(request).username)
    except drills.DrillRefused as refused:
        messages.error(request, f"{refused.field}: {refused.message}")
        return redirect("frontend:failover")
    messages.success(request, f"Drill #{incident.pk} started: {incident.summary}. The timeline "
                              "below fills in as failover acts.")
    return redirect("frontend:failover")
