"""Rollouts: each canary rollout's timeline (steps, weights, the analysis figures and the
decision of each), the revisions' TTFT and 5xx side by side, and, for platform operators,
a form to start one, and pause, resume, promote and roll back."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from django import forms
from django.contrib import messages
from django.db import transaction
from django.http import Http404, HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect
from django.utils import timezone

from controlplane.core.models import Role
from controlplane.deployments.models import Deployment, Model
from controlplane.deployments.services import tensor_parallel_error
from controlplane.rollouts import analyst, lifecycle, validation
from controlplane.rollouts.models import IN_PROGRESS, Rollout, RolloutState, Strategy
from frontend import charts
from frontend.access import principal_of
from frontend.views.common import dashboard_view, forbidden, paginate, render_page
from regions.models import GpuType

S = RolloutState

# action → (service, the states it is offered in, what the button says)
ACTIONS: dict[str, tuple[Callable[..., Rollout], tuple[str, ...], str]] = {
    "pause": (lifecycle.pause, (S.RUNNING,), "Pause"),
    "resume": (lifecycle.resume, (S.PAUSED,), "Resume"),
    "promote": (lifecycle.promote, (S.RUNNING, S.PAUSED), "Promote"),
    "rollback": (lifecycle.roll_back, (S.RUNNING, S.PAUSED, S.PENDING), "Roll back"),
}


class ActionForm(forms.Form):
    reason = forms.CharField(max_length=500, required=False)


class StartForm(forms.Form):
    """A new revision of a deployment and its rollout: settings left blank are the stable
    revision's (the service's defaults), as in `POST /api/v1/rollouts/`."""

    deployment = forms.ChoiceField()
    strategy = forms.ChoiceField(choices=Strategy.choices, initial=Strategy.CANARY)
    steps = forms.CharField(required=False, max_length=100, help_text=(
        "Canary weights (%), e.g. 5, 25, 50, 100; blank: 5, 25, 50, 100 (blue/green: 100)."))
    bake_s = forms.IntegerField(label="Bake time (s)", min_value=1, initial=300)
    rollback_window_s = forms.IntegerField(label="Rollback window (s)", required=False,
                                           help_text="Blue/green only; blank: 600.")
    auto_promote = forms.BooleanField(label="Promote when the last step passes",
                                      required=False, initial=True, help_text=(
        "Canary: unticked, the last step waits for an operator's promote."))
    waves = forms.CharField(required=False, max_length=500, help_text=(
        "Canary only: waves of edge regions, waves split by ';', regions by ',', e.g. "
        "aws:eu-central-1; aws:us-east-1, gcp:europe-west4. Blank: every edge at once."))
    model = forms.ChoiceField(required=False)
    vllm_version = forms.CharField(label="vLLM version", required=False, max_length=32)
    engine_args = forms.CharField(label="Engine arguments (JSON)", required=False,
                                  max_length=2000, help_text='e.g. {"max_model_len": 4096}')
    tensor_parallel = forms.IntegerField(required=False, min_value=1, max_value=16)
    pipeline_parallel = forms.IntegerField(required=False, min_value=1, max_value=16)
    preferred_gpu_type = forms.ChoiceField(label="Preferred GPU type", required=False)
    ttft_ratio = forms.FloatField(label="TTFT p95 ≤ × stable", required=False)
    itl_ratio = forms.FloatField(label="ITL p95 ≤ × stable", required=False)
    error_points = forms.FloatField(label="5xx ≤ stable + points", required=False)
    max_ttft_p95_s = forms.FloatField(label="TTFT p95 ≤ s (SLO)", required=False)
    max_error_rate = forms.FloatField(label="5xx rate ≤", required=False)
    reason = forms.CharField(max_length=500, required=False)

    THRESHOLDS = ("ttft_ratio", "itl_ratio", "error_points", "max_ttft_p95_s",
                  "max_error_rate")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._offer("deployment", [(d, d) for d in Deployment.objects.values_list(
            "name", flat=True).order_by("name")])
        self._offer("model", [("", "the stable revision's"), *(
            (m, m) for m in Model.objects.values_list("name", flat=True).order_by("name"))])
        self._offer("preferred_gpu_type", [("", "the stable revision's"), *(
            (g, g) for g in GpuType.objects.values_list("name", flat=True).order_by("name"))])

    def _offer(self, name: str, choices: list[tuple[str, str]]) -> None:
        field = self.fields[name]
        assert isinstance(field, forms.ChoiceField)
        field.choices = choices

    def clean_steps(self) -> list[int] | None:
        text = self.cleaned_data["steps"].strip()
        if not text:
            return None
        try:
            return [int(part) for part in text.replace(" ", "").split(",")]
        except ValueError:
            raise forms.ValidationError(f"steps must be whole percentages split by commas, "
                                        f"not {text!r}") from None

    def clean_waves(self) -> list[list[str]] | None:
        text = self.cleaned_data["waves"].strip()
        if not text:
            return None
        return [[key.strip() for key in wave.split(",") if key.strip()]
                for wave in text.split(";")]

    def clean_engine_args(self) -> dict[str, Any] | None:
        text = self.cleaned_data["engine_args"].strip()
        if not text:
            return None
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise forms.ValidationError(f"engine_args is not JSON: {exc}") from None
        if not isinstance(value, dict):
            raise forms.ValidationError("engine_args must be a JSON object, such as "
                                        '{"max_model_len": 4096}')
        return value

    def clean(self) -> dict[str, Any]:
        data = super().clean() or {}
        deployment = Deployment.objects.filter(name=data.get("deployment")).first()
        model = Model.objects.filter(name=data.get("model")).first() if data.get(
            "model") else (deployment.model if deployment is not None else None)
        tp = data.get("tensor_parallel")
        if model is not None and tp is not None:
            error = tensor_parallel_error(model, tp)
            if error:
                self.add_error("tensor_parallel", error)
        return data

    def start_request(self, deployment: Deployment) -> validation.RolloutRequest:
        """What lifecycle.start takes, from the cleaned fields; raises
        validation.RolloutInputError as the API's serializer answers 400."""
        data = self.cleaned_data
        thresholds = {k: data[k] for k in self.THRESHOLDS if data.get(k) is not None}
        raw = {
            "strategy": data["strategy"], "steps": data["steps"], "bake_s": data["bake_s"],
            "rollback_window_s": data["rollback_window_s"], "waves": data["waves"],
            "auto_promote": bool(data["auto_promote"]), "thresholds": thresholds or None,
        }
        revision = validation.RevisionSpec(
            model=Model.objects.filter(name=data["model"]).first() if data["model"] else None,
            vllm_version=data["vllm_version"] or None,
            engine_args=data["engine_args"] or {},
            tensor_parallel=data["tensor_parallel"],
            pipeline_parallel=data["pipeline_parallel"],
            preferred_gpu_type=(GpuType.objects.filter(name=data["preferred_gpu_type"])
                                .first() if data["preferred_gpu_type"] else None))
        return validation.rollout_request(deployment, raw, revision, reason=data["reason"])

    def field_of(self, error: validation.RolloutInputError) -> str | None:
        """The form field a service error names (`thresholds.x` → x, `waves[i][j]` →
        waves); None where the form has no such field."""
        name = error.field.split(".", 1)[-1].split("[", 1)[0]
        return name if name in self.fields else None


