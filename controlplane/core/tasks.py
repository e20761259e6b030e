"""Core periodic tasks."""

from celery import shared_task

from controlplane.core import certificates
from controlplane.core.locks import advisory_lock
from controlplane.core.services import beat
from controlplane.core.status import BEAT_HEARTBEAT


@shared_task(name="core.beat_tick")
def beat_tick() -> None:
    """Scheduled every few seconds so /api/v1/status/ can tell that beat is alive."""
    beat(BEAT_HEARTBEAT)


@shared_task(name="core.renew_certificates")
def renew_certificates() -> dict[str, object]:
    """Renew the engine CA's installed certificates before they expire."""
    with advisory_lock(certificates.RENEW_LOCK) as acquired:
        if not acquired:
            return {"skipped": 1}
        return {"renewed": certificates.renew_due()}
