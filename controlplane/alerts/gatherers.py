"""What each alert rule reads: its inputs loaded from the database and telemetry, turned
into findings by the pure rules (rules.py). `GATHERERS` says which rules each loader answers
for; services.evaluate runs them."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from typing import Any

from django.db.models import F, Max, Min, Q

from controlplane.alerts import rules
from controlplane.alerts.models import Rule
from controlplane.alerts.rules import Finding
from controlplane.alerts.thresholds import Thresholds
from controlplane.core.models import Tenant
from controlplane.costs.budgets import month_to_date_usd
from controlplane.deployments.lifecycle import SERVING_STATES
from controlplane.deployments.models import Deployment, Replica
from controlplane.failover.models import RegionHealth
from controlplane.placement import rules as placement_rules
from controlplane.rollouts.analyst import ANALYST
from controlplane.rollouts.models import Rollout, RolloutState
from controlplane.routing.models import RoutingTable
from controlplane.telemetry.edge_metrics import traffic_by_model
from controlplane.telemetry.services import metrics_source, newest_edge_requests
from regions.models import Quota


def latency_findings(now: datetime, limits: dict[str, Thresholds]) -> list[Finding]:
    """TTFT and ITL p95 per deployment from the metrics source, against each deployment's SLO."""
    wanted = [r for r in (Rule.TTFT_SLO, Rule.ITL_SLO) if limits[r].enabled]
    if not wanted:
        return []
    replicas = list(Replica.objects.filter(state__in=SERVING_STATES).exclude(url="")
                    .select_related("deployment", "region__cloud"))
    if not replicas:
        return []
    targets = {str(r.pk): r.url for r in replicas}
    source = metrics_source()
    findings: list[Finding] = []
    stats_by_window: dict[int, dict[str, Any]] = {}
    for rule in wanted:
        window = limits[rule].window_s
        if window not in stats_by_window:
            stats_by_window[window] = source.replica_stats(targets, window)
        stats = stats_by_window[window]
        per_deployment: dict[int, dict[str, float]] = {}
        for replica in replicas:
            s = stats.get(str(replica.pk))
            p95_s = None if s is None or not s.up else (
                s.ttft_p95_s if rule == Rule.TTFT_SLO else s.itl_p95_s)
            if p95_s is not None:
                label = f"{replica.public_id} ({replica.region.key})"
                per_deployment.setdefault(replica.deployment_id, {})[label] = p95_s * 1000
        deployments = {r.deployment_id: r.deployment for r in replicas}
        inputs = [
            rules.DeploymentLatency(
                name=d.name, tenant_id=d.tenant_id, p95_ms=per_deployment.get(pk, {}),
                slo_ms=d.slo_ttft_p95_ms if rule == Rule.TTFT_SLO else d.slo_itl_p95_ms)
            for pk, d in deployments.items()
        ]
        findings += rules.latency_slo(rule, inputs, limits[rule])
    return findings


def model_traffic(now: datetime, window_s: int) -> list[rules.ModelTraffic]:
    """Requests and 5xx per model over the window, summed over edges: for each edge, the
    newest sample less the newest sample at or before the window's start."""
    newer = newest_edge_requests()
    older = newest_edge_requests(before=now - timedelta(seconds=window_s))
    totals = traffic_by_model(
        (requests, older.get(edge_id)) for edge_id, requests in newer.items())
    owners: dict[str, set[int | None]] = {}
    for served, owner in Deployment.objects.filter(
            served_model_name__in=list(totals)).values_list("served_model_name", "tenant_id"):
        owners.setdefault(served, set()).add(owner)
    out = []
    for model, (requests, errors) in sorted(totals.items()):
        tenants = owners.get(model, set())
        # A model served only by one tenant's deployments is that tenant's; else platform.
        tenant_id = next(iter(tenants)) if len(tenants) == 1 else None
        out.append(rules.ModelTraffic(model, requests, errors, tenant_id))
    return out


def error_rate_findings(now: datetime, limits: dict[str, Thresholds]) -> list[Finding]:
    t = limits[Rule.ERROR_RATE]
    return rules.error_rate(model_traffic(now, t.window_s), t)


def region_findings(now: datetime, limits: dict[str, Thresholds]) -> list[Finding]:
    rows = RegionHealth.objects.exclude(state="healthy").select_related("region__cloud")
    return rules.region_down(
        rules.RegionState(key=h.region.key, state=h.state, reason=h.reason,
                          failing=h.failing, serving=h.serving)
        for h in rows)


def quota_findings(now: datetime, limits: dict[str, Thresholds]) -> list[Finding]:
    rows = Quota.objects.filter(limit_gpus__gt=0, in_use_gpus__gt=0).select_related(
        "region__cloud", "gpu_type")
    return rules.quota_exhausted(
        (rules.QuotaUse(region=q.region.key, gpu=q.gpu_type.name, limit=q.limit_gpus,
                        in_use=q.in_use_gpus) for q in rows),
        limits[Rule.QUOTA_EXHAUSTED])


