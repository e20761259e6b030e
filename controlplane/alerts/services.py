"""Alert services: evaluate each rule on its inputs (gatherers.py), open and resolve Alert
rows, queue their webhook deliveries (webhook.py), and acknowledge them.

`evaluate` is idempotent: run twice on the same state it changes nothing the second time
but `last_evaluated_at`. A finding opens an alert (after its rule's `for_s`, remembered in
AlertCondition), updates the open one, or — once a subject has no finding — the open alert is
resolved. A rule whose inputs cannot be loaded is reported and leaves its alerts as they are.

The webhook (`MERIDIAN_ALERT_WEBHOOK_URL`) gets one POST per opening, escalation (warning to
critical, which also clears an acknowledgement) and resolution, sent by the
`alerts.deliver_webhook` task outside the evaluation and retried there (webhook.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from django.db import transaction
from django.db.models import Count, Q
from django.utils import timezone

from controlplane.alerts import webhook
from controlplane.alerts.gatherers import GATHERERS, Gather
from controlplane.alerts.models import (
    Alert,
    AlertCondition,
    AlertState,
    DeliveryEvent,
    NotifyState,
    RuleSetting,
    Severity,
)
from controlplane.alerts.rules import Finding
from controlplane.alerts.thresholds import DEFAULTS, Thresholds
from controlplane.core.services import Principal, record_audit

log = logging.getLogger(__name__)

ACTOR = "alerts"


def thresholds() -> dict[str, Thresholds]:
    """Every rule's thresholds: the defaults in thresholds.py, overridden by RuleSetting rows."""
    limits = dict(DEFAULTS)
    for row in RuleSetting.objects.all():
        if row.rule in limits:
            limits[row.rule] = row.effective()
    return limits


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
    report = reconcile(findings, evaluated, now, limits, webhook.webhook_url())
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
    by_key = _most_severe(findings)
    open_alerts = {(a.rule, a.subject): a for a in Alert.objects.select_for_update().filter(
        state=AlertState.OPEN, rule__in=evaluated)}
    conditions = {(c.rule, c.subject): c for c in AlertCondition.objects.select_for_update()
                  .filter(rule__in=evaluated)}
    changed, still_pending = [], []
    for key, finding in by_key.items():
        alert = open_alerts.get(key)
        if alert is not None:
            _update(alert, finding, now, url, report)
            changed.append(alert)
            continue
        since = _held_since(finding, conditions.get(key), limits[finding.rule].for_s, now)
        if since is None:
            report.pending += 1
            if key in conditions:
                still_pending.append(conditions[key])
            continue
        alert = _open(finding, since, now, url)
        report.opened.append(alert.pk)
        if url:
            report.deliveries.append(
                webhook.queue_delivery(alert, DeliveryEvent.OPENED, url, now))
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
            report.deliveries.append(
                webhook.queue_delivery(alert, DeliveryEvent.RESOLVED, url, now))
    # Conditions that stopped holding before their rule's `for_s` are forgotten.
    gone = [c.pk for key, c in conditions.items() if key not in by_key]
    AlertCondition.objects.filter(pk__in=gone).delete()
    return report


def _most_severe(findings: list[Finding]) -> dict[tuple[str, str], Finding]:
    """One finding per subject: the most severe wins (the first of equals)."""
    by_key: dict[tuple[str, str], Finding] = {}
    for finding in findings:
        known = by_key.get(finding.key)
        if known is None or (finding.severity == Severity.CRITICAL
                             and known.severity != Severity.CRITICAL):
            by_key[finding.key] = finding
    return by_key


def _update(alert: Alert, finding: Finding, now: datetime, url: str | None,
            report: Report) -> None:
    """An open alert takes its subject's newest finding (saved by the caller); escalated
    when it first becomes critical."""
    escalated = (finding.severity == Severity.CRITICAL
                 and alert.severity != Severity.CRITICAL and alert.escalated_at is None)
    alert.severity, alert.message = finding.severity, finding.message
    alert.value, alert.threshold, alert.unit = (finding.value, finding.threshold, finding.unit)
    alert.last_evaluated_at = now
    if escalated:
        _escalate(alert, now, url)
        report.escalated.append(alert.pk)
        if url:
            report.deliveries.append(
                webhook.queue_delivery(alert, DeliveryEvent.ESCALATED, url, now))


def _held_since(finding: Finding, condition: AlertCondition | None, hold_s: float,
                now: datetime) -> datetime | None:
    """Since when the finding has held, once it held for its rule's `for_s` (`hold_s`);
    None while it is pending. A new condition is created; a pending one is marked seen
    (saved by the caller); one that held long enough is deleted, its alert opening."""
    if hold_s <= 0:
        return now
    if condition is None:
        AlertCondition.objects.create(rule=finding.rule, subject=finding.subject,
                                      since=now, last_seen_at=now)
        return None
    if (now - condition.since).total_seconds() < hold_s:
        condition.last_seen_at = now
        return None
    condition.delete()
    return condition.since


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
