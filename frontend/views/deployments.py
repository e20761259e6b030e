"""Deployments: the list, one deployment's replicas, traffic and events, scale and drain."""

from __future__ import annotations

from collections import defaultdict
from decimal import Decimal
from typing import Any

from django.contrib import messages
from django.db.models import Case, CharField, Count, IntegerField, Prefetch, Q, Value, When
from django.db.models.functions import Cast
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect

from controlplane.core.models import AuditLog, Role
from controlplane.core.services import Principal
from controlplane.costs.services import usd_h_for
from controlplane.deployments.lifecycle import LIVE_STATES, SERVING_STATES, IllegalTransition
from controlplane.deployments.models import Deployment, Replica
from controlplane.deployments.models import ReplicaState as S
from controlplane.placement import rules as placement_rules
from controlplane.scaling.services import (
    DRAIN_DEADLINE_S,
    ScaleRefused,
    drain_replica,
    scale_in_region,
)
from frontend import charts, fleet, traffic
from frontend.access import change_refusal, principal_of
from frontend.forms import ReasonForm, ScaleForm
from frontend.views.common import (
    dashboard_view,
    forbidden,
    paginate,
    query_without_page,
    render_page,
)
from regions.models import Offer, Region

EVENT_LIMIT = 25
SCALING_DECISION_LIMIT = 10
SERIES_MINUTES = 30
STATE_RANK = Case(*(When(state=state, then=Value(i)) for i, state in enumerate(fleet.STATE_ORDER)),
                  output_field=IntegerField())


def visible_deployments(principal: Principal) -> Any:
    return Deployment.objects.visible_to(principal)


@dashboard_view()
def deployment_list(request: HttpRequest) -> HttpResponse:
    live = Q(replicas__state__in=LIVE_STATES)
    rows = (
        visible_deployments(principal_of(request)).select_related("model", "tenant")
        .annotate(
            ready=Count("replicas", filter=Q(replicas__state=S.READY)),
            live=Count("replicas", filter=live),
            failed=Count("replicas", filter=Q(replicas__state=S.FAILED)),
            region_count=Count("replicas__region", filter=live, distinct=True),
            usd_h=fleet.billed_usd_h(replica="replicas__", deployment=""),
        ).order_by("name")
    )
    query = request.GET.get("q", "").strip()
    if query:
        rows = rows.filter(Q(name__icontains=query) | Q(served_model_name__icontains=query))
    page = paginate(request, rows.prefetch_related(
        "allowed_jurisdictions", Prefetch("user_regions", Region.objects.select_related("cloud"))))
    page.object_list = list(page.object_list)
    broken = placement_rules.rule_violations(page.object_list)
    for d in page.object_list:
        d.rule_violations = [str(v) for v in broken[d.pk]]
    return render_page(request, "frontend/deployments/list.html", {
        "page": page, "query": query_without_page(request), "q": query,
    })


def _deployment(request: HttpRequest, name: str) -> Deployment:
    rows = visible_deployments(principal_of(request)).select_related("model", "tenant")
    rows = rows.prefetch_related(
        "allowed_jurisdictions", Prefetch("user_regions", Region.objects.select_related("cloud")))
    return get_object_or_404(rows, name=name)


def _refresh_s(deployment: Deployment) -> int:
    """Seconds between refreshes of the replica table: quick while a replica is on its way
    up, out or down."""
    return fleet.refresh_s(deployment.replicas.filter(state__in=fleet.IN_FLIGHT_STATES).exists())


def _replicas(deployment: Deployment, show_all: bool) -> Any:
    rows = (deployment.replicas.select_related("region__cloud", "offer__gpu_type")
            .annotate(rank=STATE_RANK, usd_h=fleet.replica_usd_h())
            .order_by("rank", "-created_at"))
    return rows if show_all else rows.exclude(state=S.TERMINATED)


def _by_region(deployment: Deployment) -> list[dict[str, Any]]:
    """One row per region holding non-terminated replicas: counts by state, health, $/h."""
    rows = (deployment.replicas.exclude(state=S.TERMINATED)
            .values("region__cloud__name", "region__code", "region__display_name", "state")
            .order_by().annotate(n=Count("id"), usd_h=fleet.billed_usd_h()))
    regions: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"counts": {}, "usd_h": Decimal(0)})
    for row in rows:
        key = f"{row['region__cloud__name']}:{row['region__code']}"
        entry = regions[key]
        entry.update(key=key, name=row["region__display_name"])
        entry["counts"][row["state"]] = row["n"]
        entry["usd_h"] += row["usd_h"] or Decimal(0)
    out = []
    for key in regions:
        entry = regions[key]
        entry["counts"] = fleet.sum_states(
            {"state": state, "n": n} for state, n in entry["counts"].items())
        entry["health"] = fleet.region_health(entry["counts"])
        entry["live"] = sum(n for s, n in entry["counts"].items() if s in LIVE_STATES)
        out.append(entry)
    severity = {h: i for i, h in enumerate(
        (fleet.DOWN, fleet.DEGRADED, fleet.STARTING, fleet.HEALTHY, fleet.IDLE))}
    return sorted(out, key=lambda e: (severity[e["health"]], e["key"]))


