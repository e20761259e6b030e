"""Failover: region health, incidents and drills with their timelines; start a drill."""

from __future__ import annotations

from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import redirect

from controlplane.core.models import Role
from controlplane.failover import services
from controlplane.failover.models import Incident, RegionHealth
from frontend import charts
from frontend.access import dashboard_view, forbidden, principal_of
from frontend.views.common import paginate, render_page

CHARTED = 12
HEALTH_ORDER = {"down": 0, "degraded": 1, "healthy": 2}


def drill_regions() -> list[tuple[str, int]]:
    """Local regions with replicas a drill could kill: (key, how many)."""
    counts: dict[str, int] = {}
    for cloud, code in services.drillable().values_list("region__cloud__name", "region__code"):
        key = f"{cloud}:{code}"
        counts[key] = counts.get(key, 0) + 1
    return sorted(counts.items())


def _may_drill(request: HttpRequest) -> bool:
    principal = principal_of(request)
    return principal.has_role(Role.OPERATOR) and principal.is_platform


@dashboard_view()
def failover(request: HttpRequest) -> HttpResponse:
    health = sorted(RegionHealth.objects.select_related("region__cloud", "region__jurisdiction"),
                    key=lambda h: (HEALTH_ORDER.get(h.state, 3), h.region.key))
    incidents = Incident.objects.select_related("region__cloud").order_by("-started_at")
    page = paginate(request, incidents, per_page=20)
    charted = [{"label": f"#{i.pk} {i.get_kind_display()} · {i.region.key if i.region else '—'}",
                "timeline": services.timeline(i)} for i in incidents[:CHARTED]]
    return render_page(request, "frontend/failover.html", {
        "health": health,
        "page": page,
        "rows": [(i, services.timeline(i)) for i in page],
        "figure": charts.incident_timeline_figure(charted) if charted else None,
        "may_drill": _may_drill(request),
        "drill_regions": drill_regions(),
    })


@dashboard_view(role=Role.OPERATOR, methods=("POST",))
def drill(request: HttpRequest) -> HttpResponse:
    """Two steps: the first POST names what will be killed, the second (confirm=yes) kills."""
    if not principal_of(request).is_platform:
        return forbidden(request, "Drills are for platform staff (users with no tenant).")
    key = request.POST.get("region", "")
    try:
        region = services.region_by_key(key)
        if request.POST.get("confirm") != "yes":
            victims = services.drill_victims(region)
            return render_page(request, "frontend/failover_confirm.html",
                               {"region": region, "victims": victims}, section="failover")
        incident = services.start_drill(region, actor=principal_of(request).username)
    except services.DrillRefused as refused:
        messages.error(request, f"{refused.field}: {refused.message}")
        return redirect("frontend:failover")
    messages.success(request, f"Drill #{incident.pk} started: {incident.summary}. The timeline "
                              "below fills in as failover acts.")
    return redirect("frontend:failover")
