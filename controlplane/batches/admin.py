"""Admin for batches: read what is stored; batches change through the API. A change made
here is still one (the admin's own event, and the triggers' events, which name the user)."""

from typing import Any

from django.contrib import admin
from django.db.models import Model as DjangoModel
from django.db.models import QuerySet
from django.http import HttpRequest

from controlplane.batches import audit
from controlplane.batches.models import Batch, BatchFile
from controlplane.core.admin_audit import AuditedAdmin


class BatchesAdmin(AuditedAdmin):
    """The audit triggers' events of a change made in the admin name the admin user."""

    def save_model(self, request: HttpRequest, obj: DjangoModel, form: Any, change: bool) -> None:
        with audit.acting_as(request.user.get_username(), "admin"):
            super().save_model(request, obj, form, change)

    def delete_model(self, request: HttpRequest, obj: DjangoModel) -> None:
        with audit.acting_as(request.user.get_username(), "admin"):
            super().delete_model(request, obj)

    def delete_queryset(self, request: HttpRequest, queryset: QuerySet[Any]) -> None:
        with audit.acting_as(request.user.get_username(), "admin"):
            super().delete_queryset(request, queryset)


@admin.register(BatchFile)
class BatchFileAdmin(BatchesAdmin):
    list_display = ("id", "tenant", "purpose", "filename", "bytes", "line_count", "created_at")
    list_filter = ("purpose",)
    exclude = ("content",)


@admin.register(Batch)
class BatchAdmin(BatchesAdmin):
    list_display = ("id", "tenant", "model", "endpoint", "status", "created_at")
    list_filter = ("status",)
