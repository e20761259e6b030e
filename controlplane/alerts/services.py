"""Alert services: load each rule's inputs, evaluate, open and resolve Alert rows, notify.

`evaluate` is idempotent: run twice on the same state it changes nothing the second time
but `last_evaluated_at`. A finding opens an alert (after its rule's `for_s`, remembered in
AlertCondition), updates the open one, or — once a subject has no finding — the open alert is
resolved. A rule whose inputs cannot be loaded is reported and leaves its alerts as they are.

The webhook (`MERIDIAN_ALERT_WEBHOOK_URL`) gets one POST per opening, escalation (warning to
critical, which also clears an acknowledgement) and resolution, sent by the
`alerts.deliver_webhook` task outside the evaluation and retried there.
"""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.models import Count, F, Max, Min, Q
from django.utils import timezone

from controlplane.alerts import rules
from controlplane.alerts.models import (
    Alert,
    AlertCondition,
    AlertDelivery,
    AlertState,
    DeliveryEvent,
    NotifyState,
    Rule,
    RuleSetting,
    Severity,
)
from controlplane.alerts.rules import Finding
from controlplane.alerts.thresholds import DEFAULTS, Thresholds
from controlplane.core.models import Tenant
from controlplane.core.services import Principal, record_audit
from controlplane.costs.services import month_to_date_usd
from controlplane.deployments.lifecycle import SERVING_STATES
from controlplane.deployments.models import Deployment, Replica
from controlplane.failover.models import RegionHealth
from controlplane.placement import rules as placement_rules
from controlplane.rollouts.models import Rollout, RolloutState
from controlplane.rollouts.services import ANALYST
from controlplane.routing.models import RoutingTable
from controlplane.telemetry.edge_metrics import traffic_by_model
from controlplane.telemetry.services import metrics_source, newest_edge_requests
from regions.models import Quota

log = logging.getLogger(__name__)

ACTOR = "alerts"


# --- settings -----------------------------------------------------------------------------

def thresholds() -> dict[str, Thresholds]:
    """Every rule's thresholds: the defaults in thresholds.py, overridden by RuleSetting rows."""
    limits = dict(DEFAULTS)
    for row in RuleSetting.objects.all():
        if row.rule in limits:
            limits[row.rule] = row.effective()
    return limits


def webhook_url() -> str | None:
    """MERIDIAN_ALERT_WEBHOOK_URL, checked at start-up; None when unset."""
    return settings.MERIDIAN["ALERT_WEBHOOK_URL"]


def webhook_timeout_s() -> float:
    return settings.MERIDIAN["ALERT_WEBHOOK_TIMEOUT_S"]


# --- inputs -------------------------------------------------------------------------------

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
                label = f"replica {replica.pk} ({replica.region.key})"
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


# --- evaluation ---------------------------------------------------------------------------

@dataclass
class Report:
    opened: list[int] = field(default_factory=list)
    escalated: list[int] = field(default_factory=list)
    resolved: list[int] = field(default_factory=list)
    updated: int = 0
    pending: int = 0
    deliveries: list[int] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        return {"opened": len(self.opened), "escalated": len(self.escalated),
                "resolved": len(self.resolved),
                "updated": self.updated, "pending": self.pending,
                "deliveries": len(self.deliveries), "errors": self.errors}


def evaluate(now: datetime | None = None, gatherers: Iterable[tuple[tuple[str, ...], Gather]]
             = GATHERERS) -> Report:
    """Evaluate every rule once and reconcile Alert rows with what holds now."""
    now = now or timezone.now()
    limits = thresholds()
    findings: list[Finding] = []
    evaluated: set[str] = set()
    errors: dict[str, str] = {}
    for names, gather in gatherers:
        active = [name for name in names if limits[name].enabled]
        evaluated.update(name for name in names if not limits[name].enabled)
        if not active:
            continue
        try:
            found = gather(now, limits)
        except Exception as exc:  # one broken input must not stop the other rules
            log.exception("alert rules %s could not be evaluated", ", ".join(active))
            errors.update(dict.fromkeys(active, f"{type(exc).__name__}: {exc}"[:300]))
            continue
        evaluated.update(active)
        findings += [f for f in found if f.rule in active]
    report = reconcile(findings, evaluated, now, limits, webhook_url())
    report.errors = errors
    return report


