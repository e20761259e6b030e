"""Core services: users and roles, API tokens and keys, the audit log, heartbeats."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from django.contrib.auth import get_user_model
from django.contrib.auth.models import AbstractBaseUser, User
from django.db import transaction
from django.db.models import Model as DjangoModel
from django.utils import timezone

from controlplane.core.hashing import (
    KEY_PREFIX,
    TOKEN_PREFIX,
    display_prefix,
    new_secret,
    sha256_hex,
)
from controlplane.core.models import (
    ROLE_RANK,
    ApiKey,
    ApiToken,
    AuditLog,
    Heartbeat,
    Membership,
    Role,
    Tenant,
)

# Writing last_used_at on every request would turn each read into a write.
TOKEN_TOUCH_INTERVAL = timedelta(seconds=60)


@dataclass(frozen=True)
class Principal:
    """Who is acting: a role and, for tenant users, the one tenant they are confined to."""

    username: str
    role: str | None
    tenant_id: int | None

    @property
    def is_platform(self) -> bool:
        return self.tenant_id is None

    def has_role(self, needed: str) -> bool:
        return self.role is not None and ROLE_RANK[Role(self.role)] >= ROLE_RANK[Role(needed)]

    def tenant_name(self) -> str | None:
        """None for platform staff; else the name of the tenant they are confined to (rows
        such as cost rollups and edge counters carry tenants by name). One query."""
        if self.tenant_id is None:
            return None
        return Tenant.objects.filter(pk=self.tenant_id).values_list("name", flat=True).first() or ""


def principal_for(user: Any) -> Principal:
    if user is None or not getattr(user, "is_authenticated", False):
        return Principal(username="anonymous", role=None, tenant_id=None)
    membership = getattr(user, "membership", None) if hasattr(user, "membership") else None
    if membership is not None:
        return Principal(user.get_username(), membership.role, membership.tenant_id)
    if user.is_superuser:
        return Principal(user.get_username(), Role.ADMIN, None)
    return Principal(user.get_username(), None, None)


@transaction.atomic
def ensure_user(username: str, role: str, tenant: Tenant | None = None) -> User:
    """Create the user if missing and set its role and tenant."""
    if role not in Role.values:
        raise ValueError(f"role must be one of {', '.join(Role.values)}, got {role!r}")
    user_model = get_user_model()
    user, _ = user_model.objects.get_or_create(username=username)
    Membership.objects.update_or_create(user=user, defaults={"role": role, "tenant": tenant})
    return user


def issue_api_token(user: User, name: str = "cli") -> tuple[ApiToken, str]:
    """A new control-plane token; the plaintext is returned once and never stored."""
    token = new_secret(TOKEN_PREFIX)
    row = ApiToken.objects.create(
        user=user, name=name, prefix=display_prefix(token), token_hash=sha256_hex(token)
    )
    return row, token


def user_for_token(token: str) -> AbstractBaseUser | None:
    """The active user a bearer token belongs to, or None."""
    now = timezone.now()
    row = (
        ApiToken.objects.select_related("user", "user__membership")
        .filter(token_hash=sha256_hex(token), revoked_at__isnull=True)
        .first()
    )
    if row is None or (row.expires_at is not None and row.expires_at <= now):
        return None
    if not row.user.is_active:
        return None
    if row.last_used_at is None or now - row.last_used_at > TOKEN_TOUCH_INTERVAL:
        ApiToken.objects.filter(pk=row.pk).update(last_used_at=now)
    return row.user


def issue_api_key(
    tenant: Tenant, name: str, tier: str, allowed_models: list[str] | None = None
) -> tuple[ApiKey, str]:
    """A new inference key for a tenant; the plaintext is returned once and never stored."""
    key = new_secret(KEY_PREFIX)
    row = ApiKey.objects.create(
        tenant=tenant,
        name=name,
        tier=tier,
        allowed_models=allowed_models if allowed_models is not None else ["*"],
        prefix=display_prefix(key),
        key_hash=sha256_hex(key),
    )
    return row, key


class RevocationFinal(Exception):
    """A tenant user tried to restore a key that platform staff revoked."""


def set_key_revoked(key: ApiKey, revoked: bool, principal: Principal) -> bool:
    """Revoke or restore `key` as `principal`, recording who revoked it; True when it
    changed. A revocation by platform staff is final for tenant users: only platform staff
    may restore such a key (RevocationFinal says so, naming who revoked it)."""
    if revoked:
        if key.revoked_at is not None:
            return False
        key.revoked_at = timezone.now()
        key.revoked_by = principal.username
        key.revoked_by_platform = principal.is_platform
        key.save(update_fields=["revoked_at", "revoked_by", "revoked_by_platform"])
        return True
    if key.revoked_at is None:
        return False
    if key.revoked_by_platform and not principal.is_platform:
        raise RevocationFinal(
            f"Key {key.name} was revoked by platform staff ({key.revoked_by or 'unknown'}); "
            "only platform staff may restore it.")
    key.revoked_at = None
    key.revoked_by = ""
    key.revoked_by_platform = False
    key.save(update_fields=["revoked_at", "revoked_by", "revoked_by_platform"])
    return True


def record_audit(
    actor: str,
    action: str,
    obj: DjangoModel | None = None,
    *,
    object_type: str = "",
    object_id: str = "",
    tenant_id: int | None = None,
    changes: dict[str, Any] | None = None,
    reason: str = "",
) -> AuditLog:
    """Append one audit event. The object's tenant is taken from it when it has one."""
    if obj is not None:
        object_type = object_type or obj._meta.label_lower
        object_id = object_id or str(obj.pk)
        if tenant_id is None:
            tenant_id = tenant_of(obj)
    return AuditLog.objects.create(
        actor=actor[:150],
        action=action[:64],
        object_type=object_type[:64],
        object_id=object_id[:64],
        object_repr=(str(obj) if obj is not None else "")[:200],
        tenant_id=tenant_id,
        changes=changes or {},
        reason=reason,
    )


def tenant_of(obj: DjangoModel) -> int | None:
    """The tenant an object belongs to, following the usual relations."""
    if isinstance(obj, Tenant):
        return obj.pk
    for attr in ("tenant_id",):
        if hasattr(obj, attr):
            return getattr(obj, attr)
    deployment = getattr(obj, "deployment", None)
    if deployment is not None:
        return deployment.tenant_id
    return None


def beat(name: str) -> Heartbeat:
    row, _ = Heartbeat.objects.update_or_create(name=name, defaults={"at": timezone.now()})
    return row
