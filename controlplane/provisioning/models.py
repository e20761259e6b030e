"""Operations: every provider job (launch, poll, terminate, observe offers) as a row."""

from __future__ import annotations

from django.db import models

from controlplane.core.tenancy import Tenancy, TenantQuerySet


class OperationKind(models.TextChoices):
    LAUNCH = "launch", "Launch"
    TERMINATE = "terminate", "Terminate"
    RECONCILE = "reconcile", "Reconcile"
    OBSERVE_OFFERS = "observe_offers", "Observe offers"


class OperationStatus(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    SUCCEEDED = "succeeded", "Succeeded"
    FAILED = "failed", "Failed"


class Operation(models.Model):
    """A provider job the UI can show: what, for which replica, how it went, its log."""

    kind = models.CharField(max_length=16, choices=OperationKind.choices)
    provider = models.CharField(max_length=32)
    replica = models.ForeignKey(
        "deployments.Replica", null=True, blank=True, on_delete=models.SET_NULL,
        related_name="operations",
    )
    status = models.CharField(
        max_length=16, choices=OperationStatus.choices, default=OperationStatus.QUEUED,
        db_index=True,
    )
    error_kind = models.CharField(max_length=32, blank=True)
    log = models.TextField(blank=True)
    attempts = models.PositiveSmallIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True)
    started_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    tenancy = Tenancy("replica__deployment__tenant", shared=True)
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["replica", "kind", "status"])]

    def __str__(self) -> str:
        return f"{self.kind} {self.provider} ({self.status})"
