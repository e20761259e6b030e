"""Batches: every batch the viewer may see with its progress, counts, ETA, tokens and cost;
one batch's failed lines, progress over time and events; cancel for operators, after a
review."""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import messages
from django.db.models import Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect

from controlplane.batches import audit, intake, progress
from controlplane.batches.errors import BatchError
from controlplane.batches.models import FINISHED, Batch, BatchStatus
from controlplane.core.models import AuditLog, Role
from frontend import charts, fleet
from frontend.access import change_refusal, principal_of
from frontend.forms import ReasonForm
from frontend.views.common import (
    dashboard_view,
    forbidden,
    paginate,
    query_without_page,
    render_page,
)

EVENT_LIMIT = 25
ERRORS_PER_PAGE = 50
UNFINISHED = "unfinished"


class BatchFilter(forms.Form):
    status = forms.ChoiceField(required=False, choices=[
        ("", "any status"), (UNFINISHED, "not finished"), *BatchStatus.choices])
    q = forms.CharField(required=False, max_length=128, label="Find")


def visible_batches(request: HttpRequest) -> Any:
    """The one tenancy rule: a tenant user sees its own tenant's batches, staff see all."""
    return Batch.objects.visible_to(principal_of(request)).select_related("tenant")


def _filtered(request: HttpRequest) -> tuple[BatchFilter, Any]:
    rows = visible_batches(request)
    form = BatchFilter(request.GET or None)
    if form.is_valid():
        status, query = form.cleaned_data["status"], form.cleaned_data["q"].strip()
        if status == UNFINISHED:
            rows = rows.exclude(status__in=FINISHED)
        elif status:
            rows = rows.filter(status=status)
        if query:
            rows = rows.filter(Q(pk__icontains=query) | Q(model__icontains=query)
                               | Q(tenant__name__icontains=query))
    elif form.is_bound:
        rows = rows.none()
    return form, rows.order_by("-created_at", "-id")


def _table_context(request: HttpRequest) -> dict[str, Any]:
    """The batch table: the part of the list that refreshes itself."""
    form, rows = _filtered(request)
    page = paginate(request, rows)
    batches = list(page)
    figures = progress.progress_of(batches)
    costs = progress.costs_of(batches)
    in_flight = any(b.status not in FINISHED for b in batches)
    return {
        "form": form,
        "page": page,
        "rows": [{"batch": b, "progress": figures[b.pk], "cost": costs[b.pk],
                  "finished_at": progress.finished_at(b)} for b in batches],
        "query": query_without_page(request),
        "refresh_s": fleet.refresh_s(in_flight),
    }


@dashboard_view()
def batch_list(request: HttpRequest) -> HttpResponse:
    return render_page(request, "frontend/batches/list.html", {
        **_table_context(request),
        "rate_window_min": int(progress.RATE_WINDOW.total_seconds() // 60),
    })


@dashboard_view()
def batch_table(request: HttpRequest) -> HttpResponse:
    """The batch table alone, re-fetched by htmx: every 2 s while a batch on the page is
    unfinished, else every 15 s."""
    return render_page(request, "frontend/batches/table.html", _table_context(request),
                       section="batches")


def _batch(request: HttpRequest, batch_id: str) -> Batch:
    # Another tenant's batch is not in the queryset: a 404, as for an unknown id.
    return get_object_or_404(visible_batches(request).select_related("input_file"), pk=batch_id)


def _may_cancel(request: HttpRequest, batch: Batch) -> bool:
    principal = principal_of(request)
    return (principal.has_role(Role.OPERATOR) and batch.status not in FINISHED
            and change_refusal(principal, batch.tenant_id) is None)


def _summary_context(request: HttpRequest, batch: Batch) -> dict[str, Any]:
    """Status, progress, counts and ETA: the part of the detail page that refreshes."""
    return {
        "batch": batch,
        "progress": progress.progress_of([batch])[batch.pk],
        "cost": progress.costs_of([batch])[batch.pk],
        "finished_at": progress.finished_at(batch),
        "retrying": progress.retrying(batch),
        "finished": batch.status in FINISHED,
        "may_cancel": _may_cancel(request, batch),
        "refresh_s": fleet.refresh_s(batch.status not in FINISHED),
    }


def _events(request: HttpRequest, batch: Batch) -> list[AuditLog]:
    """The batch's events and its input file's."""
    rows = AuditLog.objects.filter(
        Q(object_type="batches.batch", object_id=batch.pk)
        | Q(object_type="batches.batchfile", object_id=batch.input_file_id))
    return list(rows.visible_to(principal_of(request)).order_by("-at", "-id")[:EVENT_LIMIT])


@dashboard_view()
def batch_detail(request: HttpRequest, batch_id: str) -> HttpResponse:
    batch = _batch(request, batch_id)
    per_minute = progress.finished_per_minute(batch)
    return render_page(request, "frontend/batches/detail.html", {
        **_summary_context(request, batch),
        "errors": paginate(request, progress.failed_lines(batch), per_page=ERRORS_PER_PAGE),
        "query": query_without_page(request),
        "events": _events(request, batch),
        "figure": charts.batch_progress_figure(per_minute) if per_minute else None,
        "reason_form": ReasonForm(),
    }, section="batches")


@dashboard_view()
def batch_summary(request: HttpRequest, batch_id: str) -> HttpResponse:
    batch = _batch(request, batch_id)
    return render_page(request, "frontend/batches/summary.html",
                       _summary_context(request, batch), section="batches")


@dashboard_view(role=Role.OPERATOR, methods=("POST",))
def cancel(request: HttpRequest, batch_id: str) -> HttpResponse:
    """Two steps: the first POST says what cancelling keeps and stops, the second
    (confirm=yes) cancels, as the operator, with the reason given."""
    batch = _batch(request, batch_id)
    principal = principal_of(request)
    refusal = change_refusal(principal, batch.tenant_id)
    if refusal:
        return forbidden(request, refusal)
    if batch.status in FINISHED:
        messages.error(request, f"Not cancelled: batch {batch.pk} has already finished "
                                f"({batch.status}); there is nothing left to stop.")
        return redirect("frontend:batch", batch_id=batch.pk)
    form = ReasonForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Not cancelled: the reason " + " ".join(
            str(e) for e in form.errors["reason"]))
        return redirect("frontend:batch", batch_id=batch.pk)
    reason = form.cleaned_data["reason"]
    if request.POST.get("confirm") != "yes":
        return render_page(request, "frontend/batches/cancel_confirm.html", {
            "batch": batch, "progress": progress.progress_of([batch])[batch.pk],
            "reason": reason,
        }, section="batches")
    try:
        with audit.acting_as(principal.username, reason):
            batch = intake.cancel_batch(batch.pk)
    except BatchError as refused:  # it finished between the two steps
        messages.error(request, f"Not cancelled: {refused.message}.")
        return redirect("frontend:batch", batch_id=batch.pk)
    counts = progress.request_counts(batch)
    kept = f"{counts['completed']} completed and {counts['failed']} failed results are kept"
    if batch.status == BatchStatus.CANCELLED:
        messages.success(request, f"Batch {batch.pk} is cancelled: {kept}.")
    else:
        messages.success(request, f"Batch {batch.pk} is cancelling: no line is sent from now "
                                  f"on; it is cancelled once the lines in flight finish. {kept}.")
    return redirect("frontend:batch", batch_id=batch.pk)
