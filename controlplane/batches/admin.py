"""Admin for batches: read what is stored; batches change through the API."""

from django.contrib import admin

from controlplane.batches.models import Batch, BatchFile
from controlplane.core.admin_audit import AuditedAdmin


@admin.register(BatchFile)
class BatchFileAdmin(AuditedAdmin):
    list_display = ("id", "tenant", "purpose", "filename", "bytes", "line_count", "created_at")
    list_filter = ("purpose",)
    exclude = ("content",)


@admin.register(Batch)
class BatchAdmin(AuditedAdmin):
    list_display = ("id", "tenant", "model", "endpoint", "status", "created_at")
    list_filter = ("status",)
