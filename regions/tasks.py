"""Periodic refresh of offer prices from SkyPilot's catalog."""

from __future__ import annotations

from celery import shared_task

from controlplane.core.locks import advisory_lock
from regions.services import refresh_offers


@shared_task(name="regions.refresh_offers")
def refresh_offers_task(provider: str = "skypilot") -> dict[str, object]:
    from controlplane.provisioning.services import get_provider

    with advisory_lock("regions.refresh_offers") as acquired:
        if not acquired:
            return {"skipped": True}
        report = refresh_offers(get_provider(provider))
    return {"ok": report.ok, "detail": report.detail, "stale": report.stale_offers}
