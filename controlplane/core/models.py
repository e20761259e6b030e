"""Tenants, user roles, API tokens (control plane), API keys (inference) and the audit log."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import MaxValueValidator, MinValueValidator
from django.db import models

from controlplane.core.tenancy import Tenancy, TenantQuerySet


class Role(models.TextChoices):
    VIEWER = "viewer", "Viewer"
    OPERATOR = "operator", "Operator"
    ADMIN = "admin", "Admin"


ROLE_RANK = {Role.VIEWER: 1, Role.OPERATOR: 2, Role.ADMIN: 3}


class Tier(models.TextChoices):
    INTERACTIVE = "interactive", "Interactive"
    BATCH = "batch", "Batch"


# A tenant's capacity caps: the defaults a new tenant gets, and the most platform staff may set.
DEFAULT_MAX_REPLICAS = 16
DEFAULT_MAX_GPUS = 32
CAP_MAX_REPLICAS = 1000
CAP_MAX_GPUS = 8000


class Tenant(models.Model):
    """A customer of the fleet: where its data may go, how fast it may send, what it may spend."""

    name = models.SlugField(max_length=64, unique=True)
    display_name = models.CharField(max_length=128, blank=True)
    allowed_jurisdictions = models.ManyToManyField(
        "regions.Jurisdiction", related_name="tenants", blank=True,
        help_text="Jurisdictions the tenant's requests may be served in. Empty: none.",
    )
    allowed_regions = models.ManyToManyField(
        "regions.Region", related_name="tenants", blank=True,
        help_text="Optional narrowing to specific regions inside the allowed jurisdictions.",
    )
    rpm_limit = models.PositiveIntegerField(default=600, validators=[MinValueValidator(1)])
    tpm_limit = models.PositiveIntegerField(default=200_000, validators=[MinValueValidator(1)])
    resume_streams = models.BooleanField(
        default=True,
        help_text="Whether edges may resume the tenant's streams on another replica when the "
                  "one serving them fails mid-answer (the text so far is sent to it).",
    )
    monthly_budget_usd = models.DecimalField(
        max_digits=12, decimal_places=2, null=True, blank=True,
        validators=[MinValueValidator(0)],
    )
    # Capacity caps: what one tenant can make the fleet run for its own deployments (shared
    # deployments count against no tenant). Checked when a deployment is created or changed,
    # and by everything that adds replicas (controlplane/deployments/caps.py).
    max_replicas = models.PositiveIntegerField(
        default=DEFAULT_MAX_REPLICAS,
        validators=[MinValueValidator(0), MaxValueValidator(CAP_MAX_REPLICAS)],
        help_text="Live replicas the tenant's own deployments may run in all, together.")
    max_gpus = models.PositiveIntegerField(
        default=DEFAULT_MAX_GPUS,
        validators=[MinValueValidator(0), MaxValueValidator(CAP_MAX_GPUS)],
        help_text="GPUs (tensor × pipeline parallel per replica) the tenant's own deployments' "
                  "live replicas may hold in all, together.")
    created_at = models.DateTimeField(auto_now_add=True)

    tenancy = Tenancy("id")
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Membership(models.Model):
    """A user's role, and the tenant it is confined to (none: platform staff)."""

    user = models.OneToOneField(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="membership"
    )
    role = models.CharField(max_length=16, choices=Role.choices, default=Role.VIEWER)
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="members"
    )

    tenancy = Tenancy("tenant")
    objects = TenantQuerySet.as_manager()

    def __str__(self) -> str:
        scope = self.tenant.name if self.tenant is not None else "platform"
        return f"{self.user} ({self.role}, {scope})"


class ApiToken(models.Model):
    """A control-plane API token; only its SHA-256 is stored, the token is shown once."""

    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="api_tokens"
    )
    name = models.CharField(max_length=64, default="cli")
    prefix = models.CharField(max_length=16, db_index=True)
    token_hash = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.user})"


class ApiKey(models.Model):
    """A tenant's inference key for the edges; only its SHA-256 is stored and routed."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=64)
    prefix = models.CharField(max_length=16, db_index=True)
    key_hash = models.CharField(max_length=64, unique=True)
    tier = models.CharField(max_length=16, choices=Tier.choices, default=Tier.INTERACTIVE)
    allowed_models = models.JSONField(
        default=list, blank=True, help_text='Served model names this key may use; ["*"] for all.'
    )
    created_at = models.DateTimeField(auto_now_add=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    # Who revoked it; a revocation by platform staff is final for the tenant's own admins.
    revoked_by = models.CharField(max_length=150, blank=True)
    revoked_by_platform = models.BooleanField(default=False)

    tenancy = Tenancy("tenant")
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["tenant__name", "name"]
        constraints = [
            models.UniqueConstraint(fields=["tenant", "name"], name="apikey_unique_name_per_tenant")
        ]

    def __str__(self) -> str:
        return f"{self.tenant}/{self.name} ({self.prefix}…)"


class AuditLog(models.Model):
    """Append-only record of who or what changed what, and why.

    A database trigger (migration 0002) refuses UPDATE and DELETE on this table, so the
    record holds even against code that forgets the rule.
    """

    at = models.DateTimeField(auto_now_add=True, db_index=True)
    actor = models.CharField(max_length=150, help_text="Username, or system:<loop> for jobs.")
    action = models.CharField(max_length=64, db_index=True)
    object_type = models.CharField(max_length=64, db_index=True)
    object_id = models.CharField(max_length=64, blank=True)
    object_repr = models.CharField(max_length=200, blank=True)
    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.DO_NOTHING, db_constraint=False,
        related_name="+",
    )
    changes = models.JSONField(default=dict, blank=True)
    reason = models.TextField(blank=True)

    tenancy = Tenancy("tenant")
    objects = TenantQuerySet.as_manager()

    class Meta:
        ordering = ["-at", "-id"]
        indexes = [models.Index(fields=["object_type", "object_id"])]

    def __str__(self) -> str:
        return f"{self.at:%Y-%m-%d %H:%M:%S} {self.actor} {self.action} {self.object_type}"


class Heartbeat(models.Model):
    """The last time a periodic process showed it was alive (e.g. celery beat)."""

    name = models.CharField(max_length=64, primary_key=True)
    at = models.DateTimeField()

    def __str__(self) -> str:
        return f"{self.name} @ {self.at:%H:%M:%S}"


class Certificate(models.Model):
    """One certificate the engine CA issued (`controlplane.core.ca`): never its key.

    `subject` names what holds it (`replica:r-12`, `edge:edge-eu`, `scraper:prometheus`);
    `install_dir`, where set, is where its files live, and renewal rewrites them there.
    A revoked certificate is refused by the control plane from then on and listed in every
    routing table, so edges refuse it too.
    """

    class Kind(models.TextChoices):
        SERVER = "server", "Server (a replica's engine)"
        CLIENT = "client", "Client (an edge or a scraper)"

    subject = models.CharField(max_length=100, db_index=True)
    kind = models.CharField(max_length=8, choices=Kind.choices)
    serial = models.CharField(max_length=40, unique=True)
    common_name = models.CharField(max_length=64)
    addresses = models.JSONField(default=list, blank=True)
    not_before = models.DateTimeField()
    not_after = models.DateTimeField(db_index=True)
    pem = models.TextField()
    install_dir = models.CharField(max_length=500, blank=True)
    renewed_by = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL,
                                   related_name="+")
    revoked_at = models.DateTimeField(null=True, blank=True, db_index=True)
    revoked_reason = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["subject", "-not_after"]

    def __str__(self) -> str:
        return f"{self.subject} {self.kind} {self.serial[:12]}"
