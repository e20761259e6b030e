"""Alerts: one row per time a rule's condition held for a subject, with its history.

`Alert` is open while the condition holds and resolved once it does not; a partial unique
constraint keeps at most one open alert per (rule, subject). `AlertCondition` remembers since
when a condition has held for rules that must hold for a while before they open (`for_s`).
`AlertDelivery` is one webhook notification (opened, escalated or resolved) and its delivery
state.
`RuleSetting` overrides a rule's default thresholds (see `alerts.thresholds.DEFAULTS`).
"""

from __future__ import annotations

from django.core.exceptions import ValidationError
from django.core.validators import MinValueValidator
from django.db import models
from django.db.models import Q

from controlplane.alerts.thresholds import DEFAULTS, Rule, Severity, Thresholds, merged
from controlplane.core.tenancy import Tenancy, TenantQuerySet

__all__ = ["Alert", "AlertCondition", "AlertDelivery", "AlertState", "NotifyState", "Rule",
           "RuleSetting", "Severity"]


class AlertState(models.TextChoices):
    OPEN = "open", "Open"
    RESOLVED = "resolved", "Resolved"


class NotifyState(models.TextChoices):
    NONE = "none", "No webhook"
    PENDING = "pending", "Pending"
    SENT = "sent", "Sent"
    FAILED = "failed", "Failed"


class Alert(models.Model):
    rule = models.CharField(max_length=32, choices=Rule.choices)
    subject = models.CharField(
        max_length=200, help_text="What it is about: deployment, model, region, quota pool, "
        "tenant or edge.")
    tenant = models.ForeignKey(
        "core.Tenant", null=True, blank=True, on_delete=models.CASCADE, related_name="alerts",
        help_text="The tenant the subject belongs to; empty: platform-wide.")
    severity = models.CharField(max_length=16, choices=Severity.choices)
    state = models.CharField(max_length=16, choices=AlertState.choices, default=AlertState.OPEN)
    message = models.TextField()
    value = models.FloatField(null=True, blank=True)
    threshold = models.FloatField(null=True, blank=True)
    unit = models.CharField(max_length=16, blank=True)
    firing_since = models.DateTimeField(help_text="When the condition was first seen holding.")
    opened_at = models.DateTimeField()
    resolved_at = models.DateTimeField(null=True, blank=True)
    last_evaluated_at = models.DateTimeField()
    escalated_at = models.DateTimeField(
        null=True, blank=True,
        help_text="When a warning became critical; an alert escalates (and re-notifies) once.")
    acknowledged_at = models.DateTimeField(null=True, blank=True)
    acknowledged_by = models.CharField(max_length=150, blank=True)
    acknowledge_note = models.CharField(max_length=500, blank=True)
    notify_state = models.CharField(
        max_length=16, choices=NotifyState.choices, default=NotifyState.NONE,
        help_text="Delivery of the latest webhook notification for this alert.")

    tenancy = Tenancy("tenant")
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["-opened_at", "-id"]
        constraints = [
            models.UniqueConstraint(fields=["rule", "subject"], condition=Q(state="open"),
                                    name="alert_one_open_per_rule_subject"),
            models.CheckConstraint(
                condition=(Q(state="open", resolved_at__isnull=True)
                           | Q(state="resolved", resolved_at__isnull=False)),
                name="alert_resolved_at_iff_resolved"),
        ]
        indexes = [
            models.Index(fields=["state", "-opened_at"]),
            models.Index(fields=["rule", "subject"]),
        ]

    def __str__(self) -> str:
        return f"{self.rule} {self.subject} ({self.state})"


class AlertCondition(models.Model):
    """A condition seen holding that has not held for its rule's `for_s` yet."""

    rule = models.CharField(max_length=32, choices=Rule.choices)
    subject = models.CharField(max_length=200)
    since = models.DateTimeField()
    last_seen_at = models.DateTimeField()

    class Meta:
        ordering = ["rule", "subject"]
        constraints = [
            models.UniqueConstraint(fields=["rule", "subject"], name="alert_condition_unique"),
        ]

    def __str__(self) -> str:
        return f"{self.rule} {self.subject} since {self.since:%H:%M:%S}"


class DeliveryEvent(models.TextChoices):
    OPENED = "opened", "Opened"
    ESCALATED = "escalated", "Escalated to critical"
    RESOLVED = "resolved", "Resolved"


class AlertDelivery(models.Model):
    """One webhook POST for an alert's opening, escalation or resolution, retried until sent or
    given up."""

    alert = models.ForeignKey(Alert, on_delete=models.CASCADE, related_name="deliveries")
    event = models.CharField(max_length=16, choices=DeliveryEvent.choices)
    url = models.URLField(max_length=500)
    payload = models.JSONField()
    state = models.CharField(
        max_length=16, choices=[c for c in NotifyState.choices if c[0] != NotifyState.NONE],
        default=NotifyState.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    response_status = models.PositiveIntegerField(null=True, blank=True)
    last_error = models.CharField(max_length=300, blank=True)
    created_at = models.DateTimeField()
    last_attempt_at = models.DateTimeField(null=True, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    tenancy = Tenancy("alert__tenant")
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "alert deliveries"

    def __str__(self) -> str:
        return f"{self.alert_id} {self.event} {self.state}"


class RuleSetting(models.Model):
    """Overrides of one rule's defaults; an empty field keeps the default."""

    rule = models.CharField(max_length=32, choices=Rule.choices, unique=True)
    enabled = models.BooleanField(default=True)
    warning = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0)],
        help_text="Warning threshold in the rule's unit (see the defaults in alerts/rules.py).")
    critical = models.FloatField(
        null=True, blank=True, validators=[MinValueValidator(0)],
        help_text="Critical threshold in the rule's unit.")
    for_s = models.PositiveIntegerField(
        null=True, blank=True,
        help_text="Seconds the condition must hold before an alert opens.")
    window_s = models.PositiveIntegerField(
        null=True, blank=True, validators=[MinValueValidator(1)],
        help_text="Seconds of metrics each evaluation looks at (latency and error rate).")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["rule"]

    def __str__(self) -> str:
        return self.get_rule_display()

    def effective(self) -> Thresholds:
        """The rule's thresholds: its defaults with this row's overrides."""
        return merged(DEFAULTS[self.rule], enabled=self.enabled, warning=self.warning,
                      critical=self.critical, for_s=self.for_s, window_s=self.window_s)

    def clean(self) -> None:
        if self.rule not in DEFAULTS:
            return  # the field's own validation names the bad choice
        limits = self.effective()
        if (limits.warning is not None and limits.critical is not None
                and limits.warning > limits.critical):
            raise ValidationError({"critical": (
                f"Must be at least the warning threshold ({limits.warning:g}); "
                f"with the defaults filled in, warning {limits.warning:g} > "
                f"critical {limits.critical:g}.")})
