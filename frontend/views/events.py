"""Events: the audit log as a timeline, filtered by who, what and since when."""

from __future__ import annotations

from datetime import timedelta

from django.db.models import Count
from django.db.models.functions import TruncHour
from django.http import HttpRequest, HttpResponse
from django.utils import timezone

from controlplane.core.models import AuditLog
from frontend import charts
from frontend.access import principal_of
from frontend.forms import EventFilter
from frontend.views.common import dashboard_view, paginate, query_without_page, render_page

CHART_HOURS = 48


@dashboard_view()
def events(request: HttpRequest) -> HttpResponse:
    principal = principal_of(request)
    # As the API: tenant users see their tenant's events, not shared or platform ones.
    rows = AuditLog.objects.visible_to(principal)
    form = EventFilter(
        request.GET or None,
        actions=rows.order_by("action").values_list("action", flat=True).distinct(),
        object_types=rows.order_by("object_type").values_list("object_type", flat=True).distinct(),
    )
    if form.is_valid():
        chosen = form.cleaned_data
        if chosen["actor"]:
            rows = rows.filter(actor__icontains=chosen["actor"])
        if chosen["action"]:
            rows = rows.filter(action=chosen["action"])
        if chosen["object_type"]:
            rows = rows.filter(object_type=chosen["object_type"])
        if chosen["since"]:
            rows = rows.filter(at__gte=chosen["since"])
    now = timezone.now()
    since = now - timedelta(hours=CHART_HOURS)
    per_hour = (rows.filter(at__gte=since).annotate(hour=TruncHour("at"))
                .values("hour", "object_type").order_by().annotate(n=Count("id")))
    figure = charts.events_figure(
        [{"hour": row["hour"], "kind": row["object_type"].rpartition(".")[2], "n": row["n"]}
         for row in per_hour],
        # To the end of this hour, so the bar counting it fits on the chart.
        since=since, until=now.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1),
    )
    return render_page(request, "frontend/events.html", {
        "form": form,
        "page": paginate(request, rows.order_by("-at", "-id")),
        "query": query_without_page(request),
        "figure": figure if figure["data"] else None,
        "chart_hours": CHART_HOURS,
    })
