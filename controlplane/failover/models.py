"""Region health, and incidents with their timelines."""

from __future__ import annotations

from django.db import models


class Health(models.TextChoices):
    HEALTHY = "healthy", "Healthy"
    DEGRADED = "degraded", "Degraded"
    DOWN = "down", "Down"
    IDLE = "idle", "Idle"  # nothing serves there: no replicas, or only draining/starting ones


class RegionHealth(models.Model):
    """The control plane's current view of a region, derived from its replicas' health."""

    region = models.OneToOneField("regions.Region", on_delete=models.CASCADE,
                                  related_name="health")
    state = models.CharField(max_length=16, choices=Health.choices, default=Health.HEALTHY)
    reason = models.CharField(max_length=300, blank=True)
    serving = models.PositiveIntegerField(default=0)
    failing = models.PositiveIntegerField(default=0)
    changed_at = models.DateTimeField()
    checked_at = models.DateTimeField()

    class Meta:
        ordering = ["region__cloud__name", "region__code"]

    def __str__(self) -> str:
        return f"{self.region} {self.state}"


class IncidentKind(models.TextChoices):
    REPLICA_FAILED = "replica_failed", "Replica failed"
    REGION_DOWN = "region_down", "Region down"
    SPOT_PREEMPTED = "spot_preempted", "Spot preempted"
    DRILL = "drill", "Drill"


class Incident(models.Model):
    """A failure (or a drill) and the timeline of Meridian's answer to it.

    Timestamps: started (the failure, or the drill's kill), detected (the control plane
    noticed), tables_pushed (edges have tables without the failed replicas), replacement_ready
    (enough replacements are ready), traffic_back (a replacement has served requests),
    resolved (the incident is closed).
    """

    kind = models.CharField(max_length=24, choices=IncidentKind.choices, db_index=True)
    region = models.ForeignKey("regions.Region", null=True, blank=True,
                               on_delete=models.SET_NULL, related_name="incidents")
    summary = models.CharField(max_length=300)
    started_by = models.CharField(max_length=150, default="system")
    started_at = models.DateTimeField(db_index=True)
    detected_at = models.DateTimeField(null=True, blank=True)
    tables_pushed_at = models.DateTimeField(null=True, blank=True)
    replacement_ready_at = models.DateTimeField(null=True, blank=True)
    traffic_back_at = models.DateTimeField(null=True, blank=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    failed_replicas = models.JSONField(default=list, blank=True)
    replacements = models.JSONField(default=list, blank=True)
    notes = models.JSONField(default=list, blank=True, help_text="[at, text] pairs, in order.")

    class Meta:
        ordering = ["-started_at"]

    def __str__(self) -> str:
        return f"{self.kind} {self.summary}"

    @property
    def open(self) -> bool:
        return self.resolved_at is None

