"""Samples of replicas' engine metrics and edges' counters, kept in Postgres for windows,
charts, cost attribution and alerts."""

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


class EdgeSample(models.Model):
    """One scrape of an edge's /metrics: cumulative counters since the edge started.

    `requests` is keyed "model|region|tenant|status", `tokens` "model|region|tenant|kind"
    (see telemetry.edge_metrics); what happened between two scrapes is their difference.
    """

    edge = models.ForeignKey("routing.Edge", on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField(db_index=True)
    up = models.BooleanField(default=True)
    error = models.CharField(max_length=300, blank=True)
    table_version = models.BigIntegerField(null=True, blank=True)
    requests = models.JSONField(default=dict, blank=True)
    tokens = models.JSONField(default=dict, blank=True)
    buckets = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at"]
        indexes = [models.Index(fields=["edge", "-at"])]

    def __str__(self) -> str:
        return f"{self.edge_id} @ {self.at:%H:%M:%S}"
