"""Samples of replicas' engine metrics and edges' counters, kept in Postgres for windows,
charts, cost attribution and alerts."""

from __future__ import annotations

from django.db import models

from controlplane.core.tenancy import Tenancy, TenantQuerySet


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

    tenancy = Tenancy("replica__deployment__tenant", shared=True)
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["-at"]
        indexes = [models.Index(fields=["replica", "-at"])]

    def __str__(self) -> str:
        return f"{self.replica_id} @ {self.at:%H:%M:%S}"


class EdgeSample(models.Model):
    """One scrape of an edge's /metrics: cumulative counters since the edge started.

    `requests` is keyed "model|region|tenant|status", `tokens` "model|region|tenant|kind"
    (see telemetry.edge_metrics); what happened between two scrapes is their difference.
    `revisions` holds the requests, TTFT and ITL buckets of models split between revisions,
    by revision id (what a rollout's analysis compares).
    """

    edge = models.ForeignKey("routing.Edge", on_delete=models.CASCADE, related_name="samples")
    at = models.DateTimeField(db_index=True)
    up = models.BooleanField(default=True)
    error = models.CharField(max_length=300, blank=True)
    table_version = models.BigIntegerField(null=True, blank=True)
    requests = models.JSONField(default=dict, blank=True)
    tokens = models.JSONField(default=dict, blank=True)
    buckets = models.JSONField(default=dict, blank=True)
    revisions = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-at"]
        indexes = [models.Index(fields=["edge", "-at"])]

    def __str__(self) -> str:
        return f"{self.edge_id} @ {self.at:%H:%M:%S}"


class GpuHealth(models.TextChoices):
    HEALTHY = "healthy", "Healthy"
    UNHEALTHY = "unhealthy", "Unhealthy"


class GpuNode(models.Model):
    """A machine whose GPUs report through `controlplane.telemetry.gpu_agent`."""

    name = models.CharField(max_length=128, unique=True)
    replica = models.ForeignKey("deployments.Replica", null=True, blank=True,
                                on_delete=models.SET_NULL, related_name="gpu_nodes")
    driver_version = models.CharField(max_length=64, blank=True)
    nvml_version = models.CharField(max_length=64, blank=True)
    cuda_driver_version = models.PositiveIntegerField(null=True, blank=True)
    gpu_count = models.PositiveSmallIntegerField(default=0)
    interval_s = models.FloatField(default=15.0, help_text="The agent's reporting interval.")
    health = models.CharField(max_length=16, choices=GpuHealth.choices,
                              default=GpuHealth.HEALTHY, db_index=True)
    health_reason = models.CharField(max_length=500, blank=True)
    health_changed_at = models.DateTimeField(null=True, blank=True)
    hot_gpus = models.JSONField(default=list, blank=True,
                                help_text="GPU indices over the temperature limit, until they cool.")
    last_seen_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    tenancy = Tenancy("replica__deployment__tenant")
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return f"{self.name} ({self.health})"


class GpuReading(models.Model):
    """One GPU of a node at one time, as NVML reported it; null where NVML could not say."""

    node = models.ForeignKey(GpuNode, on_delete=models.CASCADE, related_name="readings")
    at = models.DateTimeField(db_index=True)
    index = models.PositiveSmallIntegerField()
    uuid = models.CharField(max_length=96)
    name = models.CharField(max_length=96)
    memory_total_bytes = models.BigIntegerField(null=True, blank=True)
    memory_used_bytes = models.BigIntegerField(null=True, blank=True)
    utilization_gpu_pct = models.FloatField(null=True, blank=True)
    utilization_memory_pct = models.FloatField(null=True, blank=True)
    temperature_c = models.FloatField(null=True, blank=True)
    power_w = models.FloatField(null=True, blank=True)
    power_limit_w = models.FloatField(null=True, blank=True)
    ecc_corrected = models.BigIntegerField(null=True, blank=True,
                                           help_text="Volatile count; null: ECC off or unsupported.")
    ecc_uncorrected = models.BigIntegerField(null=True, blank=True)
    xid_supported = models.BooleanField(default=False)
    xid_errors = models.JSONField(default=list, blank=True,
                                  help_text="XID codes NVML delivered since the last reading.")
    lost = models.BooleanField(default=False, help_text="NVML answered 'GPU is lost'.")
    errors = models.JSONField(default=dict, blank=True, help_text="field → NVML error")

    tenancy = Tenancy("node__replica__deployment__tenant")
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["-at", "index"]
        indexes = [models.Index(fields=["node", "-at"])]

    def __str__(self) -> str:
        return f"{self.node_id} gpu{self.index} @ {self.at:%H:%M:%S}"
