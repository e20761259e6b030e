"""Scaling decisions: what the autoscaler decided for a deployment, and why."""

from __future__ import annotations

from django.db import models

from controlplane.core.tenancy import Tenancy, TenantQuerySet


class ScalingDecision(models.Model):
    """One autoscaler decision for a deployment, with the signals that drove it."""

    deployment = models.ForeignKey("deployments.Deployment", on_delete=models.CASCADE,
                                   related_name="scaling_decisions")
    at = models.DateTimeField(db_index=True)
    direction = models.CharField(max_length=8)  # up | down
    replicas_before = models.PositiveIntegerField()
    replicas_after = models.PositiveIntegerField()
    reason = models.CharField(max_length=300)
    signals = models.JSONField(default=dict)
    placed = models.JSONField(default=list, blank=True, help_text="region keys of new replicas")
    # A decision that could not place what it wanted stays open: the same attempt on later
    # ticks updates it (repeats, last_at) rather than writing a row and an event each time.
    replicas_wanted = models.PositiveIntegerField(null=True, blank=True)
    open = models.BooleanField(default=False)
    repeats = models.PositiveIntegerField(default=1)
    last_at = models.DateTimeField(null=True, blank=True)

    tenancy = Tenancy("deployment__tenant", shared=True)
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["-at"]
        # The table the rows were first written to (by the failover app): the model moved,
        # the rows did not.
        db_table = "failover_scalingdecision"

    def __str__(self) -> str:
        return (f"{self.deployment.name} {self.direction} "
                f"{self.replicas_before}→{self.replicas_after}")
