"""Who may see and do what on the dashboard: the REST API's roles and tenancy, for views.

The rules are the API's (controlplane/api/permissions.py): every role reads, writes need the
view's role, and tenant users never change shared rows. Which rows anyone sees is the one
tenancy rule, `Model.objects.visible_to(principal)` (controlplane/core/tenancy.py): another
tenant's row is a 404. The rules answer with reasons; `frontend/views/common.py` turns them
into pages (`dashboard_view`, `forbidden`).
"""

from __future__ import annotations

from django.http import HttpRequest

from controlplane.core.services import Principal, principal_for


def principal_of(request: HttpRequest) -> Principal:
    principal = getattr(request, "meridian_principal", None)
    if principal is None:
        principal = principal_for(request.user)
        request.meridian_principal = principal  # type: ignore[attr-defined]
    return principal


def refusal(principal: Principal, needed: str) -> str | None:
    """Why `principal` may not act with the `needed` role, or None when it may."""
    if principal.role is None:
        return "Your account has no role; ask an admin to grant one."
    if not principal.has_role(needed):
        return f"This action needs the {needed} role; you are {principal.role}."
    return None


# Pages for platform staff alone, reads included: they show every tenant's deployments.
PLATFORM_PAGES = frozenset({"plans", "failover"})
PLATFORM_ONLY = ("Only platform staff (users with no tenant) may see this: it names every "
                 "tenant's deployments.")


def page_refusal(principal: Principal, role: str, platform_only: bool) -> str | None:
    """Why `principal` may not open a page that needs `role` (and platform staff with
    `platform_only`), or None when it may."""
    reason = refusal(principal, role)
    if reason is None and platform_only and not principal.is_platform:
        reason = PLATFORM_ONLY
    return reason


def may_see_page(principal: Principal, name: str) -> bool:
    """Whether the navigation shows the page `name` to `principal`."""
    return principal.is_platform or name not in PLATFORM_PAGES


def change_refusal(principal: Principal, owner_tenant_id: int | None) -> str | None:
    """Why the principal may not change a row owned by `owner_tenant_id` (None: shared)."""
    if principal.is_platform:
        return None
    if owner_tenant_id is None:
        return "Shared objects may be changed by platform staff only."
    if owner_tenant_id != principal.tenant_id:
        return "This belongs to another tenant."
    return None