@transaction.atomic
def reconcile(findings: list[Finding], evaluated: set[str], now: datetime,
              limits: dict[str, Thresholds], url: str | None = None) -> Report:
    """Open, update and resolve alerts of the evaluated rules to match the findings; with a
    webhook URL, queue a delivery for each opening, escalation to critical and resolution.
    An escalation (once per alert) also clears the alert's acknowledgement: a warning someone
    acknowledged is not the critical alert it has become."""
    report = Report()
    by_key: dict[tuple[str, str], Finding] = {}
    for finding in findings:  # one finding per subject: the most severe wins
        known = by_key.get(finding.key)
        if known is None or (finding.severity == Severity.CRITICAL
                             and known.severity != Severity.CRITICAL):
            by_key[finding.key] = finding
    open_alerts = {(a.rule, a.subject): a for a in Alert.objects.select_for_update().filter(
        state=AlertState.OPEN, rule__in=evaluated)}
    conditions = {(c.rule, c.subject): c for c in AlertCondition.objects.select_for_update()
                  .filter(rule__in=evaluated)}
    changed, still_pending = [], []
    for key, finding in by_key.items():
        alert = open_alerts.get(key)
        if alert is not None:
            escalated = (finding.severity == Severity.CRITICAL
                         and alert.severity != Severity.CRITICAL and alert.escalated_at is None)
            alert.severity, alert.message = finding.severity, finding.message
            alert.value, alert.threshold, alert.unit = (finding.value, finding.threshold,
                                                        finding.unit)
            alert.last_evaluated_at = now
            if escalated:
                _escalate(alert, now, url)
                report.escalated.append(alert.pk)
                if url:
                    report.deliveries.append(
                        _queue_delivery(alert, DeliveryEvent.ESCALATED, url, now))
            changed.append(alert)
            continue
        since = now
        hold_s = limits[finding.rule].for_s
        if hold_s > 0:
            condition = conditions.get(key)
            if condition is None:
                AlertCondition.objects.create(rule=finding.rule, subject=finding.subject,
                                              since=now, last_seen_at=now)
                report.pending += 1
                continue
            if (now - condition.since).total_seconds() < hold_s:
                condition.last_seen_at = now
                still_pending.append(condition)
                report.pending += 1
                continue
            since = condition.since
            condition.delete()
        alert = _open(finding, since, now, url)
        report.opened.append(alert.pk)
        if url:
            report.deliveries.append(_queue_delivery(alert, DeliveryEvent.OPENED, url, now))
    Alert.objects.bulk_update(changed, ["severity", "message", "value", "threshold", "unit",
                                        "last_evaluated_at", "escalated_at", "acknowledged_at",
                                        "acknowledged_by", "acknowledge_note", "notify_state"])
    report.updated = len(changed)
    AlertCondition.objects.bulk_update(still_pending, ["last_seen_at"])
    for key, alert in open_alerts.items():
        if key in by_key:
            continue
        _resolve(alert, now, url)
        report.resolved.append(alert.pk)
        if url:
            report.deliveries.append(_queue_delivery(alert, DeliveryEvent.RESOLVED, url, now))
    # Conditions that stopped holding before their rule's `for_s` are forgotten.
    gone = [c.pk for key, c in conditions.items() if key not in by_key]
    AlertCondition.objects.filter(pk__in=gone).delete()
    return report


def _open(finding: Finding, since: datetime, now: datetime, url: str | None) -> Alert:
    alert = Alert.objects.create(
        rule=finding.rule, subject=finding.subject, tenant_id=finding.tenant_id,
        severity=finding.severity, state=AlertState.OPEN, message=finding.message,
        value=finding.value, threshold=finding.threshold, unit=finding.unit,
        firing_since=since, opened_at=now, last_evaluated_at=now,
        notify_state=NotifyState.PENDING if url else NotifyState.NONE)
    record_audit(ACTOR, "alert.opened", alert, reason=finding.message,
                 changes={"rule": finding.rule, "subject": finding.subject,
                          "severity": finding.severity, "value": finding.value,
                          "threshold": finding.threshold})
    return alert


def _escalate(alert: Alert, now: datetime, url: str | None) -> None:
    """Severity has just become critical for the first time: the alert is to be seen, and
    sent, again. Later swings between warning and critical only update it."""
    acknowledged_by = alert.acknowledged_by
    alert.escalated_at = now
    alert.acknowledged_at, alert.acknowledged_by, alert.acknowledge_note = None, "", ""
    if url:
        alert.notify_state = NotifyState.PENDING
    record_audit(ACTOR, "alert.escalated", alert, reason=alert.message,
                 changes={"rule": alert.rule, "subject": alert.subject, "severity": "critical",
                          "value": alert.value, "threshold": alert.threshold,
                          "acknowledgement_cleared": bool(acknowledged_by)})


def _resolve(alert: Alert, now: datetime, url: str | None) -> None:
    alert.state, alert.resolved_at, alert.last_evaluated_at = AlertState.RESOLVED, now, now
    fields = ["state", "resolved_at", "last_evaluated_at"]
    if url:
        alert.notify_state = NotifyState.PENDING
        fields.append("notify_state")
    alert.save(update_fields=fields)
    record_audit(ACTOR, "alert.resolved", alert, reason="the condition no longer holds",
                 changes={"rule": alert.rule, "subject": alert.subject,
                          "open_s": round((now - alert.opened_at).total_seconds(), 1)})


# --- webhook ------------------------------------------------------------------------------