def _events(principal: Principal, deployment: Deployment) -> list[AuditLog]:
    replica_ids = (Replica.objects.filter(deployment=deployment)
                   .annotate(text_id=Cast("pk", CharField())).values("text_id"))
    about = (Q(object_type="deployments.deployment", object_id=str(deployment.pk))
             | Q(object_type="deployments.replica", object_id__in=replica_ids))
    rows = AuditLog.objects.filter(about).visible_to(principal)
    return list(rows.order_by("-at", "-id")[:EVENT_LIMIT])


def _scale_regions(deployment: Deployment) -> list[tuple[str, str]]:
    allowed = [j.pk for j in deployment.allowed_jurisdictions.all()]
    regions = (Region.objects.filter(jurisdiction_id__in=allowed, enabled=True)
               .select_related("cloud", "jurisdiction").order_by("cloud__name", "code"))
    return [(r.key, f"{r.key} · {r.display_name} ({r.jurisdiction.code})") for r in regions]


def _region_by_key(key: str) -> Region:
    return get_object_or_404(Region.objects.select_related("cloud", "jurisdiction"),
                             **Region.key_filter(key))


def _detail_context(request: HttpRequest, deployment: Deployment,
                    scale_form: ScaleForm | None = None) -> dict[str, Any]:
    principal = principal_of(request)
    show_all = request.GET.get("replicas") == "all"
    by_region = _by_region(deployment)
    if scale_form is None:
        busiest = min(by_region, key=lambda e: (-e["live"], e["key"]), default=None)
        initial = ({"region": busiest["key"], "replicas": busiest["live"]}
                   if busiest else {"replicas": 1})
        scale_form = ScaleForm(regions=_scale_regions(deployment), initial=initial)
    series = traffic.deployment_series(deployment.pk, minutes=SERIES_MINUTES)
    totals: dict[str, int] = defaultdict(int)
    for entry in by_region:
        for state, n in entry["counts"].items():
            totals[state] += n
    context: dict[str, Any] = {
        "deployment": deployment,
        "rule_violations": [str(v) for v in
                            placement_rules.rule_violations([deployment])[deployment.pk]],
        "by_region": by_region,
        "totals": fleet.sum_states({"state": s, "n": n} for s, n in totals.items()),
        "usd_h": sum((e["usd_h"] for e in by_region), Decimal(0)),
        "live": sum(e["live"] for e in by_region),
        "page": paginate(request, _replicas(deployment, show_all)),
        "query": query_without_page(request),
        "show_all": show_all,
        # From the counts above (non-terminated replicas by state): no query of its own.
        "refresh_s": fleet.refresh_s(any(totals.get(state) for state in fleet.IN_FLIGHT_STATES)),
        "events": _events(principal, deployment),
        "scaling_decisions": list(deployment.scaling_decisions.order_by("-at", "-id")
                                  [:SCALING_DECISION_LIMIT]),
        "scale_form": scale_form,
        "may_change": principal.has_role(Role.OPERATOR)
        and change_refusal(principal, deployment.tenant_id) is None,
        "series": series,
        "series_minutes": SERIES_MINUTES,
        "serving_states": SERVING_STATES,
        "billed_states": fleet.BILLED_STATES,
        "drain_deadline_s": DRAIN_DEADLINE_S,
    }
    if not series.empty:
        context["figures"] = {
            "latency": charts.latency_figure(series, deployment.slo_ttft_p95_ms,
                                             deployment.slo_itl_p95_ms),
            "throughput": charts.throughput_figure(series),
            "load": charts.load_figure(series),
            "kv": charts.kv_figure(series),
        }
    return context


@dashboard_view()
def deployment_detail(request: HttpRequest, name: str) -> HttpResponse:
    deployment = _deployment(request, name)
    return render_page(request, "frontend/deployments/detail.html",
                       _detail_context(request, deployment), section="deployments")


