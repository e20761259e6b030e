"""Who may see and do what on the dashboard: the REST API's roles and tenancy, for views.

The rules are the API's (controlplane/api/permissions.py): every role reads, writes need the
view's role, and tenant users never change shared rows. Which rows anyone sees is the one
tenancy rule, `Model.objects.visible_to(principal)` (controlplane/core/tenancy.py): another
tenant's row is a 404.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

from django.contrib.auth.views import redirect_to_login
from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed
from django.shortcuts import render

from controlplane.core.models import Role
from controlplane.core.services import Principal, principal_for

View = Callable[..., HttpResponse]


def principal_of(request: HttpRequest) -> Principal:
    principal = getattr(request, "meridian_principal", None)
    if principal is None:
        principal = principal_for(request.user)
        request.meridian_principal = principal  # type: ignore[attr-defined]
    return principal


def forbidden(request: HttpRequest, message: str) -> HttpResponse:
    from frontend.views.common import page_context

    return render(request, "frontend/forbidden.html",
                  page_context(request, {"message": message}), status=403)


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


def dashboard_view(
    role: str = Role.VIEWER, methods: tuple[str, ...] = ("GET",), platform_only: bool = False,
) -> Callable[[View], View]:
    """Signed-in users with at least `role` only (platform staff alone with
    `platform_only`); other methods are refused with 405."""

    def decorate(view: View) -> View:
        @wraps(view)
        def wrapped(request: HttpRequest, *args: Any, **kwargs: Any) -> HttpResponse:
            if not request.user.is_authenticated:
                return redirect_to_login(request.get_full_path())
            if request.method not in methods:
                return HttpResponseNotAllowed(methods)
            principal = principal_of(request)
            reason = refusal(principal, role)
            if reason is None and platform_only and not principal.is_platform:
                reason = PLATFORM_ONLY
            if reason:
                return forbidden(request, reason)
            return view(request, *args, **kwargs)

        return wrapped

    return decorate


def change_refusal(principal: Principal, owner_tenant_id: int | None) -> str | None:
    """Why the principal may not change a row owned by `owner_tenant_id` (None: shared)."""
    if principal.is_platform:
        return None
    if owner_tenant_id is None:
        return "Shared objects may be changed by platform staff only."
    if owner_tenant_id != principal.tenant_id:
        return "This belongs to another tenant."
    return None
