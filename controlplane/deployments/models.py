"""Model architectures, deployments (what to serve, where it may run, its SLO) and replicas."""

from __future__ import annotations

from typing import Self, TypeVar

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models

from controlplane.core.models import Tier
from controlplane.core.tenancy import Tenancy, TenantQuerySet


class Dtype(models.TextChoices):
    BF16 = "bfloat16", "bfloat16"
    FP16 = "float16", "float16"
    FP8 = "fp8", "fp8"
    INT8 = "int8", "int8"
    INT4 = "int4", "int4"


class Engine(models.TextChoices):
    VLLM = "vllm", "vLLM"
    ENGINESIM = "enginesim", "enginesim (simulated; local regions only)"


# Where each engine can run: enginesim is a simulator for the local lab only.
ENGINE_CLOUDS: dict[str, frozenset[str]] = {Engine.ENGINESIM: frozenset({"local"})}


def default_engine() -> str:
    return str(settings.MERIDIAN["DEFAULT_ENGINE"])


class Model(models.Model):
    """An open model's architecture: enough to size its weights and KV cache."""

    name = models.CharField(
        max_length=96, unique=True,
        validators=[RegexValidator(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", "Use letters, digits, '.', '_' and '-'.")],
    )
    hf_id = models.CharField(max_length=200, help_text="Hugging Face id passed to vllm serve.")
    family = models.CharField(max_length=32, blank=True)
    parameters_b = models.FloatField(validators=[MinValueValidator(0.01)])
    active_parameters_b = models.FloatField(null=True, blank=True)
    layers = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    hidden_size = models.PositiveIntegerField(null=True, blank=True)
    attention_heads = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    kv_heads = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    head_dim = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    dtype = models.CharField(max_length=16, choices=Dtype.choices, default=Dtype.BF16)
    max_context = models.PositiveIntegerField(validators=[MinValueValidator(1)])
    license = models.CharField(max_length=64, blank=True)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Deployment(models.Model):
    """A model served for a tenant (or shared), with its SLO, scale bounds and engine args."""

    name = models.SlugField(max_length=64, unique=True)
    served_model_name = models.CharField(
        max_length=96, help_text="The name clients send as `model`."
    )
    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="deployments")
    tenant = models.ForeignKey(
        "core.Tenant", null=True, blank=True, on_delete=models.PROTECT,
        related_name="deployments", help_text="Empty: shared by every tenant.",
    )
    tier = models.CharField(max_length=16, choices=Tier.choices, default=Tier.INTERACTIVE)
    allowed_jurisdictions = models.ManyToManyField(
        "regions.Jurisdiction", related_name="deployments",
        help_text="Where replicas may be placed.",
    )
    user_regions = models.ManyToManyField(
        "regions.Region", related_name="deployments_served", blank=True,
        help_text="Where the deployment's users are; latency targets are measured from here.",
    )
    slo_ttft_p95_ms = models.PositiveIntegerField(default=1000, validators=[MinValueValidator(1)])
    slo_itl_p95_ms = models.PositiveIntegerField(default=100, validators=[MinValueValidator(1)])
    min_replicas = models.PositiveIntegerField(default=1)
    max_replicas = models.PositiveIntegerField(default=4, validators=[MinValueValidator(1)])
    spread_regions = models.PositiveSmallIntegerField(
        default=1, validators=[MinValueValidator(1)],
        help_text="Replicas must span at least this many regions.",
    )
    max_spot_fraction = models.FloatField(
        default=0.0, validators=[MinValueValidator(0.0), MaxValueValidator(1.0)]
    )
    demand_tokens_per_s = models.FloatField(default=0.0, validators=[MinValueValidator(0.0)])
    tensor_parallel = models.PositiveSmallIntegerField(default=1)
    pipeline_parallel = models.PositiveSmallIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(16)]
    )
    max_model_len = models.PositiveIntegerField(default=8192, validators=[MinValueValidator(16)])
    enable_prefix_caching = models.BooleanField(default=True)
    shared_prefix_cache = models.BooleanField(
        default=False, help_text=(
            "Let every tenant's requests share this shared deployment's prefix cache (for "
            "platform-wide system prompts). Off: the edges salt each request's cache with its "
            "tenant's cache_salt, so no tenant can find another's prompt in it."))
    engine = models.CharField(
        max_length=16, choices=Engine.choices, default=default_engine,
        help_text="What serves it: a real vLLM, or enginesim (the simulator, local regions "
                  "only). Default: MERIDIAN_DEFAULT_ENGINE.")
    disaggregated_prefill = models.BooleanField(default=False)
    auto_apply_plans = models.BooleanField(default=False)
    autoscale = models.BooleanField(
        default=True, help_text="Let the autoscaler move the replica count within its bounds.")
    target_inflight_per_replica = models.PositiveIntegerField(
        default=24, validators=[MinValueValidator(1)],
        help_text="Running + waiting requests per replica the autoscaler aims for.")
    warm_pool = models.PositiveSmallIntegerField(
        default=0, help_text="Idle replicas kept ready beyond demand (interactive tier).")
    scale_up_cooldown_s = models.PositiveIntegerField(default=30)
    scale_down_cooldown_s = models.PositiveIntegerField(default=300)
    # Written by whatever last tried to place it (the autoscaler, a plan): empty while it
    # can be placed, else why not, in the solver's words (quota, a region down, …).
    placement_problem = models.TextField(blank=True, default="")
    placement_problem_since = models.DateTimeField(null=True, blank=True)
    # Revisions (DESIGN §3): the one the deployment serves, and while a rollout is in
    # progress the one it is trying with `canary_weight` % of the traffic (rollouts app).
    stable_revision = models.ForeignKey(
        "Revision", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    canary_revision = models.ForeignKey(
        "Revision", null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    canary_weight = models.PositiveSmallIntegerField(
        default=0, validators=[MaxValueValidator(100)],
        help_text="Share of new conversations (%) sent to the canary revision.")
    canary_region_weights = models.JSONField(
        default=dict, blank=True, help_text=(
            "A rollout in waves: the canary's share (%) at edges in these regions "
            "({\"cloud:code\": share}); edges elsewhere use canary_weight."))
    created_at = models.DateTimeField(auto_now_add=True)
    updated_at = models.DateTimeField(auto_now=True)

    tenancy = Tenancy("tenant", shared=True)
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["name"]
        constraints = [
            models.CheckConstraint(
                condition=models.Q(min_replicas__lte=models.F("max_replicas")),
                name="deployment_min_le_max_replicas",
            ),
            models.CheckConstraint(
                condition=models.Q(canary_weight__lte=100),
                name="deployment_canary_weight_le_100",
            ),
        ]

    def __str__(self) -> str:
        return self.name

    @property
    def placement_status(self) -> str:
        """placeable, or unplaceable (see placement_problem)."""
        return "unplaceable" if self.placement_problem else "placeable"


class ImmutableError(Exception):
    """A revision is never changed once written; a new one is made instead."""


class Revision(models.Model):
    """The engine-relevant settings of a deployment at one point, never updated: save()
    refuses an existing row and a database trigger refuses UPDATE (migration 0005); rows go
    only with their deployment. The served name is the deployment's, the same across its
    revisions."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE,
                                   related_name="revisions")
    number = models.PositiveIntegerField(help_text="1, 2, … within the deployment.")
    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="revisions")
    vllm_version = models.CharField(max_length=32, blank=True, default="")
    engine_args = models.JSONField(default=dict, blank=True)
    tensor_parallel = models.PositiveSmallIntegerField(default=1,
                                                       validators=[MinValueValidator(1)])
    pipeline_parallel = models.PositiveSmallIntegerField(
        default=1, validators=[MinValueValidator(1), MaxValueValidator(16)])
    preferred_gpu_type = models.ForeignKey(
        "regions.GpuType", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)

    tenancy = Tenancy("deployment__tenant", shared=True)
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["deployment_id", "number"]
        constraints = [models.UniqueConstraint(fields=["deployment", "number"],
                                               name="revision_number_unique")]

    def save(self, *args: object, **kwargs: object) -> None:
        if self.pk is not None and not self._state.adding:
            raise ImmutableError(f"revision {self.pk} is immutable; make a new revision")
        super().save(*args, **kwargs)  # type: ignore[arg-type]

    @property
    def public_id(self) -> str:
        return f"rev-{self.pk}"

    def __str__(self) -> str:
        return f"{self.deployment.name} revision {self.number}"  # as the pages name it


class ReplicaState(models.TextChoices):
    PENDING = "pending", "Pending"
    PROVISIONING = "provisioning", "Provisioning"
    STARTING = "starting", "Starting"
    READY = "ready", "Ready"
    DEGRADED = "degraded", "Degraded"
    DRAINING = "draining", "Draining"
    TERMINATED = "terminated", "Terminated"
    FAILED = "failed", "Failed"


# States of a replica that has not ended, and of those the ones not on their way out: what a
# deployment will still have once its drains finish (deployments.lifecycle uses both).
LIVE_STATES = frozenset(ReplicaState) - {ReplicaState.TERMINATED, ReplicaState.FAILED}
STAYING_STATES = LIVE_STATES - {ReplicaState.DRAINING}
_Row = TypeVar("_Row", bound=models.Model)


class ReplicaQuerySet(TenantQuerySet[_Row]):
    def staying(self) -> Self:
        """Replicas that are live and not draining: what a deployment will still have once
        its drains finish (lifecycle.STAYING_STATES)."""
        return self.filter(state__in=STAYING_STATES)


class Replica(models.Model):
    """One running copy of a deployment: one SkyPilot cluster or one local engine process."""

    deployment = models.ForeignKey(Deployment, on_delete=models.CASCADE, related_name="replicas")
    region = models.ForeignKey("regions.Region", on_delete=models.PROTECT, related_name="replicas")
    offer = models.ForeignKey(
        "regions.Offer", null=True, blank=True, on_delete=models.SET_NULL, related_name="replicas"
    )
    provider = models.CharField(max_length=32, default="local")
    provider_handle = models.JSONField(default=dict, blank=True)
    url = models.URLField(max_length=300, blank=True)
    state = models.CharField(
        max_length=16, choices=ReplicaState.choices, default=ReplicaState.PENDING, db_index=True
    )
    revision = models.ForeignKey(
        Revision, null=True, blank=True, on_delete=models.SET_NULL, related_name="replicas",
        help_text="The engine settings it was launched with; empty: the stable revision.")
    spot = models.BooleanField(default=False)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    state_changed_at = models.DateTimeField(auto_now_add=True)
    ready_at = models.DateTimeField(null=True, blank=True)
    terminated_at = models.DateTimeField(null=True, blank=True)
    # Set in the transaction that requests a failed replica's replacement, before its
    # resources are released: a failover pass that dies in between is rerun without
    # replacing the same loss twice.
    replacement_requested_at = models.DateTimeField(null=True, blank=True)

    tenancy = Tenancy("deployment__tenant", shared=True)
    objects = ReplicaQuerySet.as_manager()

    class Meta:
        ordering = ["deployment__name", "id"]
        indexes = [models.Index(fields=["deployment", "state"])]

    @property
    def public_id(self) -> str:
        return f"r-{self.pk}"

    def __str__(self) -> str:
        return f"{self.public_id} {self.deployment} @ {self.region} ({self.state})"
