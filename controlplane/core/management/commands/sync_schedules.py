"""Create or correct Meridian's celery beat schedules (idempotent)."""

from __future__ import annotations

from typing import Any

from django.core.management.base import BaseCommand

from controlplane.core.schedules import SCHEDULES, sync_schedules


class Command(BaseCommand):
    help = "Create or correct the periodic tasks run by celery beat."

    def handle(self, *args: Any, **options: Any) -> None:
        changed = sync_schedules()
        self.stdout.write(f"{len(SCHEDULES)} schedule(s), {len(changed)} changed: {', '.join(changed) or '-'}")
