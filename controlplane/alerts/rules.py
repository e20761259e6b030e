"""The alert rules as pure functions: plain inputs in, findings out. No database, no clock.

Each rule compares a value with a warning and a critical threshold (value ≥ threshold) in its
own unit, and returns one `Finding` per subject over a threshold. `services.py` loads the
inputs, and opens and resolves Alert rows from the findings. The rules' names and default
thresholds are `thresholds.py`, which the models (a rule's overrides) use too.

| rule | value | default warning / critical | for |
|---|---|---|---|
| ttft_slo, itl_slo | worst replica's p95 ÷ the deployment's SLO | 1.0 / 2.0 | 60 s |
| error_rate | 5xx responses ÷ responses per model at the edges | 0.05 / 0.20 | 60 s |
| region_down | the health loop's state: degraded → warning, down → critical | — | 0 |
| quota_exhausted | GPUs in use ÷ quota limit per region and GPU type | 0.9 / 1.0 | 0 |
| budget | month-to-date spend ÷ monthly budget per tenant | 0.8 / 1.0 | 0 |
| edge_table_stale | seconds an edge has been behind its newest table | 30 / 300 | 0 |
| rollout_rolled_back | a rollout its analysis rolled back within the window: critical | — | 0 |
| table_entry_excluded | an entry the edge's parser refused, left out of the newest tables: critical | — | 0 |
| rule_violated | a deployment's serving replicas break its placement rules (placement/rules.py): warning | — | 60 s |
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from controlplane.alerts.thresholds import Rule, Severity, Thresholds

# The error-rate rule ignores models with fewer responses than this in its window, so that
# one failed request out of two is not a 50% error rate.
MIN_REQUESTS = 20


@dataclass(frozen=True)
class Finding:
    rule: str
    subject: str
    severity: str
    message: str
    value: float | None = None
    threshold: float | None = None
    unit: str = ""
    tenant_id: int | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.rule, self.subject)


# --- latency SLOs -------------------------------------------------------------------------

@dataclass(frozen=True)
class DeploymentLatency:
    name: str
    tenant_id: int | None
    slo_ms: float
    p95_ms: Mapping[str, float]  # replica label → p95 in ms, replicas with data only


LATENCY_NAMES: dict[str, str] = {Rule.TTFT_SLO: "TTFT", Rule.ITL_SLO: "ITL"}


def latency_slo(rule: str, deployments: Iterable[DeploymentLatency], limits: Thresholds
                ) -> list[Finding]:
    """Deployments whose worst replica's p95 is at or over the SLO times a threshold."""
    findings = []
    for d in deployments:
        if not d.p95_ms or d.slo_ms <= 0:
            continue
        replica, worst = max(d.p95_ms.items(), key=lambda item: (item[1], item[0]))
        ratio = worst / d.slo_ms
        severity = limits.severity(ratio)
        if severity is None:
            continue
        over = sum(1 for p95 in d.p95_ms.values() if p95 > d.slo_ms)
        factor = limits.threshold(severity)
        findings.append(Finding(
            rule=rule, subject=d.name, severity=severity, value=round(worst, 1),
            threshold=round(d.slo_ms * factor, 1) if factor is not None else None, unit="ms",
            tenant_id=d.tenant_id,
            message=(f"{LATENCY_NAMES[rule]} p95 {worst:.0f} ms on {replica} is "
                     f"{ratio:.2f}× the {d.slo_ms:.0f} ms SLO of {d.name} "
                     f"({over} of {len(d.p95_ms)} replicas over the SLO)."),
        ))
    return findings


# --- error rate ---------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelTraffic:
    model: str
    requests: float
    errors: float
    tenant_id: int | None = None