def _rows(principal: Any) -> Any:
    return (Rollout.objects.visible_to(principal)
            .select_related("deployment", "from_revision", "to_revision"))


def _may_act(request: HttpRequest) -> bool:
    principal = principal_of(request)
    return principal.has_role(Role.OPERATOR) and principal.is_platform


@dashboard_view()
def rollout_list(request: HttpRequest) -> HttpResponse:
    return _list_page(request)


def _list_page(request: HttpRequest, form: StartForm | None = None,
               status: int = 200) -> HttpResponse:
    may_act = _may_act(request)
    return render_page(request, "frontend/rollouts/list.html", {
        "page": paginate(request, _rows(principal_of(request)).order_by("-created_at", "-id")),
        "start_form": (form or StartForm()) if may_act else None,
    }, section="rollouts", status=status)


@dashboard_view(role=Role.OPERATOR, methods=("POST",))
def start(request: HttpRequest) -> HttpResponse:
    """Start a rollout: the form's errors (and the service's, by field) shown on the page
    with nothing made; a deployment with a rollout in progress answers 409."""
    principal = principal_of(request)
    if not principal.is_platform:
        return forbidden(request, "Rollouts are started by platform staff (users with no "
                                  "tenant), as in the API.")
    form = StartForm(request.POST)
    if not form.is_valid():
        return _list_page(request, form, status=400)
    deployment = Deployment.objects.get(name=form.cleaned_data["deployment"])
    try:
        wanted = form.start_request(deployment)
        with transaction.atomic():
            rollout = lifecycle.start(deployment, wanted, actor=principal.username)
    except validation.RolloutInputError as exc:
        form.add_error(form.field_of(exc), f"{exc.field}: {exc}")
        return _list_page(request, form, status=400)
    except lifecycle.RolloutStateError as exc:
        form.add_error(None, str(exc))
        return _list_page(request, form, status=409)
    messages.success(request, f"Rollout {rollout.pk} of {deployment.name} started: revision "
                              f"{rollout.from_revision.number} → {rollout.to_revision.number}.")
    return redirect("frontend:rollout", pk=rollout.pk)


