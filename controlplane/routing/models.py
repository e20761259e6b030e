"""Edges, the routing policy they apply, and every table compiled for them."""

from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models


def default_scorer_weights() -> dict[str, float]:
    return {"latency": 1.0, "load": 2.0, "prefix": 3.0, "cost": 0.5}


class StaleTableMode(models.TextChoices):
    """What an edge does once its table is older than `max_table_age_s` (edge/server.py)."""

    LAST_KNOWN_GOOD = "last_known_good", "Keep serving the last known good table"
    FAIL_CLOSED = "fail_closed", "Refuse every tenant not marked fail-open"


class RoutingPolicy(models.Model):
    """How edges weigh their scorers and handle failures; one row named `default`."""

    name = models.SlugField(max_length=32, unique=True, default="default")
    scorers = models.JSONField(default=default_scorer_weights)
    retry_before_first_byte = models.PositiveSmallIntegerField(
        default=2, validators=[MaxValueValidator(10)]
    )
    eject_after_failures = models.PositiveSmallIntegerField(
        default=2, validators=[MinValueValidator(1), MaxValueValidator(100)]
    )
    eject_base_s = models.FloatField(default=1.0, validators=[MinValueValidator(0.05)])
    resume_streams_max = models.PositiveSmallIntegerField(
        default=2, validators=[MaxValueValidator(10)],
        help_text="Resumptions of a stream cut mid-answer, each on another replica; 0: none.",
    )
    resume_deadline_s = models.FloatField(
        default=30.0, validators=[MinValueValidator(0.1)],
        help_text="A stream is resumed only within this many seconds of its first cut.",
    )
    stream_stall_s = models.FloatField(
        default=10.0, validators=[MinValueValidator(0.1)],
        help_text="A stream whose replica sends nothing for this long counts as cut.",
    )
    first_byte_timeout_s = models.FloatField(
        default=30.0, validators=[MinValueValidator(1.0), MaxValueValidator(600.0)],
        help_text="A stream whose replica has sent no first token this long after the request "
                  "goes to another replica (a hung engine whose kernel still acknowledges).",
    )
    aliases = models.JSONField(
        default=dict, blank=True,
        help_text='Model aliases, e.g. {"auto": {"rules": [...], "default": "llama-3.1-8b"}}.',
    )
    max_table_age_s = models.PositiveIntegerField(
        default=24 * 3600, validators=[MinValueValidator(60), MaxValueValidator(30 * 24 * 3600)],
        help_text="A table issued longer ago than this is stale at the edge (60 s to 30 days).",
    )
    stale_table_mode = models.CharField(
        max_length=16, choices=StaleTableMode.choices, default=StaleTableMode.LAST_KNOWN_GOOD,
        help_text="What an edge does with a stale table.",
    )
    fail_open_tenants = models.ManyToManyField(
        "core.Tenant", blank=True, related_name="+",
        help_text="Tenants still served from a stale table under fail_closed.",
    )
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        ordering = ["name"]
        verbose_name_plural = "routing policies"

    def __str__(self) -> str:
        return self.name


class Edge(models.Model):
    name = models.SlugField(max_length=64, unique=True)
    region = models.ForeignKey("regions.Region", on_delete=models.PROTECT, related_name="edges")
    admin_url = models.URLField(max_length=300, help_text="Where PUT /admin/table is sent.")
    public_url = models.URLField(max_length=300, blank=True, help_text="What clients call.")
    enabled = models.BooleanField(default=True)
    last_acked_version = models.BigIntegerField(null=True, blank=True)
    last_acked_at = models.DateTimeField(null=True, blank=True)
    last_seen_at = models.DateTimeField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class RoutingTable(models.Model):
    """One signed table as compiled for one edge; `version` is global and only grows."""

    edge = models.ForeignKey(Edge, on_delete=models.CASCADE, related_name="tables")
    version = models.BigIntegerField()
    payload = models.JSONField()
    payload_hash = models.CharField(max_length=64)
    content_hash = models.CharField(
        max_length=64, default="", help_text="Hash of the payload less version, time, signature."
    )
    excluded = models.JSONField(
        default=list, blank=True,
        help_text="Entries left out because the edge's parser refused them "
                  "(routing/screening.py): subject, field, message.",
    )
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-version"]
        constraints = [
            models.UniqueConstraint(fields=["edge", "version"], name="table_unique_version")
        ]
        indexes = [models.Index(fields=["edge", "-version"])]

    def __str__(self) -> str:
        return f"{self.edge} v{self.version}"
