"""Role checks: every role reads; writes need the view's role; tenants never touch shared rows,
and views marked `platform_only` are for platform staff alone, reads included."""

from __future__ import annotations

from typing import Any

from rest_framework import permissions
from rest_framework.request import Request

from controlplane.core.models import Role
from controlplane.core.services import principal_for
from controlplane.core.tenancy import has_tenancy, owner_tenant_id


class RolePermission(permissions.BasePermission):
    message = "Your role does not allow this action."

    def has_permission(self, request: Request, view: Any) -> bool:
        principal = principal_for(request.user)
        if principal.role is None:
            if request.user is not None and getattr(request.user, "is_authenticated", False):
                self.message = "Your account has no role; ask an admin to grant one."
            return False
        if getattr(view, "platform_only", False) and not principal.is_platform:
            self.message = "Only platform staff (users with no tenant) may use this."
            return False
        if request.method in permissions.SAFE_METHODS:
            return True
        needed = getattr(view, "write_role", Role.ADMIN)
        if not principal.has_role(needed):
            self.message = f"This action needs the {needed} role; you are {principal.role}."
            return False
        if getattr(view, "platform_only_writes", False) and not principal.is_platform:
            self.message = "Only platform staff (users with no tenant) may change this."
            return False
        return True

    def has_object_permission(self, request: Request, view: Any, obj: Any) -> bool:
        if request.method in permissions.SAFE_METHODS:
            return True
        principal = principal_for(request.user)
        if principal.is_platform or not has_tenancy(type(obj)):
            return True
        # Another tenant's row never reaches here (the queryset hides it): no owner is shared.
        if owner_tenant_id(obj) is None:
            self.message = "Shared objects may be changed by platform staff only."
            return False
        return True
