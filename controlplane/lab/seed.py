"""Everything the lab needs in its database, once Django is set up: migrations, the catalog,
schedules, static files, the demo tenant, the admin's login and the kept API token and key."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from django.contrib.auth import get_user_model
from django.core.management import call_command

from controlplane.core.hashing import sha256_hex
from controlplane.core.models import ApiKey, ApiToken, Role, Tenant
from controlplane.core.schedules import sync_schedules
from controlplane.core.services import ensure_user, issue_api_key, issue_api_token
from regions.models import Jurisdiction


@dataclass(frozen=True)
class LabCredentials:
    username: str
    password: str
    api_token: str
    demo_api_key: str


def lab_password(var_dir: Path) -> str:
    """A password generated once per checkout and kept under var/, so logins survive restarts."""
    path = var_dir / "lab" / "admin-password"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(secrets.token_urlsafe(12))
        path.chmod(0o600)
    return path.read_text().strip()


def prepare(var_dir: Path) -> LabCredentials:
    """Everything the lab needs in the database; safe to run on every start."""
    call_command("migrate", interactive=False, verbosity=0)
    call_command("seed_catalog", verbosity=0)
    sync_schedules()
    call_command("collectstatic", interactive=False, verbosity=0)

    password = lab_password(var_dir)
    admin = ensure_user("admin", Role.ADMIN)
    user_model = get_user_model()
    user_model.objects.filter(pk=admin.pk).update(is_staff=True, is_superuser=True)
    admin = user_model.objects.get(pk=admin.pk)
    admin.set_password(password)
    admin.save(update_fields=["password"])
    token = _kept_secret(
        var_dir / "lab" / "admin-token",
        lambda secret: ApiToken.objects.filter(
            token_hash=sha256_hex(secret), user=admin, revoked_at__isnull=True
        ).exists(),
        lambda: issue_api_token(admin, "lab")[1],
    )
    demo, _ = Tenant.objects.get_or_create(name="demo", defaults={"display_name": "Demo tenant"})
    demo.allowed_jurisdictions.set(Jurisdiction.objects.filter(code__in=["EU", "US", "UK", "JP"]))
    key = _kept_secret(
        var_dir / "lab" / "demo-api-key",
        lambda secret: ApiKey.objects.filter(
            key_hash=sha256_hex(secret), revoked_at__isnull=True
        ).exists(),
        lambda: issue_api_key(demo, f"lab-{secrets.token_hex(3)}", "interactive")[1],
    )
    return LabCredentials("admin", password, token, key)


def _kept_secret(path: Path, still_valid: Callable[[str], bool], issue: Callable[[], str]) -> str:
    """Reuse the secret kept at `path` while the database still honours it, else issue one."""
    if path.exists():
        secret = path.read_text().strip()
        if secret and still_valid(secret):
            return secret
    secret = issue()
    path.write_text(secret)
    path.chmod(0o600)
    return secret
