"""Plans: the solver's proposed replica changes with reasons and cost; review and apply them.

As in the API (controlplane/api/plan_views.py), plans are for platform staff alone (they name
every tenant's deployments and costs): every platform role reads them and platform operators
propose, approve, apply and reject; the steps are controlplane.plans.apply.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django.contrib import messages
from django.db.models import Count, Prefetch
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect

from controlplane.core.models import Role
from controlplane.placement.models import OPEN_STATUSES, Plan, PlanChange, PlanStatus
from controlplane.placement.proposals import propose_plan
from controlplane.plans import apply as plans
from controlplane.plans.freshness import moved
from frontend.access import principal_of
from frontend.forms import ReasonForm
from frontend.views.common import (
    dashboard_view,
    forbidden,
    paginate,
    query_without_page,
    render_page,
)

PLATFORM_ONLY = "Only platform staff (users with no tenant) may change this."


def _review_steps() -> dict[str, tuple[Callable[..., Plan], str]]:
    return {
        "approve": (plans.approve, "approved"),
        "apply": (plans.start_apply,
                  "is being applied: new replicas first, removals once they are ready"),
        "reject": (plans.reject, "rejected"),
    }


@dashboard_view(platform_only=True)
def plan_list(request: HttpRequest) -> HttpResponse:
    rows = Plan.objects.annotate(change_count=Count("changes")).defer("inputs", "log")
    status = request.GET.get("status", "")
    if status in PlanStatus.values:
        rows = rows.filter(status=status)
    page = paginate(request, rows.order_by("-created_at", "-id"))
    return render_page(request, "frontend/plans/list.html", {
        "page": page,
        # Open plans on this page whose fleet moved since: they can only be proposed again.
        "stale": {plan.pk for plan in page if plan.status in OPEN_STATUSES and moved(plan)},
        "query": query_without_page(request),
        "statuses": PlanStatus.choices,
        "status": status,
        "may_review": _may_review(request),
    })


def _may_review(request: HttpRequest) -> bool:
    principal = principal_of(request)
    return principal.has_role(Role.OPERATOR) and principal.is_platform


@dashboard_view(platform_only=True)
def plan_detail(request: HttpRequest, pk: int) -> HttpResponse:
    changes = PlanChange.objects.select_related(
        "deployment", "region__cloud", "offer__gpu_type",
    ).order_by("deployment__name", "action", "id")
    plan = get_object_or_404(Plan.objects.prefetch_related(Prefetch("changes", changes)), pk=pk)
    rows = list(plan.changes.all())
    # An open plan whose fleet moved since it was computed cannot act (plans.freshness).
    stale = moved(plan) if plan.status in OPEN_STATUSES else []
    return render_page(request, "frontend/plans/detail.html", {
        "plan": plan,
        "changes": rows,
        "stale": stale,
        "may_review": _may_review(request),
        # A plan that changes nothing has nothing to approve or apply (plans.apply refuses).
        "can_approve": plan.status == PlanStatus.PROPOSED and bool(rows) and not stale,
        "can_apply": plan.status == PlanStatus.APPROVED and bool(rows) and not stale,
        "can_reject": plan.status in (PlanStatus.PROPOSED, PlanStatus.APPROVED),
        "solver": _solver_facts(plan.solver),
    }, section="plans")


def _solver_facts(solver: dict[str, Any]) -> list[tuple[str, Any]]:
    labels = {"status": "solver status", "solve_s": "solve time (s)", "variables": "variables",
              "gap_to_lp_bound": "gap to LP bound", "lp_bound_usd_h": "LP bound ($/h)"}
    return [(labels.get(k, k), _fact(k, v)) for k, v in (solver or {}).items() if v is not None]


def _fact(key: str, value: Any) -> Any:
    """Figures as people read them: dollars to the cent, shares as percentages."""
    if isinstance(value, float):
        if key.endswith("usd_h"):
            return f"${value:,.2f}"
        if key == "gap_to_lp_bound":
            return f"{100 * value:.2f}%"
        if key == "solve_s":
            return f"{value:.3f}"
    return value


@dashboard_view(role=Role.OPERATOR, methods=("POST",), platform_only=True)
def propose(request: HttpRequest) -> HttpResponse:
    principal = principal_of(request)
    if not principal.is_platform:
        return forbidden(request, PLATFORM_ONLY)
    plan = propose_plan(None, actor=principal.username, trigger="manual")
    messages.success(request, f"Plan {plan.pk} proposed: {plan.status}.")
    return redirect("frontend:plan", pk=plan.pk)


@dashboard_view(role=Role.OPERATOR, methods=("POST",), platform_only=True)
def review(request: HttpRequest, pk: int, step: str) -> HttpResponse:
    steps = _review_steps()
    if step not in steps:
        raise Http404(f"no plan step {step!r}")
    principal = principal_of(request)
    if not principal.is_platform:
        return forbidden(request, PLATFORM_ONLY)
    plan = get_object_or_404(Plan, pk=pk)
    action, done = steps[step]
    form = ReasonForm(request.POST)
    reason = form.cleaned_data["reason"] if form.is_valid() else ""
    try:
        if step == "reject":
            action(plan.pk, principal.username, reason)
        else:
            action(plan.pk, principal.username)
    except plans.PlanStateError as exc:
        messages.error(request, f"Nothing done: {exc}.")
    else:
        messages.success(request, f"Plan {plan.pk} {done}.")
    return redirect("frontend:plan", pk=plan.pk)
