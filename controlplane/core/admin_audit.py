"""A ModelAdmin base that writes an audit event for every change made in the admin."""

from __future__ import annotations

from typing import Any

from django.contrib import admin
from django.db.models import Model as DjangoModel
from django.db.models import QuerySet
from django.http import HttpRequest

from controlplane.core.services import record_audit


class AuditedAdmin(admin.ModelAdmin):
    def save_model(self, request: HttpRequest, obj: DjangoModel, form: Any, change: bool) -> None:
        super().save_model(request, obj, form, change)
        changed = {name: str(form.cleaned_data.get(name)) for name in form.changed_data}
        action = "update" if change else "create"
        record_audit(request.user.get_username(), action, obj, changes=changed, reason="admin")

    def delete_model(self, request: HttpRequest, obj: DjangoModel) -> None:
        record_audit(request.user.get_username(), "delete", obj, reason="admin")
        super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        for obj in queryset:
            record_audit(request.user.get_username(), "delete", obj, reason="admin")
        super().delete_queryset(request, queryset)
