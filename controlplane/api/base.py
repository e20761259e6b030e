"""The one base viewset: tenancy scoping and audit on every write, done once for all."""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models import Model as DjangoModel
from django.db.models import QuerySet
from rest_framework import serializers, viewsets
from rest_framework.generics import get_object_or_404

from controlplane.api.fields import deployment_lookup
from controlplane.core.models import Role
from controlplane.core.services import Principal, principal_for, record_audit
from controlplane.core.tenancy import TenantQuerySet, has_tenancy


def _plain(value: Any) -> Any:
    """A JSON-friendly form of a validated value for the audit record."""
    if isinstance(value, DjangoModel):
        return str(value)
    if isinstance(value, (list, tuple, set, QuerySet)):
        return [_plain(item) for item in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


class TenantScopedViewSet(viewsets.GenericViewSet):
    """Shows the caller the rows the tenancy rule lets it see (`visible_to`, on every model
    that belongs to tenants: see controlplane/core/tenancy.py); other rows are a 404."""

    write_role: str = Role.OPERATOR
    platform_only_writes = False

    @property
    def principal(self) -> Principal:
        return principal_for(self.request.user)

    def get_queryset(self) -> QuerySet[Any]:
        queryset = super().get_queryset()
        if has_tenancy(queryset.model):
            assert isinstance(queryset, TenantQuerySet), f"{queryset.model} needs TenantQuerySet"
            return queryset.visible_to(self.principal)
        return queryset


class ByNameOrId:
    """Detail routes take the row's name or its id: `/deployments/chat-eu/` and
    `/deployments/12/` (all digits is an id; such names are refused at creation)."""

    lookup_value_regex = "[^/]+"

    def get_object(self) -> Any:
        view: Any = self
        value = view.kwargs[view.lookup_url_kwarg or view.lookup_field]
        queryset = view.filter_queryset(view.get_queryset())
        found = get_object_or_404(queryset, **deployment_lookup(value))
        view.check_object_permissions(view.request, found)
        return found


class MeridianViewSet(TenantScopedViewSet, viewsets.ModelViewSet):
    """Full CRUD on tenant-scoped rows, with an audit event for every change.

    Subclasses set `queryset`, `serializer_class` and `filterset_class`.
    """

    def _audit(self, action: str, instance: DjangoModel, changes: dict[str, Any]) -> None:
        record_audit(self.principal.username, action, instance, changes=changes, reason="api")

    @transaction.atomic
    def perform_create(self, serializer: serializers.BaseSerializer) -> None:
        instance = serializer.save()
        self._audit("create", instance, self._changes(serializer))

    @transaction.atomic
    def perform_update(self, serializer: serializers.BaseSerializer) -> None:
        instance = serializer.save()
        self._audit("update", instance, self._changes(serializer))

    @transaction.atomic
    def perform_destroy(self, instance: DjangoModel) -> None:
        self._audit("delete", instance, {})
        instance.delete()

    @staticmethod
    def _changes(serializer: serializers.BaseSerializer) -> dict[str, Any]:
        data = getattr(serializer, "validated_data", {}) or {}
        return {key: _plain(value) for key, value in data.items()}