def payload(alert: Alert, event: str, now: datetime) -> dict[str, Any]:
    return {
        "event": event,
        "sent_by": "meridian",
        "alert": {
            "id": alert.pk, "rule": alert.rule, "subject": alert.subject,
            "tenant": alert.tenant.name if alert.tenant_id and alert.tenant else None,
            "severity": alert.severity, "state": alert.state, "message": alert.message,
            "value": alert.value, "threshold": alert.threshold, "unit": alert.unit,
            "firing_since": _iso(alert.firing_since), "opened_at": _iso(alert.opened_at),
            "resolved_at": _iso(alert.resolved_at),
        },
        "at": _iso(now),
    }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _queue_delivery(alert: Alert, event: str, url: str, now: datetime) -> int:
    delivery = AlertDelivery.objects.create(
        alert=alert, event=event, url=url, payload=payload(alert, event, now), created_at=now)
    return delivery.pk


def deliver(delivery_id: int, timeout_s: float | None = None) -> bool:
    """POST one delivery's JSON body; records the attempt. True once it is delivered (2xx)."""
    delivery = AlertDelivery.objects.filter(pk=delivery_id).first()
    if delivery is None or delivery.state == NotifyState.SENT:
        return True  # gone with its alert, or sent by an earlier attempt
    timeout_s = timeout_s if timeout_s is not None else webhook_timeout_s()
    body = json.dumps(delivery.payload).encode()
    request = urllib.request.Request(
        delivery.url, data=body, method="POST",
        headers={"Content-Type": "application/json", "User-Agent": "meridian-alerts/1"})
    status, error = None, ""
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310
            status = response.status
    except urllib.error.HTTPError as exc:
        status, error = exc.code, f"the webhook answered HTTP {exc.code}"
    except (urllib.error.URLError, TimeoutError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        error = f"{type(reason).__name__}: {reason}"[:300]
    sent = status is not None and 200 <= status < 300
    now = timezone.now()
    AlertDelivery.objects.filter(pk=delivery.pk).update(
        attempts=F("attempts") + 1, last_attempt_at=now, response_status=status,
        last_error="" if sent else error, state=NotifyState.SENT if sent else NotifyState.PENDING,
        delivered_at=now if sent else None)
    if sent:
        _set_notify_state(delivery, NotifyState.SENT)
    return sent


def give_up(delivery_id: int) -> None:
    """After the last retry: the delivery failed."""
    delivery = AlertDelivery.objects.filter(pk=delivery_id).first()
    if delivery is None or delivery.state == NotifyState.SENT:
        return
    AlertDelivery.objects.filter(pk=delivery.pk).update(state=NotifyState.FAILED)
    _set_notify_state(delivery, NotifyState.FAILED)


def _set_notify_state(delivery: AlertDelivery, state: str) -> None:
    """The alert shows its newest delivery's state; an older one finishing late does not."""
    newest = AlertDelivery.objects.filter(alert_id=delivery.alert_id).order_by(
        "-created_at", "-id").values_list("pk", flat=True).first()
    if newest == delivery.pk:
        Alert.objects.filter(pk=delivery.alert_id).update(notify_state=state)


def undelivered(older_than: timedelta = timedelta(minutes=10)) -> list[int]:
    """Deliveries still pending long after they were queued with no attempt (a lost task)."""
    cutoff = timezone.now() - older_than
    return list(AlertDelivery.objects.filter(
        state=NotifyState.PENDING, attempts=0, created_at__lt=cutoff).values_list("pk", flat=True))


# --- reading ------------------------------------------------------------------------------

def open_counts(principal: Principal) -> dict[str, int]:
    """Open alerts by severity, plus the total, in one query."""
    counts = Alert.objects.visible_to(principal).filter(state=AlertState.OPEN).aggregate(
        total=Count("id"),
        critical=Count("id", filter=Q(severity=Severity.CRITICAL)),
        warning=Count("id", filter=Q(severity=Severity.WARNING)))
    return {key: value or 0 for key, value in counts.items()}


class AcknowledgeError(Exception):
    pass


def acknowledge(alert_id: int, actor: str, note: str = "") -> Alert:
    """Mark an open alert as seen by someone; resolved or already acknowledged ones refuse."""
    with transaction.atomic():
        alert = Alert.objects.select_for_update().get(pk=alert_id)
        if alert.state != AlertState.OPEN:
            raise AcknowledgeError("This alert is already resolved.")
        if alert.acknowledged_at is not None:
            raise AcknowledgeError(
                f"Already acknowledged by {alert.acknowledged_by} at "
                f"{alert.acknowledged_at:%Y-%m-%d %H:%M:%S} UTC.")
        alert.acknowledged_at, alert.acknowledged_by = timezone.now(), actor[:150]
        alert.acknowledge_note = note
        alert.save(update_fields=["acknowledged_at", "acknowledged_by", "acknowledge_note"])
        record_audit(actor, "alert.acknowledged", alert, reason=note,
                     changes={"rule": alert.rule, "subject": alert.subject})
    return alert
