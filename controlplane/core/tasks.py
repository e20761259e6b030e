"""Core periodic tasks."""

from celery import shared_task

from controlplane.core.services import beat
from controlplane.core.status import BEAT_HEARTBEAT


@shared_task(name="core.beat_tick")
def beat_tick() -> None:
    """Scheduled every few seconds so /api/v1/status/ can tell that beat is alive."""
    beat(BEAT_HEARTBEAT)
