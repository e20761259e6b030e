"""Which rows a principal may see: the one tenancy rule of the API, the dashboard, alerts and
costs.

Every model whose rows belong to a tenant, directly or through a relation (a replica through
its deployment), says how to reach the tenant and uses `TenantQuerySet`:

    tenancy = Tenancy("deployment__tenant", shared=True)
    objects = TenantQuerySet.as_manager()

`Model.objects.visible_to(principal)` is then the rule: platform staff (a role and no tenant)
see every row; a tenant user sees its own tenant's rows, and rows with no tenant where the
model says such rows are shared (shared deployments and what hangs off them); a principal
with no role sees nothing. Another tenant's row is never in the queryset, so it is a 404.

`tenant_owned_models()` finds, from the app registry, every model that reaches a tenant; the
tests run the rule and the API's permission matrix over that list, so a new model cannot
be left out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Self, TypeVar

from django.apps import apps
from django.db import models
from django.db.models import Q

_Row = TypeVar("_Row", bound=models.Model)

TENANT_MODEL = "core.Tenant"


class Viewer(Protocol):
    """Who is looking: `controlplane.core.services.Principal` (a user's role and tenant)."""

    @property
    def role(self) -> str | None: ...

    @property
    def tenant_id(self) -> int | None: ...


@dataclass(frozen=True)
class Tenancy:
    """How a model's rows reach their tenant.

    `path`: the lookup from a row to its tenant's key (`"tenant"`, `"deployment__tenant"`;
    `"id"` for the tenant itself). `shared`: a row with no tenant is shared, and every tenant
    user reads it (it is never theirs to change). `by_name`: the row carries the tenant's
    name rather than a foreign key (hourly usage and cost rows, which outlive tenants).
    """

    path: str
    shared: bool = False
    by_name: bool = False

    def scope(self, tenant_id: int) -> Q:
        """The rows a user of tenant `tenant_id` may read."""
        if self.by_name:
            names = apps.get_model(TENANT_MODEL).objects.filter(pk=tenant_id).values("name")
            own = Q(**{f"{self.path}__in": names})
        else:
            own = Q(**{self.path: tenant_id})
        if self.shared:
            own |= Q(**{f"{self.path}__isnull": True})
        return own

    def owner_id(self, row: models.Model) -> Any:
        """The tenant key the row belongs to (a name where `by_name`); None when shared or
        unowned. Follows loaded relations; the last step reads the foreign key's column."""
        *steps, last = self.path.split("__")
        target: Any = row
        for step in steps:
            target = getattr(target, step, None)
            if target is None:
                return None
        return getattr(target, f"{last}_id", getattr(target, last, None))


class TenantQuerySet(models.QuerySet[_Row]):
    """Rows of a tenant-owned model; `visible_to` is the tenancy rule."""

    def visible_to(self, principal: Viewer) -> Self:
        if principal.role is None:
            return self.none()
        if principal.tenant_id is None:
            return self.all()
        return self.usable_by(principal.tenant_id)

    def usable_by(self, tenant_id: int) -> Self:
        """The rows tenant `tenant_id` may use: its own, and those with no tenant where the
        model shares them (what its users see)."""
        return self.filter(tenancy_of(self.model).scope(tenant_id))


def tenancy_of(model: type[models.Model]) -> Tenancy:
    tenancy = getattr(model, "tenancy", None)
    if not isinstance(tenancy, Tenancy):
        raise TypeError(f"{model._meta.label} belongs to tenants but declares no Tenancy")
    return tenancy


def has_tenancy(model: type[models.Model]) -> bool:
    return isinstance(getattr(model, "tenancy", None), Tenancy)


def owner_tenant_id(row: models.Model) -> Any:
    """The tenant a row belongs to (None: shared or platform-wide); None for untenanted rows."""
    model = type(row)
    return tenancy_of(model).owner_id(row) if has_tenancy(model) else None


def tenant_owned_models() -> list[type[models.Model]]:
    """Every installed model whose rows reach a tenant: the tenant itself, models with a
    `tenant` field or a foreign key to the tenant, and, transitively, models with a foreign
    key to one of those."""
    tenant = apps.get_model(TENANT_MODEL)
    owned: set[type[models.Model]] = {tenant}
    for model in apps.get_models():
        if any(f.name == "tenant" for f in model._meta.concrete_fields):
            owned.add(model)
    grew = True
    while grew:
        grew = False
        for model in apps.get_models():
            if model in owned:
                continue
            if any((f.many_to_one or f.one_to_one) and f.related_model in owned
                   for f in model._meta.concrete_fields if f.is_relation):
                owned.add(model)
                grew = True
    return sorted(owned, key=lambda m: m._meta.label)