def budget_findings(now: datetime, limits: dict[str, Thresholds]) -> list[Finding]:
    spend = [
        rules.TenantSpend(
            tenant=t.name, tenant_id=t.pk, spent_usd=float(month_to_date_usd(t, now=now)),
            budget_usd=float(t.monthly_budget_usd) if t.monthly_budget_usd is not None else None)
        for t in Tenant.objects.filter(monthly_budget_usd__isnull=False)
    ]
    return rules.budget(spend, limits[Rule.BUDGET])


def edge_lags() -> list[rules.EdgeLag]:
    """Enabled edges with tables newer than their acked version, and since when: the time the
    oldest of those tables was compiled (the same edges as routing.services.edges_behind)."""
    rows = (RoutingTable.objects.filter(edge__enabled=True)
            .filter(Q(edge__last_acked_version__isnull=True)
                    | Q(version__gt=F("edge__last_acked_version")))
            .values("edge__name", "edge__last_acked_version").order_by()
            .annotate(since=Min("created_at"), latest=Max("version")))
    return [rules.EdgeLag(edge=r["edge__name"], acked_version=r["edge__last_acked_version"],
                          latest_version=r["latest"], behind_since=r["since"]) for r in rows]


def edge_findings(now: datetime, limits: dict[str, Thresholds]) -> list[Finding]:
    return rules.edge_table_stale(edge_lags(), now, limits[Rule.EDGE_TABLE_STALE])


def left_out_entries() -> list[rules.LeftOut]:
    """What the newest table of each enabled edge left out, by subject."""
    newest = (RoutingTable.objects.filter(edge__enabled=True).order_by("edge_id", "-version")
              .distinct("edge_id").values_list("edge__name", "excluded"))
    found: dict[str, tuple[dict[str, Any], list[str]]] = {}
    for edge, excluded in newest:
        for entry in excluded or []:
            found.setdefault(entry["subject"], (entry, []))[1].append(edge)
    deployments = {d.name: d.tenant_id for d in Deployment.objects.filter(
        name__in=[d for entry, _ in found.values() for d in entry.get("deployments", [])])}
    return [rules.LeftOut(subject=subject, field=entry.get("field", ""),
                          message=entry.get("message", ""), edges=tuple(edges),
                          tenant_id=next((deployments.get(d) for d in entry.get("deployments", [])
                                          if deployments.get(d) is not None), None))
            for subject, (entry, edges) in found.items()]


def table_findings(now: datetime, limits: dict[str, Thresholds]) -> list[Finding]:
    return rules.table_entry_excluded(left_out_entries())


def rollout_findings(now: datetime, limits: dict[str, Thresholds]) -> list[Finding]:
    since = now - timedelta(seconds=limits[Rule.ROLLOUT_ROLLED_BACK].window_s)
    rows = (Rollout.objects.filter(state=RolloutState.ROLLED_BACK, ended_by=ANALYST,
                                   ended_at__gte=since)
            .select_related("deployment", "to_revision").prefetch_related("step_rows"))
    return rules.rollout_rolled_back(
        rules.RolledBack(rollout_id=r.pk, deployment=r.deployment.name,
                         tenant_id=r.deployment.tenant_id, to_revision=r.to_revision.number,
                         weight=max((s.weight for s in r.step_rows.all()
                                     if s.decision == "rolled_back"), default=0),
                         why=r.reason)
        for r in rows)


def rule_findings(now: datetime, limits: dict[str, Thresholds]) -> list[Finding]:
    deployments = list(Deployment.objects.prefetch_related(
        "allowed_jurisdictions", "user_regions").order_by("name"))
    broken = placement_rules.rule_violations(deployments)
    return rules.rule_violated(
        rules.RulesBroken(deployment=d.name, tenant_id=d.tenant_id,
                          violations=tuple(str(v) for v in broken[d.pk]),
                          auto_apply_plans=d.auto_apply_plans)
        for d in deployments)


Gather = Callable[[datetime, dict[str, Thresholds]], list[Finding]]

# Which rules each loader answers for; a loader that fails leaves those rules' alerts alone.
GATHERERS: tuple[tuple[tuple[str, ...], Gather], ...] = (
    ((Rule.TTFT_SLO, Rule.ITL_SLO), latency_findings),
    ((Rule.ERROR_RATE,), error_rate_findings),
    ((Rule.REGION_DOWN,), region_findings),
    ((Rule.QUOTA_EXHAUSTED,), quota_findings),
    ((Rule.BUDGET,), budget_findings),
    ((Rule.EDGE_TABLE_STALE,), edge_findings),
    ((Rule.ROLLOUT_ROLLED_BACK,), rollout_findings),
    ((Rule.TABLE_ENTRY_EXCLUDED,), table_findings),
    ((Rule.RULE_VIOLATED,), rule_findings),
)