@dashboard_view()
def replica_table(request: HttpRequest, name: str) -> HttpResponse:
    """The replica table alone, which the detail page re-fetches every few seconds."""
    deployment = _deployment(request, name)
    principal = principal_of(request)
    show_all = request.GET.get("replicas") == "all"
    return render_page(request, "frontend/deployments/replica_table.html", {
        "deployment": deployment,
        "page": paginate(request, _replicas(deployment, show_all)),
        "query": query_without_page(request),
        "show_all": show_all,
        "refresh_s": _refresh_s(deployment),
        "may_change": principal.has_role(Role.OPERATOR)
        and change_refusal(principal, deployment.tenant_id) is None,
        "serving_states": SERVING_STATES,
        "billed_states": fleet.BILLED_STATES,
        "drain_deadline_s": DRAIN_DEADLINE_S,
    }, section="deployments")


def _new_replica_offer(deployment: Deployment, region: Region) -> Offer | None:
    # The offer provisioning picks for new replicas (provisioning.services.request_replicas).
    return (Offer.objects.filter(region=region, gpus_per_node__gte=deployment.tensor_parallel)
            .select_related("gpu_type").order_by("on_demand_usd_h").first())


def _added_usd_h(deployment: Deployment, offer: Offer | None, spot: bool, count: int) -> Decimal:
    """What `count` new replicas on `offer` add per hour (costs.services prices replicas)."""
    if offer is None or not count:
        return Decimal(0)
    return usd_h_for(offer, spot, deployment.tensor_parallel,
                     deployment.pipeline_parallel) * count


@dashboard_view(role=Role.OPERATOR, methods=("POST",))
def scale(request: HttpRequest, name: str) -> HttpResponse:
    """Two steps: the first POST shows what would change, the second (confirm=yes) does it."""
    deployment = _deployment(request, name)
    principal = principal_of(request)
    refusal = change_refusal(principal, deployment.tenant_id)
    if refusal:
        return forbidden(request, refusal)
    form = ScaleForm(request.POST, regions=_scale_regions(deployment))
    if not form.is_valid():
        return render_page(request, "frontend/deployments/detail.html",
                           _detail_context(request, deployment, form),
                           section="deployments", status=400)
    region = _region_by_key(form.cleaned_data["region"])
    confirmed = request.POST.get("confirm") == "yes"
    try:
        result = scale_in_region(
            deployment, region, form.cleaned_data["replicas"], actor=principal.username,
            reason=form.cleaned_data["reason"], spot=form.cleaned_data["spot"],
            preview=not confirmed,
        )
    except ScaleRefused as refused:
        form.add_error(refused.field if refused.field in form.fields else None, refused.message)
        return render_page(request, "frontend/deployments/detail.html",
                           _detail_context(request, deployment, form),
                           section="deployments", status=400)
    if not confirmed:
        spot = form.cleaned_data["spot"]
        offer = _new_replica_offer(deployment, region) if result.to_add else None
        return render_page(request, "frontend/deployments/scale_confirm.html", {
            "deployment": deployment, "region": region, "result": result, "form": form,
            "offer": offer, "spot": spot,
            "added_usd_h": _added_usd_h(deployment, offer, spot, result.to_add),
            "drain_deadline_s": DRAIN_DEADLINE_S,
        }, section="deployments")
    done = []
    if result.added:
        done.append(f"requested {', '.join(result.added)}")
    if result.draining:
        done.append(f"draining {', '.join(result.draining)}")
    messages.success(request, f"{deployment.name} in {region.key}: {result.before} → "
                              f"{result.after} replicas; {'; '.join(done) or 'nothing to do'}.")
    return redirect("frontend:deployment", name=deployment.name)


@dashboard_view(role=Role.OPERATOR, methods=("POST",))
def drain(request: HttpRequest, pk: int) -> HttpResponse:
    principal = principal_of(request)
    rows = Replica.objects.select_related("deployment", "region__cloud").visible_to(principal)
    replica = get_object_or_404(rows, pk=pk)
    refusal = change_refusal(principal, replica.deployment.tenant_id)
    if refusal:
        return forbidden(request, refusal)
    form = ReasonForm(request.POST)
    reason = form.cleaned_data["reason"] if form.is_valid() else ""
    try:
        drain_replica(replica, actor=principal.username, reason=reason)
    except IllegalTransition as exc:
        messages.error(request, f"Not drained: {exc}. Only ready or degraded replicas drain.")
    else:
        messages.success(request, f"{replica.public_id} in {replica.region.key} is draining: "
                                  f"no new requests; terminated in {DRAIN_DEADLINE_S} s.")
    return redirect("frontend:deployment", name=replica.deployment.name)
