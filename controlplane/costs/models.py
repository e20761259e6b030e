"""Cost rollups and budgets.

`TokenUsage` holds the tokens the edges counted, per hour, served model, region and tenant;
`costs.services.record_usage` adds to it atomically. `CostRollup` is what each hour cost,
per served model, region and tenant: the replicas' cost allocated by those tokens, with cost
nobody's tokens used kept under tenant "" (idle). `RollupHour` records when each hour was
last rolled up, so the periodic task knows which closed hours still need their final pass.
"""

from __future__ import annotations

from decimal import Decimal

from django.db import models

from controlplane.core.tenancy import Tenancy, TenantQuerySet


class TokenUsage(models.Model):
    """Tokens served in one hour for one (model, region, tenant), from the edges' counters."""

    hour = models.DateTimeField(help_text="Start of the hour (UTC).")
    model = models.CharField(max_length=96, help_text="The served model name clients send.")
    region = models.CharField(max_length=100, help_text="The replicas' region, cloud:code.")
    tenant = models.CharField(max_length=64, blank=True, help_text="Tenant name; empty: none.")
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)

    tenancy = Tenancy("tenant", by_name=True)
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["-hour", "model", "region", "tenant"]
        constraints = [
            models.UniqueConstraint(fields=["hour", "model", "region", "tenant"],
                                    name="token_usage_unique_key"),
        ]
        indexes = [models.Index(fields=["hour"])]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H:00} {self.model} {self.region} {self.tenant or '-'}"


class CostRollup(models.Model):
    """One hour's cost for one (model, region, tenant); tenant "" is cost no tokens used."""

    hour = models.DateTimeField(help_text="Start of the hour (UTC).")
    model = models.CharField(max_length=96)
    region = models.CharField(max_length=100)
    tenant = models.CharField(max_length=64, blank=True, help_text="Empty: idle cost.")
    prompt_tokens = models.BigIntegerField(default=0)
    completion_tokens = models.BigIntegerField(default=0)
    usd = models.DecimalField(max_digits=16, decimal_places=6, default=Decimal(0))
    computed_at = models.DateTimeField()

    tenancy = Tenancy("tenant", by_name=True)
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["-hour", "model", "region", "tenant"]
        constraints = [
            models.UniqueConstraint(fields=["hour", "model", "region", "tenant"],
                                    name="cost_rollup_unique_key"),
        ]
        indexes = [models.Index(fields=["hour"]), models.Index(fields=["tenant", "hour"])]

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __str__(self) -> str:
        return (f"{self.hour:%Y-%m-%d %H:00} {self.model} {self.region} "
                f"{self.tenant or '(idle)'} ${self.usd}")


class RollupHour(models.Model):
    """When an hour was last rolled up; an hour rolled up after it closed is final."""

    hour = models.DateTimeField(unique=True)
    computed_at = models.DateTimeField()
    usd = models.DecimalField(max_digits=16, decimal_places=6, default=Decimal(0))
    tokens = models.BigIntegerField(default=0)

    class Meta:
        ordering = ["-hour"]

    def __str__(self) -> str:
        return f"{self.hour:%Y-%m-%d %H:00} ${self.usd}"
