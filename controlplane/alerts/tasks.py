"""Alert tasks: the periodic evaluation and webhook delivery with retries."""

from __future__ import annotations

from typing import Any

from celery import shared_task

from controlplane.alerts import services, webhook
from controlplane.core.locks import advisory_lock

WEBHOOK_RETRIES = 6  # after the first attempt: 5, 10, 20, 40, 80, 160 s apart


@shared_task(name="alerts.evaluate")
def evaluate() -> dict[str, Any]:
    with advisory_lock("alerts.evaluate") as acquired:
        if not acquired:
            return {"skipped": 1}
        report = services.evaluate()
        lost = webhook.undelivered()
    for delivery_id in dict.fromkeys(report.deliveries + lost):
        deliver_webhook.delay(delivery_id)
    return report.summary()


@shared_task(name="alerts.deliver_webhook", bind=True, max_retries=WEBHOOK_RETRIES)
def deliver_webhook(self: Any, delivery_id: int) -> dict[str, int]:
    """POST one notification; on failure retry with exponential backoff, then give up."""
    if webhook.deliver(delivery_id):
        return {"sent": 1, "attempts": self.request.retries + 1}
    if self.request.retries >= self.max_retries:
        webhook.give_up(delivery_id)
        return {"sent": 0, "attempts": self.request.retries + 1}
    raise self.retry(countdown=min(5 * 2 ** self.request.retries, 300))
