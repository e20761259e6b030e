"""Rollouts: each canary rollout's timeline (steps, weights, the analysis figures and the
decision of each), the revisions' TTFT and 5xx side by side, and, for platform operators,
pause, resume, promote and roll back."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import messages
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.utils import timezone

from controlplane.core.models import Role
from controlplane.rollouts import services
from controlplane.rollouts.models import IN_PROGRESS, Rollout, RolloutState
from frontend import charts
from frontend.access import dashboard_view, forbidden, principal_of
from frontend.views.common import paginate, render_page

S = RolloutState

# action → (service, the states it is offered in, what the button says)
ACTIONS: dict[str, tuple[Callable[..., Rollout], tuple[str, ...], str]] = {
    "pause": (services.pause, (S.RUNNING,), "Pause"),
    "resume": (services.resume, (S.PAUSED,), "Resume"),
    "promote": (services.promote, (S.RUNNING, S.PAUSED), "Promote"),
    "rollback": (services.roll_back, (S.RUNNING, S.PAUSED, S.PENDING), "Roll back"),
}


class ActionForm(forms.Form):
    reason = forms.CharField(max_length=500, required=False)


def _rows(principal: Any) -> Any:
    return (Rollout.objects.visible_to(principal)
            .select_related("deployment", "from_revision", "to_revision"))


def _may_act(request: HttpRequest) -> bool:
    principal = principal_of(request)
    return principal.has_role(Role.OPERATOR) and principal.is_platform


@dashboard_view()
def rollout_list(request: HttpRequest) -> HttpResponse:
    return render_page(request, "frontend/rollouts/list.html", {
        "page": paginate(request, _rows(principal_of(request)).order_by("-created_at", "-id")),
    })


def _pair(figures: dict[str, Any], key: str, fmt: Callable[[float], str]) -> str:
    """“stable / canary” of one figure, a dash where unmeasured."""
    return " / ".join(fmt(v) if (v := (figures.get(side) or {}).get(key)) is not None else "—"
                      for side in ("stable", "canary"))


def step_rows(rollout: Rollout) -> list[dict[str, Any]]:
    """Each step with its figures: the judged ones, or, for the step under way, its window
    so far (marked live)."""
    rows = []
    for step in rollout.step_rows.all():
        figures, live = step.analysis or {}, False
        if (step.ended_at is None and step.ready_at is not None and not figures
                and rollout.state in (S.RUNNING, S.PAUSED)):
            _, _, figures = services.step_figures(rollout, step.ready_at, timezone.now())
            live = True
        failed = [c for c in figures.get("checks", []) if not c.get("passed")]
        rows.append({
            "step": step, "figures": figures, "live": live, "failed": failed,
            "label": (f"wave {step.wave + 1} · " if rollout.waves else "")
                     + f"{step.step + 1}: {step.weight}%",
            "regions": rollout.waves[step.wave] if rollout.waves else [],
            "requests": _pair(figures, "requests", lambda v: f"{v:.0f}"),
            "errors": _pair(figures, "error_rate", lambda v: f"{v:.1%}"),
            "ttft": _pair(figures, "ttft_p95_s", lambda v: f"{v * 1000:.0f} ms"),
            "itl": _pair(figures, "itl_p95_s", lambda v: f"{v * 1000:.0f} ms"),
        })
    return rows


@dashboard_view()
def rollout_detail(request: HttpRequest, pk: int) -> HttpResponse:
    rollout = get_object_or_404(_rows(principal_of(request)).prefetch_related("step_rows"),
                                pk=pk)  # another tenant's: 404
    rows = step_rows(rollout)
    may_act = _may_act(request)
    in_progress = rollout.state in IN_PROGRESS
    current = next((r["step"] for r in rows if (r["step"].wave, r["step"].step)
                    == (rollout.current_wave, rollout.current_step)), None)
    return render_page(request, "frontend/rollouts/detail.html", {
        "rollout": rollout,
        "rows": rows,
        # What the tables carry now: a step's weight goes live once its replicas serve.
        "live_weight": rollout.deployment.canary_weight if in_progress else rollout.weight,
        "waiting": in_progress and current is not None and current.ready_at is None,
        "figure": charts.rollout_figure(rows, rollout.from_revision.number,
                                        rollout.to_revision.number) if rows else None,
        "actions": [(name, label) for name, (_, states, label) in ACTIONS.items()
                    if rollout.state in states] if may_act else [],
    }, section="rollouts")


@dashboard_view(role=Role.OPERATOR, methods=("POST",))
def act(request: HttpRequest, pk: int, action: str) -> HttpResponse:
    principal = principal_of(request)
    if not principal.is_platform:
        return forbidden(request, "Rollouts are steered by platform staff (users with no "
                                  "tenant), as in the API.")
    if action not in ACTIONS:
        raise Http404(f"no action {action!r}")
    rollout = get_object_or_404(_rows(principal), pk=pk)
    form = ActionForm(request.POST)
    if not form.is_valid():
        messages.error(request, "Nothing done: reason: " + " ".join(str(e) for e in form.errors["reason"]))
        return redirect("frontend:rollout", pk=rollout.pk)
    step, _, label = ACTIONS[action]
    try:
        step(rollout.pk, actor=principal.username, reason=form.cleaned_data["reason"])
    except services.RolloutStateError as exc:
        messages.error(request, f"Nothing done: {exc}")
    else:
        messages.success(request, f"{label}: rollout {rollout.pk} of "
                                  f"{rollout.deployment.name} done.")
    return redirect("frontend:rollout", pk=rollout.pk)
