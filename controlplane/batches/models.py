"""Files, batches and their lines (DESIGN §3): a tenant's uploaded JSONL, stored whole or not
at all; an OpenAI batch object; one row per request line, claimed with FOR UPDATE SKIP
LOCKED and given its result exactly once."""

from __future__ import annotations

import secrets

from django.db import models

from controlplane.core.tenancy import Tenancy, TenantQuerySet


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


def new_batch_id() -> str:
    return "batch_" + secrets.token_hex(12)


class FilePurpose(models.TextChoices):
    BATCH = "batch", "Batch input"
    BATCH_OUTPUT = "batch_output", "Batch output"


class BatchFile(models.Model):
    """A JSONL file: the content is kept in the row, written in the same transaction as its
    metadata, so a file exists whole or not at all."""

    id = models.CharField(max_length=40, primary_key=True, default=new_file_id, editable=False)
    tenant = models.ForeignKey("core.Tenant", on_delete=models.CASCADE, related_name="batch_files")
    purpose = models.CharField(max_length=16, choices=FilePurpose.choices)
    filename = models.CharField(max_length=255)
    bytes = models.PositiveBigIntegerField()
    line_count = models.PositiveIntegerField()
    content = models.BinaryField()
    created_at = models.DateTimeField(auto_now_add=True)

    tenancy = Tenancy("tenant")
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"{self.id} {self.filename}"


class BatchStatus(models.TextChoices):
    VALIDATING = "validating", "Validating"
    FAILED = "failed", "Failed"
    IN_PROGRESS = "in_progress", "In progress"
    FINALIZING = "finalizing", "Finalizing"
    COMPLETED = "completed", "Completed"
    EXPIRED = "expired", "Expired"
    CANCELLING = "cancelling", "Cancelling"
    CANCELLED = "cancelled", "Cancelled"


FINISHED = frozenset({BatchStatus.FAILED, BatchStatus.COMPLETED, BatchStatus.EXPIRED,
                      BatchStatus.CANCELLED})


class Batch(models.Model):
    """OpenAI's batch object; the request counts are read from the lines."""

    id = models.CharField(max_length=40, primary_key=True, default=new_batch_id, editable=False)
    tenant = models.ForeignKey("core.Tenant", on_delete=models.CASCADE, related_name="batches")
    input_file = models.ForeignKey(BatchFile, on_delete=models.PROTECT, related_name="batches")
    endpoint = models.CharField(max_length=64)
    model = models.CharField(max_length=128)
    completion_window = models.CharField(max_length=8, default="24h")
    status = models.CharField(max_length=16, choices=BatchStatus.choices,
                              default=BatchStatus.VALIDATING, db_index=True)
    metadata = models.JSONField(null=True, blank=True)
    errors = models.JSONField(null=True, blank=True)
    output_file = models.ForeignKey(BatchFile, null=True, blank=True, on_delete=models.SET_NULL,
                                    related_name="+")
    error_file = models.ForeignKey(BatchFile, null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField()
    in_progress_at = models.DateTimeField(null=True, blank=True)
    finalizing_at = models.DateTimeField(null=True, blank=True)
    completed_at = models.DateTimeField(null=True, blank=True)
    failed_at = models.DateTimeField(null=True, blank=True)
    expired_at = models.DateTimeField(null=True, blank=True)
    cancelling_at = models.DateTimeField(null=True, blank=True)
    cancelled_at = models.DateTimeField(null=True, blank=True)
    last_run_at = models.DateTimeField(
        null=True, blank=True, help_text="When a worker last ran the batch (the sweep's clock).")

    tenancy = Tenancy("tenant")
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["-created_at", "-id"]
        verbose_name_plural = "batches"

    def __str__(self) -> str:
        return f"{self.id} ({self.status})"


class LineState(models.TextChoices):
    QUEUED = "queued", "Queued"
    RUNNING = "running", "Running"
    DONE = "done", "Done"
    FAILED = "failed", "Failed"


class BatchLine(models.Model):
    """One request of a batch. `result` is written once, by a conditional UPDATE on
    (batch, custom_id) that only matches while no result is stored."""

    batch = models.ForeignKey(Batch, on_delete=models.CASCADE, related_name="lines")
    line_number = models.PositiveIntegerField()
    custom_id = models.CharField(max_length=512)
    body = models.JSONField()
    state = models.CharField(max_length=8, choices=LineState.choices, default=LineState.QUEUED)
    attempts = models.PositiveSmallIntegerField(default=0)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    claimed_at = models.DateTimeField(null=True, blank=True)
    worker = models.CharField(max_length=128, blank=True)
    response_status = models.PositiveSmallIntegerField(null=True, blank=True)
    request_id = models.CharField(max_length=64, blank=True)
    result = models.JSONField(null=True, blank=True)
    error = models.JSONField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    tenancy = Tenancy("batch__tenant")
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["batch", "line_number"]
        constraints = [
            models.UniqueConstraint(fields=["batch", "custom_id"], name="batch_line_custom_id"),
            models.UniqueConstraint(fields=["batch", "line_number"], name="batch_line_number"),
        ]
        indexes = [models.Index(fields=["batch", "state"], name="batch_line_state")]

    def __str__(self) -> str:
        return f"{self.batch_id}:{self.custom_id} ({self.state})"
