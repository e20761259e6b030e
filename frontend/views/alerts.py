"""Alerts: what is open now (critical first), then what resolved recently; operators
acknowledge open alerts."""

from __future__ import annotations

from django import forms
from django.contrib import messages
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect

from controlplane.alerts import services
from controlplane.alerts.models import Alert, AlertState, Rule, Severity
from controlplane.core.models import Role
from frontend.access import principal_of
from frontend.views.common import dashboard_view, paginate, query_without_page, render_page

OPEN_LIMIT = 200


class AlertFilter(forms.Form):
    rule = forms.ChoiceField(choices=[("", "any")] + Rule.choices, required=False)
    severity = forms.ChoiceField(choices=[("", "any")] + Severity.choices, required=False)


class AcknowledgeForm(forms.Form):
    note = forms.CharField(max_length=500, required=False)


@dashboard_view()
def alerts(request: HttpRequest) -> HttpResponse:
    principal = principal_of(request)
    rows = Alert.objects.select_related("tenant").visible_to(principal)
    form = AlertFilter(request.GET or None)
    if form.is_valid():
        if form.cleaned_data["rule"]:
            rows = rows.filter(rule=form.cleaned_data["rule"])
        if form.cleaned_data["severity"]:
            rows = rows.filter(severity=form.cleaned_data["severity"])
    elif form.is_bound:
        rows = rows.none()
    # "critical" sorts before "warning": the worst first, then the newest.
    open_rows = list(rows.filter(state=AlertState.OPEN)
                     .order_by("severity", "-opened_at", "-id")[:OPEN_LIMIT + 1])
    return render_page(request, "frontend/alerts.html", {
        "form": form,
        "open_alerts": open_rows[:OPEN_LIMIT],
        "open_more": len(open_rows) > OPEN_LIMIT,
        "counts": services.open_counts(principal),
        "resolved": paginate(request, rows.filter(state=AlertState.RESOLVED)
                             .order_by("-resolved_at", "-id")),
        "query": query_without_page(request),
        "may_acknowledge": principal.has_role(Role.OPERATOR),
    })


@dashboard_view(role=Role.OPERATOR, methods=("POST",))
def acknowledge(request: HttpRequest, pk: int) -> HttpResponse:
    principal = principal_of(request)
    alert = get_object_or_404(Alert.objects.visible_to(principal), pk=pk)  # another tenant's: 404
    form = AcknowledgeForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Nothing done: the note " + " ".join(str(e) for e in form.errors["note"]))
        return redirect("frontend:alerts")
    try:
        services.acknowledge(alert.pk, principal.username, form.cleaned_data["note"])
    except services.AcknowledgeError as exc:
        messages.error(request, f"Nothing done: {exc}")
    else:
        messages.success(request, f"Alert {alert.pk} ({alert.subject}) acknowledged.")
    return redirect("frontend:alerts")