def error_rate(models: Iterable[ModelTraffic], limits: Thresholds,
               min_requests: float = MIN_REQUESTS) -> list[Finding]:
    findings = []
    for m in models:
        if m.requests < min_requests or m.requests <= 0:
            continue
        share = m.errors / m.requests
        severity = limits.severity(share)
        if severity is None:
            continue
        findings.append(Finding(
            rule=Rule.ERROR_RATE, subject=m.model, severity=severity, value=round(share, 4),
            threshold=limits.threshold(severity), unit="ratio", tenant_id=m.tenant_id,
            message=(f"{share:.1%} of requests for {m.model} failed with a 5xx at the edges "
                     f"({m.errors:.0f} of {m.requests:.0f} in the window)."),
        ))
    return findings


# --- region health ------------------------------------------------------------------------

@dataclass(frozen=True)
class RegionState:
    key: str
    state: str  # healthy | degraded | down
    reason: str = ""
    failing: int = 0
    serving: int = 0


def region_down(regions: Iterable[RegionState]) -> list[Finding]:
    findings = []
    for r in regions:
        if r.state == "down":
            severity, what = Severity.CRITICAL, "down"
        elif r.state == "degraded":
            severity, what = Severity.WARNING, "degraded"
        else:
            continue
        detail = f": {r.reason}" if r.reason else ""
        findings.append(Finding(
            rule=Rule.REGION_DOWN, subject=r.key, severity=severity, value=float(r.failing),
            unit="replicas failing",
            message=(f"Region {r.key} is {what}{detail} ({r.serving} serving, "
                     f"{r.failing} failing)."),
        ))
    return findings


# --- quota --------------------------------------------------------------------------------

@dataclass(frozen=True)
class QuotaUse:
    region: str
    gpu: str
    limit: int
    in_use: int


def quota_exhausted(quotas: Iterable[QuotaUse], limits: Thresholds) -> list[Finding]:
    """Quota pools used at or over a share of their limit (pools with no quota are skipped)."""
    findings = []
    for q in quotas:
        if q.limit <= 0:
            continue
        used = q.in_use / q.limit
        severity = limits.severity(used)
        if severity is None:
            continue
        left = max(q.limit - q.in_use, 0)
        findings.append(Finding(
            rule=Rule.QUOTA_EXHAUSTED, subject=f"{q.region}/{q.gpu}", severity=severity,
            value=round(used, 4), threshold=limits.threshold(severity), unit="ratio",
            message=(f"{q.gpu} quota in {q.region}: {q.in_use} of {q.limit} GPUs in use "
                     f"({used:.0%}), {left} left."),
        ))
    return findings


# --- budget -------------------------------------------------------------------------------

@dataclass(frozen=True)
class TenantSpend:
    tenant: str
    tenant_id: int | None
    budget_usd: float | None
    spent_usd: float


def budget(tenants: Iterable[TenantSpend], limits: Thresholds) -> list[Finding]:
    """Tenants whose month-to-date spend reached a share of their monthly budget."""
    findings = []
    for t in tenants:
        if t.budget_usd is None:
            continue
        if t.budget_usd > 0:
            used = t.spent_usd / t.budget_usd
        elif t.spent_usd > 0:
            used = float("inf")  # a zero budget with any spend is over it
        else:
            continue
        severity = limits.severity(used)
        if severity is None:
            continue
        share = "over" if used == float("inf") else f"{used:.0%} of"
        findings.append(Finding(
            rule=Rule.BUDGET, subject=t.tenant, severity=severity, tenant_id=t.tenant_id,
            value=round(t.spent_usd, 2), unit="USD",
            threshold=(round(t.budget_usd * factor, 2)
                       if (factor := limits.threshold(severity)) is not None else None),
            message=(f"Tenant {t.tenant} has spent ${t.spent_usd:,.2f} this month, {share} "
                     f"its ${t.budget_usd:,.2f} budget."),
        ))
    return findings


# --- edges --------------------------------------------------------------------------------

@dataclass(frozen=True)
class EdgeLag:
    edge: str
    acked_version: int | None
    latest_version: int
    behind_since: datetime  # when the oldest table the edge has not acked was compiled


