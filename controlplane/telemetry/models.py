"""Samples of each replica's engine metrics, kept in Postgres for windows and charts."""

from __future__ import annotations

from django.db import models


class ReplicaSample(models.Model):
    replica = models.ForeignKey(
        "deployments.Replica", on_delete=models.CASCADE, related_name="samples"
    )
    at = models.DateTimeField(db_index=True)
    up = models.BooleanField(default=True)
    error = models.CharField(max_length=300, blank=True)
    running = models.FloatField(default=0)
    waiting = models.FloatField(default=0)
    kv_usage = models.FloatField(default=0)
    counters = models.JSONField(default=dict, blank=True)
    buckets = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at"]
        indexes = [models.Index(fields=["replica", "-at"])]

    def __str__(self) -> str:
        return f"{self.replica_id} @ {self.at:%H:%M:%S}"