def _pair(figures: dict[str, Any], key: str, fmt: Callable[[float], str]) -> str:
    """“stable / canary” of one figure, a dash where unmeasured."""
    return " / ".join(fmt(v) if (v := (figures.get(side) or {}).get(key)) is not None else "—"
                      for side in ("stable", "canary"))


def _latency_pair(figures: dict[str, Any], key: str) -> str:
    """“stable / canary” of a latency, which counts successful answers only: a side that
    answered nothing but errors says so rather than showing a dash, never a fast figure."""
    def one(side: dict[str, Any]) -> str:
        value = side.get(key)
        if value is not None:
            return f"{value * 1000:.0f} ms"
        if side.get("requests") and side.get("errors", 0) >= side["requests"]:
            return "none (all 5xx)"
        return "—"
    return " / ".join(one(figures.get(side) or {}) for side in ("stable", "canary"))


def step_rows(rollout: Rollout) -> list[dict[str, Any]]:
    """Each step with its figures: the judged ones, or, for the step under way, its window
    so far (marked live)."""
    rows = []
    for step in rollout.step_rows.all():
        figures, live = step.analysis or {}, False
        if (step.ended_at is None and step.ready_at is not None and not figures
                and rollout.state in (S.RUNNING, S.PAUSED)):
            _, _, figures = analyst.step_figures(rollout, step.ready_at, timezone.now())
            live = True
        failed = [c for c in figures.get("checks", []) if not c.get("passed")]
        rows.append({
            "step": step, "figures": figures, "live": live, "failed": failed,
            "label": (f"wave {step.wave + 1} · " if rollout.waves else "")
                     + f"{step.step + 1}: {step.weight}%",
            "regions": rollout.waves[step.wave] if rollout.waves else [],
            "requests": _pair(figures, "requests", lambda v: f"{v:.0f}"),
            "errors": _pair(figures, "error_rate", lambda v: f"{v:.1%}"),
            "ttft": _latency_pair(figures, "ttft_p95_s"),
            "itl": _latency_pair(figures, "itl_p95_s"),
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
    except lifecycle.RolloutStateError as exc:
        messages.error(request, f"Nothing done: {exc}")
    else:
        messages.success(request, f"{label}: rollout {rollout.pk} of "
                                  f"{rollout.deployment.name} done.")
    return redirect("frontend:rollout", pk=rollout.pk)