def edge_table_stale(edges: Iterable[EdgeLag], now: datetime, limits: Thresholds
                     ) -> list[Finding]:
    """Edges that have not acked their newest table for longer than the grace period."""
    findings = []
    for e in edges:
        if e.acked_version is not None and e.acked_version >= e.latest_version:
            continue
        behind_s = (now - e.behind_since).total_seconds()
        severity = limits.severity(behind_s)
        if severity is None:
            continue
        acked = f"v{e.acked_version}" if e.acked_version is not None else "no table"
        findings.append(Finding(
            rule=Rule.EDGE_TABLE_STALE, subject=e.edge, severity=severity,
            value=round(behind_s, 1), threshold=limits.threshold(severity), unit="s",
            message=(f"Edge {e.edge} has acked {acked} but the newest table is "
                     f"v{e.latest_version}; behind for {behind_s:.0f} s."),
        ))
    return findings


# --- routing tables -----------------------------------------------------------------------

@dataclass(frozen=True)
class LeftOut:
    subject: str  # a deployment, "alias auto", "tenant acme key 1a2b…", "routing policy"
    field: str
    message: str
    edges: tuple[str, ...]
    tenant_id: int | None = None


def table_entry_excluded(entries: Iterable[LeftOut]) -> list[Finding]:
    """One critical finding per entry left out of the newest tables (routing/screening.py):
    whatever it stands for is not routed until it is fixed."""
    return [Finding(
        rule=Rule.TABLE_ENTRY_EXCLUDED, subject=e.subject, severity=Severity.CRITICAL,
        value=float(len(e.edges)), unit="edges", tenant_id=e.tenant_id,
        message=(f"{e.subject} is left out of the routing tables of {len(e.edges)} edge(s) "
                 f"({', '.join(sorted(e.edges)[:5])}): the edge's parser refuses {e.field}: "
                 f"{e.message}. The rest of each table ships; fix or remove it."),
    ) for e in entries]


# --- rollouts -----------------------------------------------------------------------------

@dataclass(frozen=True)
class RolledBack:
    rollout_id: int
    deployment: str
    tenant_id: int | None
    to_revision: int
    weight: int  # the canary's share when it failed (%)
    why: str  # the failed checks with their figures


def rollout_rolled_back(rollouts: Iterable[RolledBack]) -> list[Finding]:
    """One critical finding per rollout that its analysis rolled back (within the window)."""
    return [Finding(
        rule=Rule.ROLLOUT_ROLLED_BACK, subject=f"rollout {r.rollout_id}",
        severity=Severity.CRITICAL, value=float(r.weight), unit="% canary",
        tenant_id=r.tenant_id,
        message=(f"Rollout {r.rollout_id} of {r.deployment} (revision {r.to_revision}) was "
                 f"rolled back automatically at {r.weight}%: {r.why}."),
    ) for r in rollouts]


# --- placement rules ----------------------------------------------------------------------

@dataclass(frozen=True)
class RulesBroken:
    deployment: str
    tenant_id: int | None
    violations: tuple[str, ...]  # placement.rules.violations, in words
    auto_apply_plans: bool


def rule_violated(deployments: Iterable[RulesBroken]) -> list[Finding]:
    """One warning per deployment that breaks its placement rules, saying which and what
    the replan does about it."""
    return [Finding(
        rule=Rule.RULE_VIOLATED, subject=d.deployment, severity=Severity.WARNING,
        value=float(len(d.violations)), unit="rules", tenant_id=d.tenant_id,
        message=(f"{d.deployment} breaks its placement rules: {'; '.join(d.violations)}. "
                 + ("The replan proposes and applies a plan that repairs it."
                    if d.auto_apply_plans else
                    "auto_apply_plans is false: the replan proposes a plan that repairs it "
                    "and nothing moves until an operator applies it (Plans).")),
    ) for d in deployments if d.violations]
